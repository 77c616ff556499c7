"""Plain next-token cross-entropy on packed text.

The demo target is pretrained with it, and it is the "plain CE" baseline a distilled drafter
must beat. For a sequence x_1..x_T and a loss mask m (1 where x_t counts as a label),

    L = - sum_t m_{t+1} log q(x_{t+1} | x_{<=t}) / sum_t m_{t+1}

in nats per predicted token; ``evaluate`` also reports top-1 accuracy, the fraction of those
positions where argmax q equals the next token.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from draftsmith.train.objectives import Batch, MetricSums, Objective


def next_token_targets(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and their weights for predicting position t+1 from position t.

    Returns ``labels`` [B, T-1] (``input_ids`` shifted left) and ``weights`` [B, T-1] (1.0 where
    the label is a real token that counts: ``loss_mask`` and ``attention_mask`` of position t+1
    when present; the batch keys follow ``draftsmith.data.packing.collate``).
    """
    input_ids = batch["input_ids"]  # [B, T]
    labels = input_ids[:, 1:]
    weights = torch.ones_like(labels, dtype=torch.float32)
    for key in ("loss_mask", "attention_mask"):
        if key in batch:
            weights = weights * batch[key][:, 1:].to(torch.float32)
    return labels, weights


def next_token_logits(module: torch.nn.Module, batch: Batch) -> torch.Tensor:  # [B, T-1, V]
    """A causal LM's logits at every position but the last: position t predicts token t+1."""
    outputs = module(
        input_ids=batch["input_ids"],
        attention_mask=batch.get("attention_mask"),
        use_cache=False,
    )
    return outputs.logits[:, :-1]


class CausalLMObjective(Objective):
    """Cross-entropy of a causal LM on its own training text (no teacher)."""

    kind: ClassVar[str] = "causal_lm"
    trains_drafter: ClassVar[bool] = False

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def trainable_module(self) -> torch.nn.Module:
        return self.model

    def compute_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        logits = self._logits(batch)  # [B, T-1, V]
        labels, weights = next_token_targets(batch)
        per_token = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), reduction="none"
        ).view_as(weights)
        denominator = weights.sum().clamp_min(1.0)
        loss = (per_token * weights).sum() / denominator
        return loss, {}

    def evaluate(self, batch: Batch) -> MetricSums:
        logits = self._logits(batch)  # [B, T-1, V]
        labels, weights = next_token_targets(batch)
        per_token = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), reduction="none"
        ).view_as(weights)
        correct = (logits.argmax(-1) == labels).to(torch.float32)
        count = float(weights.sum())
        return {
            "loss": (float((per_token * weights).sum()), count),
            "top1_accuracy": (float((correct * weights).sum()), count),
        }

    def _logits(self, batch: Batch) -> torch.Tensor:  # [B, T-1, V]
        return next_token_logits(self.module, batch)
