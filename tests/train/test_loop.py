"""The one training loop: schedule, learning, time budget, exact resume, objective registry."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from draftsmith.train.batches import ShardedBatches
from draftsmith.train.checkpoint import CheckpointManager
from draftsmith.train.loop import (
    LoopConfig,
    LoopResult,
    build_scheduler,
    lr_multiplier,
    make_accelerator,
    run_training,
)
from draftsmith.train.objectives import Objective, get_objective_class, register_objective
from draftsmith.train.objectives.causal_lm import CausalLMObjective, next_token_targets
from tiny_models import tiny_llama

VOCAB = 64


def _dataset(rows: int = 64, length: int = 16, seed: int = 0) -> list[dict[str, list[int]]]:
    """Sequences with a learnable rule: x_{t+1} = (x_t + 3) mod VOCAB from a random start."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(4, VOCAB, (rows,), generator=generator)
    data = []
    for start in starts.tolist():
        ids = [(start + 3 * t) % VOCAB for t in range(length)]
        data.append({"input_ids": ids, "loss_mask": [1] * length})
    return data


def _collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    input_ids = torch.tensor([row["input_ids"] for row in rows])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "loss_mask": torch.tensor([row["loss_mask"] for row in rows]),
    }


def _objective(seed: int = 0) -> CausalLMObjective:
    model = tiny_llama(vocab_size=VOCAB, num_layers=1, seed=seed, dtype=torch.float32).train()
    return CausalLMObjective(model)


def _run(
    steps: int,
    tmp: Path | None = None,
    resume: Path | None = None,
    checkpoint_every: int = 0,
    crash_at: int | None = None,
    **overrides: float,
) -> tuple[list[tuple[int, float]], LoopResult]:
    losses: list[tuple[int, float]] = []

    def log(metrics: dict[str, float], step: int) -> None:
        if step == crash_at:
            raise _Crash(losses)
        if "train/loss" in metrics:
            losses.append((step, metrics["train/loss"]))

    config = LoopConfig(
        max_steps=steps,
        learning_rate=3e-3,
        warmup_steps=2,
        log_every=1,
        checkpoint_every=checkpoint_every,
        progress_bar=False,
        **overrides,
    )
    accelerator = make_accelerator(cpu=True)
    batches = ShardedBatches(_dataset(), batch_size=8, collate=_collate, seed=1)
    manager = CheckpointManager(tmp, keep_last=3) if tmp is not None else None
    eval_set = [_collate(_dataset(rows=16, seed=9))]
    result = run_training(
        _objective(),
        batches,
        config,
        accelerator,
        eval_batches=eval_set,
        log=log,
        checkpoints=manager,
        resume_from=resume,
    )
    return losses, result


class _Crash(Exception):
    """Interrupts a run from inside the loop, carrying the losses logged so far."""

    def __init__(self, losses: list[tuple[int, float]]) -> None:
        super().__init__("simulated crash")
        self.losses = losses


def test_cosine_schedule_warms_up_then_decays_to_the_floor() -> None:
    assert lr_multiplier(0.0, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_multiplier(0.5, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_multiplier(1.0, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_multiplier(2.0, "linear", 0.0) == pytest.approx(0.0)
    assert lr_multiplier(0.3, "constant", 0.0) == 1.0
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(optimizer, LoopConfig(max_steps=10, warmup_steps=4))
    rates = []
    for _ in range(10):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    expected_5 = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))
    assert rates[5] == pytest.approx(expected_5)


class _StoppedClock:
    """A training clock that reads what the test sets."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def elapsed(self) -> float:
        return self.seconds


def test_a_time_boxed_schedule_decays_by_the_larger_of_steps_and_budget_spent() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    clock = _StoppedClock()
    timed = LoopConfig(max_steps=100, max_minutes=1.0, schedule_by_time=True)
    scheduler = build_scheduler(optimizer, timed, clock)  # type: ignore[arg-type]
    multiplier = scheduler.lr_lambdas[0]
    assert multiplier(10) == pytest.approx(lr_multiplier(0.1, "cosine", 0.1))  # steps lead
    clock.seconds = 30.0  # half the budget spent at step 10: time leads
    assert multiplier(10) == pytest.approx(0.55)
    clock.seconds = 60.0  # the deadline: fully annealed whatever the step
    assert multiplier(10) == pytest.approx(0.1)
    assert multiplier(90) == pytest.approx(0.1)
    by_steps = build_scheduler(optimizer, LoopConfig(max_steps=100, max_minutes=1.0), clock)  # type: ignore[arg-type]
    assert by_steps.lr_lambdas[0](10) == pytest.approx(lr_multiplier(0.1, "cosine", 0.1))


def test_loop_learns_a_rule_and_reports_held_out_metrics() -> None:
    losses, result = _run(steps=30)
    assert result.steps == 30
    assert result.stop_reason == "max_steps"
    assert result.tokens_seen == 30 * 8 * 16
    assert losses[-1][1] < 0.5 * losses[0][1]
    assert result.final_eval["top1_accuracy"] > 0.5
    assert result.params_in_sync


def test_time_budget_stops_cleanly_and_checkpoints(tmp_path: Path) -> None:
    _, result = _run(steps=10_000, tmp=tmp_path, max_minutes=0.02)
    assert result.stop_reason == "max_minutes"
    assert result.steps < 10_000
    assert result.last_checkpoint is not None
    assert result.last_checkpoint.name == f"checkpoint-{result.steps:07d}"


def test_resume_replays_the_same_losses(tmp_path: Path) -> None:
    reference, _ = _run(steps=8)
    with pytest.raises(_Crash) as crash:
        _run(steps=8, tmp=tmp_path, checkpoint_every=2, crash_at=5)
    assert [step for step, _ in crash.value.losses] == [1, 2, 3, 4]
    checkpoint = CheckpointManager(tmp_path).resolve("latest")
    assert checkpoint.name == "checkpoint-0000004"
    resumed, result = _run(steps=8, tmp=tmp_path, resume=checkpoint, checkpoint_every=2)
    assert [step for step, _ in resumed] == [5, 6, 7, 8]
    assert [loss for _, loss in resumed] == pytest.approx(
        [loss for _, loss in reference[4:]], rel=1e-6, abs=1e-7
    )
    assert result.steps == 8


def test_next_token_targets_shift_and_mask() -> None:
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 0]]),
        "loss_mask": torch.tensor([[0, 1, 1, 0]]),
    }
    labels, weights = next_token_targets(batch)
    assert labels.tolist() == [[6, 7, 0]]
    assert weights.tolist() == [[1.0, 1.0, 0.0]]


def test_objective_registry_resolves_and_explains_unknown_kinds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from draftsmith.train import objectives

    assert get_objective_class("causal_lm") is CausalLMObjective
    with pytest.raises(ValueError, match="unknown objective/drafter kind 'nope'"):
        get_objective_class("nope")
    # A registration the other tests must not see (they walk the registry).
    monkeypatch.setattr(objectives, "OBJECTIVES", dict(objectives.OBJECTIVES))
    register_objective("ghost_for_test", "draftsmith.train.objectives.ghost_for_test:Ghost")
    with pytest.raises(ValueError, match="does not exist in this installation"):
        get_objective_class("ghost_for_test")
    with pytest.raises(ValueError, match=r"package\.module:ClassName"):
        register_objective("bad", "no_colon_here")


def test_unbound_objective_explains_itself() -> None:
    objective: Objective = _objective()
    with pytest.raises(RuntimeError, match="not bound"):
        objective.compute_loss(_collate(_dataset(rows=2)))


def test_loop_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="lr_scheduler"):
        LoopConfig(max_steps=1, lr_scheduler="exp")
    with pytest.raises(ValueError, match="schedule_by_time needs max_minutes"):
        LoopConfig(max_steps=1, schedule_by_time=True)
    with pytest.raises(ValueError, match="max_steps"):
        LoopConfig(max_steps=0)
