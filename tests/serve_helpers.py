"""Helpers shared by the server's socket tests: free ports, Prometheus text, OpenAI errors."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

Metrics = dict[tuple[str, frozenset[tuple[str, str]]], float]

SAMPLE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"'
    r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*")*)\})? (?P<value>[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|NaN|Inf))$'
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def metric(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


def parse_prometheus(text: str) -> Metrics:
    """Prometheus text format 0.0.4, strictly: HELP and TYPE before every metric's samples."""
    assert text.endswith("\n")
    samples: Metrics = {}
    typed: dict[str, str] = {}
    helped: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helped.add(line.split()[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert kind in {"counter", "gauge", "histogram"}, line
            typed[name] = kind
        else:
            match = SAMPLE.match(line)
            assert match, f"not a Prometheus sample line: {line!r}"
            name = match["name"]
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            if typed.get(family) == "histogram":  # a histogram's samples carry suffixes
                assert name != family, f"{name}: a histogram sample needs _bucket/_sum/_count"
                name = family
            assert name in typed and name in helped, f"{name} has no # TYPE / # HELP"
            labels = frozenset(
                re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', match["labels"] or "")
            )
            samples[(match["name"], labels)] = float(match["value"])
    return samples


def openai_error(body: object, code: str | None = None) -> dict:
    """``body`` is exactly OpenAI's error schema; returns its ``error`` object."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if code is not None:
        assert error["code"] == code
    return error


def wait_for_health(process: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    """Poll ``url``/health until it answers 200; fail with the log's tail if the server exits
    or ``timeout_s`` passes (a busy machine imports torch slowly)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}:\n{tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not come up:\n{tail(log)}")
        time.sleep(0.2)


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def saved_dtype(folder: Path) -> str:
    """The dtype a model folder was saved in (its config.json), as a --dtype value."""
    config = json.loads((Path(folder) / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


@contextlib.contextmanager
def serving(target: Path, log: Path, *flags: str) -> Iterator[str]:
    """decode/serve.py serving ``target`` (no drafter unless ``flags`` name one) on a free
    loopback port; yields the API base (``http://127.0.0.1:PORT/v1``) once /health answers."""
    port = free_port()
    command = [
        sys.executable, "decode/serve.py", "--target", str(target), "--port", str(port),
        "--num-threads", "1", "--log-level", "warning", *flags,
    ]  # fmt: skip
    if "--drafter-kind" not in flags and "--drafter" not in flags:
        command += ["--drafter-kind", "none"]
    if "--dtype" not in flags:  # the references run in the saved dtype: compare like with like
        command += ["--dtype", saved_dtype(target)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, cwd=Path(__file__).resolve().parents[1], env=env, stdout=sink, stderr=sink
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(process, url, log, timeout_s=600)  # minutes when 2 cores are shared
        yield f"{url}/v1"
    finally:
        stop_server(process)
