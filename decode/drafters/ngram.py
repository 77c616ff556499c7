"""Prompt-lookup drafting: copy what followed the last earlier occurrence of the newest n-gram.

Saxena 2023 ("prompt lookup decoding"); the proposer is deterministic, so ``q`` is one-hot and
verification accepts a draft ``x`` with probability ``p(x)`` (docs/theory.md §2). Rows with no
match propose nothing; the round's width is the longest match in the batch, and rows with a
shorter match pad with a token they will simply not get accepted (one-hot ``q`` keeps this
exact).
"""

from __future__ import annotations

import torch
from draftsmith.decode.drafters.base import Drafter, DraftProposal, TargetPass
from draftsmith.decode.sampling import SamplingConfig


class NgramIndex:
    """One row's committed tokens and, for each n-gram length, where each n-gram started.

    Appending a token records the n-grams it ends (``O(max_ngram)``), so a lookup visits only
    the earlier occurrences of the newest n-gram instead of scanning the whole history.
    """

    def __init__(self, tokens: list[int], max_ngram: int) -> None:
        self.tokens: list[int] = []
        self.max_ngram = max_ngram
        self.starts: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_ngram + 1)]
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(1, min(self.max_ngram, end) + 1):
                key = tuple(self.tokens[end - n : end])
                self.starts[n].setdefault(key, []).append(end - n)


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
        self._history: list[NgramIndex] = []
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
            NgramIndex(
                [tok for tok, k in zip(row, mask, strict=True) if k] + [tok0], self.max_ngram
            )
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
    def histories(self) -> list[NgramIndex]:
        """Each row's committed tokens (prompt, then everything emitted), indexed."""
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
            history.extend([*drafts[:accepted], token])

    def select_rows(self, rows: torch.Tensor) -> None:
        self._history = [self._history[row] for row in rows.tolist()]
        self._last_drafts = []

    def merge(self, other: Drafter) -> None:
        if not isinstance(other, NgramDrafter):
            raise TypeError(f"cannot merge a {other.kind} drafter's rows into an ngram drafter")
        self._history = self._history + other._history
        self._last_drafts = []

    def lookup(self, history: NgramIndex | list[int], num_tokens: int) -> tuple[list[int], int]:
        """Tokens after an earlier occurrence of the longest matching suffix, and its length.

        The most recent occurrence that still has ``num_tokens`` tokens after it wins (on a
        repeated pattern the nearest match would leave only one token to copy); failing that,
        the occurrence with the longest continuation. ``([], 0)`` when nothing matches.
        """
        if not isinstance(history, NgramIndex):
            history = NgramIndex(history, self.max_ngram)
        tokens = history.tokens
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            starts = history.starts[n].get(tuple(tokens[length - n :]), [])
            best: list[int] = []
            # The most recent occurrence best predicts what comes next; the last start listed
            # is the suffix itself.
            for start in reversed(starts[:-1]):
                continuation = tokens[start + n : start + n + num_tokens]
                if len(continuation) == num_tokens:
                    return continuation, n
                if len(continuation) > len(best):
                    best = continuation
            if best:
                return best, n
        return [], 0
