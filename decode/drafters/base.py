"""The runtime protocol every drafter follows inside the speculative decoder.

One decoding round (THEORY.md sections 1-2):

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

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from decode.sampling import SamplingConfig


@dataclass
class TargetPass:
    """What the target computed in one forward pass, for drafters that read it.

    ``hidden_states`` is the model's ``output_hidden_states`` tuple (embeddings first, then one
    entry per layer, each [B, T, H]) and is filled only when the drafter asks for it.
    """

    logits: torch.Tensor  # [B, T, V]
    hidden_states: tuple[torch.Tensor, ...] | None = None


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

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Size of the token space the proposals are drawn from (must match the target)."""

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
        """Guess ``num_tokens`` tokens after each row's pending token."""

    @abstractmethod
    def commit(
        self,
        num_accepted: torch.Tensor,  # [B] accepted drafts per row, 0..N
        next_tokens: torch.Tensor,  # [B] recovered or bonus token: the new pending token
        target_pass: TargetPass,  # the verify pass over [pending, d_1 .. d_N]
    ) -> None:
        """Bring the drafter's state to the newly committed sequence."""
