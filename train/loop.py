"""The one training loop: accelerate, AdamW, warmup + decay, clipping, eval, checkpoints.

Every model this project trains (the demo target, every drafter kind) goes through
``run_training``; what differs between them lives in an ``Objective``
(``draftsmith.train.objectives``). The loop owns the optimisation and the bookkeeping:

- AdamW (Loshchilov & Hutter 2019) with weight decay on matrices only;
- learning rate ``lr(s) = lr_max * s / warmup`` during warmup, then cosine
  (``min + (1 - min) * (1 + cos(pi * u)) / 2``) or linear (``1 - (1 - min) * u``) decay in
  the progress ``u`` in [0, 1]: the fraction of ``max_steps`` done, or with
  ``schedule_by_time`` the larger of that and the fraction of the wall-clock budget spent,
  so that a time-boxed run anneals fully by its deadline;
- gradient accumulation and clipping through accelerate, so DDP, FSDP and DeepSpeed work;
- a wall-clock budget that stops cleanly (and checkpoints) when it runs out;
- evaluation every N steps and at the end, checkpoints every N steps and at the end;
- exact resumption: model, optimizer, scheduler, RNG states, the objective's state and the
  data position (``draftsmith.train.batches.ShardedBatches`` replays the same batches);
- a non-finite loss or gradient norm stops the run with ``NonFiniteLossError`` (naming the
  step and the fix) before the optimizer applies it, and parameters are checked finite before
  every checkpoint and at the end, so a diverged run never checkpoints or exports NaN weights.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from draftsmith.train.batches import ShardedBatches
from draftsmith.train.checkpoint import (
    STATE_FILE,
    CheckpointError,
    CheckpointManager,
    broken_file_message,
)
from draftsmith.train.objectives import Batch, Objective
from tqdm.auto import tqdm

LogFn = Callable[[dict[str, float], int], None]

SCHEDULES = ("cosine", "linear", "constant")


class NonFiniteLossError(FloatingPointError):
    """Training diverged: a loss, gradient norm or parameter is NaN or infinite."""


@dataclass
class LoopConfig:
    """Optimisation and bookkeeping settings of one run."""

    max_steps: int
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    warmup_steps: int = 0
    lr_scheduler: str = "cosine"
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    max_minutes: float | None = None
    schedule_by_time: bool = False
    eval_every: int = 0
    checkpoint_every: int = 0
    checkpoint_at_end: bool = True
    log_every: int = 10
    progress_bar: bool = True
    description: str = "training"

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.lr_scheduler not in SCHEDULES:
            raise ValueError(
                f"unknown lr_scheduler {self.lr_scheduler!r}; choose one of {', '.join(SCHEDULES)}"
            )
        for name in ("max_grad_norm", "weight_decay", "adam_epsilon"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not math.isfinite(self.learning_rate):
            raise ValueError(f"learning_rate must be finite, got {self.learning_rate}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must lie in [0, 1), got {getattr(self, name)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"max_minutes must be > 0 or unset, got {self.max_minutes}")
        if self.schedule_by_time and self.max_minutes is None:
            raise ValueError("schedule_by_time needs max_minutes: set a wall-clock budget")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "log_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 disables it), got {getattr(self, name)}")


@dataclass
class TrainerState:
    """Where a run stands; saved in every checkpoint as trainer_state.json."""

    step: int = 0
    micro_step: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    world_size: int = 1
    last_eval: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerState:
        """The state a checkpoint's ``trainer_state.json`` holds, every field checked
        (``ValueError`` naming the first bad one: the file was damaged or tampered with)."""
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        for name, least in (("step", 0), ("micro_step", 0), ("tokens_seen", 0), ("world_size", 1)):
            value = known.get(name, least)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        elapsed = known.get("elapsed_s", 0.0)
        if not _finite_number(elapsed) or elapsed < 0:
            raise ValueError(f"elapsed_s must be a finite number >= 0, got {elapsed!r}")
        last_eval = known.get("last_eval", {})
        numbers = (int, float, type(None))  # NaN allowed: an evaluation may have measured it
        if not isinstance(last_eval, dict) or not all(
            isinstance(v, numbers) and not isinstance(v, bool) for v in last_eval.values()
        ):
            raise ValueError(f"last_eval must map metric names to numbers, got {last_eval!r}")
        return cls(**known)


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class LoopResult:
    """What a finished (or time-boxed) run reports."""

    steps: int
    tokens_seen: int
    minutes: float
    tokens_per_second: float
    stop_reason: str  # "max_steps" or "max_minutes"
    world_size: int
    params_in_sync: bool
    last_train_metrics: dict[str, float]
    final_eval: dict[str, float]
    last_checkpoint: Path | None


def run_training(
    objective: Objective,
    train_batches: ShardedBatches,
    config: LoopConfig,
    accelerator: Accelerator,
    eval_batches: Sequence[Batch] = (),
    log: LogFn | None = None,
    checkpoints: CheckpointManager | None = None,
    resume_from: Path | None = None,
) -> LoopResult:
    """Train ``objective`` on ``train_batches`` until ``max_steps`` or the time budget.

    ``eval_batches`` are this process's share of the held-out set; ``log(metrics, step)`` is
    called on the main process only; ``resume_from`` is a checkpoint folder written by
    ``checkpoints``. The accelerator must be built with ``step_scheduler_with_optimizer=False``
    (see ``make_accelerator``): the schedule counts optimizer steps, not samples.
    """
    _check_loop_arguments(accelerator, checkpoints, resume_from)
    run = _start_run(objective, config, accelerator, checkpoints, resume_from)
    batches = train_batches.iterate(start=run.state.micro_step)
    stop_reason = "max_steps"
    while run.state.step < config.max_steps:
        if config.max_minutes is not None and _out_of_time(run.clock, config, accelerator):
            stop_reason = "max_minutes"
            break
        _optimizer_step(run, batches)
        _after_step(run, eval_batches, log, checkpoints)
    run.bar.close()
    return _end_run(run, eval_batches, log, checkpoints, stop_reason)


@dataclass
class _RunState:
    """Everything one ``run_training`` call carries from step to step."""

    objective: Objective
    config: LoopConfig
    accelerator: Accelerator
    module: torch.nn.Module  # prepared by accelerate
    optimizer: Any
    scheduler: Any
    trainable: list[torch.nn.Parameter]
    state: TrainerState
    clock: _Clock
    bar: Any  # tqdm
    window: _MetricWindow = field(default_factory=lambda: _MetricWindow())
    window_tokens: int = 0
    window_start: float = 0.0
    last_train: dict[str, float] = field(default_factory=dict)
    last_checkpoint: Path | None = None


def _check_loop_arguments(
    accelerator: Accelerator, checkpoints: CheckpointManager | None, resume_from: Path | None
) -> None:
    if accelerator.step_scheduler_with_optimizer:
        raise ValueError(
            "run_training needs Accelerator(step_scheduler_with_optimizer=False): accelerate "
            "would otherwise step the schedule once per process; use draftsmith.train.loop.make_accelerator"
        )
    if resume_from is not None and checkpoints is None:
        raise ValueError("resume_from needs a CheckpointManager to load it with")


def _start_run(
    objective: Objective,
    config: LoopConfig,
    accelerator: Accelerator,
    checkpoints: CheckpointManager | None,
    resume_from: Path | None,
) -> _RunState:
    """Prepare module, optimizer and schedule with accelerate; restore a checkpoint if given."""
    clock = _Clock()
    module = objective.trainable_module()
    optimizer = build_optimizer(module, config)
    scheduler = build_scheduler(optimizer, config, clock)
    module, optimizer, scheduler = accelerator.prepare(module, optimizer, scheduler)
    objective.bind(module, accelerator)
    # The checkpoint manager saves the objective's state as tensors (not accelerate's
    # register_for_checkpointing, which pickles it).

    state = TrainerState(world_size=accelerator.num_processes)
    if resume_from is not None and checkpoints is not None:
        state = _restored_state(checkpoints.load(accelerator, resume_from, objective), resume_from)
        _check_resume_world(state, accelerator)
        state.world_size = accelerator.num_processes
    clock.offset_s = state.elapsed_s

    bar = tqdm(
        # A time-boxed run ends by the clock, not at max_steps: show a count, not a fraction.
        total=None if config.max_minutes is not None else config.max_steps,
        initial=state.step,
        desc=config.description,
        disable=not (accelerator.is_local_main_process and config.progress_bar),
        dynamic_ncols=True,
    )
    run = _RunState(
        objective,
        config,
        accelerator,
        module,
        optimizer,
        scheduler,
        trainable=[p for p in module.parameters() if p.requires_grad],
        state=state,
        clock=clock,
        bar=bar,
    )
    run.window_start = clock.elapsed()
    module.train()
    return run


def _restored_state(data: dict[str, Any], checkpoint: Path) -> TrainerState:
    """``TrainerState.from_dict``; a bad field is a ``CheckpointError`` naming the file."""
    try:
        return TrainerState.from_dict(data)
    except (TypeError, ValueError) as error:
        raise CheckpointError(
            broken_file_message(Path(checkpoint) / STATE_FILE, str(error))
        ) from None


def _optimizer_step(run: _RunState, batches: Any) -> None:
    """One optimizer step over ``gradient_accumulation_steps`` micro-batches."""
    accelerator, config, state = run.accelerator, run.config, run.state
    for _ in range(accelerator.gradient_accumulation_steps):
        _, batch = next(batches)
        batch = _to_device(batch, accelerator.device)
        with accelerator.accumulate(run.module):
            loss, metrics = run.objective.compute_loss(batch)
            loss_value = _finite_loss(loss, state.step + 1, accelerator, config)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                if config.max_grad_norm > 0:
                    grad_norm = accelerator.clip_grad_norm_(run.trainable, config.max_grad_norm)
                    if grad_norm is not None:
                        metrics["grad_norm"] = float(grad_norm)
                        if not math.isfinite(metrics["grad_norm"]):
                            raise _diverged(
                                f"the gradient norm is {metrics['grad_norm']}",
                                state.step + 1,
                                config,
                            )
                run.optimizer.step()
                run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
        tokens = _count_tokens(batch) * accelerator.num_processes
        state.micro_step += 1
        state.tokens_seen += tokens
        run.window_tokens += tokens
        run.window.add({"loss": loss_value, **metrics})
    state.step += 1
    state.elapsed_s = run.clock.elapsed()
    run.bar.update(1)


def _after_step(
    run: _RunState,
    eval_batches: Sequence[Batch],
    log: LogFn | None,
    checkpoints: CheckpointManager | None,
) -> None:
    """Log, evaluate and checkpoint when their intervals fall on this step."""
    accelerator, config, state = run.accelerator, run.config, run.state
    if config.log_every and (state.step % config.log_every == 0 or state.step == 1):
        now = run.clock.elapsed()
        last_train = run.window.mean(accelerator)
        last_train["lr"] = run.scheduler.get_last_lr()[0]
        last_train["tokens_seen"] = float(state.tokens_seen)
        last_train["tokens_per_s"] = run.window_tokens / max(now - run.window_start, 1e-9)
        run.last_train, run.window_tokens, run.window_start = last_train, 0, now
        run.bar.set_postfix(loss=f"{last_train['loss']:.3f}", lr=f"{last_train['lr']:.2e}")
        if log is not None and accelerator.is_main_process:
            log({f"train/{k}": v for k, v in last_train.items()}, state.step)
    if config.eval_every and state.step % config.eval_every == 0 and eval_batches:
        state.last_eval = _run_eval(run.objective, eval_batches, accelerator, log, state.step)
        run.module.train()
    if (
        checkpoints is not None
        and config.checkpoint_every
        and state.step % config.checkpoint_every == 0
    ):
        _check_parameters(run.trainable, state.step, config, accelerator)
        run.last_checkpoint = checkpoints.save(
            accelerator, state.step, asdict(state), run.objective
        )


def _end_run(
    run: _RunState,
    eval_batches: Sequence[Batch],
    log: LogFn | None,
    checkpoints: CheckpointManager | None,
    stop_reason: str,
) -> LoopResult:
    """The final evaluation and checkpoint (unless this step already had them); the result."""
    accelerator, config, state = run.accelerator, run.config, run.state
    if eval_batches and not (config.eval_every and state.step % config.eval_every == 0):
        state.last_eval = _run_eval(run.objective, eval_batches, accelerator, log, state.step)
    state.elapsed_s = run.clock.elapsed()
    _check_parameters(run.trainable, state.step, config, accelerator)
    if checkpoints is not None and config.checkpoint_at_end:
        latest = checkpoints.latest()
        if latest is None or latest.name != f"checkpoint-{state.step:07d}":
            run.last_checkpoint = checkpoints.save(
                accelerator, state.step, asdict(state), run.objective
            )
        else:
            run.last_checkpoint = latest
    accelerator.wait_for_everyone()
    in_sync = parameters_in_sync(run.module, accelerator)
    return LoopResult(
        steps=state.step,
        tokens_seen=state.tokens_seen,
        minutes=state.elapsed_s / 60,
        tokens_per_second=state.tokens_seen / max(state.elapsed_s, 1e-9),
        stop_reason=stop_reason,
        world_size=accelerator.num_processes,
        params_in_sync=in_sync,
        last_train_metrics=run.last_train,
        final_eval=state.last_eval,
        last_checkpoint=run.last_checkpoint,
    )


def make_accelerator(
    gradient_accumulation_steps: int = 1,
    mixed_precision: str = "no",
    cpu: bool | None = None,
    log_with: list[str] | None = None,
    project_dir: Path | None = None,
) -> Accelerator:
    """An ``Accelerator`` the loop accepts (the schedule counts optimizer steps)."""
    kwargs: dict[str, Any] = {}
    if cpu is not None:
        kwargs["cpu"] = cpu
    on_cpu = cpu or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    if mixed_precision == "fp16" and (on_cpu or not _has_accelerator_device()):
        raise ValueError(
            "--mixed_precision fp16 needs a GPU (its loss scaling is a CUDA feature) but this "
            "run is on the CPU: use --mixed_precision bf16 or no"
        )
    _forget_other_precision(mixed_precision)
    accelerator = Accelerator(
        gradient_accumulation_steps=gradient_accumulation_steps,
        mixed_precision=mixed_precision,
        step_scheduler_with_optimizer=False,
        log_with=log_with or None,
        project_dir=str(project_dir) if project_dir is not None else None,
        **kwargs,
    )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > accelerator.num_processes:
        # Measured: `accelerate launch` with a CPU config but without ACCELERATE_USE_CPU=true
        # starts N processes that each believe they are alone and overwrite each other's files.
        raise RuntimeError(
            f"{launched} processes were launched but this one sees a world of "
            f"{accelerator.num_processes}: they formed no process group. On CPU launch with "
            "ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes N ..."
        )
    # accelerate drops an FSDP config on CPU ranks (DDP instead): restore it (draftsmith.train.distributed).
    from draftsmith.train.distributed import enable_cpu_fsdp

    enable_cpu_fsdp(accelerator)
    return accelerator


def _forget_other_precision(mixed_precision: str) -> None:
    """Let one process run trainings of different precisions one after another (the main job
    builds the demo target, then distils; tests run many). accelerate keeps one process-wide
    ``AcceleratorState`` and refuses a second Accelerator with another mixed precision; its
    per-run part is dropped here, the process group (``PartialState``) is kept."""
    from accelerate.state import AcceleratorState

    state = AcceleratorState._shared_state
    if state and str(state.get("_mixed_precision", mixed_precision)) != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=False)


def build_optimizer(module: torch.nn.Module, config: LoopConfig) -> torch.optim.AdamW:
    """AdamW with decay on weight matrices only (not on norms, biases or 1-D gains)."""
    decay, no_decay = [], []
    for parameter in module.parameters():
        if parameter.requires_grad:
            (decay if parameter.ndim >= 2 else no_decay).append(parameter)
    if not decay and not no_decay:
        raise ValueError("the objective's trainable module has no parameter with requires_grad")
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [group for group in groups if group["params"]],
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: LoopConfig, clock: _Clock | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup then cosine/linear/constant decay; see the module docstring for the formulas."""
    budget_s = (config.max_minutes or 0.0) * 60

    def multiplier(step: int) -> float:
        if config.warmup_steps and step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = step / config.max_steps
        if config.schedule_by_time and clock is not None and budget_s > 0:
            progress = max(progress, clock.elapsed() / budget_s)
        return lr_multiplier(progress, config.lr_scheduler, config.min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def lr_multiplier(progress: float, schedule: str, min_ratio: float) -> float:
    """The decay factor at ``progress`` in [0, 1] (clamped) after warmup."""
    u = min(max(progress, 0.0), 1.0)
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * u))
    if schedule == "linear":
        return 1 - (1 - min_ratio) * u
    return 1.0


def evaluate(
    objective: Objective, eval_batches: Sequence[Batch], accelerator: Accelerator
) -> dict[str, float]:
    """Sum each metric's (sum, weight) over batches and processes, then divide."""
    objective.module.eval()
    local: dict[str, list[float]] = {}
    with torch.no_grad():
        for batch in eval_batches:
            for name, (total, weight) in objective.evaluate(
                _to_device(batch, accelerator.device)
            ).items():
                sums = local.setdefault(name, [0.0, 0.0])
                sums[0] += float(total)
                sums[1] += float(weight)
    merged: dict[str, list[float]] = {}
    shards = gather_object([local]) if accelerator.num_processes > 1 else [local]
    for shard in shards:
        for name, (total, weight) in shard.items():
            sums = merged.setdefault(name, [0.0, 0.0])
            sums[0] += total
            sums[1] += weight
    return {name: total / weight for name, (total, weight) in merged.items() if weight > 0}


def parameters_in_sync(module: torch.nn.Module, accelerator: Accelerator) -> bool:
    """Whether every process holds (or, sharded, gathers) bit-identical trainable parameters."""
    if accelerator.num_processes == 1:
        return True
    from torch.distributed.tensor import DTensor

    with torch.no_grad():  # FSDP shards differ by design: compare the gathered parameters
        trained = [p for p in module.parameters() if p.requires_grad]
        full = [p.full_tensor() if isinstance(p, DTensor) else p for p in trained]
        checksum = torch.stack([p.detach().double().sum() for p in full]).sum()
    sums = accelerator.gather(checksum.reshape(1).to(accelerator.device))
    return bool((sums == sums[0]).all())


def _run_eval(
    objective: Objective,
    eval_batches: Sequence[Batch],
    accelerator: Accelerator,
    log: LogFn | None,
    step: int,
) -> dict[str, float]:
    metrics = evaluate(objective, eval_batches, accelerator)
    if log is not None and accelerator.is_main_process:
        log({f"eval/{k}": v for k, v in metrics.items()}, step)
    return metrics


def _check_resume_world(state: TrainerState, accelerator: Accelerator) -> None:
    if state.world_size != accelerator.num_processes:
        raise ValueError(
            f"the checkpoint was written by {state.world_size} process(es) but this run has "
            f"{accelerator.num_processes}: resume with the same number of processes, or the "
            "data order and per-process RNG states would not match"
        )


def _out_of_time(clock: _Clock, config: LoopConfig, accelerator: Accelerator) -> bool:
    """The budget test, agreed by all processes so that none waits alone in a collective."""
    assert config.max_minutes is not None
    out = clock.elapsed() >= config.max_minutes * 60
    if accelerator.num_processes == 1:
        return out
    flag = torch.tensor([1.0 if out else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


def _finite_loss(
    loss: torch.Tensor, step: int, accelerator: Accelerator, config: LoopConfig
) -> float:
    """The loss as a float; raise ``NonFiniteLossError`` if any process's is not finite.

    Agreed by all processes (one tiny all-reduce) so that none waits alone in backward.
    """
    value = float(loss.detach())
    bad = not math.isfinite(value)
    if accelerator.num_processes > 1:
        flag = torch.tensor([1.0 if bad else 0.0], device=accelerator.device)
        bad = bool(accelerator.reduce(flag, reduction="sum").item() > 0)
    if bad:
        raise _diverged(f"the loss is {value}", step, config)
    return value


def _check_parameters(
    trainable: list[torch.nn.Parameter], step: int, config: LoopConfig, accelerator: Accelerator
) -> None:
    """Refuse to checkpoint or hand back non-finite weights.

    Each process checks the parameters it holds (its shards under FSDP); the verdict is agreed
    by all processes so that none enters the checkpoint's collectives alone.
    """
    with torch.no_grad():
        local = [p.to_local() if hasattr(p, "to_local") else p for p in trainable]  # shards
        bad = not all(bool(torch.isfinite(t).all()) for t in local)
    if accelerator.num_processes > 1:
        flag = torch.tensor([1.0 if bad else 0.0], device=accelerator.device)
        bad = bool(accelerator.reduce(flag, reduction="sum").item() > 0)
    if bad:
        raise _diverged("a trainable parameter is NaN or infinite", step, config)


def _diverged(what: str, step: int, config: LoopConfig) -> NonFiniteLossError:
    return NonFiniteLossError(
        f"training diverged: {what} at step {step}, so the run stops and nothing is exported. "
        f"Lower the learning rate (--learning_rate, now {config.learning_rate:g}), add warmup "
        f"(--warmup_steps, now {config.warmup_steps}) or clip gradients (--max_grad_norm, now "
        f"{config.max_grad_norm:g}); checkpoints written before step {step} are intact"
    )


def _has_accelerator_device() -> bool:
    xpu = getattr(torch, "xpu", None)
    return (
        torch.cuda.is_available()
        or (xpu is not None and xpu.is_available())
        or torch.backends.mps.is_available()
    )


def _to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _count_tokens(batch: Batch) -> int:
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())


class _Clock:
    """Wall-clock seconds of training, continuing across resumes via ``offset_s``."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.offset_s = 0.0

    def elapsed(self) -> float:
        return self.offset_s + time.perf_counter() - self.start


class _MetricWindow:
    """Running means of the scalar metrics logged since the last report."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.sums[name] = self.sums.get(name, 0.0) + float(value)
            self.counts[name] = self.counts.get(name, 0) + 1

    def mean(self, accelerator: Accelerator) -> dict[str, float]:
        """Means over the window, averaged over processes; resets the window."""
        names = sorted(self.sums)
        values = torch.tensor(
            [self.sums[n] / self.counts[n] for n in names], dtype=torch.float64
        ).to(accelerator.device)
        if accelerator.num_processes > 1 and names:
            values = accelerator.reduce(values, reduction="mean")
        self.sums, self.counts = {}, {}
        return dict(zip(names, values.tolist(), strict=True))
