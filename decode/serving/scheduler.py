"""The worker that runs the decoder over the queued requests (``draftsmith.decode.serving.jobs``).

Continuous batching: the worker keeps *lanes*, each a ``DecodeSession`` with the requests it
decodes, and runs one speculative round of every lane in turn. Between rounds, waiting requests
join (``DecodeSession.add_rows``: they are prefilled as a batch of their own and merged into
the running caches) and finished ones retire (``DecodeSession.retire`` frees their cache
slots), so a new request waits at most one round per lane, never for a batch to finish.
Requests that arrive while others are prefilled join right after them, before the next round,
and a worker with nothing to decode gathers a burst (``IDLE_GATHER``), so that clients that
start together share one prefill instead of each waiting for the prefills and rounds before.
``max_batch_size`` bounds the rows decoding at once, over all lanes.

Requests share a lane when they sample alike: every greedy request shares one lane (the
sampling knobs are moot), unseeded sampled requests with equal ``SamplingConfig`` share one
(its generator seeded from the server's generator), and a sampled request with a ``seed`` gets
a lane of its own with ``torch.Generator().manual_seed(seed)``, so the seed alone fixes its
answer. The sampler applies one temperature, top-k and top-p to a whole batch, hence the
lanes. EOS is applied per request here (``ignore_eos`` requests share the greedy lane): the
sessions decode without EOS and a row that emitted one is finished for its client and retired.

The session's streamer hands every round's ``RoundUpdate`` to ``_deliver``: each row's new
tokens go to its request's ``asyncio.Queue`` (thread-safe, through the event loop; a joining
request's first token as soon as its prefill has chosen it, before the drafter's prefill and
the merges into the lane's caches, which ``after_work`` is called for) and its
accepted-draft count to the request's own tally (plain ints, no tensor per row and round),
folded into its ``DecodeStats`` when it finishes, so per-request acceptance is exact.

Draft lengths: with ``draft_policy="load-aware"`` (the server's default) every chain lane
shares one ``LoadAwareDraftLength`` per kind of lane (greedy, sampled), which chooses each
round's width, zero included, from the round's measured cost at its batch size and its rows'
own acceptance (a seeded sampled request drafts N every round, so that its seed alone fixes
its answer); ``"fixed"`` drafts N every round; ``"adaptive"`` is the decoder's pooled
policy (and tree shapes). Every round is reported to ``on_round`` as a ``RoundProfile``: its
rows, the drafts per row it verified, and where its time went.
A cancelled request (a disconnected client, a ``stop`` string) is finished at the next round
and its row retired after it.

Failures never leave a request waiting: a round that raises fails its lane's requests (500)
and the other lanes go on; an error between rounds (admitting, retiring) fails every request
the worker holds and the thread goes on; and if the thread ends for any reason, the queue is
closed (new requests: 503) and every request still waiting or decoding is answered 503.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from draftsmith.decode.draft_length import LoadAwareDraftLength
from draftsmith.decode.drafters.base import Drafter, TreeSpec
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.decode.sampling import SamplingConfig
from draftsmith.decode.serving.jobs import (
    DoneEvent,
    ErrorEvent,
    Gather,
    GenerationJob,
    RequestQueue,
    SamplingParams,
    TokensEvent,
)
from draftsmith.decode.session import DecodeSession, RoundUpdate
from draftsmith.decode.stats import DecodeStats

logger = logging.getLogger(__name__)

# Prompt and answer tokens of ``BatchWorker.warm_up``'s request.
WARM_UP_TOKENS = 16
# An idle worker takes a burst of requests together (``Gather``): it waits while requests
# arrive less than 2 ms apart, at most 10 ms after the first.
IDLE_GATHER = Gather(gap=0.002, window=0.010)
# A prefill pass's fixed cost in prompt tokens (``prefill_groups``): on the AVX2-only AMD EPYC
# in float32 a joining batch's prefill (target and EAGLE-3 head) took about 29 ms plus 0.85 ms
# per padded prompt token, so a pass costs about what 32 more padded tokens do.
PREFILL_PASS_TOKENS = 32


# Where a round's time goes (``RoundProfile.seconds``): the drafter's proposal, the target's
# verification, the drafter's commit and the session's bookkeeping, handing tokens to the
# requests (``_deliver``), and the rest of ``DecodeSession.step`` (choosing the width, syncs).
ROUND_PHASES = ("draft", "verify", "commit", "handoff", "other")


@dataclass(frozen=True)
class RoundProfile:
    """One round of one lane: its rows, the drafts per row it verified, its phases' seconds."""

    rows: int
    drafted: int
    seconds: dict[str, float]


@dataclass
class _Lane:
    """One decoding session and its requests, in the session's row order."""

    key: SamplingConfig | None
    session: DecodeSession
    jobs: list[GenerationJob] = field(default_factory=list)


class BatchWorker:
    """The thread that owns the decoder: admits queued requests, runs rounds, retires rows."""

    def __init__(
        self,
        target: torch.nn.Module,
        drafter: Drafter,
        queue: RequestQueue,
        *,
        num_draft_tokens: int,
        draft_policy: str = "load-aware",
        tree: TreeSpec | None = None,
        tree_when_sampling: bool = False,
        max_batch_size: int,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        seed: int,
        on_decode: Callable[[DecodeStats], None] | None = None,
        on_prefill: Callable[[int], None] | None = None,
        on_round: Callable[[RoundProfile], None] | None = None,
        after_work: Callable[[], None] | None = None,
    ) -> None:
        """``tree`` drafts trees for greedy requests, and for sampled ones too with
        ``tree_when_sampling`` (else they draft chains), as ``draftsmith.decode.measure.evaluate``'s flags do.
        ``on_decode`` gets the totals of every round (folded ``DecodeStats``), ``on_prefill``
        the number of requests each prefill pass admitted, ``on_round`` every round's
        ``RoundProfile``; ``after_work`` is called after every admission, every round and when
        the loop ends, once the events posted so far are complete (a sink that buffers the
        events sends them on then: the decoder process, one pipe message per round).
        ``draft_policy`` is ``"load-aware"``, ``"fixed"`` or ``"adaptive"``
        (the module docstring)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if draft_policy not in ("load-aware", "fixed", "adaptive"):
            raise ValueError(f"unknown draft_policy {draft_policy!r}")
        self.decoder = SpeculativeDecoder(
            target, drafter, num_draft_tokens, tree=tree, adaptive=draft_policy == "adaptive"
        )
        # One load-aware policy per kind of lane (greedy: True), shared by its sessions; none
        # when the drafter drafts nothing (plain decoding has no length to choose).
        most = drafter.max_draft_tokens
        longest = num_draft_tokens if most is None else min(num_draft_tokens, most)
        self.load_aware: dict[bool, LoadAwareDraftLength] = (
            {greedy: LoadAwareDraftLength(longest) for greedy in (True, False)}
            if draft_policy == "load-aware" and drafter.kind != "none"
            else {}
        )
        self._on_round = on_round
        self._handoff_seconds = 0.0  # time in _deliver during the current round
        self._drafted = 0  # drafts per row of the current round (from its RoundUpdate)
        self.tree_when_sampling = tree_when_sampling
        self.queue = queue
        self.max_batch_size = max_batch_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pad_token_id = pad_token_id
        self._on_decode = on_decode
        self._on_prefill = on_prefill
        self._after_work = after_work
        device = self.decoder.device
        self._seeds = torch.Generator(device=device).manual_seed(seed)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self.run, name="draftsmith-decoder", daemon=True)
        self._running = threading.Event()  # set while ``run`` loops, in whichever thread
        self._lanes: list[_Lane] = []
        self._admitting: list[GenerationJob] = []  # taken from the queue, not yet in a lane

    @property
    def running(self) -> int:
        """Requests being decoded (read by /metrics)."""
        return sum(len(lane.jobs) for lane in list(self._lanes))

    @property
    def alive(self) -> bool:
        return self._running.is_set()

    def warm_up(self) -> None:
        """Decode one short greedy request of ``WARM_UP_TOKENS`` dummy tokens before serving.

        A process's first passes pay one-time costs (oneDNN builds kernels for each new shape,
        layouts are prepared on first use: ``decode/draft_length.py`` has figures), which
        would otherwise land on the first client's time to first token: on the AVX2-only AMD
        EPYC a 20-second one-client sweep point had a TTFT p99 of 0.278 s against a p50 of
        0.045 s. The request runs in a session of its own, so no lane, policy or metric sees
        it; a target that cannot decode it is logged, not refused (its clients will hear)."""
        target = self.decoder.target
        vocab = int(getattr(target.config, "vocab_size", 0) or 0)
        if vocab < 2:
            return
        prompt = torch.arange(1, WARM_UP_TOKENS + 1, device=self.decoder.device) % vocab
        try:
            self.decoder.generate(
                prompt[None],
                max_new_tokens=WARM_UP_TOKENS,
                eos_token_id=[],
                pad_token_id=self.pad_token_id,
                temperature=0.0,
            )
        except Exception:  # serving goes on; a request will name the problem
            logger.warning("the decoder's warm-up request failed", exc_info=True)

    def start(self) -> None:
        """Run the loop in a thread of its own (``run`` runs it in the calling thread)."""
        self._running.set()  # alive from now on, not from whenever the thread is scheduled
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current round; fail the jobs that never finished."""
        self._stopping.set()
        for job in self.queue.close():
            job.post(ErrorEvent("the server is shutting down", status=503))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def run(self) -> None:
        """Admit, decode and retire until ``stop``; then answer whatever is left 503.

        Run it on the thread that will do every tensor operation of this process: a process
        whose threads each run OpenMP's parallel regions has an OpenMP team per thread, and
        once the teams hold more threads than the machine has cores, libgomp stops spinning
        between regions (``gomp_throttled_spin_count_var``), so every region waits for its
        threads to wake. Measured on the 2-core AMD EPYC (torch 2.13, 2 threads): a 1M-element
        add took 99 us on a second thread of a process whose main thread had run one parallel
        region, against 49-52 us on either thread alone; the decoder, 288-301 against 507-518
        tokens/s. The server's decoder process therefore decodes on its main thread, the one
        that loaded the models (``draftsmith.decode.serving.backend``)."""
        self._running.set()
        try:
            while not self._stopping.is_set():
                try:
                    self.tick(timeout=0.2)
                except Exception as error:  # a bug outside a round: fail its requests, go on
                    logger.exception("the decoder failed between rounds")
                    self._fail_all(error)
                    self._work_done()
        finally:
            # Whatever ends the thread, no request may wait for it: refuse new ones (503) and
            # answer every one still waiting or decoding.
            stopped = ErrorEvent("the server is shutting down", status=503)
            for job in self.queue.close():
                job.post(stopped)
            for lane in self._lanes:
                for job in lane.jobs:
                    if not job.finished:
                        job.finished = True
                        job.post(stopped)
            self._lanes = []
            self._work_done()
            self._running.clear()

    def _fail_all(self, error: Exception) -> None:
        """Answer every request taken from the queue with ``error`` and drop every lane."""
        self._fail(self._admitting, error)
        for lane in self._lanes:
            self._fail(lane.jobs, error)
        self._admitting, self._lanes = [], []

    def tick(self, timeout: float = 0.0) -> bool:
        """Admit waiting requests (waiting up to ``timeout`` s when nothing runs), then run one
        round of every lane and retire its finished rows. True while some lane runs."""
        self._admit(timeout if not self._lanes else 0.0)
        self._work_done()
        for lane in list(self._lanes):
            if self._stopping.is_set():
                break
            self._round(lane)
            self._work_done()
        return bool(self._lanes)

    def _work_done(self) -> None:
        if self._after_work is not None:
            self._after_work()

    def drain(self) -> None:
        """Run until no request waits or decodes (tests; the thread runs ``tick`` itself)."""
        while self.tick() or len(self.queue):
            pass

    # -- joining -------------------------------------------------------------------------
    def _admit(self, timeout: float) -> None:
        """Join waiting requests: an idle worker first gathers a burst (``IDLE_GATHER``), and
        requests that arrived during a prefill join at once, not after the next round (at most
        ``max_batch_size`` rows, so running rows wait a bounded time). Prompts of very
        different lengths are prefilled in separate passes, shortest first (``prefill_groups``)."""
        gather = IDLE_GATHER if not self._lanes else None
        while (free := self.max_batch_size - self.running) > 0:
            jobs = self.queue.take(free, timeout, gather)
            if not jobs:
                return
            self._admitting = jobs  # answered by ``_fail_all`` if joining them fails unexpectedly
            groups: dict[int, tuple[_Lane, list[GenerationJob]]] = {}
            for job in jobs:
                lane = self._lane_for(job.params)
                groups.setdefault(id(lane), (lane, []))[1].append(job)
            for lane, joining in groups.values():
                lengths = [len(job.prompt_ids) for job in joining]
                for group in prefill_groups(lengths, PREFILL_PASS_TOKENS):
                    self._join(lane, [joining[index] for index in group])
            self._admitting = []
            self._work_done()  # their first tokens go out before the next prefill
            timeout, gather = 0.0, None

    def _lane_for(self, params: SamplingParams) -> _Lane:
        key = params.lane_key()
        if key is not None:
            for lane in self._lanes:
                if lane.key == key:
                    return lane
        tree: TreeSpec | None = None
        if params.greedy or self.tree_when_sampling:
            tree = self.decoder.tree
        # A seeded request drafts N every round: a width chosen from measured times would
        # make its draws, and so its answer, depend on the machine's load.
        seeded = params.seed is not None and not params.greedy
        policy = self.load_aware.get(params.greedy) if tree is None and not seeded else None
        session = self.decoder.session(
            sampling=params.sampling,
            eos_token_id=[],  # EOS is each request's own business (``_deliver``)
            pad_token_id=self.pad_token_id,
            generator=self._generator(params),
            tree=tree,
            **({"draft_length": policy} if policy is not None else {}),
        )
        lane = _Lane(key, session)
        session.streamer = lambda update: self._deliver(lane, update)
        self._lanes.append(lane)
        return lane

    def _join(self, lane: _Lane, jobs: list[GenerationJob]) -> None:
        """Prefill ``jobs`` as one left-padded batch and add them to ``lane``."""
        width = max(len(job.prompt_ids) for job in jobs)
        input_ids = torch.full((len(jobs), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for row, job in enumerate(jobs):
            input_ids[row, width - len(job.prompt_ids) :] = torch.tensor(job.prompt_ids)
            attention_mask[row, width - len(job.prompt_ids) :] = 1
        device = self.decoder.device
        running = len(lane.jobs)
        lane.jobs.extend(jobs)
        try:
            lane.session.add_rows(
                input_ids.to(device), attention_mask.to(device), [job.max_tokens for job in jobs]
            )
        except Exception as error:  # answer these clients; a lane left half-merged fails too
            logger.exception("prefill failed for %d requests", len(jobs))
            lane.jobs = lane.jobs[:running]
            self._fail(jobs, error)
            if lane.session.batch_size != running or not lane.jobs:
                self._fail(lane.jobs, error)
                self._lanes.remove(lane)
            return
        if self._on_prefill is not None:
            self._on_prefill(len(jobs))
        self._retire(lane)

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        device = self.decoder.device
        if params.seed is not None:
            return torch.Generator(device=device).manual_seed(params.seed)
        seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds, device=device))
        return torch.Generator(device=device).manual_seed(seed)

    # -- rounds --------------------------------------------------------------------------
    def _round(self, lane: _Lane) -> None:
        rows = len(lane.jobs)
        self._handoff_seconds, lane.session.last_round_times = 0.0, None
        start = time.perf_counter()
        try:
            lane.session.step()
        except Exception as error:  # answer the clients, keep serving the other lanes
            logger.exception("generation failed for a batch of %d", len(lane.jobs))
            self._fail(lane.jobs, error)
            self._lanes.remove(lane)
            return
        end = time.perf_counter()
        times = lane.session.last_round_times
        if self._on_round is not None and times is not None:
            round_start, verify_start, verify_end, round_end = times
            handoff = self._handoff_seconds
            seconds = {
                "draft": verify_start - round_start,
                "verify": verify_end - verify_start,
                "commit": max(round_end - verify_end - handoff, 0.0),
                "handoff": handoff,
                "other": max((end - start) - (round_end - round_start), 0.0),
            }
            self._on_round(RoundProfile(rows, self._drafted, seconds))
        if self._on_decode is not None:
            stats, lane.session.stats = lane.session.stats, DecodeStats()
            self._on_decode(stats.fold())
        self._retire(lane)

    def _retire(self, lane: _Lane) -> None:
        """Drop the finished requests' rows (an emptied lane closes)."""
        done = [row for row, job in enumerate(lane.jobs) if job.finished]
        if not done:
            return
        lane.session.retire(done)
        lane.jobs = [job for job in lane.jobs if not job.finished]
        if not lane.jobs:
            self._lanes.remove(lane)

    def _deliver(self, lane: _Lane, update: RoundUpdate) -> bool:
        """The streamer: pass each row's new tokens on; False once no row needs more."""
        start = time.perf_counter()
        self._drafted = update.drafted
        rows = len(lane.jobs)
        lane.session.stats.tokens_emitted += sum(len(tokens) for tokens in update.tokens)
        for row, (job, tokens) in enumerate(zip(lane.jobs, update.tokens, strict=True)):
            if job.finished:
                continue
            if job.cancelled:
                self._finish(job)
                continue
            if not tokens:
                continue
            job.batch_size = max(job.batch_size, rows)
            if update.accepted is not None:
                job.accepted_by_width.setdefault(update.drafted, []).append(update.accepted[row])
            tokens = tokens[: job.max_tokens - job.delivered]
            eos = () if job.params.ignore_eos else self.eos_token_ids
            ended = next((i for i, token in enumerate(tokens) if token in eos), None)
            if ended is not None:
                tokens = tokens[: ended + 1]
            job.delivered += len(tokens)
            job.post(TokensEvent(tokens))
            if job.delivered >= job.max_tokens or ended is not None:
                self._finish(job)
        more = not self._stopping.is_set() and not all(job.finished for job in lane.jobs)
        if update.accepted is None:  # a prefill's first tokens: out now, not after the merges
            self._work_done()
        self._handoff_seconds += time.perf_counter() - start
        return more

    @staticmethod
    def _finish(job: GenerationJob) -> None:
        if job.finished:
            return
        job.finished = True
        stats = request_stats(job.accepted_by_width)
        stats.tokens_emitted = job.delivered
        job.post(DoneEvent(stats, job.batch_size))

    @staticmethod
    def _fail(jobs: list[GenerationJob], error: Exception) -> None:
        for job in jobs:
            if not job.finished:
                job.finished = True
                job.post(ErrorEvent(f"generation failed: {type(error).__name__}: {error}"))


def prefill_groups(lengths: Sequence[int], pass_tokens: int) -> list[list[int]]:
    """Split joining prompts into prefill passes, shortest first: indices into ``lengths``.

    A pass over prompts padded to the longest of them costs about ``pass_tokens + rows *
    longest`` prompt tokens' work, so one long prompt beside short ones makes every short one
    pay for its length. Over the prompts sorted by length, the cheapest split into runs of
    neighbours follows from ``best[j] = min_i best[i] + pass_tokens + (j - i) * lengths[j - 1]``
    (O(n^2) for n prompts, a batch's worth). Shorter runs go first, so their first tokens are
    sent before the longer prompts' prefill.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    sorted_lengths = [lengths[index] for index in order]
    best = [0.0] + [float("inf")] * len(order)  # best[j]: the first j prompts' cheapest cost
    start = [0] * (len(order) + 1)  # start[j]: where the last run of that split begins
    for end in range(1, len(order) + 1):
        for begin in range(end):
            cost = best[begin] + pass_tokens + (end - begin) * sorted_lengths[end - 1]
            if cost < best[end]:
                best[end], start[end] = cost, begin
    groups, end = [], len(order)
    while end > 0:
        groups.append(order[start[end] : end])
        end = start[end]
    return groups[::-1]


def request_stats(accepted_by_width: dict[int, list[int]]) -> DecodeStats:
    """One request's ``DecodeStats`` from its rounds' accepted drafts, grouped by the drafts
    per row each round verified (one ``record_round`` per width, then the pass counts fixed
    to one per round)."""
    stats = DecodeStats()
    for width, accepted in accepted_by_width.items():
        stats.record_round(
            torch.tensor(accepted), width, torch.ones(len(accepted), dtype=torch.bool)
        )
    stats.fold()
    stats.target_forward_passes = sum(len(accepted) for accepted in accepted_by_width.values())
    stats.draft_positions = sum(w * len(accepted) for w, accepted in accepted_by_width.items())
    return stats
