"""The decoder in a process of its own (decode/serving/backend.py), without HTTP: the same
answers as the decoder thread, the queue's bound, cancellation, and a process that fails to
start or dies under requests. The routes over it run in tests/decode/test_serve.py, whose
server runs the decoder in a process (the default)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from decode_helpers import noisy_copy
from draftsmith.decode import SpeculativeDecoder
from draftsmith.decode.drafters.draft_lm import DraftModelDrafter
from draftsmith.decode.serving.backend import DecoderProcess, _Outbox
from draftsmith.decode.serving.config import ServeConfig
from draftsmith.decode.serving.jobs import (
    DoneEvent,
    ErrorEvent,
    Event,
    GenerationJob,
    QueueClosed,
    QueueFull,
    SamplingParams,
    TokensEvent,
)
from tiny_models import tiny_llama

GREEDY = SamplingParams()
LONG = 100_000  # tokens of a request that runs until the test cancels it or kills its process


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("backend")
    target = tiny_llama(seed=0)
    draft = noisy_copy(target, scale=0.3)
    for model in (target, draft):  # rotary positions: room for a request that outlasts a test
        model.config.max_position_embeddings = LONG + 64
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return root / "target", root / "draft"


class Collected:
    """A front-end job whose events land in a list (no event loop needed)."""

    def __init__(self, prompt: list[int], max_tokens: int) -> None:
        self.events: list[Event] = []
        self.over = threading.Event()
        self.job = GenerationJob(prompt, max_tokens, GREEDY, sink=self._take)

    def _take(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, DoneEvent | ErrorEvent):
            self.over.set()

    @property
    def tokens(self) -> list[int]:
        return [t for event in self.events if isinstance(event, TokensEvent) for t in event.tokens]

    def wait(self) -> Event:
        assert self.over.wait(120), "no answer within 120 s"
        return self.events[-1]


def start(folders: tuple[Path, Path], capacity: int = 8, max_batch_size: int = 4, **config):
    target, draft = folders
    serve = ServeConfig(
        target=str(target), drafter=str(draft), num_threads=1, dtype="float32", **config
    )
    settings = {
        "num_draft_tokens": 3,
        "draft_policy": "fixed",
        "tree": None,
        "tree_when_sampling": False,
        "max_batch_size": max_batch_size,
        "eos_token_ids": [],
        "pad_token_id": 0,
        "seed": 0,
    }
    rounds: list = []
    reports = {"on_decode": rounds.append, "on_prefill": lambda n: None, "on_round": rounds.append}
    backend = DecoderProcess(serve, settings, capacity, reports)
    backend.start()
    return backend, rounds


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_process_answers_equal_plain_greedy_and_report_metrics(folders) -> None:
    """Every request's tokens equal the target's own greedy continuation (float32), several
    at once in one batch; the worker's round reports reach the front end."""
    backend, rounds = start(folders)
    try:
        prompts = [[5, 9, 3], [7, 1], [11, 12, 13, 14]]
        jobs = [Collected(prompt, 12) for prompt in prompts]
        for job in jobs:
            backend.put(job.job)
        for job in jobs:
            assert isinstance(job.wait(), DoneEvent)
        wait_until(lambda: backend.running == 0 and backend.queue_depth == 0, "an idle decoder")
        assert rounds, "no round reports crossed the pipe"
    finally:
        backend.stop()
    target = tiny_llama(seed=0)
    draft = noisy_copy(target, scale=0.3)
    reference = SpeculativeDecoder(target, DraftModelDrafter(draft), 3)
    for prompt, job in zip(prompts, jobs, strict=True):
        out = reference.generate(
            torch.tensor([prompt]), max_new_tokens=12, eos_token_id=[], temperature=0.0
        )
        assert job.tokens == out.sequences[0, len(prompt) :].tolist()
    assert not backend.alive
    with pytest.raises(QueueClosed):
        backend.put(Collected([1], 4).job)


def test_queue_bound_and_cancellation_cross_the_pipe(folders) -> None:
    """With one row decoding and ``capacity`` waiting, the next request is refused
    (QueueFull); cancelling the decoding one finishes it at the next round and lets the
    waiting one in; a waiting one the client left is never decoded."""
    backend, _ = start(folders, capacity=1, max_batch_size=1)
    try:
        long = Collected([5, 9], LONG)
        backend.put(long.job)
        wait_until(lambda: backend.running == 1 and long.tokens, "the first job to decode")
        waiting = Collected([7, 1], 4)
        backend.put(waiting.job)
        assert backend.queue_depth == 1
        with pytest.raises(QueueFull, match="1 requests are already waiting"):
            backend.put(Collected([3], 4).job)
        left = waiting.job
        left.cancel()
        assert backend.discard(left) and backend.queue_depth == 0
        third = Collected([3, 4], 4)
        backend.put(third.job)
        long.job.cancel()
        assert isinstance(long.wait(), DoneEvent) and len(long.tokens) < LONG
        assert isinstance(third.wait(), DoneEvent) and len(third.tokens) == 4
        assert waiting.events == []  # forgotten: never decoded, never answered
    finally:
        backend.stop()


def test_process_that_cannot_load_is_refused_by_name(tmp_path: Path) -> None:
    empty = tmp_path / "no-model"
    empty.mkdir()
    with pytest.raises(RuntimeError, match=r"could not start: .*no-model"):
        start((empty, empty))


def test_dead_process_answers_open_requests_503(folders) -> None:
    backend, _ = start(folders)
    try:
        job = Collected([5, 9], LONG)
        backend.put(job.job)
        wait_until(lambda: job.tokens, "tokens")
        assert backend._process is not None
        os.kill(backend._process.pid, signal.SIGKILL)
        event = job.wait()
        assert isinstance(event, ErrorEvent) and event.status == 503
        assert not backend.alive
        with pytest.raises(QueueClosed):
            backend.put(Collected([1], 4).job)
    finally:
        backend.stop()


class RecordingPipe:
    """A pipe end that keeps what was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, message: tuple) -> None:
        self.sent.append(message)


def test_a_rounds_messages_cross_the_pipe_as_one() -> None:
    """The worker's messages wait for the end of its round (``flush``); a message sent at
    once takes those kept before it along, in order; an empty flush sends nothing."""
    pipe = RecordingPipe()
    outbox = _Outbox(pipe)
    outbox.flush()
    assert pipe.sent == []
    outbox.post(("event", 0, TokensEvent([1, 2])))
    outbox.post(("on_round", "profile"))
    assert pipe.sent == []
    outbox.flush()
    assert pipe.sent == [("batch", [("event", 0, TokensEvent([1, 2])), ("on_round", "profile")])]
    outbox.post(("event", 1, TokensEvent([3])))
    outbox.send(("taken", [2]))
    assert pipe.sent[-1] == ("batch", [("event", 1, TokensEvent([3])), ("taken", [2])])
    outbox.send(("stopped",))
    assert pipe.sent[-1] == ("stopped",)  # alone: not wrapped
