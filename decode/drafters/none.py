"""The drafter that drafts nothing: every round is one plain target step.

It turns the speculative decoder into a plain autoregressive decoder over the same target
forward, cache and sampler, which makes it the control for a benchmark: the gap between it and
Hugging Face ``generate`` is what the decoder's forward adds, and the gap between a drafter and
it is what drafting adds.
"""

from __future__ import annotations

import torch
from draftsmith.decode.drafters.base import Drafter, DraftProposal, TargetPass
from draftsmith.decode.sampling import SamplingConfig


class NoDrafter(Drafter):
    """Proposes zero tokens per round (``tau`` is exactly 1)."""

    kind = "none"

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size
        self._batch = 0
        self._device = torch.device("cpu")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def prefill(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor,  # [B, T]
        target_pass: TargetPass,
        pending: torch.Tensor,  # [B]
    ) -> None:
        self._batch, self._device = input_ids.shape[0], input_ids.device

    def propose(
        self,
        num_tokens: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        empty = torch.empty(self._batch, 0, dtype=torch.long, device=self._device)  # [B, 0]
        return DraftProposal(tokens=empty, probs=None)

    def commit(
        self,
        num_accepted: torch.Tensor,  # [B]
        next_tokens: torch.Tensor,  # [B]
        target_pass: TargetPass,
    ) -> None:
        return None

    def select_rows(self, rows: torch.Tensor) -> None:
        self._batch = rows.numel()

    def merge(self, other: Drafter) -> None:
        if not isinstance(other, NoDrafter):
            raise TypeError(f"cannot merge a {other.kind} drafter's rows into a none drafter")
        self._batch += other._batch
