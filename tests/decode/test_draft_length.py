"""Adaptive draft lengths: the policy's choices, and exactness of the rounds it shapes."""

from __future__ import annotations

import itertools

import pytest
import torch
from decode_helpers import (
    AdversarialDrafter,
    noisy_copy,
    ragged_greedy_batch,
    tiny_eagle_drafter,
    tiny_medusa_drafter,
)
from draftsmith.decode import DraftModelDrafter, NgramDrafter, SpeculativeDecoder
from draftsmith.decode.draft_length import TIME_WINDOW, AdaptiveDraftLength, probe_width
from tiny_models import tiny_llama


def _feed(policy: AdaptiveDraftLength, rounds: int, alpha: float, seconds) -> list[int]:
    """Run the policy against a simulated drafter; return the widths it chose."""
    chosen = []
    for _ in range(rounds):
        width = policy.choose(policy.max_tokens)
        chosen.append(width)
        accepted = int(alpha * width)  # a deterministic stand-in for the acceptance
        policy.update(width, torch.tensor([accepted] * 4), seconds(width))
    return chosen


def test_policy_measures_the_longest_length_then_a_plain_step_first() -> None:
    policy = AdaptiveDraftLength(max_tokens=4)
    for width, seconds in ((4, 0.02), (0, 0.01)):
        assert policy.choose(4) == width  # a warm-up round: its one-time costs are not timed
        policy.update(width, torch.tensor([2 if width else 0]), 1.0)
        assert policy.choose(4) == width
        policy.update(width, torch.tensor([2 if width else 0]), seconds)
    assert policy.round_seconds(2) == pytest.approx(0.015)  # the line through both points
    reached, accepted = 2.0, 1.0  # the prior, then both rounds of 4 drafts (2 accepted)
    for _ in range(2):
        reached, accepted = 0.99 * reached + 1, 0.99 * accepted + 1
    assert policy.alpha[0] == pytest.approx(accepted / reached)  # the warm-up's counts too
    assert policy.choose(1) <= 1  # never beyond the room the rows have left


def test_a_lengths_first_round_counts_its_acceptance_not_its_time() -> None:
    policy = AdaptiveDraftLength(max_tokens=2, probe_every=0)
    policy.update(1, torch.tensor([1]), 5.0)  # a stall: a kernel built for a new row count
    assert policy.round_seconds(1) is None
    assert policy.alpha[0] == pytest.approx((0.99 * 1 + 1) / (0.99 * 2 + 1))
    policy.update(1, torch.tensor([1]), 0.012)
    policy.update(1, torch.tensor([1]), 0.014)
    assert policy.round_seconds(1) == pytest.approx(0.013)  # the median of the timed rounds


def test_one_stalled_round_does_not_keep_a_length_slow() -> None:
    """A stall in a length's first timed round is forgotten after two more rounds, and the
    estimate follows the last TIME_WINDOW rounds."""
    policy = AdaptiveDraftLength(max_tokens=2, probe_every=0)
    policy.update(2, torch.tensor([1]), 1.0)  # the untimed warm-up round
    for seconds in (0.050, 0.008, 0.009):  # a stall, then the length's real cost
        policy.update(2, torch.tensor([1]), seconds)
    assert policy.round_seconds(2) == pytest.approx(0.009)
    for _ in range(TIME_WINDOW):  # the context grew: rounds now take longer
        policy.update(2, torch.tensor([1]), 0.012)
    assert policy.round_seconds(2) == pytest.approx(0.012)


def test_policy_drafts_the_longest_when_drafts_are_accepted_and_cheap() -> None:
    policy = AdaptiveDraftLength(max_tokens=4, probe_every=0)
    chosen = _feed(policy, 40, alpha=1.0, seconds=lambda w: 0.010 + 0.001 * w)
    assert chosen[-10:] == [4] * 10
    assert policy.alpha[0] > 0.9


def test_policy_falls_back_to_plain_steps_when_drafts_are_rejected() -> None:
    policy = AdaptiveDraftLength(max_tokens=4, probe_every=8)
    chosen = _feed(policy, 64, alpha=0.0, seconds=lambda w: 0.010 + 0.004 * w)
    tail = chosen[-32:]
    assert tail.count(0) >= 28  # plain steps, with a probe of length 1 every 8th round
    assert set(tail) <= {0, 1}


def test_a_drafting_policy_times_a_plain_step_again() -> None:
    """Probes from a width of 2 or more go up, down and to a plain step in turn: a plain step
    whose one timed round at the start stalled is timed again and chosen once it is the faster
    option (with probes of the neighbours alone the policy drafted 4 for good)."""
    policy = AdaptiveDraftLength(max_tokens=4, probe_every=4)
    plain = iter([0.010, 0.100])  # the untimed warm-up, then a stalled round; then 10 ms each

    def seconds(width: int) -> float:  # drafting: 5 tokens in 64 ms, plain: 1 token in 10 ms
        return 0.060 + 0.001 * width if width else next(plain, 0.010)

    chosen = _feed(policy, 40, alpha=1.0, seconds=seconds)
    assert chosen[:8] == [4, 4, 0, 0, 4, 4, 4, 3]  # warm-ups, then 4 drafts and a probe down
    assert chosen[11] == 0  # the third probe: a plain step
    assert chosen[-8:].count(0) >= 6  # plain steps, with probes of one draft


def test_probes_go_up_down_and_to_a_plain_step_in_turn() -> None:
    assert [probe_width(3, 4, probe) for probe in range(6)] == [4, 2, 0, 4, 2, 0]
    assert [probe_width(1, 4, probe) for probe in range(4)] == [2, 0, 2, 0]
    assert [probe_width(0, 4, probe) for probe in range(3)] == [1, 1, 1]
    assert probe_width(4, 4, 0) == 4  # no room above: the probe stays at the limit


def test_policy_keeps_its_length_unless_another_is_clearly_faster() -> None:
    policy = AdaptiveDraftLength(max_tokens=2, probe_every=0, switch_margin=0.1)
    for width, accepted, seconds in ((2, 2, 0.030), (0, 0, 0.010), (1, 0, 0.050)):
        for _ in range(2):  # a warm-up round, then a timed one; plain steps: 100 tokens/s
            policy.update(width, torch.tensor([accepted]), seconds)
    two = policy.expected_tokens(2)
    for rate, expected in ((95.0, 0), (104.0, 0), (130.0, 2)):  # 2 drafts at this rate
        policy._seconds[2] = two / rate
        assert policy.choose(2) == expected, rate  # 104 is not 10% better than 100


def test_policy_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        AdaptiveDraftLength(0)
    with pytest.raises(ValueError, match="decay"):
        AdaptiveDraftLength(4, decay=1.0)
    with pytest.raises(ValueError, match="drafts chains only"):  # adaptive trees need trees
        SpeculativeDecoder(
            tiny_llama(), NgramDrafter(vocab_size=64), 3, tree=_tree_spec(), adaptive=True
        )


def _tree_spec():
    from draftsmith.decode.drafters.base import TreeSpec

    return TreeSpec(top_k=2, total_tokens=4)


@pytest.mark.parametrize("name", ["perfect", "noisy", "adversarial", "ngram", "eagle", "medusa"])
def test_adaptive_rounds_keep_greedy_output_exact(name: str) -> None:
    """Rounds of every length, zero included, leave each drafter's state in step."""
    target = tiny_llama(num_layers=4, seed=0)
    drafters = {
        "perfect": lambda: DraftModelDrafter(target),
        "noisy": lambda: DraftModelDrafter(noisy_copy(target, 0.5)),
        "adversarial": lambda: AdversarialDrafter(target),
        "ngram": lambda: NgramDrafter(vocab_size=64),
        "eagle": lambda: tiny_eagle_drafter(target),
        "medusa": lambda: tiny_medusa_drafter(target),
    }
    ids, mask, reference = ragged_greedy_batch(target, 24)
    decoder = SpeculativeDecoder(target, drafters[name](), 3, adaptive=True)
    # The policy's own choices follow measured round times, so which lengths it visits varies
    # from run to run; a fixed schedule visits each length 0..3 whatever the timings (the
    # policy still runs every round and is fed every round's outcome).
    schedule = itertools.cycle([3, 0, 2, 1, 0, 3, 1, 2])
    widths = []
    choose = decoder.draft_length.choose

    def scheduled(limit: int) -> int:
        choose(limit)
        widths.append(min(next(schedule), limit))
        return widths[-1]

    decoder.draft_length.choose = scheduled
    for _ in range(2):  # the second call starts from the first call's estimates
        out = decoder.generate(ids, attention_mask=mask, max_new_tokens=24)
        assert torch.equal(out.sequences, reference)
    assert set(widths) == {0, 1, 2, 3}
