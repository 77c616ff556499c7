"""Load-test a draftsmith server: N concurrent streaming clients for a bounded time.

    python decode/serve.py --target PATH --drafter-kind ngram &          # the server
    python scripts/load_test.py --clients 16 --duration 60               # this script

Each client sends streaming requests back to back (``stream: true`` with
``stream_options.include_usage``) until ``--duration`` seconds have passed; requests still
running then get ``--grace`` seconds to finish and are cut off after that, so the run always
ends by itself. Printed: requests/s and completion tokens/s over the run, p50/p99 latency
(request sent -> ``[DONE]``), p50/p99 time to first token (request sent -> first non-empty
text), the mean per-request tau when the server reports ``usage.speculative`` (draftsmith's
acceptance: tokens per target pass), and errors (any non-200 answer, an ``error`` event, a
stream without ``[DONE]``; expected: 0). Exit status 1 when there were errors or no request
completed. Only loopback servers unless ``--allow-remote``.

``--sweep`` runs 1, 4, 8 and 16 clients at T = 0 and T = 1 against one or more servers,
running or started here (vLLM's OpenAI server too, given ``--vllm-python``), and writes the
runs with the machine record as JSON and a plot of tokens/s and TTFT against clients
(scripts/load_sweep.py; ``draftsmith-report`` renders the serving guide's table from it).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

if TYPE_CHECKING:
    import httpx

PROMPTS = (
    "import os\n\n\ndef",
    "class Config:\n    def __init__(self",
    "def read_lines(path):\n    with open(path) as f:\n",
    "import sys\nimport json\n\n\ndef main(argv",
    "    for key, value in sorted(items.items()):\n",
    "def _check(name, value):\n    if not isinstance(value, ",
    "try:\n    import ssl\nexcept ImportError:\n",
    "    def __repr__(self):\n        return ",
)


@dataclass
class Result:
    ok: bool
    latency_s: float = 0.0
    ttft_s: float | None = None
    completion_tokens: int = 0
    error: str | None = None
    tau: float | None = None  # usage.speculative.tau, when the server reports it


@dataclass
class Summary:
    url: str
    model: str
    endpoint: str
    clients: int
    duration_s: float
    elapsed_s: float
    completed: int
    errors: int
    cut_off: int
    requests_per_s: float
    tokens_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    mean_completion_tokens: float
    mean_tau: float | None = None
    error_examples: list[str] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from draftsmith.decode.command_line import (
        check_output_file,
        check_positive_finite,
        http_url_problem,
    )
    from draftsmith.decode.measure.side_by_side import at_least_one, temperature_value
    from draftsmith.scripts.load_sweep import add_sweep_flags, check_sweep_flags

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: draftsmith-load-test --url http://127.0.0.1:8000 --clients 16",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server root URL")
    parser.add_argument("--model", default=None, help="model name (default: GET /v1/models)")
    parser.add_argument("--clients", type=at_least_one, default=16, help="concurrent clients")
    parser.add_argument(
        "--duration", "--seconds", type=float, default=60.0, help="seconds to send requests"
    )
    parser.add_argument("--grace", type=float, default=30.0, help="seconds to let the last finish")
    parser.add_argument(
        "--max-tokens", type=at_least_one, default=64, help="max_tokens per request"
    )
    parser.add_argument("--temperature", type=temperature_value, default=0.0)
    parser.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    parser.add_argument(
        "--api-key", default=os.environ.get("DRAFTSMITH_API_KEY"), help="bearer key, if any"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    parser.add_argument(
        "--allow-remote", action="store_true", help="allow a server that is not on loopback"
    )
    add_sweep_flags(parser)
    args = parser.parse_args(argv)
    check_sweep_flags(parser, args, max_clients())
    # A run that never ends (inf) or never starts (NaN) is refused, not timed.
    try:
        check_positive_finite(args.duration, "--duration", "seconds")
    except ValueError as error:
        parser.error(str(error))
    if not (math.isfinite(args.grace) and args.grace >= 0):
        parser.error(f"--grace must be a finite number of seconds >= 0, got {args.grace}")
    most = max_clients()
    if args.clients > most:
        parser.error(
            f"--clients {args.clients}: each client holds a connection, and this process may "
            f"open {most + FILES_KEPT} files (ulimit -n); pass at most {most}, or raise the limit"
        )
    if args.model is not None and not args.model.strip():
        parser.error("--model is empty; pass the served model's name, or drop it")
    problem = http_url_problem(args.url, "--url", "http://127.0.0.1:8000")
    if problem:
        parser.error(problem)
    for url in [args.url, *(entry.partition("=")[2].strip() for entry in args.server)]:
        problem = http_url_problem(url, "--server" if url != args.url else "--url", url)
        if problem:
            parser.error(problem)
        host = urlparse(url).hostname or ""
        if not args.allow_remote and not _is_loopback(host):
            parser.error(f"{url} is not a loopback address; pass --allow-remote to load it")
    if args.json is not None:
        try:
            check_output_file(args.json, "--json")
        except ValueError as error:
            parser.error(str(error))
    return args


FILES_KEPT = 64
"""Open files left to the process itself (its modules, standard streams, the event loop)."""


def max_clients() -> int:
    """The most clients this process can connect at once: its open-file limit, less
    :data:`FILES_KEPT` (each client holds one socket)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1_000_000
    return max(soft - FILES_KEPT, 1)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def request_body(args: argparse.Namespace, model: str, index: int) -> dict[str, object]:
    prompt = PROMPTS[index % len(PROMPTS)]
    body: dict[str, object] = {
        "model": model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def one_request(client: httpx.AsyncClient, path: str, body: dict[str, object]) -> Result:
    """Send one streaming request and time it."""
    start = time.perf_counter()
    ttft = None
    tokens = 0
    tau = None
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            return Result(False, error=f"HTTP {response.status_code}: {text[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                latency = time.perf_counter() - start
                return Result(True, latency, ttft if ttft is not None else latency, tokens, tau=tau)
            chunk = json.loads(data)
            if "error" in chunk:
                return Result(False, error=f"error event: {chunk['error'].get('message')}")
            for choice in chunk.get("choices") or []:
                delta = choice.get("text") or (choice.get("delta") or {}).get("content")
                if delta and ttft is None:
                    ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
                speculative = chunk["usage"].get("speculative") or {}
                if speculative.get("rounds"):
                    tau = float(speculative["tau"])
    return Result(False, error="the stream ended without [DONE]")


async def client_loop(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    model: str,
    client_id: int,
    deadline: float,
    results: list[Result],
) -> None:
    path = "/v1/chat/completions" if args.chat else "/v1/completions"
    sent = 0
    while time.monotonic() < deadline:
        body = request_body(args, model, client_id + sent * args.clients)
        sent += 1
        try:
            result = await one_request(client, path, body)
        except Exception as error:  # connection refused, reset, bad JSON: all count as errors
            result = Result(False, error=f"{type(error).__name__}: {error}")
        results.append(result)
        if not result.ok:
            await asyncio.sleep(0.1)  # do not spin on a failing server


async def run(args: argparse.Namespace) -> Summary:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 1)
    timeout = httpx.Timeout(args.duration + args.grace + 10.0)
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, limits=limits, timeout=timeout
    ) as client:
        model = args.model or await first_model(client)
        results: list[Result] = []
        start = time.monotonic()
        deadline = start + args.duration
        tasks = [
            asyncio.create_task(client_loop(client, args, model, i, deadline, results))
            for i in range(args.clients)
        ]
        _, pending = await asyncio.wait(tasks, timeout=args.duration + args.grace)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        elapsed = time.monotonic() - start
    return summarize(args, model, results, len(pending), elapsed)


async def first_model(client: httpx.AsyncClient) -> str:
    """The first model the server lists; ``ValueError`` naming the fix when it answers none."""
    import httpx

    url = client.base_url.join("/v1/models")
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as error:
        raise ValueError(
            f"GET {url} failed ({type(error).__name__}: {error}); start the server "
            "(python decode/serve.py ...) or pass its address with --url"
        ) from None
    if response.status_code != 200:
        raise ValueError(
            f"GET {url} answered {response.status_code}: {response.text[:200]}; check --url "
            "and --api-key, or name the model with --model"
        )
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(
            f"GET {url} listed no model ({response.text[:200]!r}); name it with --model"
        ) from None


def summarize(
    args: argparse.Namespace, model: str, results: list[Result], cut_off: int, elapsed: float
) -> Summary:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    latencies = [r.latency_s for r in done]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tokens = sum(r.completion_tokens for r in done)
    taus = [r.tau for r in done if r.tau is not None]
    return Summary(
        url=args.url,
        model=model,
        endpoint="chat" if args.chat else "completions",
        clients=args.clients,
        duration_s=args.duration,
        elapsed_s=elapsed,
        completed=len(done),
        errors=len(failed),
        cut_off=cut_off,
        requests_per_s=len(done) / elapsed,
        tokens_per_s=tokens / elapsed,
        latency_p50_s=percentile(latencies, 0.5),
        latency_p99_s=percentile(latencies, 0.99),
        ttft_p50_s=percentile(ttfts, 0.5),
        ttft_p99_s=percentile(ttfts, 0.99),
        mean_completion_tokens=tokens / len(done) if done else 0.0,
        mean_tau=sum(taus) / len(taus) if taus else None,
        error_examples=sorted({r.error or "" for r in failed})[:5],
    )


def report(summary: Summary, args: argparse.Namespace) -> str:
    lines = [
        f"load test: {summary.clients} streaming clients x {summary.duration_s:g} s against "
        f"{summary.url} (model {summary.model}, {summary.endpoint}, max_tokens "
        f"{args.max_tokens}, temperature {args.temperature:g})",
        f"elapsed:          {summary.elapsed_s:.1f} s",
        f"requests:         {summary.completed} completed, {summary.errors} errors, "
        f"{summary.cut_off} cut off at the time limit",
        f"requests/s:       {summary.requests_per_s:.2f}",
        f"tokens/s:         {summary.tokens_per_s:.1f} (completion tokens, "
        f"{summary.mean_completion_tokens:.1f} per request)",
        f"latency p50/p99:  {summary.latency_p50_s:.3f} / {summary.latency_p99_s:.3f} s",
        f"ttft p50/p99:     {summary.ttft_p50_s:.3f} / {summary.ttft_p99_s:.3f} s",
        "tau per request:  "
        + ("not reported" if summary.mean_tau is None else f"{summary.mean_tau:.2f} (mean)"),
        f"errors:           {summary.errors}",
    ]
    lines += [f"  {example}" for example in summary.error_examples]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from draftsmith.data.atomic_io import write_json_atomic

    args = parse_args(argv)
    if args.sweep:
        from draftsmith.scripts.load_sweep import main_sweep

        return main_sweep(args, run)
    summary = asyncio.run(run(args))
    print(report(summary, args), flush=True)
    if args.json is not None:
        write_json_atomic(args.json, asdict(summary))
    if not summary.completed and not summary.errors:  # nothing measured: not a passing run
        print(
            f"no request completed in {summary.duration_s:g} s (+ {args.grace:g} s grace): "
            "raise --duration or --grace, or lower --clients",
            file=sys.stderr,
        )
    return 1 if summary.errors or not summary.completed else 0


if __name__ == "__main__":
    from draftsmith.decode.command_line import run_command

    sys.exit(run_command(main))
