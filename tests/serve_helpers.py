"""Helpers shared by the server's socket tests: free ports, Prometheus text, OpenAI errors."""

from __future__ import annotations

import re
import socket
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
