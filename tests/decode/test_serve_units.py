"""The server's parts without HTTP: text assembly, the queue, the batch worker, config, loading."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from decode_helpers import (
    noisy_copy,
    tiny_eagle_drafter,
    tiny_medusa_drafter,
    tiny_peagle_drafter,
)
from draftsmith.data.tokenizer import train_byte_level_bpe
from draftsmith.decode import SpeculativeDecoder
from draftsmith.decode.drafters.base import Drafter, TreeSpec
from draftsmith.decode.drafters.draft_lm import DraftModelDrafter
from draftsmith.decode.sampling import SamplingConfig
from draftsmith.decode.serve import _is_loopback
from draftsmith.decode.serving.config import ServeConfig, parse_serve_args
from draftsmith.decode.serving.jobs import (
    DoneEvent,
    ErrorEvent,
    Event,
    Gather,
    GenerationJob,
    QueueClosed,
    QueueFull,
    RequestQueue,
    SamplingParams,
    TokensEvent,
)
from draftsmith.decode.serving.loading import load_target
from draftsmith.decode.serving.metrics import ServerMetrics, batch_bucket, bucket_label
from draftsmith.decode.serving.protocol import (
    MAX_STOP_CHARS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from draftsmith.decode.serving.scheduler import (
    ROUND_PHASES,
    BatchWorker,
    RoundProfile,
    prefill_groups,
)
from draftsmith.decode.serving.text import TextStream
from draftsmith.decode.stats import DecodeStats
from serve_helpers import metric, parse_prometheus
from tiny_models import tiny_llama
from transformers import PreTrainedTokenizerFast

TEXTS = ["def add(a, b):\n    return a + b\n", "hello world, stop here", "import os\n"] * 10


Models = tuple[torch.nn.Module, torch.nn.Module]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_byte_level_bpe(TEXTS, vocab_size=300)


def stream_text(
    tokenizer: PreTrainedTokenizerFast, text: str, stop: list[str]
) -> tuple[TextStream, list[str], int | None]:
    """Push ``text``'s tokens one by one; return the stream, deltas and the stopping index."""
    ids = tokenizer(text)["input_ids"]
    stream = TextStream(tokenizer, [], stop)
    deltas, stopped_at = [], None
    for i, token in enumerate(ids):
        if stream.push(token):
            stopped_at = i
            deltas.append(stream.take())
            break
        deltas.append(stream.take())
    deltas.append(stream.finish())
    return stream, deltas, stopped_at


# -- text ------------------------------------------------------------------------------------


def test_text_stream_equals_full_decode_and_holds_split_characters(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    text = "naïve café: 東京 -> ok"
    ids = tokenizer(text)["input_ids"]
    stream = TextStream(tokenizer, [], ())
    deltas = []
    for token in ids:
        assert not stream.push(token)
        deltas.append(stream.take())
    deltas.append(stream.finish())
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in delta for delta in deltas)
    assert "" in deltas[:-1]  # a 3-byte character spans byte tokens: held until complete
    assert stream.num_tokens == len(ids) and stream.finish_reason is None


def test_stop_string_ends_the_text_before_it_and_is_never_streamed(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    stream, deltas, stopped_at = stream_text(tokenizer, "hello world, stop here", ["stop"])
    assert "".join(deltas) == stream.text == "hello world, "
    assert stream.finish_reason == "stop"
    ids = tokenizer("hello world, stop here")["input_ids"]
    prefix = tokenizer.decode(ids[: stopped_at + 1])
    assert "stop" in prefix and "stop" not in tokenizer.decode(ids[:stopped_at])
    assert stream.num_tokens == stopped_at + 1


def test_stop_prefix_is_held_then_released(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer("a sto b")["input_ids"]
    stream = TextStream(tokenizer, [], ["stop"])
    released = ""
    for token in ids:
        assert not stream.push(token)
        released += stream.take()
        assert not released.endswith(("s", "st", "sto"))  # could still become "stop"
    assert released + stream.finish() == "a sto b"
    two = TextStream(tokenizer, [], ["xx", "hello w"])
    for token in tokenizer("hello world")["input_ids"]:
        if two.push(token):
            break
    assert two.finish() == "" and two.text == ""


def test_eos_ends_the_text_and_counts_as_a_token(tokenizer: PreTrainedTokenizerFast) -> None:
    eos = tokenizer.eos_token_id
    ids = [*tokenizer("import os")["input_ids"], eos, *tokenizer("more")["input_ids"]]
    stream = TextStream(tokenizer, tokenizer("def")["input_ids"], (), eos_token_ids=[eos])
    for token in ids:
        if stream.push(token):
            break
    assert stream.finish() == "import os" and stream.num_tokens == ids.index(eos) + 1
    with pytest.raises(RuntimeError, match="after the answer stopped"):
        stream.push(5)


# -- queue -----------------------------------------------------------------------------------


def test_queue_batches_compatible_jobs_in_order_and_is_bounded() -> None:
    async def scenario() -> None:
        greedy = SamplingParams()
        hot = SamplingParams(SamplingConfig(temperature=0.7))
        jobs = {
            "g1": GenerationJob([1], 4, greedy),
            "s1": GenerationJob([1], 4, hot),
            # greedy: the knobs are moot
            "g2": GenerationJob([1], 4, SamplingParams(SamplingConfig(top_p=0.5), seed=3)),
            "seeded": GenerationJob([1], 4, SamplingParams(SamplingConfig(0.7), seed=1)),
            "g_raw": GenerationJob([1], 4, SamplingParams(ignore_eos=True)),
            "s2": GenerationJob([1], 4, hot),
        }
        queue = RequestQueue(capacity=len(jobs))
        for job in jobs.values():
            queue.put(job)
        with pytest.raises(QueueFull):
            queue.put(GenerationJob([1], 4, greedy))
        names = {id(job): name for name, job in jobs.items()}

        def take(max_jobs: int = 8) -> list[str]:
            return [names[id(job)] for job in queue.take(max_jobs, timeout=0.01)]

        assert take(2) == ["g1", "s1"]  # oldest first, whatever their settings
        jobs["s2"].cancel()
        assert take() == ["g2", "seeded", "g_raw"]  # the cancelled one was dropped
        assert take() == [] and len(queue) == 0
        keys = {name: job.params.lane_key() for name, job in jobs.items()}
        assert keys["g1"] == keys["g2"] == keys["g_raw"]  # greedy: one lane, EOS per request
        assert keys["s1"] == keys["s2"] != keys["g1"]
        assert keys["seeded"] is None  # a seeded sampled request runs alone

        late = GenerationJob([1], 4, greedy)
        queue.put(late)
        assert queue.discard(late) and not queue.discard(late)
        assert queue.close() == [] and take() == []
        with pytest.raises(QueueClosed, match="shutting down"):  # answered 503, not 429
            queue.put(late)

    asyncio.run(scenario())


def test_a_gathering_take_waits_for_a_burst_and_no_longer() -> None:
    """``take`` with a ``Gather`` takes jobs arriving less than ``gap`` apart together, and
    returns at once when ``max_jobs`` wait or the oldest has waited ``window`` s."""
    params = SamplingParams()

    async def scenario() -> None:
        queue = RequestQueue(16)
        burst = [GenerationJob([1], 4, params) for _ in range(5)]

        def send() -> None:  # a burst that starts while ``take`` waits for its first job
            for job in burst:
                threading.Event().wait(0.002)
                queue.put(job)

        sender = threading.Thread(target=send)
        sender.start()
        taken = await asyncio.to_thread(queue.take, 8, 5.0, Gather(gap=1.0, window=3.0))
        sender.join()
        assert taken == burst  # all five, in one take

        never = Gather(gap=60.0, window=60.0)  # a take that waited it out would time the test out
        full = [GenerationJob([1], 4, params) for _ in range(3)]
        for job in full:
            queue.put(job)
        assert queue.take(3, 0.0, never) == full  # max_jobs wait: nothing to gather
        old = GenerationJob([1], 4, params)
        queue.put(old)
        old.queued_at -= 120.0  # it has waited past the window
        assert queue.take(8, 0.0, never) == [old]
        assert queue.take(8, 0.0, never) == []  # nothing waits: no gathering
        late = GenerationJob([1], 4, params)
        queue.put(late)
        threading.Timer(0.05, queue.close).start()
        assert queue.take(8, 0.0, never) == []  # closing ends the wait (and answers ``late``)

    asyncio.run(scenario())


def test_an_idle_worker_prefills_a_burst_as_one_batch(models: Models) -> None:
    """Requests that arrive together while nothing decodes join in one prefill, so none waits
    for another's prefill and round; a busy worker does not wait for more."""
    worker = make_worker(models, draft_policy="fixed")
    prefills: list[int] = []
    worker._on_prefill = prefills.append
    params = SamplingParams(ignore_eos=True)

    async def scenario() -> None:
        jobs = [GenerationJob([5 + row, 9], 6, params) for row in range(4)]

        def send() -> None:
            for job in jobs:
                threading.Event().wait(0.001)
                worker.queue.put(job)

        sender = threading.Thread(target=send)
        sender.start()
        await asyncio.to_thread(worker.tick, 5.0)
        sender.join()
        assert prefills == [4]
        await asyncio.to_thread(worker.drain)
        for row, job in enumerate(jobs):
            tokens = [t for e in _events(job) if isinstance(e, TokensEvent) for t in e.tokens]
            assert tokens == greedy_reference(models[0], [5 + row, 9], 6, eos=())

    asyncio.run(scenario())


def test_requests_arriving_during_a_prefill_join_before_the_next_round(models: Models) -> None:
    """A request that arrives while others are prefilled joins right after them, not after
    a round of theirs; the rows that ran first keep their greedy answers."""
    order: list[str] = []
    worker = make_worker(models, draft_policy="fixed")
    worker._on_round = lambda profile: order.append(f"round of {profile.rows}")
    params = SamplingParams(ignore_eos=True)
    prompts = [[5, 9], [7], [3, 4, 8]]

    async def scenario() -> list[GenerationJob]:
        jobs = [GenerationJob(prompt, 5, params) for prompt in prompts]
        late = iter(jobs[1:])

        def prefilled(rows: int) -> None:
            order.append(f"prefill of {rows}")
            arriving = next(late, None)  # one more request arrives during each prefill
            if arriving is not None:
                worker.queue.put(arriving)

        worker._on_prefill = prefilled
        worker.queue.put(jobs[0])
        await asyncio.to_thread(worker.drain)
        return jobs

    jobs = asyncio.run(scenario())
    assert order[:4] == ["prefill of 1", "prefill of 1", "prefill of 1", "round of 3"]
    for prompt, job in zip(prompts, jobs, strict=True):
        tokens = [t for e in _events(job) if isinstance(e, TokensEvent) for t in e.tokens]
        assert tokens == greedy_reference(models[0], prompt, 5, eos=())


def _split_cost(lengths: list[int], groups: list[list[int]], pass_tokens: int) -> int:
    return sum(pass_tokens + len(group) * max(lengths[i] for i in group) for group in groups)


@pytest.mark.parametrize("seed", range(40))
def test_prefill_groups_are_the_cheapest_split_shortest_first(seed: int) -> None:
    """Against every split of the sorted prompts into runs: the cheapest cost, every prompt
    once, runs in order of length."""
    import itertools
    import random

    rng = random.Random(seed)
    lengths = [rng.choice([1, 2, 5, 9, 40, 130]) for _ in range(rng.randint(1, 7))]
    pass_tokens = rng.choice([0, 8, 32, 500])
    groups = prefill_groups(lengths, pass_tokens)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    longest = [max(lengths[i] for i in group) for group in groups]
    assert longest == sorted(longest)
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    cheapest = min(
        _split_cost(lengths, [order[a:b] for a, b in itertools.pairwise((0, *cuts, len(order)))],
                    pass_tokens)
        for size in range(len(order))
        for cuts in itertools.combinations(range(1, len(order)), size)
    )  # fmt: skip
    assert _split_cost(lengths, groups, pass_tokens) == cheapest
    assert prefill_groups([], pass_tokens) == []
    assert prefill_groups([7, 7, 7], 32) == [[0, 1, 2]]  # equal lengths: one pass


def test_a_long_prompt_is_prefilled_apart_from_short_ones_and_answers_stay_exact(
    models: Models,
) -> None:
    """A burst of short prompts and one long one: the short ones share a pass that does not
    pad them to the long one's length, and go first; every greedy answer is the target's."""
    worker = make_worker(models, draft_policy="fixed")
    prefills: list[int] = []
    worker._on_prefill = prefills.append
    params = SamplingParams(ignore_eos=True)
    prompts = [[(7 * i) % 50 + 3 for i in range(90)], [5, 9], [7], [3, 4, 8]]

    async def scenario() -> list[GenerationJob]:
        jobs = [GenerationJob(prompt, 5, params) for prompt in prompts]
        for job in jobs:
            worker.queue.put(job)
        await asyncio.to_thread(worker.drain)
        return jobs

    jobs = asyncio.run(scenario())
    assert prefills == [3, 1]
    for prompt, job in zip(prompts, jobs, strict=True):
        tokens = [t for e in _events(job) if isinstance(e, TokensEvent) for t in e.tokens]
        assert tokens == greedy_reference(models[0], prompt, 5, eos=())


@pytest.mark.parametrize(
    ("fields", "values"),
    [
        ('"temperature": -1', {"temperature": -1.0}),
        ('"temperature": 1e400', {"temperature": math.inf}),  # JSON's way to write infinity
        ('"top_p": 0', {"top_p": 0.0}),
        ('"top_p": 1.5', {"top_p": 1.5}),
        ('"top_p": 1e400', {"top_p": math.inf}),
        ('"top_k": -2', {"top_k": -2}),
    ],
)
def test_sampling_values_are_checked_by_sampling_config(
    fields: str, values: dict[str, float]
) -> None:
    with pytest.raises(APIError) as caught:
        parse_body(f'{{"model": "m", "prompt": "a", {fields}}}'.encode(), CompletionRequest)
    (param,) = values
    assert caught.value.status == 400 and caught.value.param == param
    with pytest.raises(ValueError) as direct:  # the one validator, with its own message
        SamplingConfig(**{"temperature": 1.0, **values})  # type: ignore[arg-type]
    assert caught.value.message == str(direct.value)


def test_sampling_defaults_and_vllm_top_k() -> None:
    request = parse_body(b'{"model": "m", "prompt": "a", "top_k": -1}', CompletionRequest)
    assert request.sampling == SamplingConfig(temperature=1.0, top_k=0, top_p=1.0)
    greedy = parse_body(b'{"model": "m", "prompt": "a", "temperature": 0}', CompletionRequest)
    assert SamplingParams(greedy.sampling).greedy
    hot = parse_body(b'{"model": "m", "prompt": "a", "temperature": 3.5}', CompletionRequest)
    assert hot.sampling.temperature == 3.5  # no range beyond the sampler's own


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "m", "prompt": "a\\\\ud800"}', None),  # an escaped backslash: plain text
        (b'{"model": "m", "prompt": "a\ud800b"}', "prompt"),
        (b'{"model": "m", "prompt": "\udfff"}', "prompt"),
        (b'{"model": "m", "prompt": ["ok", "\ud800"]}', "prompt.1"),
        (b'{"model": "m\ud800", "prompt": "a"}', "model"),
        (b'{"model": "m", "prompt": "a", "stop": ["x", "\udc00"]}', "stop.1"),
        (b'{"model": "m", "prompt": "a", "logit_bias": {"\ud800": 1}}', "logit_bias.\\ud800"),
        (b'{"model": "m", "prompt": "a\ud83d\ude00"}', None),  # a pair: U+1F600, fine
    ],
)
def test_lone_surrogates_are_refused_naming_the_parameter(body: bytes, param: str | None) -> None:
    if param is None:
        parse_body(body, CompletionRequest)
        return
    with pytest.raises(APIError, match="lone UTF-16 surrogate") as caught:
        parse_body(body, CompletionRequest)
    assert caught.value.status == 400 and caught.value.param == param
    caught.value.message.encode("utf-8")  # the message itself is sendable


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b'{"model": "m", "prompt": "a", "temperature": NaN}', "NaN is not a JSON value"),
        (b'{"model": "m", "prompt": "a", "top_p": -Infinity}', "-Infinity is not a JSON value"),
        (
            b'{"model": "m", "prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
            "nested too deeply",
        ),
    ],
)
def test_json_that_is_not_standard_is_refused(body: bytes, fragment: str) -> None:
    with pytest.raises(APIError, match=fragment) as caught:
        parse_body(body, CompletionRequest)
    assert caught.value.status == 400


# -- the batch worker ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models() -> Models:
    target = tiny_llama(seed=0)
    return target, noisy_copy(target, scale=0.3)


def make_worker(
    models: Models,
    rounds: list[DecodeStats] | None = None,
    draft_policy: str = "load-aware",
    drafter: Drafter | None = None,
    tree: TreeSpec | None = None,
    max_batch_size: int = 8,
    profiles: list[RoundProfile] | None = None,
) -> BatchWorker:
    target, draft = models
    return BatchWorker(
        target,
        DraftModelDrafter(draft) if drafter is None else drafter,
        RequestQueue(16),
        num_draft_tokens=3 if tree is not None else 4,
        draft_policy=draft_policy,
        tree=tree,
        max_batch_size=max_batch_size,
        eos_token_ids=[2],
        pad_token_id=0,
        seed=0,
        on_decode=None if rounds is None else rounds.append,
        on_round=profiles.append if profiles is not None else None,
    )


Spec = tuple[list[int], int, SamplingParams]


def run_jobs(
    worker: BatchWorker,
    specs: list[Spec],
    cancel: tuple[int, ...] = (),
    later: list[tuple[int, Spec]] = (),  # type: ignore[assignment]
) -> list[list[Event]]:
    """Queue the jobs of ``specs``, run the worker until idle and collect every job's events;
    each ``(rounds, spec)`` of ``later`` is queued after that many rounds (it joins mid-run)."""

    async def scenario() -> list[list[Event]]:
        jobs = [GenerationJob(ids, max_tokens, params) for ids, max_tokens, params in specs]
        joining = [(at, GenerationJob(*spec)) for at, spec in later]
        for index in cancel:
            jobs[index].cancel()
        for job in jobs:
            worker.queue.put(job)

        def work() -> None:
            ticks = 0
            while worker.tick() or len(worker.queue) or any(at >= ticks for at, _ in joining):
                ticks += 1
                for at, job in joining:
                    if at == ticks:
                        worker.queue.put(job)

        await asyncio.to_thread(work)
        await asyncio.sleep(0)
        jobs += [job for _, job in joining]
        return [_events(job) for job in jobs]

    return asyncio.run(scenario())


def _events(job: GenerationJob) -> list[Event]:
    """The events posted to ``job`` so far, in order."""
    received = []
    while not job.events.empty():
        received.append(job.events.get_nowait())
    return received


def tokens_of(events: list[Event]) -> list[int]:
    assert isinstance(events[-1], DoneEvent), events[-1]
    assert sum(isinstance(event, DoneEvent) for event in events) == 1
    return [token for event in events if isinstance(event, TokensEvent) for token in event.tokens]


def greedy_reference(
    target: torch.nn.Module, prompt: list[int], max_tokens: int, eos: tuple[int, ...] = (2,)
) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=list(eos) or None,
        pad_token_id=0,
    )
    tokens = out[0, len(prompt) :].tolist()
    ended = next((i for i, token in enumerate(tokens) if token in eos), None)
    return tokens if ended is None else tokens[: ended + 1]


@pytest.mark.parametrize("policy", ["fixed", "adaptive", "load-aware"])
def test_batched_rows_each_get_their_own_greedy_answer_and_max_tokens(
    models: Models, policy: str
) -> None:
    specs = [([5, 9, 11], 6, SamplingParams()), ([7], 20, SamplingParams()),
             ([3, 4, 5, 6, 7, 8, 9], 13, SamplingParams())]  # fmt: skip
    events = run_jobs(make_worker(models, draft_policy=policy), specs)
    for (prompt, max_tokens, _), received in zip(specs, events, strict=True):
        assert tokens_of(received) == greedy_reference(models[0], prompt, max_tokens)
        assert received[-1].batch_size == 3


def test_a_joining_requests_first_token_is_handed_on_before_the_drafters_prefill(
    models: Models,
) -> None:
    """Time to first token: a request joining a running lane gets its first token, and
    ``after_work`` sends it on (the decoder process's pipe), before the drafter prefills its
    prompt and its rows are merged into the lane's caches."""
    worker = make_worker(models, draft_policy="fixed")
    posted: list[tuple[str, Event]] = []
    sent: list[int] = []  # events posted by each ``after_work`` call
    worker._after_work = lambda: sent.append(len(posted))

    def job(name: str, prompt: list[int]) -> GenerationJob:
        params = SamplingParams(ignore_eos=True)
        return GenerationJob(prompt, 12, params, sink=lambda e: posted.append((name, e)))

    worker.queue.put(job("running", [5, 9, 11]))
    worker.tick()
    (lane,) = worker._lanes
    at_prefill: list[tuple[int, int]] = []  # (joining request's events, events sent)

    def spying_spawn(spawn=lane.session.drafter.spawn) -> Drafter:
        spawned = spawn()
        prefill = spawned.prefill

        def spying_prefill(*args) -> None:
            at_prefill.append((sum(name == "joining" for name, _ in posted), sent[-1]))
            prefill(*args)

        spawned.prefill = spying_prefill
        return spawned

    lane.session.drafter.spawn = spying_spawn
    worker.queue.put(job("joining", [7, 3]))
    worker.tick()
    first = next(event for name, event in posted if name == "joining")
    assert isinstance(first, TokensEvent) and len(first.tokens) == 1
    (before_prefill,) = at_prefill
    joined = posted.index(("joining", first))
    assert before_prefill[0] == 1 and before_prefill[1] > joined
    worker.drain()
    tokens = [t for name, e in posted if name == "joining" and isinstance(e, TokensEvent)
              for t in e.tokens]  # fmt: skip
    assert tokens == greedy_reference(models[0], [7, 3], 12, eos=())


@pytest.mark.parametrize("policy", ["fixed", "adaptive", "load-aware"])
def test_per_request_stats_add_up_to_the_batch_stats(models: Models, policy: str) -> None:
    rounds: list[DecodeStats] = []
    raw = SamplingParams(ignore_eos=True)
    specs = [([5, 9, 11], 24, raw), ([7], 24, raw), ([3, 4, 5, 6], 24, raw)]
    worker = make_worker(models, rounds, policy)
    events = run_jobs(worker, specs, later=[(3, ([8, 1], 9, raw))])
    rows = [received[-1].stats for received in events]
    batch = DecodeStats()
    for stats in rounds:
        batch = batch.merge(stats)
    assert sum(row.rounds for row in rows) == batch.rounds
    for j in range(4):
        accepted = [row.accepted_per_position[j : j + 1] for row in rows]  # [] if never drafted
        reached = [row.reached_per_position[j : j + 1] for row in rows]
        assert sum(sum(a) for a in accepted) == batch.accepted_per_position[j]
        assert sum(sum(r) for r in reached) == batch.reached_per_position[j]
    assert [row.tokens_emitted for row in rows] == [24, 24, 24, 9]
    assert sum(row.target_forward_passes for row in rows) == batch.rounds  # one per row-round
    assert sum(row.draft_positions for row in rows) == sum(
        width * n for width, n in batch.rounds_per_width.items()
    )
    assert 1.0 <= batch.tau < 5.0  # the noisy draft is right only sometimes


@pytest.mark.parametrize(
    "kind", ["draft_lm", "eagle3_tree", "eagle3_frontier_tree", "medusa_tree", "peagle"]
)
def test_requests_joining_a_running_batch_get_their_own_greedy_answers(
    models: Models, kind: str
) -> None:
    """Continuous batching: requests queued while others decode join at a round boundary
    (EOS per request: ``ignore_eos`` rows share the greedy lane) and retire when done."""
    target = models[0]
    drafter, tree = None, None
    if kind == "eagle3_tree":
        drafter, tree = tiny_eagle_drafter(target), TreeSpec(top_k=3, total_tokens=8)
    elif kind == "eagle3_frontier_tree":  # the greedy chain with its runners-up
        drafter, tree = tiny_eagle_drafter(target), TreeSpec(3, 9, frontier=1)
    elif kind == "medusa_tree":
        drafter, tree = tiny_medusa_drafter(target), TreeSpec()
    elif kind == "peagle":  # every draft of a round in one pass
        drafter = tiny_peagle_drafter(target)
    worker = make_worker(models, drafter=drafter, tree=tree, max_batch_size=3)
    raw = SamplingParams(ignore_eos=True)
    specs = [([5, 9, 11], 20, raw), ([7], 5, SamplingParams())]
    later = [(2, ([3, 4, 5, 6, 7, 8, 9], 13, SamplingParams())), (2, ([12, 13], 9, raw)),
             (4, ([30, 31, 32, 33], 7, SamplingParams()))]  # fmt: skip
    events = run_jobs(worker, specs, later=later)
    for (prompt, max_tokens, params), received in zip(
        specs + [spec for _, spec in later], events, strict=True
    ):
        eos = () if params.ignore_eos else (2,)
        assert tokens_of(received) == greedy_reference(target, prompt, max_tokens, eos)
    assert events[0][-1].batch_size == 3  # at most max_batch_size rows at once
    assert worker.running == 0 and not worker._lanes


def test_sampled_lanes_run_beside_the_greedy_one_and_a_seed_still_fixes_the_answer(
    models: Models,
) -> None:
    worker = make_worker(models)
    seeded = SamplingParams(SamplingConfig(temperature=0.9), seed=11, ignore_eos=True)
    hot = SamplingParams(SamplingConfig(temperature=0.8, top_k=20), ignore_eos=True)
    alone = tokens_of(run_jobs(worker, [([5, 9], 16, seeded)])[0])
    specs = [([7], 12, SamplingParams()), ([5, 9], 16, seeded), ([4], 10, hot), ([6], 10, hot)]
    events = run_jobs(worker, specs, later=[(2, ([5, 9], 16, seeded))])
    assert tokens_of(events[1]) == tokens_of(events[4]) == alone
    assert tokens_of(events[0]) == greedy_reference(models[0], [7], 12)
    assert [len(tokens_of(e)) for e in events[2:4]] == [10, 10]
    assert events[2][-1].batch_size == 2 and events[1][-1].batch_size == 1  # lanes by setting


def test_a_cancelled_row_is_dropped_and_the_others_finish(models: Models) -> None:
    specs = [([5, 9, 11], 10, SamplingParams()), ([7], 10, SamplingParams())]
    events = run_jobs(make_worker(models), specs, cancel=(0,))
    assert events[0] == []  # its client left while it waited: dropped from the queue
    assert tokens_of(events[1]) == greedy_reference(models[0], [7], 10)


def test_a_seed_fixes_the_sampled_answer(models: Models) -> None:
    worker = make_worker(models)
    params = SamplingParams(SamplingConfig(temperature=0.9), seed=11, ignore_eos=True)
    first = tokens_of(run_jobs(worker, [([5, 9], 16, params)])[0])
    again = tokens_of(run_jobs(worker, [([5, 9], 16, params)])[0])
    target, draft = models
    direct = SpeculativeDecoder(target, DraftModelDrafter(draft), 4).generate(
        torch.tensor([[5, 9]]),
        max_new_tokens=16,
        temperature=0.9,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(11),
    )
    assert first == again == direct.sequences[0, 2:].tolist()


def test_a_failing_batch_answers_with_an_error_and_the_worker_goes_on(models: Models) -> None:
    worker = make_worker(models)
    (events,) = run_jobs(worker, [([10**6], 4, SamplingParams())])
    assert isinstance(events[-1], ErrorEvent) and events[-1].status == 500
    assert "outside" in events[-1].message
    assert len(tokens_of(run_jobs(worker, [([7], 4, SamplingParams())])[0])) == 4


def test_the_warm_up_request_is_seen_by_no_lane_metric_or_policy(models: Models) -> None:
    """``warm_up`` decodes a dummy request in a session of its own: no report, no queue
    change, no cost table, and the answers after it are the target's greedy ones."""
    rounds: list[DecodeStats] = []
    profiles: list[RoundProfile] = []
    worker = make_worker(models, rounds=rounds, profiles=profiles)
    worker.warm_up()
    assert rounds == [] and profiles == [] and len(worker.queue) == 0 and worker.running == 0
    assert all(not policy._by_rows for policy in worker.load_aware.values())
    (events,) = run_jobs(worker, [([7, 3], 9, SamplingParams())])
    assert tokens_of(events) == greedy_reference(models[0], [7, 3], 9)


def test_a_warm_up_that_fails_is_logged_and_serving_goes_on(
    models: Models, caplog: pytest.LogCaptureFixture
) -> None:
    worker = make_worker(models)
    worker.decoder.generate = lambda *args, **kwargs: 1 / 0  # type: ignore[method-assign]
    with caplog.at_level("WARNING"):
        worker.warm_up()
    assert "warm-up request failed" in caplog.text
    assert len(tokens_of(run_jobs(worker, [([7], 4, SamplingParams())])[0])) == 4


# -- config, loading, protocol, metrics --------------------------------------------------------


def test_metric_batch_buckets_and_their_labels() -> None:
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        16,
        32,
    ]
    assert [bucket_label(b) for b in (1, 2, 4, 8, 32)] == ["1", "2", "3-4", "5-8", "17-32"]


def test_config_defaults_are_safe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DRAFTSMITH_API_KEY", raising=False)
    config = parse_serve_args(["--target", "t", "--drafter-kind", "ngram"])
    assert config.host == "127.0.0.1" and config.port == 8000
    assert config.trust_remote_code is False and config.api_key is None
    monkeypatch.setenv("DRAFTSMITH_API_KEY", "from-env")
    assert parse_serve_args(["--target", "t", "--drafter", "d"]).api_key == "from-env"
    assert parse_serve_args(["--target", "t", "--drafter", "d", "--api_key", "k"]).api_key == "k"
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("localhost")
    assert not _is_loopback("0.0.0.0") and not _is_loopback("example.org")


def test_config_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("target: /models/t\ndrafter_kind: ngram\nport: 9000\nmax_batch_size: 2\n")
    config = parse_serve_args(["--config", str(path), "--port", "9001"])
    assert (config.target, config.port, config.max_batch_size) == ("/models/t", 9001, 2)
    path.write_text("target: t\nbatch: 2\n")
    with pytest.raises(ValueError, match="unknown keys \\['batch'\\]"):
        parse_serve_args(["--config", str(path)])


def test_without_a_drafter_the_target_is_served_plainly() -> None:
    assert ServeConfig(target="t").drafter_kind == "none"
    config = parse_serve_args(["--target", "t"])
    assert (config.drafter_kind, config.chosen_draft_policy) == ("none", "load-aware")
    assert parse_serve_args(["--target", "t", "--drafter", "d"]).drafter_kind is None  # read
    assert parse_serve_args(["--target", "t", "--adaptive"]).chosen_draft_policy == "adaptive"
    assert parse_serve_args(["--target", "t"]).decoder == "process"  # the default
    assert parse_serve_args(["--target", "t", "--decoder", "thread"]).decoder == "thread"


def test_config_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="no drafter is served"):
        ServeConfig(target="t", tree=True).validate()
    with pytest.raises(ValueError, match="--draft-policy 'always' is not valid"):
        ServeConfig(target="t", draft_policy="always").validate()
    with pytest.raises(ValueError, match="contradict"):
        ServeConfig(target="t", draft_policy="fixed", adaptive=True).validate()
    with pytest.raises(
        ValueError, match="--decoder 'gpu' is not valid; choose one of process, thread"
    ):
        ServeConfig(target="t", decoder="gpu").validate()
    with pytest.raises(ValueError, match="--max-queue must be >= 1"):
        ServeConfig(target="t", drafter_kind="ngram", max_queue=0).validate()
    with pytest.raises(ValueError, match="--dtype"):
        ServeConfig(target="t", drafter_kind="ngram", dtype="int8").validate()
    for threads in (0, 10**6):  # a huge count used to abort the process inside OpenMP
        with pytest.raises(ValueError, match=f"--num-threads {threads}: give a thread count"):
            ServeConfig(target="t", drafter_kind="ngram", num_threads=threads).validate()
    for value in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="--timeout-headers must be > 0 seconds"):
            ServeConfig(target="t", drafter_kind="ngram", timeout_headers=value).validate()
    for value in (-1, 5):  # above --tree-top-k 4
        with pytest.raises(ValueError, match=r"--tree-frontier must lie in \[0, --tree-top-k=4\]"):
            ServeConfig(target="t", drafter_kind="ngram", tree_frontier=value).validate()
    with pytest.raises(ValueError, match="--lookup-tokens must be >= 1"):
        ServeConfig(target="t", drafter="d", drafter_kind="hybrid", lookup_tokens=0).validate()
    with pytest.raises(ValueError, match="add --drafter-kind hybrid"):
        ServeConfig(target="t", drafter_kind="ngram", lookup_tokens=6).validate()
    ServeConfig(target="t", drafter="d", drafter_kind="hybrid", lookup_tokens=6).validate()
    config = parse_serve_args(["--target", "t", "--drafter-kind", "ngram", "--timeout-body", "2.5"])
    assert (config.timeout_keep_alive, config.timeout_headers, config.timeout_body) == (5, 10, 2.5)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"port: !!python/object/apply:os.system ['echo hi']\n", "not a valid plain YAML file"),
        (b"port: [\n", "not a valid plain YAML file"),
        (b"port: 1\x00\n", "not a valid plain YAML file"),
        (bytes(range(256)), "is not UTF-8 text"),
        (b"port: [1]\n", r"port must be an integer, got \[1\] \(a list\)"),
        (b"port: 80.5\n", "port must be an integer, got 80.5"),
        (b"max_queue: null\n", "max_queue must be an integer, got null"),
        (b"timeout_body: {a: 1}\n", "timeout_body must be a finite number"),
        (b"api_key: 12345\n", "api_key must be a string or null, got 12345"),
        (b"tree: 5\n", "tree must be true or false"),
        (b"num_draft_tokens: 2.5\n", "num_draft_tokens must be an integer"),
    ],
    ids=[
        "python-tag",
        "unclosed",
        "nul",
        "binary",
        "list",
        "float",
        "null",
        "dict",
        "key",
        "bool",
        "ndt",
    ],
)
def test_config_file_values_are_checked(tmp_path: Path, content: bytes, expected: str) -> None:
    """A server config file is plain YAML whose values have their fields' types: a ValueError
    naming the file and the key, never a yaml, codec or TypeError, nor an int api_key that
    would fail every request later."""
    path = tmp_path / "serve.yaml"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=expected) as raised:
        parse_serve_args(["--config", str(path), "--target", "t", "--drafter-kind", "ngram"])
    assert str(path) in str(raised.value) and "\n" not in str(raised.value)
    path.write_text("timeout_body: 1e-1\nport: 9000\n")  # YAML 1.1 reads 1e-1 as a string
    config = parse_serve_args(["--config", str(path), "--target", "t", "--drafter-kind", "ngram"])
    assert (config.timeout_body, config.port) == (0.1, 9000)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--api-key", " "], "--api-key .* is empty"),
        (["--log-level", "INFO"], "--log-level 'INFO' is not valid"),
    ],
)
def test_flags_uvicorn_or_clients_would_trip_on_are_refused(
    flags: list[str], expected: str
) -> None:
    with pytest.raises(ValueError, match=expected):
        parse_serve_args(["--target", "t", "--drafter-kind", "ngram", *flags])


def test_the_serve_command_reports_bad_input_in_one_line(tmp_path: Path) -> None:
    """``python decode/serve.py`` with a bad flag, file or folder: one line, exit status 2."""
    repo = Path(__file__).resolve().parents[2]
    bad_yaml = tmp_path / "serve.yaml"
    bad_yaml.write_text("port: !!python/object/apply:os.system ['echo hi']\n")
    for argv, expected in (
        (["--target", str(tmp_path / "missing"), "--drafter-kind", "none"], "no such folder"),
        (["--config", str(bad_yaml), "--target", "t"], "not a valid plain YAML file"),
        (["--target", "t", "--drafter-kind", "none", "--device", "bogus"], "--device 'bogus'"),
    ):
        result = subprocess.run(
            [sys.executable, "decode/serve.py", *argv],
            cwd=repo, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and expected in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith("error: ")


def test_only_safetensors_weights_load(tmp_path: Path) -> None:
    model = tiny_llama()
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # pickled weights only
    with pytest.raises(OSError, match="safetensors"):
        load_target(tmp_path, "auto", torch.device("cpu"), trust_remote_code=False)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_target(tmp_path / "missing", "auto", torch.device("cpu"), trust_remote_code=False)


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (b'{"model": "m", "prompt": ["a", "b"]}', "prompt", "one prompt per request"),
        (b'{"model": "m", "prompt": "a", "stream_options": {"include_usage": true}}',
         "stream_options", "only allowed with stream=true"),
        (b'{"model": "m", "prompt": "a", "logprobs": 2}', "logprobs", "not supported"),
        (b'{"model": "m", "prompt": "a", "presence_penalty": 0.5}', "presence_penalty", "leave it"),
        (b'{"model": "m", "prompt": "a", "seed": 36893488147419103232}', "seed", "64 bits"),
        (b'{"model": "m", "prompt": "a", "stop": ["1", "2", "3", "4", "5"]}', "stop", "at most 4"),
    ],
)  # fmt: skip
def test_unsupported_parameters_are_named(body: bytes, param: str, fragment: str) -> None:
    with pytest.raises(APIError, match=fragment) as caught:
        parse_body(body, CompletionRequest)
    assert caught.value.status == 400 and caught.value.param == param


def test_chat_content_parts_and_max_completion_tokens() -> None:
    body = (
        b'{"model": "m", "max_completion_tokens": 7, "messages": [{"role": "user", "content": '
        b'[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}'
    )
    request = parse_body(body, ChatCompletionRequest)
    assert request.messages[0].as_template_input() == {"role": "user", "content": "ab"}
    assert request.requested_tokens == 7


def test_metrics_text_escapes_labels_and_folds_batches() -> None:
    metrics = ServerMetrics('we"ird\\name', "ngram", 4)
    stats = DecodeStats()
    stats.record_round(torch.tensor([2, 0]), 3, torch.tensor([True, True]))
    metrics.record_prefill(rows=2)
    metrics.record_decode(stats.fold())
    for accepted in ([2, 0], [1], []):  # three requests' own rounds (the last: no round)
        own = DecodeStats()
        for a in accepted:
            own.record_round(torch.tensor([a]), 3, torch.tensor([True]))
        metrics.record_request(own.fold())
    text = metrics.render(queue_depth=1, running=0)
    assert 'model="we\\"ird\\\\name"' in text
    assert "draftsmith_tau 2.0\n" in text  # 1 + 2 accepted / 2 row-rounds
    assert 'draftsmith_acceptance_rate{position="2"} 1.0' in text  # reached 1, accepted 1
    assert 'draftsmith_acceptance_rate{position="3"} 0.0' in text
    assert "draftsmith_queue_depth 1\n" in text
    samples = parse_prometheus(text)
    assert metric(samples, "draftsmith_prefill_rows_total") == 2
    # Per-request tau: 2.0 (2 + 0 accepted over 2 rounds) and 2.0 (1 over 1 round).
    assert metric(samples, "draftsmith_request_tau_bucket", le="1.75") == 0
    assert metric(samples, "draftsmith_request_tau_bucket", le="2.0") == 2
    assert metric(samples, "draftsmith_request_tau_bucket", le="+Inf") == 2
    assert metric(samples, "draftsmith_request_tau_count") == 2
    assert metric(samples, "draftsmith_request_tau_sum") == 4.0
    assert metric(samples, "draftsmith_request_draft_tokens_total") == 9
    assert metric(samples, "draftsmith_request_accepted_tokens_total") == 3


def test_every_round_is_profiled_and_its_width_counted_by_batch_size(models: Models) -> None:
    """/metrics shows the widths the load-aware policy chose at each batch size and where
    each bucket's round time went; the profile's rows and widths are the rounds' own."""
    profiles: list[RoundProfile] = []
    rounds: list[DecodeStats] = []
    worker = make_worker(models, rounds, profiles=profiles)
    raw = SamplingParams(ignore_eos=True)
    run_jobs(worker, [([5, 9, 11], 16, raw), ([7], 16, raw), ([3, 4], 16, raw)])
    run_jobs(worker, [([5, 9], 12, raw)])
    assert len(profiles) == sum(stats.target_forward_passes for stats in rounds)
    assert {1, 3} <= {profile.rows for profile in profiles}
    widths = Counter()
    for stats in rounds:
        widths.update(stats.rounds_per_width)
    assert sum(p.rows for p in profiles) == sum(widths.values())  # row-rounds
    for profile in profiles:
        assert set(profile.seconds) == set(ROUND_PHASES)
        assert all(seconds >= 0 for seconds in profile.seconds.values())
        assert 0 <= profile.drafted <= 4
    metrics = ServerMetrics("m", "draft_lm", 4, "load-aware")
    for profile in profiles:
        metrics.record_round(profile)
    samples = parse_prometheus(metrics.render(queue_depth=0, running=0))
    assert metric(samples, "draftsmith_info", model="m", drafter_kind="draft_lm",
                  draft_policy="load-aware") == 1  # fmt: skip
    for bucket, sizes in (("1", {1}), ("2", {2}), ("3-4", {3, 4})):
        counted = sum(
            metric(samples, "draftsmith_rounds_total", batch=bucket, drafted=str(w))
            for w in range(5)
        )
        assert counted == sum(profile.rows in sizes for profile in profiles)
        verify = sum(p.seconds["verify"] for p in profiles if p.rows in sizes)
        assert metric(
            samples, "draftsmith_round_seconds_total", batch=bucket, phase="verify"
        ) == pytest.approx(verify)


def test_stop_sequences_longer_than_the_bound_are_a_400_naming_it() -> None:
    """The stream checks each held-back length per token; a 16,000-character stop made that
    tens of milliseconds of the event loop per token, so stops are bounded."""
    fits = CompletionRequest(model="m", prompt="a", stop=["x" * MAX_STOP_CHARS, "y"])
    assert fits.stop_strings() == ["x" * MAX_STOP_CHARS, "y"]
    too_long = CompletionRequest(model="m", prompt="a", stop=["y", "x" * (MAX_STOP_CHARS + 1)])
    with pytest.raises(APIError, match=f"at most {MAX_STOP_CHARS} characters") as raised:
        too_long.stop_strings()
    assert raised.value.status == 400 and raised.value.param == "stop"


class _Fatal(BaseException):
    """Ends a thread as nothing the worker catches would (a stand-in for any fatal error)."""


def test_a_dead_decoder_thread_answers_waiting_requests_and_refuses_new_ones(
    models: Models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request queued when the decoder thread died used to wait for ever, and so did every
    later one; now the waiting ones get a 503 and the queue refuses new ones."""
    worker = make_worker(models)

    def fatal(timeout: float = 0.0) -> bool:
        raise _Fatal

    monkeypatch.setattr(worker, "tick", fatal)
    monkeypatch.setattr(threading, "excepthook", lambda _: None)  # the death is the point

    async def scenario() -> None:
        waiting = GenerationJob([7], 4, SamplingParams())
        worker.queue.put(waiting)
        worker.start()
        await asyncio.to_thread(worker._thread.join, 30)
        assert not worker.alive
        event = await asyncio.wait_for(waiting.events.get(), 30)
        assert isinstance(event, ErrorEvent) and event.status == 503
        with pytest.raises(QueueClosed, match="decoder has stopped"):
            worker.queue.put(GenerationJob([7], 4, SamplingParams()))

    asyncio.run(scenario())


def test_a_request_after_the_decoder_stopped_is_a_503_not_a_429(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    """A stopped server is the server's state, not the client's load: 503, not 'retry, busy'."""
    from draftsmith.decode.drafters.none import NoDrafter
    from draftsmith.decode.serving.app import OpenAIServer
    from starlette.testclient import TestClient

    target = tiny_llama(vocab_size=len(tokenizer), dtype=torch.float32)
    server = OpenAIServer(target, tokenizer, NoDrafter(len(tokenizer)), model_name="m")
    server.backend.queue.close()  # what the decoder thread does when it stops
    client = TestClient(server.app())  # no lifespan: the decoder thread never starts
    response = client.post("/v1/completions", json={"model": "m", "prompt": [5], "max_tokens": 2})
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "server_unavailable" and "retry later" in error["message"]


def test_a_target_that_decodes_one_row_at_a_time_is_served_unbatched(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    """MPT biases attention by cache slot (``draftsmith.decode.forward.attention_layout.single_row_problem``): a batch
    would shift it, so the server refuses to batch it at start, not on the second request."""
    import transformers
    from draftsmith.decode.drafters.none import NoDrafter
    from draftsmith.decode.serving.app import OpenAIServer

    config = transformers.MptConfig(
        vocab_size=len(tokenizer), d_model=32, n_layers=1, n_heads=4, max_seq_len=64
    )
    target = transformers.MptForCausalLM(config).eval()
    drafter = NoDrafter(len(tokenizer))
    with pytest.raises(ValueError, match=r"cache slot.*--max-batch-size 1"):
        OpenAIServer(target, tokenizer, drafter, model_name="m", max_batch_size=2)
    OpenAIServer(target, tokenizer, drafter, model_name="m", max_batch_size=1)


def test_a_context_past_a_learned_position_table_is_refused_at_start(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    """GPT-2 embeds positions from a table: a --max-context-length past it would let requests
    in that the forward cannot run (a 500), so the server refuses the setting at start."""
    import transformers
    from draftsmith.decode.drafters.none import NoDrafter
    from draftsmith.decode.serving.app import OpenAIServer, ServingLimits

    config = transformers.GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=4, n_positions=64
    )
    target = transformers.GPT2LMHeadModel(config).eval()
    drafter = NoDrafter(len(tokenizer))
    with pytest.raises(ValueError, match=r"--max-context-length 2048 passes the 64 positions"):
        OpenAIServer(target, tokenizer, drafter, model_name="m")
    limits = ServingLimits(max_context_length=64)
    OpenAIServer(target, tokenizer, drafter, model_name="m", limits=limits)
