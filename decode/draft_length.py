"""Each round's draft length, chosen from the decoder's own measured acceptance and cost.

Drafting pays only while a round's expected tokens per second beat a plain target step
(docs/theory.md §5). With ``alpha_j`` the acceptance rate at draft position j given that
position j - 1 was accepted, and a round of w drafts taking ``T(w) = c0 + c1 * w`` seconds (the
verify pass widens, each draft adds a draft step), the expected emitted tokens and the choice are

    E(w) = 1 + sum_{j <= w} prod_{i <= j} alpha_i,        w* = argmax_{0 <= w <= N} E(w) / T(w),

where w = 0 is a plain target step. SpecDec++ (Huang et al. 2024) and DISCO (Mamou et al. 2024)
stop drafting on the draft's own confidence; this policy uses measured rates and times instead,
so a drafter that costs more than it saves (a draft close to the target's size, sampling at a
high temperature) falls back to plain decoding rather than slowing it down. Acceptance
estimates decay geometrically so they follow a change of prompt or temperature; every
``probe_every``-th round tries a neighbouring length, and from a length of 2 or more every
third probe a plain step (``probe_width``), so that the deeper positions and the costs stay
measured (a measured length uses its own time: a plain step is not on the drafting
rounds' line, having no draft pass at all; the line only extrapolates to lengths not yet run).
A length's time is the median of its last ``TIME_WINDOW`` timed rounds, not a running
average: a length run only by probes is timed a few times per hundred rounds, and one stalled
round (a kernel built for a row count not seen before: 49.7 ms against a median of 7.9 for
2-draft rounds of the main job's head at T = 1 on ood prompts) kept an exponential average
(weight 0.1) above every other length's for the rest of a 12-prompt run, so that length was
never chosen again; the median forgets it after two more rounds. A
length's first round counts its acceptance but not its time: it pays one-time costs (oneDNN
builds a kernel for each new row count, a layout is prepared on first use; on the demo target
in bfloat16 a fresh decoder's first 4-draft round took 32-40 ms against 13-15 for its second,
its first plain step 11-14 against 8), so a length runs twice before its time is compared.
The policy keeps its length until another promises ``switch_margin`` more tokens per second,
since switching has a cost of its own (a draft LM reads the tokens of skipped rounds in its
next pass) and round times are noisy. For the same reason a policy may probe less often while
its best length is 0 (``idle_probe_every``): a probe from a plain length makes the drafter
read what it skipped, and the server's load-aware policy, whose drafter forgets what waits
longer than ``FORGET_AFTER_ROUNDS`` rounds, probes from 0 every ``IDLE_PROBE_EVERY`` rounds
at batches of ``IDLE_PROBE_ROWS`` rows or more, so that its drafter reads an eighth of the
entries of a large batch that does not draft. Smaller batches keep ``probe_every``: at one
row the head's catch-up is a small pass beside a step bound by reading the target's weights,
and rare probes left a policy that had settled on plain steps there before its acceptance was
measured plain for good (AVX2-only AMD EPYC, float32, one client: 0.02 drafts per row and
67.0 tokens/s against 79.3 drafting always). From five rows on a probe is dear: at eight rows
there a 1-draft round took 51.3 ms against a 24.9-ms plain step for 1.58 tokens per row, so a
probe every 16 rounds cost about 3% of a batch that did not draft; with rare probes from five
rows instead of nine, load-aware served 1.10x (T = 0) and 1.02x (T = 1) the tokens/s of the
same policy probing as before, the median of four interleaved 8-second windows of 8
closed-loop clients (``draftsmith-compare-policies``' harness).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Protocol

import torch

# Pseudo-counts of the acceptance prior: one accepted draft out of two reached.
PRIOR_REACHED, PRIOR_ACCEPTED = 2.0, 1.0
# A length's time is the median of its last this many timed rounds (the module docstring).
TIME_WINDOW = 9
# The load-aware policy's probes while no length beats a plain step, and the rounds after
# which its drafter drops the entries it has not read (``Drafter.forget_after_rounds``).
IDLE_PROBE_EVERY = 128
IDLE_PROBE_ROWS = 5
FORGET_AFTER_ROUNDS = 16


def adaptive_draft_bound(num_draft_tokens: int, adaptive_draft_tokens: int) -> int:
    """The most drafts an adaptive round may take beside fixed rounds of ``num_draft_tokens``:
    ``adaptive_draft_tokens``, never fewer than the fixed N (an adaptive row may always draft as
    far as a fixed one)."""
    return max(num_draft_tokens, adaptive_draft_tokens)


class RoundPolicy:
    """What the chain-length and tree-size policies share: estimates that decay by ``decay``
    per round, a probe every ``probe_every`` rounds (0: never; ``idle_probe_every`` while
    the best option is a plain step, by default as often), a switch only for
    ``switch_margin`` more expected tokens per second, and an untimed first round of every
    option."""

    def __init__(
        self,
        decay: float,
        probe_every: int,
        switch_margin: float,
        idle_probe_every: int | None = None,
    ) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must lie in (0, 1), got {decay}")
        self.decay = decay
        self.probe_every = probe_every
        self.idle_probe_every = probe_every if idle_probe_every is None else idle_probe_every
        self.switch_margin = switch_margin
        self._warmed: set[Hashable] = set()  # options whose first (untimed) round has run

    def _warming_up(self, option: Hashable) -> bool:
        """Whether this is ``option``'s first round, whose time pays one-time costs and is not
        counted (the module docstring); marks it run."""
        first = option not in self._warmed
        self._warmed.add(option)
        return first


class AdaptiveDraftLength(RoundPolicy):
    """Picks w in ``0 .. max_tokens`` per round; fed each round's acceptance and duration."""

    def __init__(
        self,
        max_tokens: int,
        decay: float = 0.99,
        probe_every: int = 16,
        switch_margin: float = 0.1,
        idle_probe_every: int | None = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        super().__init__(decay, probe_every, switch_margin, idle_probe_every)
        self.max_tokens = max_tokens
        self._current: int | None = None  # the length kept between probes
        self._reached = [PRIOR_REACHED] * max_tokens  # decayed drafts verified at position j
        self._accepted = [PRIOR_ACCEPTED] * max_tokens  # decayed drafts accepted at position j
        self._recent: dict[int, deque[float]] = {}  # w -> its last TIME_WINDOW round times
        self._seconds: dict[int, float] = {}  # w -> the median of _recent[w]
        self._borrowed: dict[int, float] = {}  # w -> another batch size's T(w) (start_from)
        self._rounds = 0

    @property
    def alpha(self) -> list[float]:
        """Current conditional acceptance estimate per draft position."""
        return [a / r for a, r in zip(self._accepted, self._reached, strict=True)]

    def expected_tokens(self, width: int) -> float:
        """``E(w)``: tokens a round with ``width`` drafts emits on average."""
        total, survive = 1.0, 1.0
        for alpha in self.alpha[:width]:
            survive *= alpha
            total += survive
        return total

    def start_from(self, other: AdaptiveDraftLength) -> None:
        """Borrow ``other``'s round times (a batch size not seen before starts from the
        nearest one's costs instead of timing the longest width and a plain step first).

        Borrowed times give the shape of ``T(w)`` until this policy has timed two widths of
        its own; with one, they are scaled to it (``round_seconds``)."""
        widths = set(other._seconds) | set(other._borrowed)
        self._borrowed = {width: other.round_seconds(width) for width in widths}

    def round_seconds(self, width: int) -> float | None:
        """``T(w)``: the median of its recent rounds where ``w`` was run, else a least-squares
        line through the measured widths; before two widths are measured, the borrowed times
        (``start_from``) scaled to the one measured (None with neither)."""
        own = self._seconds
        if width in own:
            return own[width]
        if len(own) < 2 and self._borrowed:
            scale = 1.0
            if own:
                ((known, seconds),) = own.items()
                scale = seconds / line_through(self._borrowed, known)
            return scale * line_through(self._borrowed, width)
        return line_through(own, width) if own else None

    def choose(self, limit: int, expected: Sequence[float] | None = None) -> int:
        """The draft length for the next round, at most ``limit`` (the rows' remaining room).

        ``expected[w]`` replaces ``E(w)`` for w in ``0 .. limit`` when given (the rows' own
        acceptance, ``RowAcceptance``); else the pooled estimate is used."""
        limit = min(limit, self.max_tokens)
        if limit <= 0:
            return 0
        # Time the longest length first, then a plain step (each after its warm-up round): two
        # points fix the line. A policy with borrowed times chooses from them at once.
        for width in (self.max_tokens, 0):
            if width not in self._seconds and width <= limit and not self._borrowed:
                return width
        gains = (
            expected
            if expected is not None
            else [self.expected_tokens(w) for w in range(limit + 1)]
        )
        rates = [gains[w] / self.round_seconds(w) for w in range(limit + 1)]
        best = max(range(limit + 1), key=rates.__getitem__)
        current = self._current
        keep = current is not None and current <= limit
        if keep and rates[best] < rates[current] * (1 + self.switch_margin):
            best = current
        self._current = best
        every = self.probe_every if best else self.idle_probe_every
        if every and self._rounds % every == every - 1:
            return probe_width(best, limit, self._rounds // every)
        return best

    def update(
        self,
        width: int,
        num_accepted: torch.Tensor,  # [B] accepted drafts of the rows that were active
        seconds: float,
    ) -> None:
        """Fold in one round: ``width`` drafts per row, their acceptance, its wall time."""
        self._rounds += 1
        if not self._warming_up(width):
            recent = self._recent.setdefault(width, deque(maxlen=TIME_WINDOW))
            recent.append(seconds)
            self._seconds[width] = statistics.median(recent)
        if width == 0 or num_accepted.numel() == 0:
            return
        counts = [0] * (width + 1)  # rows by accepted drafts
        for kept in num_accepted.tolist():
            counts[min(kept, width)] += 1
        for j in range(width):
            reached = sum(counts[j:])  # rows whose draft j + 1 was verified
            accepted = sum(counts[j + 1 :])
            if reached:
                self._reached[j] = self.decay * self._reached[j] + reached
                self._accepted[j] = self.decay * self._accepted[j] + accepted


def line_through(seconds: dict[int, float], width: int) -> float:
    """A round time at ``width`` from ``seconds`` (width -> time, not empty): the time itself
    where measured, else a least-squares line through the measured widths (its slope at least
    0), or with one width measured a draft step costing as much as that round."""
    if width in seconds:
        return seconds[width]
    if len(seconds) == 1:
        ((known, time),) = seconds.items()
        return time * (1 + width) / (1 + known)
    mean_w = sum(seconds) / len(seconds)
    mean_t = sum(seconds.values()) / len(seconds)
    spread = sum((w - mean_w) ** 2 for w in seconds)
    slope = max(sum((w - mean_w) * (t - mean_t) for w, t in seconds.items()) / spread, 0.0)
    return max(mean_t + slope * (width - mean_w), 1e-9)


def probe_width(best: int, limit: int, probe: int) -> int:
    """The width the ``probe``-th probe from ``best`` runs: one more and one fewer in turn, and
    from a width of 2 or more a plain step every third probe.

    The neighbours keep the deeper positions' acceptance and the nearby times measured; the
    plain step is the alternative every decision weighs, and probes of neighbours alone never
    time it again while the policy drafts 2 or more. In a closed-loop run of 16 sampling
    clients (T = 1, the demo target on the AVX2-only AMD EPYC, float32), the load-aware
    policy's 2-row table chose 3 drafts against a plain-step time from the one round timed at
    its start."""
    if best == 0:
        return min(limit, 1)
    turns = (min(limit, best + 1), best - 1) + ((0,) if best >= 2 else ())
    return turns[probe % len(turns)]


# A row's acceptance follows about its last five rounds; a joining row starts from the pooled
# rates with the weight of this many verified drafts per position.
ROW_DECAY = 0.8
ROW_PRIOR_WEIGHT = 2.0


class RowAcceptance:
    """Each row's recent acceptance per draft position, as decayed counts (on the host).

    Row r's rate at position j is ``accepted[r, j] / reached[r, j]``, both decayed by ``decay``
    at every round that verified row r's draft j; a joining row starts from the pooled rates
    (``ROW_PRIOR_WEIGHT`` pseudo-drafts). A round that took part without verifying draft j (a
    shorter width, no drafting, or an earlier draft rejected) moves the row's counts at j
    towards the pooled rate ``alpha0_j`` of that round,

        reached <- d * reached + (1 - d) * W,    accepted <- d * accepted + (1 - d) * W * alpha0_j,

    so that evidence ages by rounds, not by verifications. Without it a row whose rates fell
    (a hard stretch of its text) was given no drafts, so nothing updated them and it decoded
    plainly to its end: served at T = 0 on the AMD EPYC, one client's requests took 0.95 s at
    p99 under the load-aware policy against 0.43 s drafting always. The rows follow the
    session's: ``add_rows`` appends, ``select_rows`` keeps a subset in a new order.

    The counts are Python lists, not tensors: a round touches a few dozen numbers, and as
    tensors its dozen small operations cost a few hundred microseconds, a twentieth of a
    one-row round of the demo target in bfloat16 on the AMD EPYC.
    """

    def __init__(self, max_tokens: int, decay: float = ROW_DECAY) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must lie in (0, 1), got {decay}")
        self.decay = decay
        self.max_tokens = max_tokens
        self._reached: list[list[float]] = []  # [B][N]
        self._accepted: list[list[float]] = []  # [B][N]

    @property
    def reached(self) -> torch.Tensor:  # [B, N] float64: the decayed drafts verified
        return torch.tensor(self._reached, dtype=torch.float64).reshape(-1, self.max_tokens)

    @property
    def accepted(self) -> torch.Tensor:  # [B, N] float64: the decayed drafts accepted
        return torch.tensor(self._accepted, dtype=torch.float64).reshape(-1, self.max_tokens)

    @property
    def batch_size(self) -> int:
        return len(self._reached)

    def add_rows(self, count: int, alpha: Sequence[float]) -> None:
        """Append ``count`` rows whose prior rates are ``alpha`` (one per position)."""
        alpha = list(alpha)
        for _ in range(count):
            self._reached.append([ROW_PRIOR_WEIGHT] * self.max_tokens)
            self._accepted.append([ROW_PRIOR_WEIGHT * rate for rate in alpha])

    def select_rows(self, index: torch.Tensor) -> None:  # [B'] rows kept, in their new order
        kept = index.tolist()
        self._reached = [self._reached[row] for row in kept]
        self._accepted = [self._accepted[row] for row in kept]

    def update(
        self,
        width: int,
        num_accepted: torch.Tensor,  # [A] accepted drafts of the rows active this round
        active: Sequence[bool] | torch.Tensor,  # [B]: which rows took part
        prior: Sequence[float],  # [N] the pooled rates that unverified positions relax to
    ) -> None:
        """Fold in one round of ``width`` drafts per active row (0: no drafting); positions an
        active row did not verify relax towards ``prior`` (the class docstring)."""
        if isinstance(active, torch.Tensor):
            active = active.tolist()
        counts = iter(num_accepted.tolist() if width else ())
        decay, relax = self.decay, (1.0 - self.decay) * ROW_PRIOR_WEIGHT
        for row, took_part in enumerate(active):
            if not took_part:
                continue
            kept = min(next(counts), width) if width else -1  # drafts 1 .. kept accepted
            reached, accepted = self._reached[row], self._accepted[row]
            for j in range(self.max_tokens):
                if j < width and j <= kept:  # draft j + 1 verified
                    reached[j] = decay * reached[j] + 1.0
                    accepted[j] = decay * accepted[j] + (1.0 if j < kept else 0.0)
                else:
                    reached[j] = decay * reached[j] + relax
                    accepted[j] = decay * accepted[j] + relax * prior[j]

    def expected_by_width(
        self,
        limit: int,
        active: Sequence[bool] | torch.Tensor,  # [B]
    ) -> list[float]:
        """``E(w)`` for w in ``0 .. limit``: the mean over the active rows of each row's
        ``1 + sum_{j <= w} prod_{i <= j} alpha_{r,i}`` (every row when none is active)."""
        if isinstance(active, torch.Tensor):
            active = active.tolist()
        rows = [row for row, took_part in enumerate(active) if took_part]
        rows = rows or list(range(self.batch_size))
        survive = [0.0] * limit  # [limit] summed over rows: P(draft j + 1 accepted)
        for row in rows:
            reached, accepted, chance = self._reached[row], self._accepted[row], 1.0
            for j in range(limit):
                chance *= accepted[j] / reached[j]
                survive[j] += chance
        expected, total = [1.0], 1.0
        for summed in survive:
            total += summed / max(len(rows), 1)
            expected.append(total)
        return expected


class LoadAwareDraftLength:
    """Chooses each round's draft length from the cost at this batch size and the rows' own
    acceptance: a server's rounds run at every batch size, and the trade-off moves with it.

    With B rows in a round, ``T_B(w)`` the measured time of a round of w drafts per row at
    that batch size (the drafter's passes and the target's verification of ``w + 1`` tokens
    per row together; ``w = 0`` a plain target step), and ``E_r(w)`` row r's expected tokens
    from its recent acceptance (``RowAcceptance``), the round's choice is

        w* = argmax_{0 <= w <= N} sum_r E_r(w) / T_B(w)                (docs/theory.md §5).

    While a small batch's target step is bound by reading the weights, a wider verify pass
    costs little more than a step and drafting pays; as B grows the pass turns compute-bound,
    ``T_B(w)`` rises with ``w`` and w* falls, to 0 (no drafting) when no width pays. Each
    batch size B has its own ``AdaptiveDraftLength`` for the times, with its warm-up, probes
    and switch margin, started from the times of the nearest batch size measured so far; the
    acceptance pooled over all rounds is the prior of a joining row. Tables shared by a range
    of batch sizes (9-16 rows in one) compared widths timed at different sizes: at 16
    closed-loop clients the 9-16 table's 1-draft time came mostly from rounds at 9-12 rows
    (a load that ebbs), its plain time from rounds at 16, so it chose 1 draft at 16 rows,
    where such a round took 1.77 times a plain step's 58.0 ms for about 1.6 tokens per row
    (the AVX2-only AMD EPYC, float32, the demo target and its EAGLE-3 head, T = 0). Sessions share one policy (the costs are the target's) through
    ``for_session``, which keeps the session's rows' acceptance. Where no width pays, the
    drafter's upkeep is the cost that remains: a session under this policy has its drafter
    forget what it has not read after ``FORGET_AFTER_ROUNDS`` rounds, and a batch size whose
    best width is 0 probes every ``idle_probe_every`` rounds from ``idle_probe_rows`` rows
    on (the module docstring).
    """

    def __init__(
        self,
        max_tokens: int,
        decay: float = 0.99,
        probe_every: int = 16,
        switch_margin: float = 0.1,
        row_decay: float = ROW_DECAY,
        idle_probe_every: int = IDLE_PROBE_EVERY,
        idle_probe_rows: int = IDLE_PROBE_ROWS,
    ) -> None:
        self.pooled = AdaptiveDraftLength(max_tokens, decay, 0, switch_margin)
        self.max_tokens = max_tokens
        self.row_decay = row_decay
        self._settings = (decay, probe_every, switch_margin)
        self._idle_probes = (idle_probe_every, idle_probe_rows)
        self._by_rows: dict[int, AdaptiveDraftLength] = {}  # batch size -> its cost table

    def costs(self, rows: int) -> AdaptiveDraftLength:
        """The round times (and their choice of width) of batches of ``rows`` rows."""
        if rows not in self._by_rows:
            every, idle_rows = self._idle_probes
            table = AdaptiveDraftLength(
                self.max_tokens,
                *self._settings,
                idle_probe_every=every if rows >= idle_rows else None,
            )
            if self._by_rows:
                nearest = min(self._by_rows, key=lambda known: (abs(known - rows), known))
                table.start_from(self._by_rows[nearest])
            self._by_rows[rows] = table
        return self._by_rows[rows]

    def for_session(self, session: DraftingRows) -> SessionDraftLength:
        """The policy as one session uses it: these costs, that session's rows."""
        return SessionDraftLength(self, session)


class DraftingRows(Protocol):
    """What a session shows the policy: its rows, and which of them still decode."""

    @property
    def batch_size(self) -> int: ...

    active: torch.Tensor  # [B] bool


class SessionDraftLength:
    """``AdaptiveDraftLength``'s protocol (``choose``, ``update``) over a shared
    ``LoadAwareDraftLength`` and one session's ``RowAcceptance``; the session calls
    ``add_rows`` and ``select_rows`` as its rows join and leave."""

    def __init__(self, shared: LoadAwareDraftLength, session: DraftingRows) -> None:
        self.shared = shared
        self.max_tokens = shared.max_tokens
        self.rows = RowAcceptance(shared.max_tokens, shared.row_decay)
        self._session = session
        self._round: tuple[int, list[bool]] | None = None  # (rows, active) of the round chosen

    def add_rows(self, count: int) -> None:
        self.rows.add_rows(count, self.shared.pooled.alpha)

    def select_rows(self, index: torch.Tensor) -> None:  # [B'] rows kept
        self.rows.select_rows(index)

    def choose(self, limit: int) -> int:
        """This round's width at the session's batch size, from its active rows' acceptance."""
        session = self._session
        active = session.active.tolist()
        self._round = (session.batch_size, active)
        costs = self.shared.costs(session.batch_size)
        limit = min(limit, self.max_tokens)
        return costs.choose(limit, expected=self.rows.expected_by_width(max(limit, 0), active))

    def update(
        self,
        width: int,
        num_accepted: torch.Tensor,  # [A] accepted drafts of the rows that were active
        seconds: float,
    ) -> None:
        """Fold in the round ``choose`` shaped: its time at this batch size, the acceptance."""
        if self._round is None:
            raise RuntimeError("update() before choose(): the round's rows are not known")
        rows, active = self._round
        self._round = None
        self.shared.costs(rows).update(width, num_accepted, seconds)
        self.shared.pooled.update(width, num_accepted, seconds)
        self.rows.update(width, num_accepted, active, self.shared.pooled.alpha)
