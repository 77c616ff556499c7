"""A non-finite loss stops the loop before it is applied; no checkpoint holds NaN weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from draftsmith.train.batches import ShardedBatches
from draftsmith.train.checkpoint import CheckpointManager
from draftsmith.train.loop import LoopConfig, NonFiniteLossError, make_accelerator, run_training
from draftsmith.train.objectives import Batch
from draftsmith.train.objectives.causal_lm import CausalLMObjective
from safetensors.torch import load_file
from tiny_models import tiny_llama

VOCAB = 32


class _PoisonedAt(CausalLMObjective):
    """Cross-entropy, except that the loss of micro-batch ``bad`` is NaN."""

    def __init__(self, bad: int) -> None:
        super().__init__(tiny_llama(vocab_size=VOCAB, num_layers=1, dtype=torch.float32).train())
        self.bad = bad
        self.calls = 0

    def compute_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = super().compute_loss(batch)
        self.calls += 1
        return (loss * float("nan") if self.calls == self.bad else loss), metrics


def _batches() -> ShardedBatches:
    rows = [{"input_ids": [(s + t) % VOCAB for t in range(8)]} for s in range(16)]

    def collate(chunk: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        ids = torch.tensor([row["input_ids"] for row in chunk])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    return ShardedBatches(rows, 4, collate, seed=0)


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_a_nan_loss_stops_the_run_naming_the_step(tmp_path: Path, max_grad_norm: float) -> None:
    objective = _PoisonedAt(bad=3)
    config = LoopConfig(
        max_steps=6,
        learning_rate=1e-3,
        max_grad_norm=max_grad_norm,
        checkpoint_every=1,
        progress_bar=False,
    )
    manager = CheckpointManager(tmp_path, keep_last=5)
    before = {k: v.clone() for k, v in objective.trainable_module().state_dict().items()}
    with pytest.raises(NonFiniteLossError, match=r"the loss is nan at step 3.*Lower the learning"):
        run_training(objective, _batches(), config, make_accelerator(cpu=True), checkpoints=manager)
    assert [p.name for p in manager.checkpoints()] == ["checkpoint-0000001", "checkpoint-0000002"]
    after = objective.trainable_module().state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())  # the NaN was never applied
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for checkpoint in manager.checkpoints():
        assert all(
            torch.isfinite(t).all()
            for t in load_file(str(checkpoint / "model.safetensors")).values()
        )
