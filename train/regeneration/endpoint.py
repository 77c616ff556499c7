"""Regenerate training data through any OpenAI-compatible server (vLLM, SGLang, decode/serve.py).

The same job as ``draftsmith.train.regeneration.in_process`` (the target answers each prompt; docs/theory.md §6), with
the target served elsewhere, typically on GPUs by an engine built for throughput. Chat prompts
go to ``POST /v1/chat/completions`` (the server applies the target's chat template); plain text
prompts go to ``POST /v1/completions`` and are continued as they are. A reasoning target's
think span, split off by the server's reasoning parser, is put back in front of the answer
(:func:`assistant_text`): the record holds what the target emitted.

Output: one JSON object per input prompt, the same records ``draftsmith.train.regeneration.in_process`` writes plus
``index`` (the prompt's position in the input) and ``finish_reason``::

    {"index": 7, "prompt": p, "response": r, "text": p + r, "finish_reason": "length"}
    {"index": 8, "messages": [...prompt, {"role": "assistant", "content": r}], ...}

Records are appended in the order answers arrive, each as one ``write`` of a full line followed
by a flush, so a run killed at any moment leaves complete lines and at most one torn last line.
A rerun with the same prompts reads what is there, cuts a torn last line, checks that each
record's prompt is the input's at its index (another prompts file is an error, not a merge),
and sends only the missing indices: nothing is lost and nothing is written twice.

Requests run ``concurrency`` at a time on a thread pool sharing one ``httpx.Client``
(a connection pool). A request that meets a connection error, a timeout, 408, 429 or a 5xx is
retried up to ``max_retries`` times after ``min(backoff_max_s, backoff_s * 2**attempt)``
seconds (times a random factor in [0.5, 1], or the server's ``Retry-After``); other 4xx
answers (a bad request, a wrong key or model) fail at once. Failed prompts are counted and
named, not written, so a rerun retries them.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftsmith.decode.command_line import check_positive_finite, http_url_problem
from draftsmith.train.regeneration.in_process import Prompt, make_record

if TYPE_CHECKING:
    import httpx

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class EndpointConfig:
    """Where to send requests and how hard to try."""

    url: str  # the API base, ending in /v1 (http://127.0.0.1:8000/v1)
    model: str | None = None  # None: the first id of GET /models
    api_key: str | None = None
    concurrency: int = 8
    max_retries: int = 6
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        problem = http_url_problem(self.url, "--endpoint", "http://127.0.0.1:8000/v1")
        if problem is not None:
            raise ValueError(problem)
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.max_retries < 0:
            raise ValueError(f"--max-retries must be >= 0, got {self.max_retries}")
        check_positive_finite(self.timeout_s, "--timeout", "seconds")
        backoff = (self.backoff_s, self.backoff_max_s)
        if not all(math.isfinite(value) and value >= 0 for value in backoff):
            raise ValueError(f"backoff_s and backoff_max_s must be finite and >= 0, got {backoff}")


@dataclass(frozen=True)
class GenerationSettings:
    """What each request asks for; ``seed + index`` seeds prompt ``index`` when seed is set."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled (vLLM's and decode/serve.py's extension; omitted when 0)
    seed: int | None = None
    thinking_off: frozenset[int] = frozenset()  # chat prompts answered with thinking off


@dataclass
class Outcome:
    """One finished prompt: a record to write, or the error that ended its retries."""

    index: int
    record: dict[str, Any] | None = None
    completion_tokens: int = 0
    error: str | None = None
    attempts: int = 1


@dataclass
class RunReport:
    """What ``regenerate_through_endpoint`` did."""

    output: str
    model: str
    total: int  # prompts in the input
    already_done: int  # records found in the output before this run
    written: int  # records this run appended
    failed: int
    retries: int
    completion_tokens: int
    seconds: float
    failures: list[str] = field(default_factory=list)  # the first few, "index: error"

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / max(self.seconds, 1e-9)

    @property
    def missing(self) -> int:
        """Prompts without a record after this run (failed ones, or not reached by a limit)."""
        return self.total - self.already_done - self.written


class PermanentError(Exception):
    """An answer that retrying cannot change (4xx other than 408/429, a malformed body)."""


def regenerate_through_endpoint(
    prompts: Sequence[Prompt],
    output: Path,
    settings: GenerationSettings,
    endpoint: EndpointConfig,
    limit: int | None = None,
    progress: bool = True,
    client: httpx.Client | None = None,
) -> RunReport:
    """Answer every prompt without a record in ``output`` through ``endpoint``; append records.

    ``limit`` caps the records sent this run (a batch of a long job; tests interrupt with it).
    """
    import httpx
    from tqdm.auto import tqdm

    if not prompts:
        raise ValueError("no prompts to answer; pass a prompts file with at least one record")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = completed_indices(output, prompts)
    todo = [i for i in range(len(prompts)) if i not in done]
    if limit is not None:
        todo = todo[: max(limit, 0)]
    own_client = client is None
    if client is None:
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(endpoint.timeout_s, connect=30.0),
            limits=httpx.Limits(
                max_connections=endpoint.concurrency, max_keepalive_connections=endpoint.concurrency
            ),
        )
    start = time.perf_counter()
    written = failed = retries = tokens = 0
    failures: list[str] = []
    try:
        model = endpoint.model or first_model(client, endpoint)
        ask = _Requester(client, endpoint, model, settings)
        bar = tqdm(total=len(prompts), initial=len(done), disable=not progress, desc="regenerate")
        with output.open("a", encoding="utf-8") as stream:
            for outcome in _run_pool(ask, prompts, todo, endpoint.concurrency):
                retries += outcome.attempts - 1
                if outcome.record is None:
                    failed += 1
                    if len(failures) < 5:
                        failures.append(f"prompt {outcome.index}: {outcome.error}")
                    continue
                stream.write(json.dumps(outcome.record, ensure_ascii=False) + "\n")
                stream.flush()
                written += 1
                tokens += outcome.completion_tokens
                bar.update(1)
                bar.set_postfix(failed=failed, refresh=False)
        bar.close()
    finally:
        if own_client:
            client.close()
    return RunReport(
        output=str(output),
        model=model,
        total=len(prompts),
        already_done=len(done),
        written=written,
        failed=failed,
        retries=retries,
        completion_tokens=tokens,
        seconds=time.perf_counter() - start,
        failures=failures,
    )


def completed_indices(output: Path, prompts: Sequence[Prompt]) -> set[int]:
    """Indices already answered in ``output``; a torn last line is cut off the file, once
    every complete line is known to be a record of these prompts (another file is never cut).

    Raises ``ValueError`` when a record does not belong to these prompts (index out of range,
    another prompt at that index) or appears twice, or when the file is no file this script
    wrote.
    """
    if not output.exists():
        return set()
    raw = output.read_bytes()
    complete = raw.rfind(b"\n") + 1  # everything after the last newline is a torn write
    torn = raw[complete:]
    if torn and not torn.startswith(RECORD_START[: len(torn)]):
        raise ValueError(
            f"{output} ends with a line that is no regenerated record ({torn[:60]!r}); resume "
            "only into a file this script wrote, or pass another --output"
        )
    try:
        text = raw[:complete].decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{output} is not UTF-8 text ({error}), so not a file this script wrote; pass "
            "another --output"
        ) from None
    done = _check_records(output, text, prompts)
    if torn:
        with output.open("r+b") as stream:
            stream.truncate(complete)
    return done


RECORD_START = b'{"index": '
"""How every record this module writes begins (``index`` is its first key)."""


def _check_records(output: Path, text: str, prompts: Sequence[Prompt]) -> set[int]:
    """The indices of the records in ``text`` (the complete lines of ``output``), checked."""
    done: set[int] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        where = f"{output}:{number}"
        try:
            record = json.loads(line)
            index = record["index"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(
                f"{where}: not a regenerated record ({error}); resume only into a file this "
                "script wrote, or pass another --output"
            ) from error
        if not isinstance(index, int) or not 0 <= index < len(prompts):
            raise ValueError(
                f"{where}: index {index!r} is outside the {len(prompts)} prompts; the output "
                "belongs to another prompts file: pass another --output"
            )
        if _prompt_of(record) != prompts[index]:
            raise ValueError(
                f"{where}: the record's prompt differs from prompt {index} of the input; the "
                "output belongs to another prompts file (or other --num-prompts/--prompt-tokens)"
                ": pass another --output"
            )
        if index in done:
            raise ValueError(f"{where}: prompt {index} is answered twice; remove one of the lines")
        done.add(index)
    return done


def first_model(client: httpx.Client, endpoint: EndpointConfig) -> str:
    """The first model the server lists (``GET /models``)."""
    url = f"{endpoint.url.rstrip('/')}/models"
    try:
        response = _send(client, "GET", url, None, endpoint)[0]
    except _Failed as failure:
        raise ValueError(
            f"GET {url} failed ({failure.error}); check --endpoint (the API base, ending in "
            "/v1) and --api-key, or name the model with --model"
        ) from failure
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise ValueError(
            f"GET {endpoint.url}/models answered no model ({response.text[:200]!r}); pass --model"
        ) from error


class _Requester:
    """Turns prompt ``index`` into an ``Outcome`` (thread-safe: httpx.Client is)."""

    def __init__(
        self,
        client: httpx.Client,
        endpoint: EndpointConfig,
        model: str,
        settings: GenerationSettings,
    ) -> None:
        self.client = client
        self.endpoint = endpoint
        self.model = model
        self.settings = settings
        self.base = endpoint.url.rstrip("/")

    def __call__(self, index: int, prompt: Prompt) -> Outcome:
        chat = not isinstance(prompt, str)
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.settings.max_tokens,
            "temperature": float(self.settings.temperature),
            "top_p": float(self.settings.top_p),
        }
        if self.settings.top_k:
            body["top_k"] = self.settings.top_k
        if self.settings.seed is not None:
            body["seed"] = self.settings.seed + index
        thinking = not (chat and index in self.settings.thinking_off)
        if not thinking:  # vLLM and SGLang hand these to the chat template
            body["chat_template_kwargs"] = {"enable_thinking": False}
        if chat:
            body["messages"] = prompt
            path = f"{self.base}/chat/completions"
        else:
            body["prompt"] = prompt
            path = f"{self.base}/completions"
        try:
            response, attempts = _send(self.client, "POST", path, body, self.endpoint)
            choice, usage = _first_choice(response)
            text = assistant_text(choice["message"]) if chat else choice["text"]
            if not isinstance(text, str):
                raise PermanentError(f"the answer holds no text: {json.dumps(choice)[:200]}")
        except _Failed as failure:
            return Outcome(index, error=str(failure.error), attempts=failure.attempts)
        except (PermanentError, KeyError, TypeError) as error:
            return Outcome(index, error=f"{type(error).__name__}: {error}")
        record = {"index": index, **make_record(prompt, text, thinking)}
        record["finish_reason"] = choice.get("finish_reason")
        return Outcome(index, record, int(usage.get("completion_tokens", 0)), attempts=attempts)


def assistant_text(message: dict[str, Any]) -> str | None:
    """A chat answer's text as the target emitted it, think span included.

    A server started with a reasoning parser (vLLM and SGLang ``--reasoning-parser qwen3`` or
    ``deepseek_r1``) moves the ``<think>`` span out of ``content`` into ``reasoning_content``
    (``reasoning`` in newer vLLM); the drafter must learn those tokens too, so they are put
    back in the form the target writes them: ``<think>\n{reasoning}\n</think>\n\n{answer}``.
    None when the answer holds no text at all.
    """
    content = message.get("content")
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if not isinstance(reasoning, str) or not reasoning:
        return content
    answer = content if isinstance(content, str) else ""
    if "</think>" in answer:  # the server left the span in place as well
        return answer
    return f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{answer.lstrip(chr(10))}"


class _Failed(Exception):
    def __init__(self, error: Exception, attempts: int) -> None:
        super().__init__(str(error))
        self.error = error
        self.attempts = attempts


def _send(
    client: httpx.Client,
    method: str,
    url: str,
    body: dict[str, Any] | None,
    endpoint: EndpointConfig,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[httpx.Response, int]:
    """One request with retries; returns the 200 answer and the attempts it took."""
    import httpx

    jitter = random.Random()
    for attempt in range(endpoint.max_retries + 1):
        retry_after = None
        try:
            response = client.request(method, url, json=body)
        except httpx.TransportError as error:  # refused, reset, timed out
            last: Exception = error
        else:
            if response.status_code == 200:
                return response, attempt + 1
            last = PermanentError(f"HTTP {response.status_code}: {response.text[:300]}")
            if response.status_code not in RETRY_STATUSES:
                raise _Failed(last, attempt + 1)
            retry_after = _retry_after(response)
        if attempt == endpoint.max_retries:
            break
        delay = min(endpoint.backoff_max_s, endpoint.backoff_s * 2**attempt)
        sleep(retry_after if retry_after is not None else delay * jitter.uniform(0.5, 1.0))
    raise _Failed(last, endpoint.max_retries + 1)


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return min(max(float(value), 0.0), 300.0) if value is not None else None
    except ValueError:
        return None


def _first_choice(response: httpx.Response) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        data = response.json()
        return data["choices"][0], data.get("usage") or {}
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise PermanentError(f"not an OpenAI answer: {response.text[:200]!r}") from error


def _run_pool(
    ask: Callable[[int, Prompt], Outcome],
    prompts: Sequence[Prompt],
    todo: Iterable[int],
    concurrency: int,
) -> Iterable[Outcome]:
    """Outcomes in completion order, with at most ``2 * concurrency`` requests queued."""
    indices = iter(todo)
    pending: set[Future[Outcome]] = set()
    lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="regenerate") as pool:

        def refill() -> None:
            with lock:
                while len(pending) < 2 * concurrency:
                    index = next(indices, None)
                    if index is None:
                        return
                    pending.add(pool.submit(ask, index, prompts[index]))

        refill()
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                pending.discard(future)
                yield future.result()
            refill()


def _prompt_of(record: dict[str, Any]) -> Prompt | None:
    if "prompt" in record:
        return record["prompt"]
    messages = record.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        return messages[:-1] if messages[-1].get("role") == "assistant" else None
    return None
