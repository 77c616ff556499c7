"""Server totals and their Prometheus text exposition (format 0.0.4).

Decoding totals merge the ``DecodeStats`` of every round, so ``draftsmith_tau`` and
``draftsmith_acceptance_rate`` follow the engine's one definition (decode/stats.py): tau is
``1 + accepted / row-rounds`` and alpha_j is accepted over reached at draft position j. Each
finished request adds its own tau to the ``draftsmith_request_tau`` histogram and its drafted
and accepted tokens to per-request counters (the numbers its ``usage.speculative`` reports).

Every round also counts under its batch bucket (1, 2, 3-4, 5-8, ...) and the drafts per row it
verified, ``draftsmith_rounds_total{batch, drafted}``: the lengths the load-aware policy chose
at each load; and its time by phase, ``draftsmith_round_seconds_total{batch, phase}`` (draft,
verify, commit, handoff, other; ``scheduler.ROUND_PHASES``), where a round's time goes.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import TYPE_CHECKING

from draftsmith.decode.stats import DecodeStats

if TYPE_CHECKING:
    from draftsmith.decode.serving.scheduler import RoundProfile

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Upper bounds of the per-request tau histogram's buckets (tau >= 1; +Inf is added).
TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


def batch_bucket(rows: int) -> int:
    """The batch sizes that share one series: ``rows`` rounded up to a power of two (1, 2, 4,
    8, 16, ...). The load-aware policy's cost tables are per batch size, not per bucket
    (``draftsmith.decode.draft_length.LoadAwareDraftLength``)."""
    return 1 << max(rows - 1, 0).bit_length()


def bucket_label(bucket: int) -> str:
    """``"1"``, ``"2"``, ``"3-4"``, ``"5-8"``, ...: the batch sizes a bucket holds."""
    low = bucket // 2 + 1
    return str(bucket) if low >= bucket else f"{low}-{bucket}"


class ServerMetrics:
    """Thread-safe counters updated by the HTTP layer and the decoder thread."""

    def __init__(
        self, model: str, drafter_kind: str, num_draft_tokens: int, draft_policy: str = "fixed"
    ) -> None:
        self.model = model
        self.drafter_kind = drafter_kind
        self.num_draft_tokens = num_draft_tokens
        self.draft_policy = draft_policy
        self._rounds: Counter[tuple[int, int]] = Counter()  # (batch bucket, drafted) -> rounds
        self._round_seconds: Counter[tuple[int, str]] = Counter()  # (bucket, phase) -> s
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, str]] = Counter()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._cancelled = 0
        self._prefills = 0
        self._prefill_rows = 0
        self._decode = DecodeStats()
        self._request_tau = [0] * (len(TAU_BUCKETS) + 1)  # per bucket, +Inf last
        self._request_tau_sum = 0.0
        self._request_drafted = 0
        self._request_accepted = 0

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

    def record_prefill(self, rows: int) -> None:
        """A prefill pass admitted ``rows`` requests (joining the running batch)."""
        with self._lock:
            self._prefills += 1
            self._prefill_rows += rows

    def record_round(self, profile: RoundProfile) -> None:
        """One lane's round: its width at its batch size, and its time by phase."""
        bucket = batch_bucket(profile.rows)
        with self._lock:
            self._rounds[(bucket, profile.drafted)] += 1
            for phase, seconds in profile.seconds.items():
                self._round_seconds[(bucket, phase)] += seconds

    def record_decode(self, stats: DecodeStats) -> None:
        """Totals of decoding rounds (folded ``DecodeStats``)."""
        with self._lock:
            self._decode = self._decode.merge(stats)

    def record_request(self, stats: DecodeStats) -> None:
        """A finished request's own acceptance (its ``usage.speculative``)."""
        if stats.rounds == 0:  # answered by its prefill alone: no verification to report
            return
        tau = stats.tau
        bucket = next((i for i, bound in enumerate(TAU_BUCKETS) if tau <= bound), -1)
        with self._lock:
            self._request_tau[bucket] += 1
            self._request_tau_sum += tau
            self._request_drafted += stats.draft_positions
            self._request_accepted += sum(stats.accepted_per_position)

    def render(self, queue_depth: int, running: int) -> str:
        """Every metric with ``# HELP`` and ``# TYPE``, one sample per line."""
        with self._lock:
            decode = self._decode
            requests = dict(self._requests)
            scalars = {
                "prompt_tokens": self._prompt_tokens,
                "generation_tokens": self._generation_tokens,
                "cancelled": self._cancelled,
                "prefills": self._prefills,
                "prefill_rows": self._prefill_rows,
                "request_drafted": self._request_drafted,
                "request_accepted": self._request_accepted,
            }
            request_tau = list(self._request_tau)
            request_tau_sum = self._request_tau_sum
            rounds = sorted(self._rounds.items())
            round_seconds = sorted(self._round_seconds.items())
        out = _Exposition()
        info = {"model": self.model, "drafter_kind": self.drafter_kind}
        info["draft_policy"] = self.draft_policy
        out.add("draftsmith_info", "gauge", "The served model and drafter (value 1).", [(info, 1)])
        out.add(
            "draftsmith_rounds_total",
            "counter",
            "Decoding rounds by batch size (bucket) and drafts per row verified (0: a plain "
            "step): the draft lengths chosen at each load.",
            [
                ({"batch": bucket_label(bucket), "drafted": str(drafted)}, n)
                for (bucket, drafted), n in rounds
            ],
        )
        out.add(
            "draftsmith_round_seconds_total",
            "counter",
            "Seconds of decoding rounds by batch size (bucket) and phase: draft, verify, "
            "commit (the drafter's commit and the session's bookkeeping), handoff (tokens to "
            "the requests), other (the rest of a round: choosing its width, syncs).",
            [
                ({"batch": bucket_label(bucket), "phase": phase}, seconds)
                for (bucket, phase), seconds in round_seconds
            ],
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
            ("prefills_total", "prefills", "Prefill passes (requests joining the batch)."),
            ("prefill_rows_total", "prefill_rows", "Requests admitted, summed over prefills."),
            (
                "request_draft_tokens_total",
                "request_drafted",
                "Draft tokens proposed for finished requests (usage.speculative.drafted_tokens).",
            ),
            (
                "request_accepted_tokens_total",
                "request_accepted",
                "Draft tokens accepted for finished requests (usage.speculative.accepted_tokens).",
            ),
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
        cumulative = [sum(request_tau[: i + 1]) for i in range(len(request_tau))]
        bounds = [repr(bound) for bound in TAU_BUCKETS] + ["+Inf"]
        out.add_histogram(
            "draftsmith_request_tau",
            "Per-request tau (1 + accepted drafts per verification round) of finished requests.",
            list(zip(bounds, cumulative, strict=True)),
            request_tau_sum,
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

    def add_histogram(
        self, name: str, help_text: str, buckets: list[tuple[str, int]], total: float
    ) -> None:
        """Cumulative ``buckets`` (upper bound label, count), then ``_sum`` and ``_count``."""
        self._lines.append(f"# HELP {name} {help_text}")
        self._lines.append(f"# TYPE {name} histogram")
        for bound, count in buckets:
            self._lines.append(f"{name}_bucket{_labels({'le': bound})} {count}")
        self._lines.append(f"{name}_sum {_number(float(total))}")
        self._lines.append(f"{name}_count {buckets[-1][1]}")

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
