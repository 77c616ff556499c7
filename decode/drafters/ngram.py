"""Prompt-lookup drafting: copy what followed the last earlier occurrence of the newest n-gram.

Saxena 2023 ("prompt lookup decoding"); the proposer is deterministic, so ``q`` is one-hot and
verification accepts a draft ``x`` with probability ``p(x)`` (docs/theory.md §2). Rows with no
match propose nothing; the round's width is the longest match in the batch, and rows with a
shorter match pad with a token they will simply not get accepted (one-hot ``q`` keeps this
exact).
"""

from __future__ import annotations

import torch

from decode.drafters.base import Drafter, DraftProposal, TargetPass
from decode.sampling import SamplingConfig


class NgramDrafter(Drafter):
    """Looks up the newest ``n``-gram (``max_ngram`` down to ``min_ngram``) in the row's history."""

    kind = "ngram"
    supports_external_drafts = True

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, "
                f"max_ngram={max_ngram}"
            )
        self._vocab_size = vocab_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._history: list[list[int]] = []
        self._last_drafts: list[list[int]] = []

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
        self._device = input_ids.device
        rows = input_ids.tolist()
        keep = attention_mask.bool().tolist()
        first = pending.tolist()
        self._history = [
            [tok for tok, k in zip(row, mask, strict=True) if k] + [tok0]
            for row, mask, tok0 in zip(rows, keep, first, strict=True)
        ]

    def propose(
        self,
        num_tokens: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        found = [self.lookup(history, num_tokens)[0] for history in self._history]
        width = max(len(drafts) for drafts in found)
        # Pads are real one-hot proposals: if the target accepts one, it is emitted and kept.
        self._last_drafts = [drafts + [0] * (width - len(drafts)) for drafts in found]
        tokens = torch.tensor(self._last_drafts, dtype=torch.long, device=self._device)
        tokens = tokens.reshape(len(found), width)
        return DraftProposal(tokens=tokens, probs=None)

    @property
    def histories(self) -> list[list[int]]:
        """Each row's committed tokens (prompt, then everything emitted)."""
        return self._history

    def replace_drafts(
        self,
        tokens: torch.Tensor,  # [B, W]
        replaced: torch.Tensor,  # [B] bool
    ) -> None:
        """The round verifies ``tokens``: commit extends the histories with their accepted part."""
        rows = tokens.tolist()
        own = self._last_drafts if len(self._last_drafts) == len(rows) else rows
        self._last_drafts = [
            new if swap else old
            for new, old, swap in zip(rows, own, replaced.tolist(), strict=True)
        ]

    def commit(
        self,
        num_accepted: torch.Tensor,  # [B]
        next_tokens: torch.Tensor,  # [B]
        target_pass: TargetPass,
    ) -> None:
        for history, drafts, accepted, token in zip(
            self._history,
            self._last_drafts,
            num_accepted.tolist(),
            next_tokens.tolist(),
            strict=True,
        ):
            history.extend(drafts[:accepted])
            history.append(token)

    def lookup(self, history: list[int], num_tokens: int) -> tuple[list[int], int]:
        """Tokens after an earlier occurrence of the longest matching suffix, and its length.

        The most recent occurrence that still has ``num_tokens`` tokens after it wins (on a
        repeated pattern the nearest match would leave only one token to copy); failing that,
        the occurrence with the longest continuation. ``([], 0)`` when nothing matches.
        """
        length = len(history)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = history[length - n :]
            best: list[int] = []
            # Scan from the right: the most recent occurrence best predicts what comes next.
            for start in range(length - n - 1, -1, -1):
                if history[start : start + n] == suffix:
                    continuation = history[start + n : start + n + num_tokens]
                    if len(continuation) == num_tokens:
                        return continuation, n
                    if len(continuation) > len(best):
                        best = continuation
            if best:
                return best, n
        return [], 0
