"""Server totals and their Prometheus text exposition (format 0.0.4).

Decoding totals merge the ``DecodeStats`` of every generate call, so ``draftsmith_tau`` and
``draftsmith_acceptance_rate`` follow the engine's one definition (decode/stats.py): tau is
``1 + accepted / row-rounds`` and alpha_j is accepted over reached at draft position j.
"""

from __future__ import annotations

import threading
from collections import Counter

from decode.stats import DecodeStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """Thread-safe counters updated by the HTTP layer and the decoder thread."""

    def __init__(self, model: str, drafter_kind: str, num_draft_tokens: int) -> None:
        self.model = model
        self.drafter_kind = drafter_kind
        self.num_draft_tokens = num_draft_tokens
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, str]] = Counter()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._cancelled = 0
        self._batches = 0
        self._batch_rows = 0
        self._decode = DecodeStats()

    def record_response(self, endpoint: str, status: int) -> None:
        with self._lock:
            self._requests[(endpoint, str(status))] += 1

    def record_answer(self, prompt_tokens: int, completion_tokens: int) -> None:
        with self._lock:
            self._prompt_tokens += prompt_tokens
            self._generation_tokens += completion_tokens

    def record_cancelled(self) -> None:
        with self._lock:
            self._cancelled += 1

    def record_batch(self, stats: DecodeStats, rows: int) -> None:
        with self._lock:
            self._decode = self._decode.merge(stats)
            self._batches += 1
            self._batch_rows += rows

    def render(self, queue_depth: int, running: int) -> str:
        """Every metric with ``# HELP`` and ``# TYPE``, one sample per line."""
        with self._lock:
            decode = self._decode
            requests = dict(self._requests)
            scalars = {
                "prompt_tokens": self._prompt_tokens,
                "generation_tokens": self._generation_tokens,
                "cancelled": self._cancelled,
                "batches": self._batches,
                "batch_rows": self._batch_rows,
            }
        out = _Exposition()
        out.add(
            "draftsmith_info",
            "gauge",
            "The served model and drafter (value 1).",
            [({"model": self.model, "drafter_kind": self.drafter_kind}, 1)],
        )
        out.add(
            "draftsmith_requests_total",
            "counter",
            "HTTP requests by endpoint and how they ended: the status sent, or 499 when the "
            "client hung up before its answer was complete (a cut stream included).",
            [({"endpoint": e, "code": c}, n) for (e, c), n in sorted(requests.items())],
        )
        for name, key, help_text in (
            ("prompt_tokens_total", "prompt_tokens", "Prompt tokens of answered requests."),
            ("generation_tokens_total", "generation_tokens", "Tokens in answers sent."),
            (
                "requests_cancelled_total",
                "cancelled",
                "Generation requests whose client left early (their decoder row was dropped).",
            ),
            ("batches_total", "batches", "Generate calls (one prefill pass each)."),
            ("batch_rows_total", "batch_rows", "Requests decoded, summed over batches."),
        ):
            out.add(f"draftsmith_{name}", "counter", help_text, [({}, scalars[key])])
        out.add(
            "draftsmith_target_forward_passes_total",
            "counter",
            "Target verification passes (prefill passes not included).",
            [({}, decode.target_forward_passes)],
        )
        out.add(
            "draftsmith_decode_rounds_total",
            "counter",
            "Row-rounds: one per active row per verification pass.",
            [({}, decode.rounds)],
        )
        out.add(
            "draftsmith_decoded_tokens_total",
            "counter",
            "Tokens the decoder emitted (also those a finished client no longer needed).",
            [({}, decode.tokens_emitted)],
        )
        positions = range(len(decode.reached_per_position))
        out.add(
            "draftsmith_draft_tokens_verified_total",
            "counter",
            "Draft tokens verified, by draft position (1-based).",
            [({"position": str(j + 1)}, decode.reached_per_position[j]) for j in positions],
        )
        out.add(
            "draftsmith_draft_tokens_accepted_total",
            "counter",
            "Draft tokens accepted, by draft position (1-based).",
            [({"position": str(j + 1)}, decode.accepted_per_position[j]) for j in positions],
        )
        out.add(
            "draftsmith_tau",
            "gauge",
            "Mean tokens emitted per verification pass per row (1 + accepted per row-round).",
            [({}, decode.tau)],
        )
        alphas = decode.alpha_per_position
        out.add(
            "draftsmith_acceptance_rate",
            "gauge",
            "alpha_j: accepted / verified at draft position j.",
            [({"position": str(j + 1)}, alphas[j]) for j in positions],
        )
        out.add(
            "draftsmith_num_draft_tokens",
            "gauge",
            "Tokens drafted per round (server setting).",
            [({}, self.num_draft_tokens)],
        )
        out.add("draftsmith_queue_depth", "gauge", "Requests waiting.", [({}, queue_depth)])
        out.add("draftsmith_running_requests", "gauge", "Requests being decoded.", [({}, running)])
        return out.text()


class _Exposition:
    def __init__(self) -> None:
        self._lines: list[str] = []

    def add(
        self,
        name: str,
        kind: str,
        help_text: str,
        samples: list[tuple[dict[str, str], float]],
    ) -> None:
        self._lines.append(f"# HELP {name} {help_text}")
        self._lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self._lines.append(f"{name}{_labels(labels)} {_number(value)}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))
