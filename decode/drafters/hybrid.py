"""Prompt lookup where the context offers a match, a learned drafter where it does not.

Code repeats itself (identifiers, call patterns, whole lines), and where it does, copying what
followed an earlier occurrence of the newest n-gram (Saxena 2023) drafts long runs for free;
elsewhere a learned drafter (a draft LM or an EAGLE-3 head) guesses. Each round and each row
takes its drafts from one of the two:

* prompt lookup, when the row's newest ``n``-gram occurred before and lookup's measured yield
  for matches of that length beats the learned drafter's, ``E_lookup(n) / T_lookup >=
  E_learned / T_learned`` (``E``: tokens emitted per round, ``T``: the round's wall time,
  both decayed running means; a round in which no row needs the learned drafter skips its
  network entirely, so ``T_lookup`` is a bare verify pass);
* the learned drafter otherwise.

Lookup drafts are deterministic: their ``q`` is one-hot (accepted with probability ``p(x)``,
docs/theory.md §2), while the learned drafter's rows keep the ``q`` they were sampled from, so
a mixed round stays exact row by row. Both parts see every committed token: the learned
drafter through ``replace_drafts`` (it commits the tokens the round actually verified), the
lookup through its history.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from decode.drafters.base import Drafter, DraftProposal, TargetPass
from decode.drafters.ngram import NgramDrafter
from decode.sampling import SamplingConfig

# Smoothing of the running yields: about the last 1 / (1 - DECAY) rounds count.
DECAY = 0.9
# A source that lost the comparison is still tried every PROBE_EVERY-th round it could draft,
# so a change in the text (a repetitive stretch starting) is noticed.
PROBE_EVERY = 16


@dataclass
class _Yield:
    """Decayed running means of tokens emitted per row-round and seconds per round."""

    tokens: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0  # decayed count of observations (0: never measured)

    def add(self, tokens: float, seconds: float) -> None:
        self.tokens = DECAY * self.tokens + tokens
        self.seconds = DECAY * self.seconds + seconds
        self.weight = DECAY * self.weight + 1.0

    @property
    def rate(self) -> float:  # tokens per second; inf until measured (try it once)
        return float("inf") if self.weight == 0 else self.tokens / max(self.seconds, 1e-9)


@dataclass
class HybridUsage:
    """How often each part drafted, and what it earned (row-rounds and accepted drafts)."""

    lookup_rows: int = 0
    learned_rows: int = 0
    lookup_accepted: int = 0
    learned_accepted: int = 0
    rounds_without_network: int = 0

    def to_dict(self) -> dict[str, float]:
        rows = self.lookup_rows + self.learned_rows
        return {
            "lookup_rows": self.lookup_rows,
            "learned_rows": self.learned_rows,
            "lookup_share": self.lookup_rows / rows if rows else 0.0,
            "lookup_mean_accepted": self.lookup_accepted / max(self.lookup_rows, 1),
            "learned_mean_accepted": self.learned_accepted / max(self.learned_rows, 1),
            "rounds_without_network": self.rounds_without_network,
        }


class HybridDrafter(Drafter):
    """Prompt lookup and a learned drafter (``draft_lm`` or ``eagle3``) in one round."""

    kind = "hybrid"

    def __init__(self, learned: Drafter, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not learned.supports_external_drafts:
            raise ValueError(
                f"the hybrid drafter pairs prompt lookup with a draft_lm or eagle3 drafter; the "
                f"{learned.kind} drafter cannot commit drafts it did not propose"
            )
        self.learned = learned
        self.lookup = NgramDrafter(learned.vocab_size, max_ngram=max_ngram, min_ngram=min_ngram)
        self.needs_hidden_states = learned.needs_hidden_states
        self._lookup_yield = [_Yield() for _ in range(max_ngram + 1)]  # by matched length
        self._learned_yield = _Yield()
        self._usage = HybridUsage()
        self._round: tuple[list[int], bool, float] | None = None  # match lengths, network, t0
        self._skipped = 0  # rounds lookup could have drafted but lost the comparison

    @property
    def vocab_size(self) -> int:
        return self.learned.vocab_size

    def usage(self) -> dict[str, float]:
        return self._usage.to_dict()

    def prefill(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor,  # [B, T]
        target_pass: TargetPass,
        pending: torch.Tensor,  # [B]
    ) -> None:
        self.learned.prefill(input_ids, attention_mask, target_pass, pending)
        self.lookup.prefill(input_ids, attention_mask, target_pass, pending)
        self._round = None

    def propose(
        self,
        num_tokens: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        start = time.perf_counter()
        found = [self.lookup.lookup(history, num_tokens) for history in self.lookup.histories]
        use_lookup = [self._prefers_lookup(n) for _, n in found] if num_tokens else []
        if num_tokens == 0 or all(use_lookup):
            width = max((len(drafts) for drafts, _ in found), default=0) if num_tokens else 0
            proposal = self.learned.propose(0, sampling, generator)
            tokens = _padded([drafts for drafts, _ in found], width, proposal.tokens)
            replaced = torch.ones(len(found), dtype=torch.bool, device=tokens.device)
            self.learned.replace_drafts(tokens, replaced)
            self.lookup.replace_drafts(tokens, replaced)
            # A plain step (width 0, an adaptive choice) says nothing about either source.
            self._round = ([n for _, n in found], False, start) if num_tokens else None
            return DraftProposal(tokens=tokens, probs=None)
        proposal = self.learned.propose(num_tokens, sampling, generator)
        tokens, probs = proposal.tokens, proposal.probs
        replaced = torch.tensor(use_lookup, dtype=torch.bool, device=tokens.device)
        if any(use_lookup):
            lookup_tokens = _padded([drafts for drafts, _ in found], num_tokens, tokens)
            tokens = torch.where(replaced[:, None], lookup_tokens, tokens)
            if probs is not None:  # lookup rows: q is one-hot on the copied token
                one_hot = torch.nn.functional.one_hot(tokens, probs.shape[-1]).to(probs.dtype)
                probs = torch.where(replaced[:, None, None], one_hot, probs)
            self.learned.replace_drafts(tokens, replaced)
        self.lookup.replace_drafts(tokens, torch.ones_like(replaced))
        lengths = [n if use else 0 for (_, n), use in zip(found, use_lookup, strict=True)]
        self._round = (lengths, True, start)
        return DraftProposal(tokens=tokens, probs=probs)

    def commit(
        self,
        num_accepted: torch.Tensor,  # [B]
        next_tokens: torch.Tensor,  # [B]
        target_pass: TargetPass,
    ) -> None:
        self.learned.commit(num_accepted, next_tokens, target_pass)
        self.lookup.commit(num_accepted, next_tokens, target_pass)
        if self._round is None:
            return
        lengths, network, start = self._round
        self._round = None
        seconds = time.perf_counter() - start  # drafting, verification and this commit
        accepted = num_accepted.tolist()
        for n, a in zip(lengths, accepted, strict=True):
            usage = self._usage
            if n:
                self._lookup_yield[n].add(a + 1, seconds)
                usage.lookup_rows += 1
                usage.lookup_accepted += a
            else:
                self._learned_yield.add(a + 1, seconds)
                usage.learned_rows += 1
                usage.learned_accepted += a
        if not network:
            self._usage.rounds_without_network += 1

    def _prefers_lookup(self, matched: int) -> bool:
        """Lookup drafts a row whose newest ``matched``-gram occurred before, when its measured
        tokens per second beat the learned drafter's (probing now and then when it does not)."""
        if matched == 0:
            return False
        if self._lookup_yield[matched].rate >= self._learned_yield.rate:
            return True
        self._skipped += 1
        return self._skipped % PROBE_EVERY == 0


def _padded(
    rows: list[list[int]], width: int, like: torch.Tensor
) -> torch.Tensor:  # [B, width] int64
    """Lookup continuations padded with token 0 (one-hot proposals that may still be accepted)."""
    return torch.tensor(
        [row[:width] + [0] * (width - len(row[:width])) for row in rows],
        dtype=torch.long,
        device=like.device,
    ).reshape(len(rows), width)
