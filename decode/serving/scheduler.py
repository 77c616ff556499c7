"""The bounded request queue and the one worker thread that runs the decoder.

Drafters are stateful, so one ``SpeculativeDecoder.generate`` call runs at a time. The worker
takes the oldest waiting request and every later one that is *compatible* with it (same
temperature, top-p, top-k and ``ignore_eos``; greedy requests ignore the sampling knobs), up to
``max_batch_size``, and decodes them as one left-padded batch. Each row gets its own
``max_tokens`` by truncation: the call runs to the largest, and a row that reached its own
limit (or EOS, or was cancelled) is finished for its client at once while the other rows go on.
A sampled request with a ``seed`` runs alone with ``torch.Generator().manual_seed(seed)``, so
the seed alone fixes its answer; unseeded sampled batches draw their seed from one server
generator.

The decoder's streamer hands every round's new tokens to each request's ``asyncio.Queue``
(thread-safe, through the event loop); when every row of the batch is finished or cancelled
(a disconnected client, a ``stop`` string) the streamer returns False and the call ends.

Per-request acceptance statistics are exact: a thin drafter wrapper records each round's
accepted-draft counts, and the streamer credits them to the rows that emitted tokens that round
(the rows the engine counts as active), as ``DecodeStats.record_round`` does for the batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from decode.drafters.base import Drafter, DraftProposal, TargetPass
from decode.engine import SpeculativeDecoder
from decode.sampling import SamplingConfig
from decode.stats import DecodeStats

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """The bounded queue holds ``capacity`` waiting requests already."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples: the decoder's (already validated) ``SamplingConfig``, a seed."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int | None = None
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy

    def batch_key(self) -> tuple[SamplingConfig | None, bool] | None:
        """Requests with equal keys share one generate call; None means run alone."""
        if self.greedy:
            return (None, self.ignore_eos)  # greedy requests ignore the sampling knobs
        if self.seed is not None:
            return None
        return (self.sampling, self.ignore_eos)


@dataclass
class TokensEvent:
    tokens: list[int]


@dataclass
class DoneEvent:
    stats: DecodeStats  # this request's rows only
    batch_size: int


@dataclass
class ErrorEvent:
    message: str
    status: int = 500  # 503 when the server is shutting down


Event = TokensEvent | DoneEvent | ErrorEvent


class GenerationJob:
    """One request: created on the event loop, run by the worker, answered through ``events``.

    Must be created inside the running event loop that consumes ``events``.
    """

    def __init__(self, prompt_ids: Sequence[int], max_tokens: int, params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("a job needs at least one prompt token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = max_tokens
        self.params = params
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._cancelled = threading.Event()
        # Worker-side state, touched only by the worker thread.
        self.delivered = 0
        self.finished = False
        self.stats = DecodeStats()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """The client is gone or needs no more tokens; the worker drops the row."""
        self._cancelled.set()

    def post(self, event: Event) -> None:
        """Hand an event to the consuming coroutine (callable from any thread)."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()


class RequestQueue:
    """FIFO of waiting jobs with a capacity; hands out batches of compatible jobs."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"queue capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._jobs: deque[GenerationJob] = deque()
        self._condition = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        with self._condition:
            return len(self._jobs)

    def put(self, job: GenerationJob) -> None:
        with self._condition:
            if self._closed:
                raise QueueFull("the server is shutting down")
            if len(self._jobs) >= self.capacity:
                raise QueueFull(f"{self.capacity} requests are already waiting")
            self._jobs.append(job)
            self._condition.notify()

    def discard(self, job: GenerationJob) -> bool:
        """Remove a job that has not started (its client left); True if it was waiting."""
        with self._condition:
            try:
                self._jobs.remove(job)
            except ValueError:
                return False
            return True

    def take_batch(self, max_size: int, timeout: float) -> list[GenerationJob]:
        """The oldest live job and the later live jobs compatible with it ([] on timeout)."""
        with self._condition:
            self._condition.wait_for(lambda: self._jobs or self._closed, timeout=timeout)
            while self._jobs and self._jobs[0].cancelled:
                self._jobs.popleft()
            if not self._jobs:
                return []
            first = self._jobs.popleft()
            batch = [first]
            key = first.params.batch_key()
            if key is None:
                return batch
            for job in list(self._jobs):
                if len(batch) >= max_size:
                    break
                if job.cancelled:
                    self._jobs.remove(job)
                elif job.params.batch_key() == key:
                    self._jobs.remove(job)
                    batch.append(job)
            return batch

    def close(self) -> list[GenerationJob]:
        """Refuse new jobs, wake the worker, and return the jobs that were still waiting."""
        with self._condition:
            self._closed = True
            waiting = list(self._jobs)
            self._jobs.clear()
            self._condition.notify_all()
            return waiting


class RecordingDrafter(Drafter):
    """Forwards every call to ``inner`` and keeps the last round's accepted-draft counts.

    Chain rounds only (``supports_trees`` is False): the server runs chain speculation.
    """

    supports_trees = False

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.kind = inner.kind  # type: ignore[misc]
        self.needs_hidden_states = inner.needs_hidden_states  # type: ignore[misc]
        self._width = 0
        self._last: tuple[list[int], int] | None = None

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def check_compatible(self, target: torch.nn.Module) -> None:
        self.inner.check_compatible(target)

    def prefill(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor,  # [B, T]
        target_pass: TargetPass,
        pending: torch.Tensor,  # [B]
    ) -> None:
        self._last = None
        self.inner.prefill(input_ids, attention_mask, target_pass, pending)

    def propose(
        self, num_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> DraftProposal:
        proposal = self.inner.propose(num_tokens, sampling, generator)
        self._width = proposal.tokens.shape[1]
        return proposal

    def commit(
        self,
        num_accepted: torch.Tensor,  # [B]
        next_tokens: torch.Tensor,  # [B]
        target_pass: TargetPass,
    ) -> None:
        self._last = (num_accepted.tolist(), self._width)
        self.inner.commit(num_accepted, next_tokens, target_pass)

    def take_round(self) -> tuple[list[int], int] | None:
        """(accepted drafts per row, drafts per row) of the round just committed, once."""
        last, self._last = self._last, None
        return last


class BatchWorker:
    """The thread that owns the decoder and drains the queue batch by batch."""

    def __init__(
        self,
        target: torch.nn.Module,
        drafter: Drafter,
        queue: RequestQueue,
        *,
        num_draft_tokens: int,
        adaptive: bool = False,
        max_batch_size: int,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        seed: int,
        on_batch: Callable[[DecodeStats, int], None] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._drafter = RecordingDrafter(drafter)
        self.decoder = SpeculativeDecoder(
            target, self._drafter, num_draft_tokens, adaptive=adaptive
        )
        self.queue = queue
        self.max_batch_size = max_batch_size
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self._on_batch = on_batch
        device = self.decoder.device
        self._seeds = torch.Generator(device=device).manual_seed(seed)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="draftsmith-decoder", daemon=True)
        self.running = 0  # rows of the batch in flight (read by /metrics)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current round; fail the jobs that never started."""
        self._stopping.set()
        for job in self.queue.close():
            job.post(ErrorEvent("the server is shutting down", status=503))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            batch = self.queue.take_batch(self.max_batch_size, timeout=0.2)
            if batch:
                self.run_batch(batch)

    def run_batch(self, jobs: list[GenerationJob]) -> None:
        """Decode ``jobs`` in one call; every job ends with a ``DoneEvent`` or ``ErrorEvent``."""
        self.running = len(jobs)
        try:
            stats = self._generate(jobs)
        except Exception as error:  # answer the clients, keep serving the others
            logger.exception("generation failed for a batch of %d", len(jobs))
            for job in jobs:
                if not job.finished:
                    job.finished = True
                    job.post(ErrorEvent(f"generation failed: {type(error).__name__}: {error}"))
            return
        finally:
            self.running = 0
        for job in jobs:
            if job.finished or job.cancelled or not self._stopping.is_set():
                self._finish(job, len(jobs))
            else:  # the call was stopped early for the shutdown
                job.finished = True
                job.post(ErrorEvent("the server is shutting down", status=503))
        if self._on_batch is not None:
            self._on_batch(stats, len(jobs))

    def _generate(self, jobs: list[GenerationJob]) -> DecodeStats:
        params = jobs[0].params
        device = self.decoder.device
        width = max(len(job.prompt_ids) for job in jobs)
        input_ids = torch.full((len(jobs), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for row, job in enumerate(jobs):
            input_ids[row, width - len(job.prompt_ids) :] = torch.tensor(job.prompt_ids)
            attention_mask[row, width - len(job.prompt_ids) :] = 1
        eos = [] if params.ignore_eos else self.eos_token_ids

        def streamer(rows: list[list[int]]) -> bool:
            return self._deliver(jobs, rows, set(eos))

        output = self.decoder.generate(
            input_ids.to(device),
            attention_mask.to(device),
            max_new_tokens=max(job.max_tokens for job in jobs),
            eos_token_id=eos,
            generator=self._generator(params, device),
            pad_token_id=self.pad_token_id,
            streamer=streamer,
            sampling=params.sampling,
        )
        return output.stats

    def _generator(self, params: SamplingParams, device: torch.device) -> torch.Generator | None:
        if params.greedy:
            return None
        if params.seed is not None:
            return torch.Generator(device=device).manual_seed(params.seed)
        seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds, device=device))
        return torch.Generator(device=device).manual_seed(seed)

    def _deliver(self, jobs: list[GenerationJob], rows: list[list[int]], eos: set[int]) -> bool:
        """The streamer: pass each row's new tokens on; False once no row needs more."""
        round_ = self._drafter.take_round()  # None for the token emitted by the prefill
        for row, (job, tokens) in enumerate(zip(jobs, rows, strict=True)):
            if job.finished:
                continue
            if job.cancelled:
                self._finish(job, len(jobs))
                continue
            if not tokens:
                continue
            if round_ is not None:
                accepted, drafted = round_
                job.stats.record_round(
                    torch.tensor([accepted[row]]), drafted, torch.ones(1, dtype=torch.bool)
                )
            tokens = tokens[: job.max_tokens - job.delivered]
            job.delivered += len(tokens)
            job.post(TokensEvent(tokens))
            if job.delivered >= job.max_tokens or tokens[-1] in eos:
                self._finish(job, len(jobs))
        return not self._stopping.is_set() and not all(job.finished for job in jobs)

    @staticmethod
    def _finish(job: GenerationJob, batch_size: int) -> None:
        if job.finished:
            return
        job.finished = True
        job.stats.tokens_emitted = job.delivered
        job.post(DoneEvent(job.stats.fold(), batch_size))
