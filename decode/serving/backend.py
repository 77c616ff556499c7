"""Where the decoder runs behind the HTTP server: a thread of its process, or a process of its own.

The server hands requests to a *backend* and reads their events back; both backends give it
the same surface (``put``, ``discard``, ``queue_depth``, ``running``, ``alive``, ``start``,
``stop``):

- ``DecoderThread``: the ``RequestQueue`` and the ``BatchWorker`` thread in the server's own
  process (the models the server was given);
- ``DecoderProcess``: the same queue and worker in a process of its own, started with
  ``spawn``, which loads the models from the ``ServeConfig`` itself and decodes on its main
  thread. Requests, cancellations
  and the worker's events and metrics cross a pipe between the two processes:

      front end (event loop)                          decoder process
      put(job) ──── ("submit", id, prompt, max_tokens, params) ──►  RequestQueue ─► BatchWorker
      job.cancel() ─ ("cancel", id) ──────────────────────────────►  job.cancel()
      job.post()  ◄─ ("taken", ids) ("event", id, event) ──────────  (its main thread)
      metrics     ◄─ ("on_decode" | "on_prefill" | "on_round", value) ─

The worker's messages of one round (every row's tokens and the round's reports) cross as one
``("batch", messages)``: at 16 rows a round would otherwise pay 18 sends, pickles and wake-ups
on each side.

Why a process, measured on the 2-core AMD EPYC (``draftsmith-profile-serve``,
docs/guides/serving.md): the decoder thread beside the event loop decoded at 0.57 of the
offline decoder's speed, and its drafting and verify passes were what ran slower.

- OpenMP: a process whose event loop thread and decoder thread both run tensor operations
  holds an OpenMP team per thread, and once the teams hold more threads than the machine has
  cores libgomp stops spinning between parallel regions, so each region waits for its
  threads to wake (``BatchWorker.run`` has the figures). The decoder process decodes on its
  main thread, the one that loaded the models; its pipe thread runs no tensor operation.
- The GIL: the front end takes it to stream every chunk, and a decoder thread in its process
  waits for it between its operations; the rounds' Python phases (commit, other) took about
  half as long in a process of their own.

vLLM runs its engine core apart from its API server too.

The pipe carries only this package's own dataclasses, pickled by one process and read by the
other; a client's bytes never cross it as anything but token ids and validated sampling
parameters.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from draftsmith.decode.serving.jobs import (
    DoneEvent,
    ErrorEvent,
    Event,
    Gather,
    GenerationJob,
    QueueClosed,
    QueueFull,
    RequestQueue,
)
from draftsmith.decode.serving.scheduler import BatchWorker

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from draftsmith.decode.serving.config import ServeConfig

logger = logging.getLogger(__name__)

# Seconds the front end waits for the decoder process to load its models and say so.
STARTUP_TIMEOUT_S = 600.0
# BatchWorker's report callbacks: the process sends each report under its callback's name.
WORKER_REPORTS = ("on_decode", "on_prefill", "on_round")


class DecoderThread:
    """The decoder as a thread of the server's process (``BatchWorker`` over ``RequestQueue``)."""

    def __init__(self, queue: RequestQueue, worker: BatchWorker) -> None:
        self.queue = queue
        self.worker = worker

    def put(self, job: GenerationJob) -> None:
        self.queue.put(job)

    def discard(self, job: GenerationJob) -> bool:
        return self.queue.discard(job)

    @property
    def queue_depth(self) -> int:
        return len(self.queue)

    @property
    def running(self) -> int:
        return self.worker.running

    @property
    def alive(self) -> bool:
        return self.worker.alive

    def start(self) -> None:
        self.worker.warm_up()
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()


class DecoderProcess:
    """The decoder in a process of its own (module docstring); jobs stay in the front end.

    ``settings`` are ``BatchWorker``'s keyword arguments but the models, the queue and the
    report callbacks, which ``reports`` holds by name (``WORKER_REPORTS``). The front end
    counts its jobs as waiting until the decoder reports it took them, and bounds that count
    by ``capacity`` (``QueueFull``), as ``RequestQueue`` does.
    """

    def __init__(
        self,
        config: ServeConfig,
        settings: dict[str, Any],
        capacity: int,
        reports: dict[str, Callable[[Any], None]],
    ) -> None:
        if capacity < 1:
            raise ValueError(f"queue capacity must be >= 1, got {capacity}")
        self.config = config
        self.settings = settings
        self.capacity = capacity
        self.reports = reports
        self._lock = threading.Lock()  # the job tables
        # The sending end of the pipe, never held with _lock: the pipe thread takes only
        # _lock, so it always drains the process's messages, and a send that waits for the
        # process to read cannot wait on it in turn.
        self._send_lock = threading.Lock()
        self._jobs: dict[int, GenerationJob] = {}  # every job not yet answered
        self._waiting: set[int] = set()  # ids not yet taken by the worker
        self._left_waiting: set[int] = set()  # ids cancelled while waiting, not yet discarded
        self._next_id = 0
        self._closed = False
        self._conn: Connection | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._reader: threading.Thread | None = None

    # -- the server's surface ---------------------------------------------------------------
    def put(self, job: GenerationJob) -> None:
        with self._lock:
            if self._closed or self._conn is None:
                raise QueueClosed("the decoder has stopped (the server is shutting down)")
            if len(self._waiting) >= self.capacity:
                raise QueueFull(f"{self.capacity} requests are already waiting")
            job_id = self._next_id
            self._next_id += 1
            self._jobs[job_id] = job
            self._waiting.add(job_id)
        # Not sent (the process just ended): the pipe thread's close answers the job 503.
        self._send(("submit", job_id, job.prompt_ids, job.max_tokens, job.params))
        job.when_cancelled(lambda: self._cancelled(job_id))

    def discard(self, job: GenerationJob) -> bool:
        """Forget a job whose client left; True if the decoder had not taken it yet. The
        process hears of it from the job's ``cancel`` (``_cancelled``), once."""
        job.cancel()  # a no-op when the client's handler cancelled it already
        with self._lock:
            job_id = next((i for i, known in self._jobs.items() if known is job), None)
            if job_id is None:
                return False
            del self._jobs[job_id]
            waiting = job_id in self._waiting or job_id in self._left_waiting
            self._waiting.discard(job_id)
            self._left_waiting.discard(job_id)
        return waiting

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return len(self._waiting)

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._jobs) - len(self._waiting) - len(self._left_waiting)

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive() and not self._closed

    @property
    def pid(self) -> int | None:
        """The decoder process's id once started (profiling reads its CPU time)."""
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Start the process and wait until it has loaded its models (or raise why not)."""
        gc.collect()  # models the front end loaded for its checks: free them before the copy
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe(duplex=True)
        process = context.Process(
            target=run_decoder_process,
            args=(theirs, self.config, self.settings, self.capacity),
            name="draftsmith-decoder",
            daemon=True,
        )
        process.start()
        theirs.close()
        if not ours.poll(STARTUP_TIMEOUT_S):
            process.terminate()
            raise RuntimeError(f"the decoder process did not start within {STARTUP_TIMEOUT_S} s")
        try:
            first = ours.recv()
        except EOFError:
            process.join(5)
            raise RuntimeError(
                f"the decoder process ended while loading (exit code {process.exitcode}); "
                "its log above says why"
            ) from None
        if first[0] != "ready":
            process.join(5)
            raise RuntimeError(f"the decoder process could not start: {first[1]}")
        self._conn, self._process = ours, process
        self._reader = threading.Thread(target=self._read, name="draftsmith-decoder-pipe")
        self._reader.daemon = True
        self._reader.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the process to stop after its round; answer every open job 503."""
        self._send(("stop",))
        if self._process is not None:
            self._process.join(timeout)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(5)
        if self._reader is not None:
            self._reader.join(timeout)
        self._close_all()

    # -- internals --------------------------------------------------------------------------
    def _cancelled(self, job_id: int) -> None:
        """A job's client left or needs no more tokens: a waiting job stops counting as
        waiting at once (the queue's bound and ``discard`` read the front end's view), and the
        process drops it."""
        with self._lock:
            if job_id in self._waiting:
                self._waiting.discard(job_id)
                self._left_waiting.add(job_id)
            answered = job_id not in self._jobs
        if not answered:  # a finished job's row is gone already: nothing to tell the process
            self._send(("cancel", job_id))

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            if self._conn is None or self._closed:
                return
            with contextlib.suppress(OSError, ValueError):  # gone: the reader answers the jobs
                self._conn.send(message)

    def _read(self) -> None:
        """The front end's end of the pipe: dispatch the process's messages until it ends."""
        assert self._conn is not None
        try:
            while True:
                message = self._conn.recv()
                messages = message[1] if message[0] == "batch" else [message]
                if not all(self._dispatch(one) for one in messages):
                    break
        except (EOFError, OSError):
            logger.error("the decoder process ended; open requests are answered 503")
        except Exception:  # a bug here must not leave clients waiting
            logger.exception("the decoder pipe failed; open requests are answered 503")
        finally:
            self._close_all()

    def _dispatch(self, message: tuple) -> bool:
        """Act on one message of the process; False once it said it stopped."""
        kind = message[0]
        if kind == "event":
            self._deliver(message[1], message[2])
        elif kind == "taken":
            with self._lock:
                self._waiting.difference_update(message[1])
        elif kind in self.reports:
            self.reports[kind](message[1])
        return kind != "stopped"

    def _deliver(self, job_id: int, event: Event) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None and isinstance(event, DoneEvent | ErrorEvent):
                del self._jobs[job_id]
                self._waiting.discard(job_id)
                self._left_waiting.discard(job_id)
        if job is not None:
            job.post(event)

    def _close_all(self) -> None:
        with self._lock:
            self._closed = True
            jobs, self._jobs = list(self._jobs.values()), {}
            self._waiting.clear()
            self._left_waiting.clear()
        for job in jobs:
            job.post(ErrorEvent("the server is shutting down", status=503))


class _TakingQueue(RequestQueue):
    """The decoder process's queue: tells the front end which jobs the worker took."""

    def __init__(self, capacity: int, report: Callable[[list[int]], None]) -> None:
        super().__init__(capacity)
        self.ids: dict[int, int] = {}  # id(job) -> the front end's id
        self._report = report

    def take(
        self, max_jobs: int, timeout: float, gather: Gather | None = None
    ) -> list[GenerationJob]:
        taken = super().take(max_jobs, timeout, gather)
        if taken:
            self._report([self.ids.pop(id(job)) for job in taken])
        return taken


def run_decoder_process(
    conn: Connection, config: ServeConfig, settings: dict[str, Any], capacity: int
) -> None:
    """The decoder process: load the models, decode on this thread, obey the front end from
    another."""
    from draftsmith.decode.serving.loading import load_models

    # Ctrl-C reaches the whole process group: the front end stops this process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    outbox = _Outbox(conn)
    try:
        target, drafter = load_models(config)
        # Cancelled jobs wait in the queue until the worker drops them: leave them room.
        # "taken" goes at once (not after the prefill): the front end bounds its queue by it.
        queue = _TakingQueue(2 * capacity, lambda ids: outbox.send(("taken", ids)))
        worker = BatchWorker(
            target,
            drafter,
            queue,
            **settings,
            **{name: functools.partial(_report, outbox.post, name) for name in WORKER_REPORTS},
            after_work=outbox.flush,
        )
    except Exception as error:
        outbox.send(("failed", f"{type(error).__name__}: {error}"))
        return
    worker.warm_up()  # before "ready": the first client must not pay the first passes
    outbox.send(("ready",))
    reader = threading.Thread(
        target=_obey, args=(conn, worker, queue, outbox), name="draftsmith-decoder-pipe"
    )
    reader.daemon = True
    reader.start()
    worker.run()  # on this thread, which loaded the models: BatchWorker.run says why
    outbox.send(("stopped",))
    conn.close()


class _Outbox:
    """The decoder process's sending end: ``post`` keeps a message for the next ``flush``
    (the worker's, sent once per round: the module docstring), ``send`` passes it on at once
    with whatever was kept before it, in order."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._kept: list[tuple] = []

    def post(self, message: tuple) -> None:
        with self._lock:
            self._kept.append(message)

    def send(self, message: tuple) -> None:
        with self._lock:
            self._kept.append(message)
            self._send_kept()

    def flush(self) -> None:
        with self._lock:
            self._send_kept()

    def _send_kept(self) -> None:
        if not self._kept:
            return
        kept, self._kept = self._kept, []
        message = kept[0] if len(kept) == 1 else ("batch", kept)
        with contextlib.suppress(OSError, ValueError):  # the front end is gone
            self._conn.send(message)


def _report(post: Callable[[tuple], None], name: str, value: Any) -> None:
    post((name, value))


def _obey(
    conn: Connection,
    worker: BatchWorker,
    queue: _TakingQueue,
    outbox: _Outbox,
) -> None:
    """The decoder process's end of the pipe: queue, cancel, stop. It runs no tensor
    operation (``BatchWorker.run``: one thread of OpenMP work per process)."""
    jobs: dict[int, GenerationJob] = {}

    def sink_of(job_id: int) -> Callable[[Event], None]:
        def sink(event: Event) -> None:
            if isinstance(event, DoneEvent | ErrorEvent):
                jobs.pop(job_id, None)
            outbox.post(("event", job_id, event))

        return sink

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the front end is gone
            break
        kind = message[0]
        if kind == "submit":
            job_id, prompt_ids, max_tokens, params = message[1:]
            job = GenerationJob(prompt_ids, max_tokens, params, sink=sink_of(job_id))
            jobs[job_id] = job
            queue.ids[id(job)] = job_id
            try:
                queue.put(job)
            except (QueueFull, QueueClosed) as error:
                queue.ids.pop(id(job), None)
                job.post(ErrorEvent(str(error), status=503))
                outbox.flush()
        elif kind == "cancel":
            job = jobs.get(message[1])
            if job is not None:
                job.cancel()
                if queue.discard(job):  # never taken: the front end forgot it already
                    queue.ids.pop(id(job), None)
                    jobs.pop(message[1], None)
                    outbox.send(("taken", [message[1]]))
        elif kind == "stop":
            break
    worker.stop()
