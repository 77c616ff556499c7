"""What the HTTP front end and the decoder hand each other: a request (``GenerationJob``) with
its sampling (``SamplingParams``), the events that answer it, and the bounded queue it waits in.

The front end creates jobs on its event loop and reads their ``events``; the decoder
(``draftsmith.decode.serving.scheduler.BatchWorker``, in a thread or a process of its own:
``draftsmith.decode.serving.backend``) takes them from a ``RequestQueue`` and posts to them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from draftsmith.decode.sampling import SamplingConfig
from draftsmith.decode.stats import DecodeStats


class QueueFull(Exception):
    """The bounded queue holds ``capacity`` waiting requests already."""


class QueueClosed(Exception):
    """The decoder has stopped (the server is shutting down): no request can join."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples: the decoder's (already validated) ``SamplingConfig``, a seed."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int | None = None
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy

    def lane_key(self) -> SamplingConfig | None:
        """Requests with equal keys share one lane (decoding session); None means alone."""
        if self.greedy:
            return SamplingConfig(temperature=0.0)  # greedy requests ignore the sampling knobs
        if self.seed is not None:
            return None
        return self.sampling


@dataclass
class TokensEvent:
    tokens: list[int]


@dataclass
class DoneEvent:
    stats: DecodeStats  # this request's rows only
    batch_size: int  # the most rows it shared a round with (itself included)


@dataclass
class ErrorEvent:
    message: str
    status: int = 500  # 503 when the server is shutting down


Event = TokensEvent | DoneEvent | ErrorEvent


class GenerationJob:
    """One request: created on the event loop, run by the worker, answered through ``events``.

    Must be created inside the running event loop that consumes ``events``, unless ``sink``
    takes its events instead (a decoder process forwards them to the front end's job).
    """

    def __init__(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int,
        params: SamplingParams,
        sink: Callable[[Event], None] | None = None,
    ) -> None:
        if not prompt_ids:
            raise ValueError("a job needs at least one prompt token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = max_tokens
        self.params = params
        self._sink = sink
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._loop = asyncio.get_running_loop() if sink is None else None
        self._cancelled = threading.Event()
        self._on_cancel: Callable[[], None] | None = None
        # Worker-side state, touched only by the worker thread.
        self.delivered = 0
        self.finished = False
        self.accepted_by_width: dict[int, list[int]] = {}  # drafts -> accepted, per round
        self.batch_size = 1
        self.queued_at = 0.0  # time.monotonic() when it entered a RequestQueue

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """The client is gone or needs no more tokens; the worker drops the row."""
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        if self._on_cancel is not None:
            self._on_cancel()

    def when_cancelled(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, at the first ``cancel`` (a decoder in another process
        hears of it so)."""
        self._on_cancel = callback

    def post(self, event: Event) -> None:
        """Hand an event to the consuming coroutine (callable from any thread)."""
        if self._sink is not None:
            self._sink(event)
            return
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()


@dataclass(frozen=True)
class Gather:
    """How long an idle worker waits for a burst of requests before it prefills the first.

    Clients that start together send their requests within a few milliseconds of each other.
    A worker that takes the first alone prefills it, runs a round, and only then prefills the
    rest as a second batch, so those wait for two prefills and a round. Taking a job waits
    while jobs keep arriving: until none arrived for ``gap`` s, at most until the oldest has
    waited ``window`` s. A lone request pays ``gap`` once.
    """

    gap: float
    window: float


class RequestQueue:
    """FIFO of waiting jobs with a capacity."""

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
                raise QueueClosed("the decoder has stopped (the server is shutting down)")
            if len(self._jobs) >= self.capacity:
                raise QueueFull(f"{self.capacity} requests are already waiting")
            job.queued_at = time.monotonic()
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

    def take(
        self, max_jobs: int, timeout: float, gather: Gather | None = None
    ) -> list[GenerationJob]:
        """Up to ``max_jobs`` of the oldest live jobs, waiting up to ``timeout`` s for one
        ([] then); cancelled jobs are dropped. With ``gather``, once a job waits, go on waiting
        while more arrive (the ``Gather`` docstring) so that a burst is taken together."""
        with self._condition:
            if timeout > 0:
                self._condition.wait_for(lambda: self._jobs or self._closed, timeout=timeout)
            if gather is not None:
                self._gather(max_jobs, gather)
            taken: list[GenerationJob] = []
            while self._jobs and len(taken) < max_jobs:
                job = self._jobs.popleft()
                if not job.cancelled:
                    taken.append(job)
            return taken

    def _gather(self, max_jobs: int, gather: Gather) -> None:
        """Wait (holding the condition; ``put`` wakes it) until ``max_jobs`` wait, none
        arrived for ``gather.gap`` s, or the oldest has waited ``gather.window`` s."""
        while self._jobs and len(self._jobs) < max_jobs and not self._closed:
            newest, oldest = self._jobs[-1].queued_at, self._jobs[0].queued_at
            left = min(newest + gather.gap, oldest + gather.window) - time.monotonic()
            if left <= 0:
                return
            self._condition.wait(timeout=left)

    def close(self) -> list[GenerationJob]:
        """Refuse new jobs, wake the worker, and return the jobs that were still waiting."""
        with self._condition:
            self._closed = True
            waiting = list(self._jobs)
            self._jobs.clear()
            self._condition.notify_all()
            return waiting
