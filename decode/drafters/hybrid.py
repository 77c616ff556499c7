"""Prompt lookup where the context offers a match, a learned drafter where it does not.

Code repeats itself (identifiers, call patterns, whole lines), and where it does, copying what
followed an earlier occurrence of the newest n-gram (Saxena 2023) drafts long runs for free;
elsewhere a learned drafter (a draft LM or an EAGLE-3 head) guesses. Each row of a drafting
round takes its drafts from one of the two:

* prompt lookup, when the row's newest ``n``-gram occurred before and lookup's measured yield
  for matches of that length beats the learned drafter's in the same context (rows whose
  newest ``n``-gram matched), ``E_lookup(n) / T_lookup(n) >= E_learned(n) / T_learned(n)``
  (``E``: tokens emitted per round, ``T``: the round's wall time, both decayed running means;
  a round in which no row needs the learned drafter skips its network entirely, so
  ``T_lookup`` is a bare verify pass). Where a match is short the learned drafter's guesses
  are often no better than the copy, and its yield over all contexts would overrate it; a
  context seen in few rounds leans on that overall yield (``_Yields.learned_rate``). A losing lookup
  is still tried every ``PROBE_EVERY``-th time, so a repetitive stretch starting is noticed;
* the learned drafter otherwise.

Whether a round drafts at all is the draft-length policy's choice
(``draftsmith.decode.draft_length``: a fixed N, the adaptive length, the server's load-aware
one), which asks for no drafts where a plain step is the faster choice; the hybrid drafts
whenever it is asked to. It once made that choice a second time, per round, from its own
decayed yields (about the last ten rounds), and they were too noisy for it: at T = 1 a learned
head's tokens per round spread widely, one unlucky stretch put its yield below a plain step's,
and a source that trails is retried only every 16-128 decisions, so the estimate stayed low.
On the AVX2-only AMD EPYC in float32 (the demo target, the main job's EAGLE-3 head, one
closed-loop client at T = 1) the hybrid stepped plainly in 227 of 318 row-rounds of one
8-second window under a fixed N = 4, and under the server's load-aware policy served 0.85
times the head's tokens per second (the median of four alternating 8-second windows). Leaving
the choice to the policy, it served 0.95 times the head's (1.02 at four clients; 2.65 at one
greedy client, where lookup copies).

A round in which every drafting row copies runs no network, so it is not bound by the learned
drafter's N, which prices that network's draft steps: lookup then copies up to
``lookup_tokens`` (``draftsmith.decode.defaults.LOOKUP_DRAFT_TOKENS``; never past the request's room,
``Drafter.draft_room``), and only the verify pass widens.
Where a verify pass over 5-17 tokens costs about one target step (bfloat16 on AVX512-BF16 or
AMX, a GPU), greedy text that repeats itself turns the longer copies into longer accepted runs:
on the demo target (AMD EPYC Zen 5, AVX512-BF16, bfloat16), the main job's EAGLE-3 head, 24
held-out prompts x 128 tokens at T = 0, one interleaved run, copies of up to 4 / 8 / 10 / 16
tokens gave the hybrid tau 3.18 / 3.70 / 3.76 / 4.08; at T = 1 (16 prompts) up to 4 / 8 / 16
gave tau 2.54 / 2.62 / 2.66, with tokens/s rising in step (the benchmarks guide). In a round
where some row runs the network, lookup rows copy N tokens, the width of that round.

Lookup drafts are deterministic: their ``q`` is one-hot (accepted with probability ``p(x)``,
docs/theory.md §2), while the learned drafter's rows keep the ``q`` they were sampled from, so
a mixed round stays exact row by row. Both parts see every committed token: the learned
drafter through ``replace_drafts`` (it commits the tokens the round actually verified), the
lookup through its history.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from draftsmith.decode.defaults import LOOKUP_DRAFT_TOKENS
from draftsmith.decode.drafters.base import Drafter, DraftProposal, TargetPass
from draftsmith.decode.drafters.ngram import NgramDrafter
from draftsmith.decode.sampling import SamplingConfig

# Smoothing of the running yields: about the last 1 / (1 - DECAY) rounds count.
DECAY = 0.9
# Lookup, when it lost the comparison, is still tried now and then, so that a change in the
# text (a repetitive stretch starting) is noticed: after PROBE_EVERY decisions against it, stretched
# by how far its measured rate trails the learned drafter's (at most MAX_PROBE_STRETCH times),
# so a lookup that clearly loses (when sampling) costs few rounds.
PROBE_EVERY = 16
MAX_PROBE_STRETCH = 8.0
# The learned drafter's yield in one context (matched n-gram length) starts from its yield over
# all rows, counted as this many rounds: rare contexts are not judged on a round or two.
CONTEXT_PRIOR_ROUNDS = 2.0
# Row sources besides lookup (whose source is the matched n-gram length, >= 1); _NONE: a round
# the draft-length policy gave no drafts.
_LEARNED, _NONE = 0, -1


@dataclass
class _Yield:
    """Decayed running means of tokens emitted per row-round and seconds per round.

    A source's first round is not counted: it pays one-time costs (a kernel built for a new row
    count, a layout prepared on first use; ``draftsmith.decode.draft_length``), so the source is tried
    again before it is compared."""

    tokens: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0  # decayed count of observations (0: never measured)
    warmed: bool = False  # the first, uncounted round has run
    skipped: int = 0  # decisions against this source since it was last tried

    def add(self, tokens: float, seconds: float) -> None:
        if not self.warmed:
            self.warmed = True
            return
        self.tokens = DECAY * self.tokens + tokens
        self.seconds = DECAY * self.seconds + seconds
        self.weight = DECAY * self.weight + 1.0

    @property
    def rate(self) -> float:  # tokens per second; inf until measured (try it)
        return float("inf") if self.weight == 0 else self.tokens / max(self.seconds, 1e-9)


class _Yields:
    """The measured yields the choice between lookup and the learned drafter reads, for one
    kind of sampling: greedy and sampled rows keep their own (lookup's one-hot drafts are
    accepted far more often greedily, so a server's greedy rounds would otherwise send its
    sampled rows to lookup, and its sampled rounds keep its greedy rows from it)."""

    def __init__(self, max_ngram: int) -> None:
        self.lookup = [_Yield() for _ in range(max_ngram + 1)]  # by matched length (0 unused)
        self.learned = _Yield()  # over all rows
        self.learned_by_context = [_Yield() for _ in range(max_ngram + 1)]  # 0: no match

    def prefers_lookup(self, matched: int) -> bool:
        """Lookup drafts a row whose newest ``matched``-gram occurred before, when its measured
        tokens per second beat the learned drafter's in rows with such a match (probing now
        and then when they do not)."""
        if matched == 0:
            return False
        lookup, learned = self.lookup[matched], self.learned_rate(matched)
        return lookup.rate >= learned or _probe(lookup, lookup.rate, learned)

    def learned_rate(self, matched: int) -> float:
        """The learned drafter's tokens per second in rows whose newest n-gram matched
        ``matched`` tokens: ``(E_n + k E / w) / (T_n + k T / w)``, its own decayed sums with
        ``k`` = ``CONTEXT_PRIOR_ROUNDS`` mean rounds over all rows (``E``, ``T``, ``w``: the
        pooled sums and weight) added, so a context seen in a few rounds leans on the pool."""
        pooled, own = self.learned, self.learned_by_context[matched]
        if pooled.weight == 0:
            return float("inf")  # never measured: try it
        prior = CONTEXT_PRIOR_ROUNDS / pooled.weight
        seconds = own.seconds + prior * pooled.seconds
        return (own.tokens + prior * pooled.tokens) / max(seconds, 1e-9)


@dataclass
class HybridUsage:
    """How often each part drafted, and what it earned (row-rounds and accepted drafts)."""

    lookup_rows: int = 0
    learned_rows: int = 0
    plain_rows: int = 0  # rounds the draft-length policy gave no drafts
    lookup_accepted: int = 0
    learned_accepted: int = 0
    rounds_without_network: int = 0

    def to_dict(self) -> dict[str, float]:
        rows = self.lookup_rows + self.learned_rows + self.plain_rows
        return {
            "lookup_rows": self.lookup_rows,
            "learned_rows": self.learned_rows,
            "plain_rows": self.plain_rows,
            "lookup_share": self.lookup_rows / rows if rows else 0.0,
            "lookup_mean_accepted": self.lookup_accepted / max(self.lookup_rows, 1),
            "learned_mean_accepted": self.learned_accepted / max(self.learned_rows, 1),
            "rounds_without_network": self.rounds_without_network,
        }


class HybridDrafter(Drafter):
    """Prompt lookup and a learned drafter (``draft_lm``, ``eagle3`` or ``peagle``) in one round."""

    kind = "hybrid"

    def __init__(
        self,
        learned: Drafter,
        max_ngram: int = 3,
        min_ngram: int = 1,
        lookup_tokens: int = LOOKUP_DRAFT_TOKENS,
    ) -> None:
        """``lookup_tokens``: the most tokens a round that runs no network copies (at least the
        round's N; the module docstring)."""
        if not learned.supports_external_drafts:
            raise ValueError(
                "the hybrid drafter pairs prompt lookup with a draft_lm, eagle3 or peagle "
                f"drafter; the {learned.kind} drafter cannot commit drafts it did not propose"
            )
        self.learned = learned
        self.lookup = NgramDrafter(learned.vocab_size, max_ngram=max_ngram, min_ngram=min_ngram)
        self.lookup_tokens = lookup_tokens
        self.needs_hidden_states = learned.needs_hidden_states
        self._yields = {greedy: _Yields(max_ngram) for greedy in (True, False)}  # by greedy
        self._usage = HybridUsage()
        # The yields the round chose from; per row: the matched n-gram length (lookup), _LEARNED
        # or _NONE, and the length matched whatever the source; whether the network ran; the
        # round's start.
        self._round: tuple[_Yields, list[int], list[int], bool, float] | None = None

    @property
    def lookup_tokens(self) -> int:
        """The most tokens a round that runs no network copies (the module docstring)."""
        return self._lookup_tokens

    @lookup_tokens.setter
    def lookup_tokens(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"lookup_tokens must be an int, got {value!r}")
        if value < 1:
            raise ValueError(
                f"lookup_tokens must be >= 1 (tokens a lookup round copies), got {value}"
            )
        self._lookup_tokens = value

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

    @property
    def max_draft_tokens(self) -> int | None:
        """The learned drafter's most (a DFlash block's B - 1): the engine's N stays within it."""
        return self.learned.max_draft_tokens

    def propose(
        self,
        num_tokens: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        start = time.perf_counter()
        # Copies as long as a round without the network takes (a round with it cuts them to N),
        # never past the round's room (``Drafter.draft_room``).
        reach = max(num_tokens, self.lookup_tokens) if num_tokens else 0
        if self.draft_room is not None:  # the engine's num_tokens never exceeds it
            reach = min(reach, self.draft_room)
        found = [self.lookup.lookup(history, reach) for history in self.lookup.histories]
        contexts = [n for _, n in found]  # the matched n-gram length of each row (0: none)
        yields = self._yields[sampling.greedy]
        if num_tokens == 0:  # a plain step chosen by the draft-length policy
            sources = [_NONE] * len(found)
        else:
            sources = [n if yields.prefers_lookup(n) else _LEARNED for n in contexts]
        lookup_rows = [s > 0 for s in sources]
        if _LEARNED not in sources:  # no network this round: lookup rows, plain steps elsewhere
            width = max(
                (len(d) for (d, _), use in zip(found, lookup_rows, strict=True) if use), default=0
            )
            proposal = self.learned.propose(0, sampling, generator)
            tokens = _padded(
                [d if use else [] for (d, _), use in zip(found, lookup_rows, strict=True)],
                width,
                proposal.tokens,
            )
            replaced = torch.ones(len(found), dtype=torch.bool, device=tokens.device)
            self.learned.replace_drafts(tokens, replaced)
            self.lookup.replace_drafts(tokens, replaced)
            self._round = (yields, sources, contexts, False, start)
            return DraftProposal(tokens=tokens, probs=None)
        proposal = self.learned.propose(num_tokens, sampling, generator)
        tokens, probs = proposal.tokens, proposal.probs
        replaced = torch.tensor(lookup_rows, dtype=torch.bool, device=tokens.device)
        if any(lookup_rows):
            # The learned proposal's width (at most N; a block drafter may verify fewer).
            lookup_tokens = _padded([drafts for drafts, _ in found], tokens.shape[1], tokens)
            tokens = torch.where(replaced[:, None], lookup_tokens, tokens)
            if probs is not None:  # lookup rows: q is one-hot on the copied token
                one_hot = torch.nn.functional.one_hot(tokens, probs.shape[-1]).to(probs.dtype)
                probs = torch.where(replaced[:, None, None], one_hot, probs)
            self.learned.replace_drafts(tokens, replaced)
        self.lookup.replace_drafts(tokens, torch.ones_like(replaced))
        self._round = (yields, sources, contexts, True, start)
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
        yields, sources, contexts, network, start = self._round
        self._round = None
        seconds = time.perf_counter() - start  # drafting, verification and this commit
        usage = self._usage
        rows = zip(sources, contexts, num_accepted.tolist(), strict=True)
        for source, context, accepted in rows:
            if source > 0:
                yields.lookup[source].add(accepted + 1, seconds)
                usage.lookup_rows += 1
                usage.lookup_accepted += accepted
            elif source == _LEARNED:
                yields.learned.add(accepted + 1, seconds)
                yields.learned_by_context[context].add(accepted + 1, seconds)
                usage.learned_rows += 1
                usage.learned_accepted += accepted
            else:
                usage.plain_rows += 1
        if not network and any(source > 0 for source in sources):
            usage.rounds_without_network += 1

    @property
    def forget_after_rounds(self) -> int | None:  # the learned drafter's (Drafter's attribute)
        return self.learned.forget_after_rounds

    @forget_after_rounds.setter
    def forget_after_rounds(self, rounds: int | None) -> None:
        self.learned.forget_after_rounds = rounds

    def spawn(self) -> HybridDrafter:
        """Spawns of both parts; the measured yields (greedy and sampled apart) and the usage
        stay shared."""
        spawned = copy.copy(self)
        spawned.learned = self.learned.spawn()
        spawned.lookup = self.lookup.spawn()
        spawned._round = None
        return spawned

    def select_rows(self, rows: torch.Tensor) -> None:
        self.learned.select_rows(rows)
        self.lookup.select_rows(rows)
        self._round = None

    def merge(self, other: Drafter) -> None:
        if not isinstance(other, HybridDrafter):
            raise TypeError(f"cannot merge a {other.kind} drafter's rows into a hybrid drafter")
        self.learned.merge(other.learned)
        self.lookup.merge(other.lookup)
        self._round = None


def lookup_tokens_problem(lookup_tokens: int | None, drafter_kind: str | None) -> str | None:
    """What is wrong with a command's ``--lookup-tokens`` for ``--drafter-kind`` (checked
    before any model loads), or None."""
    if lookup_tokens is not None and drafter_kind != "hybrid":
        return (
            "--lookup-tokens sets the hybrid drafter's copies: add --drafter-kind hybrid or drop "
            "--lookup-tokens"
        )
    return None


def set_lookup_tokens(drafter: Drafter, lookup_tokens: int | None, flag: str) -> None:
    """Apply a command's ``flag`` (None: leave the default) to a hybrid drafter; any other
    kind gets a ``ValueError`` that names the flag and the fix."""
    if lookup_tokens is None:
        return
    if not isinstance(drafter, HybridDrafter):
        raise ValueError(
            f"{flag} sets how many tokens the hybrid drafter's lookup rounds copy; this drafter "
            f"is {drafter.kind}: add --drafter-kind hybrid or drop {flag} (prompt lookup alone "
            "copies --num-draft-tokens)"
        )
    drafter.lookup_tokens = lookup_tokens


def _probe(source: _Yield, rate: float, best: float) -> bool:
    """Whether a source whose ``rate`` (tokens/s) lost to ``best`` is tried anyway this time:
    once every ``PROBE_EVERY * min(best / rate, MAX_PROBE_STRETCH)`` decisions against it."""
    source.skipped += 1
    stretch = min(best / max(rate, 1e-9), MAX_PROBE_STRETCH)
    if source.skipped < PROBE_EVERY * stretch:
        return False
    source.skipped = 0
    return True


def _padded(
    rows: list[list[int]], width: int, like: torch.Tensor
) -> torch.Tensor:  # [B, width] int64
    """Lookup continuations padded with token 0 (one-hot proposals that may still be accepted)."""
    return torch.tensor(
        [row[:width] + [0] * (width - len(row[:width])) for row in rows],
        dtype=torch.long,
        device=like.device,
    ).reshape(len(rows), width)
