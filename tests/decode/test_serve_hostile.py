"""The server against hostile clients, over real loopback sockets.

The app runs under uvicorn in this process (``OpenAIServer.uvicorn_config``, the settings
``decode/serve.py`` uses) with a tiny Llama target and short deadlines, so that the tests can
pace the decoder round by round and read the server's counters directly. Every test must leave
the server up (``/health`` 200), with no 5xx counted and no error or traceback logged.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import pytest
import torch
import uvicorn
from draftsmith.decode.drafters.none import NoDrafter
from draftsmith.decode.serving.app import OpenAIServer, ServingLimits
from draftsmith.decode.serving.jobs import GenerationJob
from serve_helpers import free_port, openai_error, parse_prometheus
from tiny_models import tiny_llama, tiny_tokenizer

MODEL = "tiny"
API_KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
HEADERS_S = BODY_S = 1.0  # the deadlines under test
IDLE_S = 5.0  # longer: a keep-alive test must not lose its connection on a busy machine
MAX_TOKENS_LIMIT = 400
GOOD = json.dumps({"model": MODEL, "prompt": "def add", "max_tokens": 3, "temperature": 0})


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.bad: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            self.bad.append(record)


@dataclass
class Live:
    server: OpenAIServer
    runner: uvicorn.Server
    port: int
    records: _Records
    target: torch.nn.Module
    server_bugs: int = 0  # 500s a test provoked on purpose

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.settimeout(60)  # a bound for a broken test, never reached by a passing one
        return sock

    def http(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def counts(self) -> dict[tuple[str, str], float]:
        text = self.server.metrics.render(queue_depth=0, running=0)
        return {
            (dict(labels)["endpoint"], dict(labels)["code"]): value
            for (name, labels), value in parse_prometheus(text).items()
            if name == "draftsmith_requests_total"
        }

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)

    def wait_for_count(self, before: dict, endpoint: str, code: str) -> None:
        self.wait_for(
            lambda: self.counts().get((endpoint, code), 0) == before.get((endpoint, code), 0) + 1,
            f"{endpoint} {code} to be counted",
        )


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    tokenizer = tiny_tokenizer()
    target = tiny_llama(vocab_size=len(tokenizer), dtype=torch.float32)
    for config in (target.config, target.generation_config):
        config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
    limits = ServingLimits(
        max_tokens_limit=MAX_TOKENS_LIMIT,
        max_context_length=512,
        keep_alive_timeout_s=IDLE_S,
        header_timeout_s=HEADERS_S,
        body_timeout_s=BODY_S,
    )
    server = OpenAIServer(
        target, tokenizer, NoDrafter(len(tokenizer)), model_name=MODEL, limits=limits,
        api_key=API_KEY,
    )  # fmt: skip
    port = free_port()
    runner = uvicorn.Server(
        server.uvicorn_config("127.0.0.1", port, log_level="warning", log_config=None)
    )
    records = _Records()
    logging.getLogger().addHandler(records)
    thread = threading.Thread(target=runner.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not runner.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        yield Live(server, runner, port, records, target)
    finally:
        runner.should_exit = True
        thread.join(30)
        logging.getLogger().removeHandler(records)
    assert not thread.is_alive()


@pytest.fixture(autouse=True)
def stays_healthy(live: Live) -> Iterator[None]:
    """After each test: the server answers, nothing counted 5xx, nothing logged an error."""
    yield
    connection = live.http()
    connection.request("GET", "/health")
    assert connection.getresponse().status == 200
    connection.close()
    failures = sum(n for (_, code), n in live.counts().items() if code.startswith("5"))
    assert failures == live.server_bugs, live.counts()
    assert not live.records.bad, [record.getMessage() for record in live.records.bad]


def request_bytes(path: str, body: bytes, headers: dict[str, str] = AUTH) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def parse_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


def abort(sock: socket.socket) -> None:
    """Close with a TCP reset, as a killed client does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


# -- lone surrogates -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", rb'{"model": "tiny", "prompt": "a\ud800b"}', "prompt"),
        ("/v1/completions", rb'{"model": "tiny", "prompt": ["\ud800"]}', "prompt.0"),
        ("/v1/completions", rb'{"model": "tiny", "prompt": "\udfff", "stream": true}', "prompt"),
        ("/v1/completions", rb'{"model": "tiny\ud800", "prompt": "a"}', "model"),
        ("/v1/completions", rb'{"model": "tiny", "prompt": "a", "stop": "\ud800"}', "stop"),
        (
            "/v1/chat/completions",
            rb'{"model": "tiny", "messages": [{"role": "user", "content": "hi \ud800"}]}',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            rb'{"model": "tiny", "stream": true, "messages": [{"role": "user", "content": '
            rb'[{"type": "text", "text": "\udc00"}]}]}',
            "messages.0.content.0.text",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400_and_the_connection_stays_usable(
    live: Live, path: str, body: bytes, param: str
) -> None:
    connection = live.http()
    connection.request("POST", path, body, AUTH)
    response = connection.getresponse()
    error = openai_error(json.loads(response.read()), "invalid_value")
    assert response.status == 400 and error["param"] == param
    assert "lone UTF-16 surrogate" in error["message"]
    assert response.getheader("connection") is None  # keep-alive, not closed
    sock = connection.sock
    connection.request("POST", "/v1/completions", GOOD, AUTH)  # the same connection again
    response = connection.getresponse()
    assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"]
    assert connection.sock is sock
    connection.close()


def test_a_malformed_request_gets_the_openai_error_schema(live: Live) -> None:
    before = live.counts()
    with live.connect() as sock:
        sock.sendall(b"GET /v1/models/\xff HTTP/1.1\r\nHost: test\r\n\r\n")
        status, headers, body = parse_response(read_until_closed(sock))
    assert status == 400 and headers["connection"] == "close"
    openai_error(json.loads(body), "bad_request")
    live.wait_for_count(before, "other", "400")


# -- sampling values ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ('"temperature": NaN', None),  # not JSON at all
        ('"top_p": NaN', None),
        ('"temperature": -Infinity', None),
        ('"temperature": 1e400', "temperature"),  # JSON for a number that overflows to inf
        ('"temperature": -0.5', "temperature"),
        ('"top_p": 1e-400', "top_p"),  # underflows to 0
        ('"top_p": 1.01', "top_p"),
        ('"top_k": -7', "top_k"),
    ],
)
def test_sampling_values_the_sampler_refuses_are_400(
    live: Live, fields: str, param: str | None
) -> None:
    body = f'{{"model": "tiny", "prompt": "def add", "max_tokens": 3, {fields}}}'
    connection = live.http()
    connection.request("POST", "/v1/completions", body, AUTH)
    response = connection.getresponse()
    error = openai_error(json.loads(response.read()))
    assert response.status == 400 and error["param"] == param
    connection.close()


@pytest.mark.parametrize("temperature", ["1e-300", "5e-324", "1e-6"])
def test_a_tiny_temperature_is_greedy(live: Live, temperature: str) -> None:
    texts = []
    for value in ("0", temperature):
        body = f'{{"model": "tiny", "prompt": "def add", "max_tokens": 12, "temperature": {value}}}'
        connection = live.http()
        connection.request("POST", "/v1/completions", body, AUTH)
        response = connection.getresponse()
        assert response.status == 200
        texts.append(json.loads(response.read())["choices"][0]["text"])
        connection.close()
    assert texts[0] == texts[1]


@pytest.mark.parametrize("top_p", ["1e-46", "1e-320"])
def test_a_top_p_below_float32_keeps_the_most_likely_token(live: Live, top_p: str) -> None:
    """A positive top_p that rounds to 0 in float32 still keeps the top token: greedy, not 500."""
    texts = []
    for fields in ('"temperature": 0', f'"temperature": 1, "top_p": {top_p}'):
        body = f'{{"model": "tiny", "prompt": "def add", "max_tokens": 12, {fields}}}'
        connection = live.http()
        connection.request("POST", "/v1/completions", body, AUTH)
        response = connection.getresponse()
        assert response.status == 200, response.read()
        texts.append(json.loads(response.read())["choices"][0]["text"])
        connection.close()
    assert texts[0] == texts[1]


# -- clients that leave ------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_client_that_leaves_mid_body_is_a_499_not_a_500(live: Live, how: str) -> None:
    before = live.counts()
    sock = live.connect()
    head = request_bytes("/v1/completions", b"x" * 1000)
    sock.sendall(head[: head.index(b"\r\n\r\n") + 4] + b'{"model": "tiny", "pro')
    # The route runs (reading the body) once the headers are in.
    live.wait_for(lambda: len(live.runner.server_state.tasks) == 1, "the route to start")
    (abort if how == "reset" else socket.socket.close)(sock)
    live.wait_for_count(before, "/v1/completions", "499")


@dataclass
class Gate:
    """The decoder thread waits here before each round's tokens are handed on."""

    semaphore: threading.Semaphore
    rounds: list[bool]  # what each round's streamer call returned (False: generation ends)
    jobs: list[GenerationJob]
    opened: threading.Event

    def open(self) -> None:
        """Stop holding rounds back."""
        self.opened.set()
        self.semaphore.release()  # the one round that may be waiting


@contextlib.contextmanager
def gated(live: Live, pace_s: float | None = None) -> Iterator[Gate]:
    """Hold the decoder at every round until the test releases it (or pace it if ``pace_s``)."""
    server = live.server
    gate = Gate(threading.Semaphore(0), [], [], threading.Event())
    deliver, put = server.backend.worker._deliver, server.backend.queue.put

    def gated_deliver(*args: object) -> bool:
        if pace_s is not None:
            time.sleep(pace_s)
        elif not gate.opened.is_set():
            gate.semaphore.acquire()
        keep_going = deliver(*args)
        gate.rounds.append(keep_going)
        return keep_going

    def recording_put(job: GenerationJob) -> None:
        gate.jobs.append(job)
        put(job)

    server.backend.worker._deliver = gated_deliver  # type: ignore[method-assign]
    server.backend.queue.put = recording_put  # type: ignore[method-assign]
    try:
        yield gate
    finally:
        del server.backend.worker._deliver, server.backend.queue.put
        gate.open()
        live.wait_for(lambda: server.backend.worker.running == 0, "the decoder to go idle")


def long_request(stream: bool) -> bytes:
    body = {"model": MODEL, "prompt": "def add", "max_tokens": MAX_TOKENS_LIMIT, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    return request_bytes("/v1/completions", json.dumps(body).encode())


@pytest.mark.parametrize("stream", [False, True])
def test_a_hang_up_stops_the_decoder_within_one_round(live: Live, stream: bool) -> None:
    before = live.counts()
    with gated(live) as gate:
        sock = live.connect()
        sock.sendall(long_request(stream))
        gate.semaphore.release(3)  # the prefill's token and two decoding rounds
        live.wait_for(lambda: len(gate.rounds) == 3, "three rounds")
        (job,) = gate.jobs
        if stream:
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK")
        abort(sock)
        # The decoder now waits before round four; the server learns of the hang-up meanwhile.
        live.wait_for(lambda: job.cancelled, "the job to be cancelled")
        gate.open()  # let it run: it must stop at once
        live.wait_for(
            lambda: job.finished and live.server.backend.worker.running == 0, "the job's end"
        )
    assert gate.rounds == [True, True, True, False]  # round four saw the cancel and ended
    assert job.delivered == 3
    live.wait_for_count(before, "/v1/completions", "499")
    assert live.counts().get(("/v1/completions", "200"), 0) == before.get(
        ("/v1/completions", "200"), 0
    )


def test_a_hang_up_is_noticed_while_tokens_keep_flowing(live: Live) -> None:
    """A decoding job always has events: a hang-up must not wait for a pause in them."""
    before = live.counts()
    with gated(live, pace_s=0.003) as gate:  # ~1.2 s for max_tokens rounds
        sock = live.connect()
        sock.sendall(long_request(stream=False))
        live.wait_for(lambda: len(gate.rounds) >= 5, "five rounds")
        (job,) = gate.jobs
        abort(sock)
        live.wait_for(
            lambda: job.finished and live.server.backend.worker.running == 0, "the job's end"
        )
    assert job.cancelled and job.delivered < MAX_TOKENS_LIMIT
    live.wait_for_count(before, "/v1/completions", "499")


# -- slow clients ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "partial",
    [b"POST /v1/compl", b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthoriz"],
    ids=["request-line", "headers"],
)
def test_half_sent_headers_get_a_408_and_the_connection_closes(live: Live, partial: bytes) -> None:
    before = live.counts()
    with live.connect() as sock:
        sock.sendall(partial)
        status, headers, body = parse_response(read_until_closed(sock))
    assert status == 408 and headers["connection"] == "close"
    error = openai_error(json.loads(body), "request_timeout")
    assert f"within {HEADERS_S:g} s" in error["message"]
    live.wait_for_count(before, "other", "408")


def test_trickled_headers_do_not_extend_the_deadline(live: Live) -> None:
    """One header byte every 0.1 s would keep an idle timer from ever firing."""
    sock = live.connect()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nX-Slow: ")
    stop = threading.Event()

    def trickle() -> None:
        with contextlib.suppress(OSError):
            while not stop.wait(0.1):
                sock.send(b"a")

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        status, _, _ = parse_response(read_until_closed(sock))
    finally:
        stop.set()
        thread.join()
        sock.close()
    assert status == 408


def test_a_half_sent_body_gets_a_408_and_the_connection_closes(live: Live) -> None:
    before = live.counts()
    with live.connect() as sock:
        sock.sendall(request_bytes("/v1/completions", b"x" * 100)[:-90])  # 10 of 100 bytes
        status, headers, body = parse_response(read_until_closed(sock))
    assert status == 408 and headers["connection"] == "close"
    error = openai_error(json.loads(body), "request_timeout")
    assert f"within {BODY_S:g} s" in error["message"]
    live.wait_for_count(before, "/v1/completions", "408")


def test_a_silent_connection_is_closed(live: Live) -> None:
    with live.connect() as sock:
        assert read_until_closed(sock) == b""


def test_an_unread_body_does_not_hold_the_connection(live: Live) -> None:
    """Refused before its body is read (401), the request's connection closes after the answer,
    though the body never ends."""
    headers = {"Content-Type": "application/json"}  # no key
    with live.connect() as sock:
        sock.sendall(request_bytes("/v1/completions", b"x" * 100, headers)[:-90])
        status, response_headers, body = parse_response(read_until_closed(sock))
    assert status == 401 and response_headers["connection"] == "close"
    openai_error(json.loads(body), "invalid_api_key")


# -- the API key -----------------------------------------------------------------------------


def test_the_schema_needs_the_key_and_the_docs_are_off(live: Live) -> None:
    for path, headers, status in [
        ("/openapi.json", {}, 401),
        ("/openapi.json", {"Authorization": "Bearer wrong"}, 401),
        ("/docs", AUTH, 404),
        ("/redoc", AUTH, 404),
    ]:
        connection = live.http()
        connection.request("GET", path, headers=headers)
        response = connection.getresponse()
        assert response.status == status, path
        openai_error(json.loads(response.read()))
        connection.close()
    connection = live.http()
    connection.request("GET", "/openapi.json", headers=AUTH)
    response = connection.getresponse()
    assert response.status == 200
    assert "/v1/chat/completions" in json.loads(response.read())["paths"]
    connection.close()


def test_a_server_bug_is_a_500_that_keeps_the_connection(
    live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the server's own failures are 5xx; even then the answer is OpenAI's schema and the
    keep-alive connection survives (no re-raise into Starlette's error middleware)."""

    def broken(*_: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(live.server, "_render_chat", broken)
    connection = live.http()
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    connection.request("POST", "/v1/chat/completions", body, AUTH)
    response = connection.getresponse()
    assert response.status == 500
    assert openai_error(json.loads(response.read()))["type"] == "server_error"
    live.server_bugs += 1
    (record,) = live.records.bad
    assert record.exc_info and "RuntimeError: a bug" in logging.Formatter().format(record)
    live.records.bad.clear()
    sock = connection.sock
    connection.request("POST", "/v1/completions", GOOD, AUTH)
    response = connection.getresponse()
    assert response.status == 200 and response.read()
    assert connection.sock is sock
    connection.close()


# -- bodies that are not what they claim -------------------------------------------------------


def post(
    live: Live, path: str, body: bytes | str, headers: dict[str, str] = AUTH
) -> tuple[int, dict]:
    """One request on a fresh connection: the status and the JSON answer."""
    connection = live.http()
    connection.request("POST", path, body, headers)
    response = connection.getresponse()
    answer = json.loads(response.read())
    connection.close()
    return response.status, answer


def plain_greedy_text(live: Live, prompt: str, max_tokens: int) -> str:
    """The target's own greedy decoding of ``prompt`` (``generate``, no server), as text."""
    tokenizer = live.server.tokenizer
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        out = live.target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=live.server.eos_token_ids,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)


def assert_still_greedy(live: Live) -> None:
    """A good request after a bad one gets the target's plain greedy answer."""
    body = json.dumps({"model": MODEL, "prompt": "def add", "max_tokens": 12, "temperature": 0})
    status, answer = post(live, "/v1/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == plain_greedy_text(live, "def add", 12)


GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
JSON_ONLY = {"Authorization": f"Bearer {API_KEY}"}


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "code", "fragment"),
    [
        # json.loads alone guesses UTF-16 and UTF-32 from the first bytes and took these.
        ("/v1/completions", GOOD.encode("utf-16"), AUTH, 400, "invalid_encoding", "not UTF-8"),
        ("/v1/completions", GOOD.encode("utf-32"), AUTH, 400, "invalid_encoding", "not UTF-8"),
        ("/v1/completions", GOOD.encode("utf-16-be"), AUTH, 400, None, "parse the JSON"),
        # A repeated key silently took its last value (parsers disagree on which one wins).
        ("/v1/completions", '{"model": "tiny", "prompt": "a", "prompt": [1]}', AUTH, 400,
         "duplicate_key", "'prompt' more than once"),
        ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "role": '
         '"system", "content": "x"}]}', AUTH, 400, "duplicate_key", "'role' more than once"),
        # A body declared as something else was parsed as JSON all the same.
        ("/v1/completions", GOOD, {**JSON_ONLY, "Content-Type": "text/plain"}, 415,
         "unsupported_media_type", "Content-Type: application/json"),
        ("/v1/chat/completions", json.dumps(GOOD_CHAT),
         {**JSON_ONLY, "Content-Type": "application/x-www-form-urlencoded"}, 415,
         "unsupported_media_type", "Content-Type: application/json"),
        ("/v1/completions", "model=tiny&prompt=x",
         {**JSON_ONLY, "Content-Type": "multipart/form-data; boundary=x"}, 415,
         "unsupported_media_type", "'multipart/form-data; boundary=x'"),
    ],
)  # fmt: skip
def test_bodies_that_are_not_utf8_json_objects_are_a_4xx_naming_the_fix(
    live: Live,
    path: str,
    body: bytes | str,
    headers: dict[str, str],
    status: int,
    code: str | None,
    fragment: str,
) -> None:
    got, answer = post(live, path, body, headers)
    error = openai_error(answer, code)
    assert got == status and fragment in error["message"], error
    assert_still_greedy(live)


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        (b"\xef\xbb\xbf" + GOOD.encode(), AUTH),  # a UTF-8 byte order mark may be ignored
        (GOOD, {**JSON_ONLY, "Content-Type": "application/json; charset=utf-8"}),
        (GOOD, {**JSON_ONLY, "Content-Type": "application/vnd.api+json"}),
        (GOOD, JSON_ONLY),  # no Content-Type at all: JSON
    ],
)
def test_utf8_json_bodies_are_served_whatever_their_json_label(
    live: Live, body: bytes | str, headers: dict[str, str]
) -> None:
    status, answer = post(live, "/v1/completions", body, headers)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == plain_greedy_text(live, "def add", 3)


def test_errors_echo_at_most_a_bounded_part_of_what_was_sent(live: Live) -> None:
    """A megabyte model name or field name is not sent back whole."""
    huge = "m" * 500_000
    for body, code in [
        ({"model": huge, "prompt": "x"}, "model_not_found"),
        ({"model": MODEL, "prompt": "x", huge: 1}, None),
        (f'{{"model": "tiny", "{huge}": 1, "{huge}": 2}}', "duplicate_key"),
    ]:
        status, answer = post(
            live, "/v1/completions", body if isinstance(body, str) else json.dumps(body)
        )
        error = openai_error(answer, code)
        assert status in (400, 404) and len(error["message"]) < 300, error["message"][:300]
    assert_still_greedy(live)


@pytest.mark.parametrize(
    ("method", "path", "status", "fragment"),
    [
        ("GET", "/v1/completions", 405, "GET /v1/completions; use POST"),
        ("POST", "/v1/models", 405, "POST /v1/models; use GET"),
        ("POST", "/v1/embeddings", 404, "POST /v1/completions, POST /v1/chat/completions"),
        ("GET", "/v2/models", 404, "no route GET /v2/models"),
    ],
)
def test_a_wrong_route_or_method_names_the_right_ones(
    live: Live, method: str, path: str, status: int, fragment: str
) -> None:
    connection = live.http()
    connection.request(method, path, GOOD if method == "POST" else None, AUTH)
    response = connection.getresponse()
    error = openai_error(json.loads(response.read()))
    assert response.status == status and fragment in error["message"], error
    connection.close()


# -- the decoder thread ------------------------------------------------------------------------


def test_prompts_are_tokenised_off_the_event_loop(
    live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt near the body limit takes a second to tokenise: not on the loop, where every
    stream and /health would wait for it."""
    threads: list[str] = []
    encode, render = live.server._encode, live.server._render_chat

    def recording(function: Callable) -> Callable:
        def call(argument: object) -> list[int]:
            threads.append(threading.current_thread().name)
            return function(argument)

        return call

    monkeypatch.setattr(live.server, "_encode", recording(encode))
    monkeypatch.setattr(live.server, "_render_chat", recording(render))
    post(live, "/v1/completions", GOOD)
    post(live, "/v1/chat/completions", json.dumps(GOOD_CHAT))
    assert len(threads) == 2
    assert all(name.startswith("draftsmith-prompts") for name in threads), threads


def test_a_decoder_bug_between_rounds_answers_500_and_decoding_goes_on(
    live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception outside a round used to end the decoder thread: every later request then
    waited for ever. Now the requests it held get a 500 and the thread keeps serving."""

    def broken(*_: object) -> None:
        raise RuntimeError("a scheduler bug")

    monkeypatch.setattr(live.server.backend.worker, "_lane_for", broken)
    status, answer = post(live, "/v1/completions", GOOD)
    assert status == 500 and openai_error(answer)["type"] == "server_error"
    assert "a scheduler bug" in answer["error"]["message"]
    live.server_bugs += 1
    (record,) = live.records.bad
    assert record.exc_info and "RuntimeError: a scheduler bug" in logging.Formatter().format(record)
    live.records.bad.clear()
    monkeypatch.undo()
    assert live.server.backend.worker.alive
    assert_still_greedy(live)


def test_requests_beyond_those_being_received_are_a_429(
    live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bodies held at once are bounded (``ServingLimits.max_receiving``): while two requests
    are being tokenised, a third is a 429, and both then complete."""
    monkeypatch.setattr(live.server, "limits", replace(live.server.limits, max_receiving=2))
    release, entered = threading.Event(), threading.Semaphore(0)
    encode = live.server._encode

    def held(prompt: str) -> list[int]:
        entered.release()
        release.wait(60)
        return encode(prompt)

    monkeypatch.setattr(live.server, "_encode", held)
    answers: list[int] = []
    senders = [
        threading.Thread(target=lambda: answers.append(post(live, "/v1/completions", GOOD)[0]))
        for _ in range(2)
    ]
    for sender in senders:
        sender.start()
    assert entered.acquire(timeout=60)  # the first is tokenising, the second waits its turn
    live.wait_for(lambda: live.server._receiving_now == 2, "two requests being received")
    status, answer = post(live, "/v1/completions", GOOD)
    assert status == 429, answer
    assert openai_error(answer, "too_many_requests")["type"] == "rate_limit_error"
    release.set()
    for sender in senders:
        sender.join(60)
    assert answers == [200, 200]
    assert live.server._receiving_now == 0
