"""Acceptance and timing statistics: the one definition every report uses.

vLLM's vocabulary: per round the target verifies the drafted tokens; ``accepted`` drafts are
kept, then one more token (recovered or bonus) is emitted. ``tau`` is the mean number of tokens
emitted per verification pass (1 + mean accepted); ``alpha_j`` is the acceptance rate at draft
position j *given that position j - 1 was accepted* (docs/theory.md §5), so that
``P(L >= i) = prod_{j < i} alpha_j`` and ``E[L] = 1 + sum_i prod_{j <= i} alpha_j``. Rounds
of different widths (an adaptive length, a hybrid's lookup rounds that copy past N) each
expect that sum up to their own width, so the prediction is the rounds' mean of it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass
class DecodeStats:
    """Counters of one ``generate`` call (or of many, merged with ``merge``)."""

    reached_per_position: list[int] = field(default_factory=list)  # drafts verified at j
    accepted_per_position: list[int] = field(default_factory=list)  # drafts accepted at j
    rounds: int = 0  # row-rounds: one per active row per verification pass
    target_forward_passes: int = 0  # verification passes (prefill not included)
    tokens_emitted: int = 0  # new tokens written to the output (after truncation)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    draft_positions: int = 0  # sum over passes of the number of drafted positions
    rounds_per_width: dict[int, int] = field(default_factory=dict)  # row-rounds by drafts
    _pending_histograms: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def record_round(
        self,
        num_accepted: torch.Tensor,  # [B] accepted drafts per row
        num_drafted: int,
        active: torch.Tensor,  # [B] bool: rows still generating before this round
    ) -> None:
        """Add one verification pass: for each active row, positions 1..a accepted.

        Counts stay on the device as a histogram of accepted lengths per round width (no
        host sync per round); ``fold`` turns them into the per-position lists.
        """
        self.target_forward_passes += 1
        self.draft_positions += num_drafted
        histogram = torch.bincount(num_accepted[active], minlength=num_drafted + 1)
        pending = self._pending_histograms.get(num_drafted)
        self._pending_histograms[num_drafted] = (
            histogram if pending is None else pending + histogram
        )

    def fold(self) -> DecodeStats:
        """Move the device-side histograms into the per-position counters; returns self."""
        for width, histogram in self._pending_histograms.items():
            counts = histogram.tolist()  # counts[a]: rows that accepted exactly a drafts
            self._grow(width)
            self.rounds += sum(counts)
            self.rounds_per_width[width] = self.rounds_per_width.get(width, 0) + sum(counts)
            for j in range(width):
                self.reached_per_position[j] += sum(counts[j:])
                self.accepted_per_position[j] += sum(counts[j + 1 :])
        self._pending_histograms = {}
        return self

    def _grow(self, length: int) -> None:
        missing = length - len(self.reached_per_position)
        if missing > 0:
            self.reached_per_position.extend([0] * missing)
            self.accepted_per_position.extend([0] * missing)

    @property
    def alpha_per_position(self) -> list[float]:
        return [
            acc / reached if reached else 0.0
            for acc, reached in zip(
                self.accepted_per_position, self.reached_per_position, strict=True
            )
        ]

    @property
    def tau(self) -> float:
        """Mean tokens per verification pass per row: 1 + mean accepted drafts."""
        if self.rounds == 0:
            return 0.0
        return 1.0 + sum(self.accepted_per_position) / self.rounds

    @property
    def verify_ms_per_pass(self) -> float:
        """Mean milliseconds of one verification pass (a plain target step when nothing was
        drafted: the cost model's ``T_step``, docs/theory.md §5)."""
        return 1000 * self.verify_seconds / max(self.target_forward_passes, 1)

    @property
    def draft_ms_per_round(self) -> float:
        """Mean milliseconds of drafting per verification pass (a round's ``T_draft``)."""
        return 1000 * self.draft_seconds / max(self.target_forward_passes, 1)

    @property
    def predicted_tau(self) -> float:
        """``E[L] = 1 + sum_{i <= w} prod_{j <= i} alpha_j`` from the per-position rates,
        averaged over the rounds' widths ``w``."""
        self.fold()
        alpha = self.alpha_per_position
        widths = self.rounds_per_width or {len(alpha): 1}
        total = sum(widths.values())
        return sum(n * predicted_tau(alpha[:w]) for w, n in widths.items()) / total

    def merge(self, other: DecodeStats) -> DecodeStats:
        self.fold()
        other.fold()
        merged = DecodeStats()
        merged._grow(max(len(self.reached_per_position), len(other.reached_per_position)))
        for stats in (self, other):
            for j, (reached, acc) in enumerate(
                zip(stats.reached_per_position, stats.accepted_per_position, strict=True)
            ):
                merged.reached_per_position[j] += reached
                merged.accepted_per_position[j] += acc
            for width, count in stats.rounds_per_width.items():
                merged.rounds_per_width[width] = merged.rounds_per_width.get(width, 0) + count
        for name in (
            "rounds",
            "target_forward_passes",
            "tokens_emitted",
            "prefill_seconds",
            "draft_seconds",
            "verify_seconds",
            "total_seconds",
            "draft_positions",
        ):
            setattr(merged, name, getattr(self, name) + getattr(other, name))
        return merged

    def to_dict(self) -> dict[str, object]:
        self.fold()
        data = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        data.update(
            tau=self.tau,
            predicted_tau=self.predicted_tau,
            alpha_per_position=self.alpha_per_position,
        )
        return data


def predicted_tau(alpha_per_position: list[float]) -> float:
    """Expected tokens per round, ``1 + sum_i prod_{j <= i} alpha_j`` (docs/theory.md §5)."""
    expected, survive = 1.0, 1.0
    for alpha in alpha_per_position:
        survive *= alpha
        expected += survive
    return expected


def predicted_speedup(
    tau: float, plain_token_s: float, draft_round_s: float, verify_s: float
) -> float:
    """``speedup = E[L] * T_t / (N * T_d + T_verify)`` (docs/theory.md §5).

    ``tau`` stands for ``E[L]``; ``plain_token_s`` is ``T_t``, the time plain decoding takes per
    token; ``draft_round_s`` is one round's drafting (``N * T_d``) and ``verify_s`` its verify
    pass over N + 1 tokens, which on a CPU costs more than one plain step. 0 when nothing was
    timed.
    """
    round_s = draft_round_s + verify_s
    return tau * plain_token_s / round_s if round_s > 0 else 0.0
