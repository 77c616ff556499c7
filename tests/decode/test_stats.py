"""The expected-gain formulas of docs/theory.md §5 and the counters they are fed from."""

from __future__ import annotations

import pytest
import torch
from draftsmith.decode.stats import DecodeStats, predicted_speedup, predicted_tau


@pytest.mark.parametrize("alpha", [0.0, 0.4, 0.8, 0.95])
@pytest.mark.parametrize("num_drafts", [1, 4, 7])
def test_constant_acceptance_gives_the_geometric_sum(alpha: float, num_drafts: int) -> None:
    closed_form = (1 - alpha ** (num_drafts + 1)) / (1 - alpha)
    assert predicted_tau([alpha] * num_drafts) == pytest.approx(closed_form, rel=1e-12)


def test_per_position_rates_multiply() -> None:
    # P(L >= 2) = a1, P(L >= 3) = a1 a2, P(L >= 4) = a1 a2 a3.
    assert predicted_tau([0.5, 0.4, 0.25]) == pytest.approx(1 + 0.5 + 0.2 + 0.05)
    assert predicted_tau([]) == 1.0


def test_predicted_speedup_charges_drafting_and_the_verify_pass() -> None:
    # E[L] = 3 tokens for 0.5 s of drafting and a 1.5 s verify pass, against 1 s per plain token.
    assert predicted_speedup(3.0, 1.0, 0.5, 1.5) == pytest.approx(1.5)
    assert predicted_speedup(3.0, 1.0, 0.0, 0.0) == 0.0


def test_counters_give_conditional_acceptance_and_tau() -> None:
    stats = DecodeStats()
    everyone = torch.ones(4, dtype=torch.bool)
    stats.record_round(torch.tensor([0, 1, 2, 2]), num_drafted=2, active=everyone)
    stats.record_round(
        torch.tensor([2, 0, 9, 9]), num_drafted=2, active=torch.tensor([1, 1, 0, 0]).bool()
    )
    stats.fold()
    # Position 1 reached 6 times, accepted 4; position 2 reached 4 times, accepted 3.
    assert stats.reached_per_position == [6, 4]
    assert stats.accepted_per_position == [4, 3]
    assert stats.alpha_per_position == pytest.approx([4 / 6, 3 / 4])
    assert stats.rounds == 6 and stats.target_forward_passes == 2
    assert stats.tau == pytest.approx(1 + 7 / 6)
    # 1 + a1 + a1 a2 = 1 + 4/6 + 3/6 = 1 + 7/6: the identity tau == predicted_tau holds here.
    assert stats.predicted_tau == pytest.approx(stats.tau)


def test_rounds_of_different_widths_each_expect_up_to_their_own_width() -> None:
    """Lookup rounds that copy past N (and plain steps, width 0) do not lend their deeper
    positions to the narrower rounds: the prediction is the rounds' mean of E[L] at their
    width."""
    stats = DecodeStats()
    one = torch.ones(1, dtype=torch.bool)
    for accepted, width in ((4, 4), (6, 6), (1, 4), (0, 0), (6, 6), (2, 6)):
        stats.record_round(torch.tensor([accepted]), num_drafted=width, active=one)
    stats.fold()
    assert stats.rounds_per_width == {4: 2, 6: 3, 0: 1}
    alpha = stats.alpha_per_position
    expected = (2 * predicted_tau(alpha[:4]) + 3 * predicted_tau(alpha) + 1.0) / 6
    assert stats.predicted_tau == pytest.approx(expected)
    assert stats.predicted_tau < predicted_tau(alpha)  # not every round reaches position 6
    merged = stats.merge(DecodeStats())
    assert merged.rounds_per_width == stats.rounds_per_width
    assert merged.predicted_tau == pytest.approx(stats.predicted_tau)
