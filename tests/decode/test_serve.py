"""The real server (``python decode/serve.py``) on a free loopback port, one per module.

A tiny Llama target and a noisy copy of it as draft LM, with a byte-level BPE tokenizer
trained here; clients are the official ``openai`` package (completions, chat, streaming) and
raw HTTP (the error cases). Greedy answers must equal the decoder's and ``target.generate``'s
token for token, streamed answers the non-streamed ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from decode_helpers import noisy_copy
from draftsmith.data.tokenizer import train_byte_level_bpe
from draftsmith.decode import SpeculativeDecoder, load_drafter
from openai import OpenAI
from openai.types import Completion
from serve_helpers import (
    Metrics,
    free_port,
    metric,
    openai_error,
    parse_prometheus,
    saved_dtype,
    stop_server,
    tail,
    wait_for_health,
)
from tiny_models import tiny_llama

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key-123"
MODEL = "tiny"
MAX_TOKENS_LIMIT = 1536
MAX_CONTEXT = 2048
MAX_QUEUE = 8
MAX_BATCH_SIZE = 4
MAX_REQUEST_BYTES = 65536
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "hello world, this is a tiny test corpus",
    "import os\nimport sys\n",
    "the quick brown fox jumps over the lazy dog",
] * 10
PROMPTS = ["def add", "hello world", "import os", "the quick", "fox", "return a", "lazy", "b):"]


@dataclass
class Served:
    url: str
    target: torch.nn.Module
    tokenizer: object
    draft_dir: Path
    eos_ids: list[int]
    log: Path

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def openai(self) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return list(encoded["input_ids"])

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Plain ``target.generate`` greedy: the new tokens, EOS included."""
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = self.target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=self.eos_ids,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        return out[0, len(prompt_ids) :].tolist()

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def metrics(self) -> Metrics:
        response = httpx.get(f"{self.url}/metrics", headers=self.auth, timeout=30)
        assert response.status_code == 200
        return parse_prometheus(response.text)

    def wait_for(self, condition: Callable[[Metrics], bool], what: str) -> Metrics:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            metrics = self.metrics()
            if condition(metrics):
                return metrics
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; server log:\n{tail(self.log)}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("serve")
    tokenizer = train_byte_level_bpe(TEXTS, vocab_size=300)
    target = tiny_llama(vocab_size=len(tokenizer), seed=0)
    for config in (target.config, target.generation_config):
        config.bos_token_id = tokenizer.bos_token_id
        config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    noisy_copy(target, scale=0.3).save_pretrained(root / "draft")

    port = free_port()
    log = root / "server.log"
    command = [
        sys.executable, "decode/serve.py",
        "--target", str(root / "target"), "--drafter", str(root / "draft"),
        "--served-model-name", MODEL, "--port", str(port), "--api-key", API_KEY,
        "--max-queue", str(MAX_QUEUE), "--max-batch-size", str(MAX_BATCH_SIZE),
        "--max-tokens-limit", str(MAX_TOKENS_LIMIT), "--max-context-length", str(MAX_CONTEXT),
        "--max-request-bytes", str(MAX_REQUEST_BYTES), "--num-threads", "1",
        "--log-level", "warning", "--dtype", saved_dtype(root / "target"),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("DRAFTSMITH_API_KEY", None)
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        from transformers import AutoModelForCausalLM

        # The reference copy loads while the server boots.
        reloaded = AutoModelForCausalLM.from_pretrained(root / "target", use_safetensors=True)
        wait_for_health(process, url, log, timeout_s=300)
        eos_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
        yield Served(url, reloaded.eval(), tokenizer, root / "draft", eos_ids, log)
    finally:
        stop_server(process)
    # uvicorn re-raises the SIGTERM it handled once it has shut down gracefully.
    assert process.returncode in (0, -signal.SIGTERM), f"exit {process.returncode}:\n{tail(log)}"
    assert "Traceback" not in log.read_text(errors="replace"), tail(log)


@contextlib.contextmanager
def long_stream(served: Served) -> Iterator[None]:
    """A streaming request that keeps the decoder busy until the block ends (then hangs up)."""
    body = {
        "model": MODEL, "prompt": "def add", "max_tokens": MAX_TOKENS_LIMIT, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{served.url}/v1/completions", json=body, headers=served.auth) as r,
    ):
        assert r.status_code == 200
        # Hold the line iterator: dropping it would close the connection at once.
        lines = r.iter_lines()
        for line in lines:  # running once its first tokens arrive
            if line.startswith("data: {"):
                break
        yield
        del lines


def post(served: Served, path: str, body: object, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(served.auth if headers is None else headers)}
    return httpx.post(f"{served.url}{path}", content=content, headers=headers, timeout=60)


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    return openai_error(response.json(), code)


# -- answers ------------------------------------------------------------------------------


def test_health_and_models(served: Served) -> None:
    health = httpx.get(f"{served.url}/health", timeout=10)  # open without a key
    assert health.status_code == 200 and health.json()["status"] == "ok"
    models = served.openai().models.list()
    assert [model.id for model in models.data] == [MODEL]


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_greedy_completion_equals_decoder_and_target_generate(served: Served, prompt: str) -> None:
    ids = served.encode(prompt)
    expected = served.greedy(ids, 40)
    decoder = SpeculativeDecoder(served.target, load_drafter(served.draft_dir, served.target), 4)
    out = decoder.generate(torch.tensor([ids]), max_new_tokens=40, eos_token_id=served.eos_ids)
    assert out.sequences[0, len(ids) :].tolist() == expected

    answer = served.openai().completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0
    )
    choice = answer.choices[0]
    assert choice.text == served.text(expected)
    assert answer.usage.completion_tokens == len(expected)
    assert answer.usage.prompt_tokens == len(ids)
    assert choice.finish_reason == ("stop" if expected[-1] in served.eos_ids else "length")
    stats = answer.model_extra["draftsmith"]
    assert stats["drafter_kind"] == "draft_lm" and stats["num_draft_tokens"] == 4
    # The load-aware policy chose each round's width in 0..4: positions up to the longest.
    assert len(stats["alpha_per_position"]) <= 4
    assert all(0.0 <= alpha <= 1.0 for alpha in stats["alpha_per_position"])
    accepted = sum(stats["accepted_per_position"])
    assert stats["tau"] == pytest.approx(1 + accepted / stats["target_forward_passes"])
    # Every verification pass yields 1 + accepted tokens; the first token comes from prefill.
    assert 1 + stats["target_forward_passes"] + accepted >= len(expected)
    speculative = answer.usage.model_extra["speculative"]  # the same numbers, usage-side
    assert speculative["rounds"] == stats["target_forward_passes"]
    assert speculative["accepted_tokens"] == accepted and speculative["tau"] == stats["tau"]
    assert sum(stats["verified_per_position"]) <= speculative["drafted_tokens"]
    assert speculative["drafted_tokens"] <= 4 * speculative["rounds"]


def test_token_id_prompt_and_chat_greedy(served: Served) -> None:
    ids = served.encode("hello world")
    expected = served.greedy(ids, 30)
    answer = served.openai().completions.create(
        model=MODEL, prompt=ids, max_tokens=30, temperature=0
    )
    assert answer.choices[0].text == served.text(expected)

    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello world"},
    ]
    chat_ids = served.chat_ids(messages)
    expected = served.greedy(chat_ids, 30)
    chat = served.openai().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == served.text(expected)
    assert chat.usage.prompt_tokens == len(chat_ids)
    assert chat.usage.completion_tokens == len(expected)
    assert "tau" in chat.model_extra["draftsmith"]


def _stream_completion(served: Served, **kwargs: object) -> tuple[str, str | None, object, dict]:
    chunks = list(
        served.openai().completions.create(
            model=MODEL, stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    finals = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].usage is not None and not chunks[-1].choices
    return text, finals[0].choices[0].finish_reason, chunks[-1].usage, finals[0].model_extra


def test_streamed_equals_non_streamed(served: Served) -> None:
    client = served.openai()
    for kwargs in (
        {"prompt": "def add", "max_tokens": 40, "temperature": 0},
        {"prompt": "import os", "max_tokens": 40, "temperature": 0.8, "seed": 1234},
    ):
        full = client.completions.create(model=MODEL, **kwargs)
        text, finish, usage, extra = _stream_completion(served, **kwargs)
        assert text == full.choices[0].text
        assert finish == full.choices[0].finish_reason
        assert usage.completion_tokens == full.usage.completion_tokens
        if "seed" in kwargs:  # a seeded request drafts N every round: its rounds repeat too
            assert extra["draftsmith"] == full.model_extra["draftsmith"]
        else:  # load-aware widths follow measured times: the same text, other rounds
            assert extra["draftsmith"]["drafter_kind"] == "draft_lm"

    messages = [{"role": "user", "content": "the quick"}]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30, temperature=0
    )
    stream = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=30, temperature=0, stream=True
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    content = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert content == full.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_seed_fixes_a_sampled_answer(served: Served) -> None:
    ids = served.encode("import os")
    decoder = SpeculativeDecoder(served.target, load_drafter(served.draft_dir, served.target), 4)
    out = decoder.generate(
        torch.tensor([ids]),
        max_new_tokens=40,
        temperature=0.8,
        eos_token_id=served.eos_ids,
        generator=torch.Generator().manual_seed(1234),
    )
    expected = out.sequences[0, len(ids) :].tolist()
    expected = expected[
        : next((i + 1 for i, t in enumerate(expected) if t in served.eos_ids), None)
    ]
    client = served.openai()
    first = client.completions.create(
        model=MODEL, prompt="import os", max_tokens=40, temperature=0.8, seed=1234
    )
    again = client.completions.create(
        model=MODEL, prompt="import os", max_tokens=40, temperature=0.8, seed=1234
    )
    assert first.choices[0].text == again.choices[0].text == served.text(expected)
    assert first.usage.completion_tokens == len(expected)


def test_stop_strings_cut_before_the_first_occurrence(served: Served) -> None:
    reference = served.text(served.greedy(served.encode("hello world"), 40))
    assert len(reference) >= 12, "the reference answer is too short to cut"
    stop = reference[10:12]
    expected = reference[: reference.find(stop)]
    kwargs = {"prompt": "hello world", "max_tokens": 40, "temperature": 0,
              "stop": [stop, "\x00never"]}  # fmt: skip
    full = served.openai().completions.create(model=MODEL, **kwargs)
    assert full.choices[0].text == expected
    assert full.choices[0].finish_reason == "stop"
    text, finish, usage, _ = _stream_completion(served, **kwargs)
    assert (text, finish) == (expected, "stop")
    assert usage.completion_tokens == full.usage.completion_tokens <= 40


# -- concurrency ---------------------------------------------------------------------------


def test_concurrent_clients_join_the_running_batch_and_are_all_correct(served: Served) -> None:
    """Continuous batching: requests sent while a long stream decodes join it at a round
    boundary (none waits for it to end) and each gets its own greedy answer."""
    expected = {prompt: served.text(served.greedy(served.encode(prompt), 24)) for prompt in PROMPTS}
    client = served.openai()

    def ask(prompt: str) -> Completion:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)

    with ThreadPoolExecutor(len(PROMPTS)) as pool, long_stream(served):
        futures = [pool.submit(ask, prompt) for prompt in PROMPTS]
        answers = [future.result() for future in futures]  # while the long stream runs
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        assert answer.choices[0].text == expected[prompt], prompt
        assert answer.model_extra["draftsmith"]["batch_size"] >= 2  # beside the long stream


def test_full_queue_is_429_and_queued_requests_still_finish(served: Served) -> None:
    body = {"model": MODEL, "prompt": "fox", "max_tokens": 4, "temperature": 0}
    with ThreadPoolExecutor(MAX_QUEUE) as pool:
        with contextlib.ExitStack() as streams:
            for _ in range(MAX_BATCH_SIZE):  # every decoder row busy: new requests must queue
                streams.enter_context(long_stream(served))
            futures = [pool.submit(post, served, "/v1/completions", body) for _ in range(MAX_QUEUE)]
            served.wait_for(
                lambda m: metric(m, "draftsmith_queue_depth") == MAX_QUEUE, "a full queue"
            )
            error = assert_openai_error(post(served, "/v1/completions", body), 429, "queue_full")
            assert error["type"] == "rate_limit_error"
        assert [future.result().status_code for future in futures] == [200] * MAX_QUEUE


def test_client_disconnect_frees_its_slot(served: Served) -> None:
    before = served.metrics()
    with long_stream(served):
        pass  # hang up right after the first tokens
    after = served.wait_for(
        lambda m: (
            metric(m, "draftsmith_running_requests") == 0
            and metric(m, "draftsmith_requests_cancelled_total")
            > metric(before, "draftsmith_requests_cancelled_total")
        ),
        "the abandoned stream to stop",
    )
    decoded = metric(after, "draftsmith_decoded_tokens_total") - metric(
        before, "draftsmith_decoded_tokens_total"
    )
    assert 0 < decoded < MAX_TOKENS_LIMIT  # stopped long before its max_tokens

    def count(metrics: Metrics, code: str) -> float:
        name = "draftsmith_requests_total"
        return metric(metrics, name, endpoint="/v1/completions", code=code)

    # Counted as a hang-up (499), not as the 200 its stream had started with.
    after = served.wait_for(lambda m: count(m, "499") == count(before, "499") + 1, "a 499")
    assert count(after, "200") == count(before, "200")
    answer = served.openai().completions.create(model=MODEL, prompt="fox", max_tokens=3)
    assert answer.usage.completion_tokens <= 3


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", b"\xff\xfe", 400, None),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": True}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
        ("/v1/completions", {"model": MODEL, "prompt": 7}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 10**6]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "bogus": 1}, 400, "bogus"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a", ""]}, 400, "stop"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": MAX_TOKENS_LIMIT + 1}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": [5] * (MAX_CONTEXT - 10), "max_tokens": 11}, 400, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 3}]}, 400, "messages.0.content"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_errors(
    served: Served, path: str, body: object, status: int, param: str | None
) -> None:
    error = assert_openai_error(post(served, path, body), status)
    assert error["param"] == param
    assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200


def test_limits_name_their_error_codes(served: Served) -> None:
    too_many = {"model": MODEL, "prompt": "x", "max_tokens": MAX_TOKENS_LIMIT + 1}
    assert_openai_error(post(served, "/v1/completions", too_many), 400, "max_tokens_too_large")
    too_long = {"model": MODEL, "prompt": [5] * (MAX_CONTEXT - 10), "max_tokens": 11}
    assert_openai_error(post(served, "/v1/completions", too_long), 400, "context_length_exceeded")
    unknown = {"model": "gpt-4", "prompt": "x"}
    assert_openai_error(post(served, "/v1/completions", unknown), 404, "model_not_found")
    huge = {"model": MODEL, "prompt": "x" * MAX_REQUEST_BYTES}
    assert_openai_error(post(served, "/v1/completions", huge), 413)


def test_api_key_is_required(served: Served) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = post(served, "/v1/completions", body, headers=headers)
        assert_openai_error(response, 401, "invalid_api_key")
        assert response.headers["www-authenticate"] == "Bearer"
    for path in ("/v1/models", "/metrics", "/openapi.json"):
        assert_openai_error(httpx.get(f"{served.url}{path}", timeout=10), 401)
    schema = httpx.get(f"{served.url}/openapi.json", headers=served.auth, timeout=10)
    assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
    for path in ("/docs", "/redoc"):
        assert_openai_error(httpx.get(f"{served.url}{path}", headers=served.auth), 404)
    from openai import AuthenticationError

    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_unknown_routes_and_methods(served: Served) -> None:
    assert_openai_error(httpx.get(f"{served.url}/v1/nothing", headers=served.auth), 404)
    assert_openai_error(httpx.get(f"{served.url}/v1/completions", headers=served.auth), 405)


# -- metrics and the load test ----------------------------------------------------------------


def test_metrics_are_prometheus_text_with_totals(served: Served) -> None:
    served.openai().completions.create(model=MODEL, prompt="def add", max_tokens=20, temperature=0)
    response = httpx.get(f"{served.url}/metrics", headers=served.auth, timeout=10)
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    metrics = parse_prometheus(response.text)
    assert metric(metrics, "draftsmith_requests_total", endpoint="/v1/completions", code="200") >= 1
    assert metric(metrics, "draftsmith_generation_tokens_total") >= 20
    passes = metric(metrics, "draftsmith_target_forward_passes_total")
    rounds = metric(metrics, "draftsmith_decode_rounds_total")
    assert passes > 0 and rounds >= passes
    accepted = [
        metric(metrics, "draftsmith_draft_tokens_accepted_total", position=str(j))
        for j in range(1, 5)
    ]
    verified = [
        metric(metrics, "draftsmith_draft_tokens_verified_total", position=str(j))
        for j in range(1, 5)
    ]
    assert metric(metrics, "draftsmith_tau") == pytest.approx(1 + sum(accepted) / rounds)
    assert 0 < sum(accepted) < sum(verified)  # the noisy draft is right only sometimes
    for j in range(1, 5):
        alpha = metric(metrics, "draftsmith_acceptance_rate", position=str(j))
        assert alpha == pytest.approx(accepted[j - 1] / verified[j - 1])
    info = {"model": MODEL, "drafter_kind": "draft_lm", "draft_policy": "load-aware"}
    assert metric(metrics, "draftsmith_info", **info) == 1
    chosen = [
        metric(metrics, "draftsmith_rounds_total", batch=batch, drafted=str(w))
        for batch in ("1", "2", "3-4", "5-8")
        for w in range(5)
    ]
    assert sum(chosen) == metric(metrics, "draftsmith_target_forward_passes_total")
    finished = metric(metrics, "draftsmith_request_tau_count")  # per-request acceptance
    assert finished >= 1 and metric(metrics, "draftsmith_request_tau_bucket", le="+Inf") == finished
    assert metric(metrics, "draftsmith_request_tau_sum") >= finished  # each tau >= 1
    assert (
        0
        < metric(metrics, "draftsmith_request_accepted_tokens_total")
        <= metric(metrics, "draftsmith_request_draft_tokens_total")
    )


def test_load_test_script_runs_and_stops_by_itself(served: Served, tmp_path: Path) -> None:
    summary_path = tmp_path / "load.json"
    command = [
        sys.executable, "scripts/load_test.py", "--url", served.url, "--clients", "3",
        "--duration", "2", "--grace", "60", "--max-tokens", "8", "--api-key", API_KEY,
        "--json", str(summary_path),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for label in ("requests/s:", "tokens/s:", "latency p50/p99:", "ttft p50/p99:", "errors:"):
        assert label in result.stdout
    summary = json.loads(summary_path.read_text())
    assert summary["errors"] == 0 and summary["cut_off"] == 0 and summary["completed"] >= 3
    assert 0 < summary["ttft_p50_s"] <= summary["latency_p50_s"] <= summary["latency_p99_s"]
    assert summary["tokens_per_s"] > 0

    remote = subprocess.run(
        [sys.executable, "scripts/load_test.py", "--url", "http://10.0.0.1:8000"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert remote.returncode == 2 and "--allow-remote" in remote.stderr
