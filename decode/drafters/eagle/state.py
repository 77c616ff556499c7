"""What an EAGLE-3 runtime drafter holds between rounds: the head's cache and its last read.

:class:`HeadState` is the state of a batch: the head's KV cache of committed entries
(f_t, x_{t+1}), which slots of it are valid, the last read entry's output and the first draft
logits after it, and the entries committed since the last read (:class:`UnreadBlock`), which
the next proposal reads in one pass (``draftsmith.decode.drafters.eagle.drafter``). Chains and trees
(``draftsmith.decode.drafters.eagle.trees``) draft from it and crop their drafted entries back off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from draftsmith.decode.forward.kv_cache import PreallocatedStack


@dataclass
class UnreadBlock:
    """One commit's entries (f_t, x_{t+1}), recorded for the head's next pass."""

    tokens: torch.Tensor  # [B, W] the token paired with each entry
    valid: torch.Tensor  # [B, W] bool: entries a row kept (the rest are holes)
    positions: torch.Tensor  # [B, W]
    features: torch.Tensor  # [B, W, A*H] the target's hidden states the head fuses
    last: torch.Tensor  # [B] column of each row's last kept entry
    holes: bool  # some row kept fewer entries than another

    def select(self, rows: torch.Tensor) -> UnreadBlock:  # rows [R]
        """The block of ``rows`` alone, in that order."""
        return self._per_row(lambda values: values[rows], self.holes)

    def with_empty_rows(self, count: int) -> UnreadBlock:
        """The block with ``count`` rows appended that hold no entry (rows merged in after
        it was recorded: every column of theirs is a hole)."""
        return self._per_row(
            lambda values: torch.cat((values, values.new_zeros(count, *values.shape[1:]))), True
        )

    def _per_row(self, change: Callable[[torch.Tensor], torch.Tensor], holes: bool) -> UnreadBlock:
        """The block with ``change`` applied to each of its per-row tensors."""
        return UnreadBlock(
            tokens=change(self.tokens),
            valid=change(self.valid),
            positions=change(self.positions),
            features=change(self.features),
            last=change(self.last),
            holes=holes,
        )


@dataclass
class HeadState:
    """The head's view of a batch: committed entries in its cache, the last one's output."""

    cache: PreallocatedStack  # per layer [B, KV, S, D]: committed entries (holes in `valid`)
    valid: torch.Tensor  # [B, S] bool
    has_holes: bool  # some committed slot of some row is invalid (padding or a hole)
    hidden: torch.Tensor  # [B, H] pre-norm output of each row's last entry the head read
    logits: torch.Tensor  # [B, V_draft] draft logits after that entry
    next_pos: torch.Tensor  # [B] position of the next entry (the pending token's pair)
    drafts: torch.Tensor | None = None  # [B, N] the last chain proposal, until committed
    unread: list[UnreadBlock] = field(default_factory=list)  # committed, not yet in the cache
