"""The runtime protocol every drafter follows inside the speculative decoder.

One decoding round (docs/theory.md §1-2):

1. the engine holds ``pending`` [B]: the newest emitted token of each row, not yet in the
   target's KV cache;
2. ``drafter.propose(...)`` guesses N tokens after ``pending`` and returns the distribution each
   was drawn from (``None`` for deterministic proposers, whose ``q`` is one-hot);
3. the target scores ``[pending, d_1 .. d_N]`` in one forward pass, the engine verifies, rolls
   its cache back and calls ``drafter.commit(...)`` with the number of accepted drafts per row,
   the token emitted after them (recovered or bonus) and the target's verify-pass outputs.

A drafter owns its own state (its KV cache, the tokens it has not read yet) and keeps it in step
with the committed sequence through ``prefill`` and ``commit``. Rows of a batch advance by
different amounts; padding inside a row is marked in attention masks, never by moving memory.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from draftsmith.decode.defaults import TREE_TOP_K, TREE_TOTAL_TOKENS
from draftsmith.decode.sampling import SamplingConfig
from draftsmith.decode.trees.layout import dynamic_tree_capacity

if TYPE_CHECKING:
    from draftsmith.decode.trees.layout import TreeProposal
    from draftsmith.decode.trees.verify import TreeVerification


@dataclass
class TargetPass:
    """What the target computed in one forward pass, for drafters that read it.

    ``hidden_states`` is the model's ``output_hidden_states`` tuple (embeddings first, then one
    entry per layer, each [B, T, H]) and is filled only when the drafter asks for it.
    """

    logits: torch.Tensor  # [B, T, V]
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass(frozen=True)
class TreeSpec:
    """The shape of a draft tree (docs/theory.md §4), verified in one target pass.

    Dynamic trees (EAGLE-2, Li et al. 2024) give each of the ``frontier`` best nodes of a
    level its ``top_k`` most likely children, for ``depth`` levels, and keep the
    ``total_tokens`` nodes of highest cumulative draft probability; EAGLE-2 expands as many
    nodes as it takes children (``frontier`` 0 means ``top_k``). ``frontier=1`` drafts the
    greedy chain with its runners-up beside it: every level is a one-row step, as a chain's
    is, and the verify pass also scores the top_k - 1 alternatives at each depth. Static
    trees (Medusa, Cai et al. 2024) follow ``choices``, a list of paths of child ranks such as
    ``((0,), (1,), (0, 0))``.
    """

    top_k: int = TREE_TOP_K
    total_tokens: int = TREE_TOTAL_TOKENS
    choices: tuple[tuple[int, ...], ...] | None = None
    frontier: int = 0  # nodes expanded per level; 0: top_k (EAGLE-2)

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.total_tokens < 1:
            raise ValueError(
                f"tree top_k and total_tokens must be >= 1, got {self.top_k}, {self.total_tokens}"
            )
        if not 0 <= self.frontier <= self.top_k:
            raise ValueError(
                f"tree frontier must lie in [0, top_k={self.top_k}], got {self.frontier}: it "
                "counts the nodes of a level that grow children (0: all top_k, EAGLE-2's rule)"
            )

    @property
    def expanded(self) -> int:
        """Nodes of each level that grow children (``frontier``, or ``top_k``)."""
        return self.frontier or self.top_k

    def capacity(self, depth: int) -> int:
        """Nodes a dynamic tree of this shape ``depth`` levels deep can hold."""
        return dynamic_tree_capacity(self.top_k, depth, self.expanded)


@dataclass
class DraftProposal:
    """N drafted tokens per row and the distribution each was drawn from."""

    tokens: torch.Tensor  # [B, N] int64
    probs: torch.Tensor | None  # [B, N, V] float, or None when q is one-hot (deterministic)


class Drafter(ABC):
    """Base class of every drafter the engine can run.

    Subclasses set ``kind`` (the registry key) and ``needs_hidden_states`` (whether the engine
    must ask the target for ``output_hidden_states`` on prefill and verify passes).
    """

    kind: ClassVar[str]
    needs_hidden_states: ClassVar[bool] = False
    supports_trees: ClassVar[bool] = False
    supports_sampled_trees: ClassVar[bool] = False  # implements ``propose_sampled_tree`` (T > 0)
    supports_external_drafts: ClassVar[bool] = False  # implements ``replace_drafts``
    # The most drafts a chain round of the engine verifies now (the rows' remaining room less
    # the token every round emits, at least one), set before each round; None outside an
    # engine. A drafter that may propose more than ``num_tokens`` (the hybrid's lookup copies)
    # stays within it, so its verify passes reach no further than a chain's.
    draft_room: int | None = None
    # Drafters that read committed entries lazily (the EAGLE-3 family) drop the entries of
    # rounds older than this many instead of reading them (None: they read them in time).
    # Set where long runs of rounds without drafts are expected and the drafter's upkeep
    # would cost more than its gaps (``draftsmith.decode.drafters.eagle.drafter``).
    forget_after_rounds: int | None = None

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Size of the token space the proposals are drawn from (must match the target)."""

    @property
    def max_draft_tokens(self) -> int | None:
        """The longest chain ``propose`` drafts (Medusa: one token per head); None: no limit.
        Trees are cut to this depth by the drafter itself."""
        return None

    def check_compatible(self, target: torch.nn.Module) -> None:
        """Raise ``ValueError`` when this drafter cannot serve ``target``."""
        target_vocab = target.get_output_embeddings().weight.shape[0]
        if self.vocab_size != target_vocab:
            raise ValueError(
                f"{self.kind} drafter proposes over a vocabulary of {self.vocab_size} tokens but "
                f"the target's has {target_vocab}: train or load a drafter that shares the "
                "target's tokenizer"
            )

    @abstractmethod
    def prefill(
        self,
        input_ids: torch.Tensor,  # [B, T] left-padded prompt
        attention_mask: torch.Tensor,  # [B, T] 1 for real tokens
        target_pass: TargetPass,  # the target's prefill over the prompt
        pending: torch.Tensor,  # [B] the first token the target emitted
    ) -> None:
        """Start a new batch: read the prompt (and the target's prefill, if needed)."""

    @abstractmethod
    def propose(
        self,
        num_tokens: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        """Guess ``num_tokens`` tokens after each row's pending token.

        ``num_tokens`` may be 0 (an adaptive round that skips drafting): return an empty
        [B, 0] proposal without running a draft network; ``commit`` follows as usual.
        """

    @abstractmethod
    def commit(
        self,
        num_accepted: torch.Tensor,  # [B] accepted drafts per row, 0..N
        next_tokens: torch.Tensor,  # [B] recovered or bonus token: the new pending token
        target_pass: TargetPass,  # the verify pass over [pending, d_1 .. d_N]
    ) -> None:
        """Bring the drafter's state to the newly committed sequence."""

    # -- continuous batching: rows join and leave between rounds --------------------------
    def spawn(self) -> Drafter:
        """A drafter with these weights and settings for a batch of its own: new rows are
        ``prefill``-ed on a spawn, then ``merge``-d into the running drafter. The default is a
        shallow copy (weights shared; ``prefill`` replaces the per-batch state)."""
        return copy.copy(self)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (batch indices, in their new order) of the state; called between
        rounds (after ``commit``), e.g. when finished requests retire."""
        raise NotImplementedError(f"the {self.kind} drafter cannot drop rows of a batch")

    def merge(self, other: Drafter) -> None:
        """Append the rows of ``other`` (a prefilled ``spawn`` of this drafter) after this
        batch's rows; called between rounds, e.g. when new requests join."""
        raise NotImplementedError(f"the {self.kind} drafter cannot merge batches")

    def usage(self) -> dict[str, float] | None:
        """What the drafter reports about its own work (the hybrid: how often each part
        drafted), or None."""
        return None

    def replace_drafts(
        self,
        tokens: torch.Tensor,  # [B, W] the tokens the round verifies instead of the proposal
        replaced: torch.Tensor,  # [B] bool: rows whose proposal was replaced
    ) -> None:
        """Between ``propose`` and ``commit``: another proposer (prompt lookup, in the hybrid
        drafter) drafted the ``replaced`` rows; the round verifies ``tokens`` there (the other
        rows keep this drafter's proposal, so ``W`` equals its width unless every row was
        replaced after a zero-width proposal). ``commit`` then brings the state to what was
        accepted of them. Drafters with ``supports_external_drafts`` implement it."""
        raise NotImplementedError(f"the {self.kind} drafter cannot verify another's drafts")

    def propose_tree(self, spec: TreeSpec, depth: int) -> TreeProposal:
        """Draft a tree of at most ``depth`` levels (drafters with ``supports_trees``)."""
        raise NotImplementedError(f"the {self.kind} drafter drafts chains only")

    def propose_sampled_tree(
        self,
        spec: TreeSpec,
        depth: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> TreeProposal:
        """Draft a tree whose nodes are drawn from the drafter's q, with ``draft_probs`` filled,
        in a shape fixed by ``spec`` and ``depth`` alone (drafters with
        ``supports_sampled_trees``; docs/theory.md §4)."""
        raise NotImplementedError(f"the {self.kind} drafter drafts no sampled trees")

    def commit_tree(self, verification: TreeVerification, target_pass: TargetPass) -> None:
        """Bring the state to the accepted branch (drafters with ``supports_trees``)."""
        raise NotImplementedError(f"the {self.kind} drafter drafts chains only")


def require_left_padded(attention_mask: torch.Tensor) -> None:  # [B, T]
    """``ValueError`` unless every row's last column is a real token (prompts left-padded:
    a drafter's first draft follows each row's last prompt token)."""
    if not bool(attention_mask[:, -1].bool().all()):
        raise ValueError(
            "prompts must be left-padded: every row's last column must be a real token"
        )
