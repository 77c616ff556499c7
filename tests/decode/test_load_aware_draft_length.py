"""Load-aware draft lengths: costs per batch size, each row's own acceptance, exact rounds."""

from __future__ import annotations

import itertools

import pytest
import torch
from decode_helpers import (
    chi_square_p_value,
    exact_two_token_law,
    noisy_copy,
    ragged_greedy_batch,
    tiny_eagle_drafter,
    tiny_peagle_drafter,
)
from draftsmith.decode import DraftModelDrafter, NgramDrafter, SpeculativeDecoder
from draftsmith.decode.draft_length import (
    FORGET_AFTER_ROUNDS,
    ROW_PRIOR_WEIGHT,
    AdaptiveDraftLength,
    LoadAwareDraftLength,
    RowAcceptance,
    SessionDraftLength,
)
from draftsmith.decode.sampling import SamplingConfig
from tiny_models import tiny_llama


class FakeSession:
    """The two things a policy reads from a session: its batch size and active rows."""

    def __init__(self, rows: int) -> None:
        self.active = torch.ones(rows, dtype=torch.bool)

    @property
    def batch_size(self) -> int:
        return self.active.shape[0]


def _run(view: SessionDraftLength, rounds: int, alpha: float, seconds) -> list[int]:
    """Simulated rounds: ``seconds(rows, width)``, every row accepting ``alpha * width``."""
    rows = view._session.batch_size
    chosen = []
    for _ in range(rounds):
        width = view.choose(view.max_tokens)
        chosen.append(width)
        view.update(width, torch.full((rows,), int(alpha * width)), seconds(rows, width))
    return chosen


def test_drafting_stops_where_a_wide_verify_pass_costs_more_than_it_saves() -> None:
    """One policy, two batch sizes, drafts always accepted: at one row a verify pass costs
    about a step, so the longest chain pays; at 16 rows each draft adds more than a step's
    time (the pass is compute-bound), so plain steps win."""

    def seconds(rows: int, width: int) -> float:
        if rows == 1:  # weight-bound: a verify pass of w + 1 tokens costs about one step
            return 0.010 + 0.0005 * width
        return 0.040 + 0.045 * width  # compute-bound: each draft adds more than a step

    policy = LoadAwareDraftLength(max_tokens=4, probe_every=0)
    alone = policy.for_session(FakeSession(1))
    busy = policy.for_session(FakeSession(16))
    for view in (alone, busy):
        view.add_rows(view._session.batch_size)
    small = _run(alone, 30, alpha=1.0, seconds=seconds)
    large = _run(busy, 30, alpha=1.0, seconds=seconds)
    assert small[-10:] == [4] * 10
    assert large[-10:] == [0] * 10
    assert set(policy._by_rows) == {1, 16}  # one cost table per batch size


def test_each_batch_size_keeps_its_own_times_and_a_new_one_starts_from_the_nearest() -> None:
    """Nine rows draft (a draft costs little beside the step), sixteen do not (each draft
    adds more than a step). With one table for 9-16 rows, each width's time would mix the two
    sizes and both would choose alike. A batch size not seen before starts from the nearest
    size's times: fifteen rows step plainly at once, without first timing the longest width."""

    def seconds(rows: int, width: int) -> float:
        return 0.030 + 0.002 * rows + width * (0.004 if rows <= 9 else 0.090)

    policy = LoadAwareDraftLength(max_tokens=4, probe_every=0)
    nine = policy.for_session(FakeSession(9))
    sixteen = policy.for_session(FakeSession(16))
    for view in (nine, sixteen):
        view.add_rows(view._session.batch_size)
    chosen: dict[int, list[int]] = {9: [], 16: []}
    for _ in range(30):  # the two sizes take turns, as a load that ebbs and flows
        for view in (nine, sixteen):
            chosen[view._session.batch_size] += _run(view, 1, alpha=1.0, seconds=seconds)
    assert chosen[9][-10:] == [4] * 10 and chosen[16][-10:] == [0] * 10
    fifteen = policy.for_session(FakeSession(15))
    fifteen.add_rows(15)
    assert _run(fifteen, 5, alpha=1.0, seconds=seconds) == [0] * 5
    assert policy.costs(15).round_seconds(0) == pytest.approx(seconds(15, 0))


def test_borrowed_times_give_the_shape_until_two_widths_are_timed() -> None:
    """A new batch size takes the nearest size's ``T(w)``: as they are before its first timed
    round, scaled to its own time after one timed width, and not at all after two."""
    nearest = AdaptiveDraftLength(max_tokens=4, probe_every=0)
    for width, seconds in ((4, 0.220), (4, 0.220), (0, 0.040), (0, 0.040)):
        nearest.update(width, torch.tensor([width]), seconds)  # each width's first is untimed
    new = AdaptiveDraftLength(max_tokens=4, probe_every=0)
    new.start_from(nearest)
    assert new.round_seconds(4) == pytest.approx(0.220)
    assert new.round_seconds(2) == pytest.approx(0.130)  # the borrowed line
    for _ in range(2):
        new.update(0, torch.tensor([0]), 0.010)
    assert new.round_seconds(0) == pytest.approx(0.010)
    assert new.round_seconds(4) == pytest.approx(0.220 * 0.010 / 0.040)
    for _ in range(2):
        new.update(1, torch.tensor([1]), 0.011)
    assert new.round_seconds(4) == pytest.approx(0.014)  # its own line through 0 and 1


def test_a_bucket_that_does_not_draft_probes_rarely_and_its_drafter_forgets() -> None:
    """Where plain steps win, a probe makes the drafter read what it skipped: the policy
    probes from 0 every ``idle_probe_every`` rounds, while a drafting bucket probes every
    ``probe_every``; a session under the policy has its drafter forget old unread rounds."""

    def seconds(rows: int, width: int) -> float:
        return 0.010 + 0.0005 * width if rows == 1 else 0.040 + 0.045 * width

    policy = LoadAwareDraftLength(max_tokens=4, probe_every=4, idle_probe_every=32)
    busy = policy.for_session(FakeSession(16))
    busy.add_rows(16)
    widths = _run(busy, 200, alpha=1.0, seconds=seconds)
    probes = [i for i, w in enumerate(widths[40:], 40) if w]
    assert probes and all(b - a == 32 for a, b in itertools.pairwise(probes))
    alone = policy.for_session(FakeSession(1))
    alone.add_rows(1)
    widths = _run(alone, 60, alpha=1.0, seconds=seconds)
    # Below IDLE_PROBE_ROWS rows a plain bucket probes as often as a drafting one.
    assert policy.costs(1).idle_probe_every == 4 and policy.costs(16).idle_probe_every == 32
    assert policy.costs(4).idle_probe_every == 4 and policy.costs(5).idle_probe_every == 32
    # Every fourth round probes: up (held at the limit), one draft down and a plain step in
    # turn, so six probes in a row go down twice and to a plain step twice.
    assert widths[-24:].count(3) == 2 and widths[-24:].count(0) == 2

    target = tiny_llama(seed=0)
    decoder = SpeculativeDecoder(target, tiny_eagle_drafter(target), 3)
    assert decoder.session(draft_length=policy).drafter.forget_after_rounds == FORGET_AFTER_ROUNDS
    assert decoder.session().drafter.forget_after_rounds is None


def test_each_rows_acceptance_is_its_own_and_follows_the_rows() -> None:
    rows = RowAcceptance(max_tokens=3, decay=0.5)
    rows.add_rows(2, [0.5, 0.5, 0.5])
    assert torch.equal(rows.reached, torch.full((2, 3), ROW_PRIOR_WEIGHT, dtype=torch.float64))
    # Row 0 accepts both drafts, row 1 none; a third row was not active.
    rows.add_rows(1, [0.5, 0.5, 0.5])
    rows.update(2, torch.tensor([2, 0]), torch.tensor([True, True, False]), [0.5] * 3)
    alpha = rows.accepted / rows.reached
    assert alpha[0, :2].tolist() == pytest.approx([(0.5 + 1) / (1 + 1)] * 2)
    assert alpha[1, 0] == pytest.approx(0.5 / 2)  # reached, rejected
    assert rows.reached[1, 1] == ROW_PRIOR_WEIGHT  # never reached: unchanged
    assert torch.equal(rows.reached[2], torch.full((3,), ROW_PRIOR_WEIGHT, dtype=torch.float64))
    only_first = rows.expected_by_width(2, torch.tensor([True, False, False]))
    assert only_first == pytest.approx([1.0, 1 + 0.75, 1 + 0.75 + 0.75**2])
    rows.select_rows(torch.tensor([1]))  # row 0 and 2 retire
    assert rows.batch_size == 1
    assert rows.expected_by_width(1, torch.tensor([True]))[1] == pytest.approx(1 + 0.25)


def test_a_row_that_stopped_drafting_returns_after_its_hard_stretch() -> None:
    """A row whose drafts were all rejected for a while is given no drafts; rounds without
    drafts move its rates back to its prior, so it drafts again a few rounds later instead
    of decoding plainly to its end (no probes here: only the relaxation can bring it back)."""
    policy = LoadAwareDraftLength(max_tokens=4, probe_every=0)
    view = policy.for_session(FakeSession(1))
    view.add_rows(1)

    def seconds(rows: int, width: int) -> float:
        return 0.010 + 0.002 * width  # a round of 4 drafts costs 1.8 plain steps

    good = _run(view, 30, alpha=1.0, seconds=seconds)
    assert min(good[-5:]) >= 3
    hard = _run(view, 12, alpha=0.0, seconds=seconds)
    assert hard[-1] == 0  # the hard stretch stops drafting
    after = _run(view, 20, alpha=1.0, seconds=seconds)
    assert min(after[-5:]) >= 3  # and the good text brings it back


def test_rounds_without_a_position_relax_it_towards_the_prior() -> None:
    rows = RowAcceptance(max_tokens=2, decay=0.5)
    rows.add_rows(1, [0.8, 0.6])
    prior = [0.8, 0.6]
    rows.update(2, torch.tensor([0]), torch.tensor([True]), prior)  # draft 1 rejected
    low = (rows.accepted / rows.reached)[0].tolist()
    assert low[0] == pytest.approx(0.8 * 2 * 0.5 / (2 * 0.5 + 1))
    assert low[1] == pytest.approx(0.6)  # not verified: at its prior already
    for _ in range(20):
        rows.update(0, torch.tensor([], dtype=torch.long), torch.tensor([True]), prior)
    assert (rows.accepted / rows.reached)[0].tolist() == pytest.approx([0.8, 0.6], abs=1e-4)
    rows.update(0, torch.tensor([], dtype=torch.long), torch.tensor([False]), [0.1, 0.1])
    assert rows.reached[0].tolist() == pytest.approx([ROW_PRIOR_WEIGHT] * 2, abs=1e-4)


def test_a_joining_row_starts_from_the_pooled_acceptance() -> None:
    policy = LoadAwareDraftLength(max_tokens=2, probe_every=0)
    first = policy.for_session(FakeSession(1))
    first.add_rows(1)
    _run(first, 20, alpha=1.0, seconds=lambda rows, width: 0.01)
    joining = policy.for_session(FakeSession(1))
    joining.add_rows(1)
    assert (joining.rows.accepted / joining.rows.reached)[0, 0] > 0.9


def test_update_without_choose_is_refused() -> None:
    view = LoadAwareDraftLength(max_tokens=2).for_session(FakeSession(1))
    with pytest.raises(RuntimeError, match="before choose"):
        view.update(1, torch.tensor([1]), 0.01)


def _scheduled(decoder_session, widths: list[int]) -> None:
    """Replace the session's choice by a fixed cycle of widths (still running the policy)."""
    view = decoder_session.draft_length
    choose = view.choose
    schedule = itertools.cycle([3, 0, 2, 1, 0, 3, 1, 2])

    def scheduled(limit: int) -> int:
        choose(limit)
        widths.append(min(next(schedule), limit))
        return widths[-1]

    view.choose = scheduled


@pytest.mark.parametrize("name", ["noisy", "ngram", "eagle", "peagle"])
def test_load_aware_rounds_keep_greedy_output_exact(name: str) -> None:
    """Whatever width each round takes (zero included), rows that join late and rows that
    retire early decode exactly the target's greedy output."""
    target = tiny_llama(num_layers=4, seed=0)
    drafters = {
        "noisy": lambda: DraftModelDrafter(noisy_copy(target, 0.5)),
        "ngram": lambda: NgramDrafter(vocab_size=64),
        "eagle": lambda: tiny_eagle_drafter(target),
        "peagle": lambda: tiny_peagle_drafter(target),
    }
    ids, mask, reference = ragged_greedy_batch(target, 20)
    decoder = SpeculativeDecoder(target, drafters[name](), 3)
    policy = LoadAwareDraftLength(3)
    widths: list[int] = []
    emitted: dict[int, list[int]] = {}
    session = decoder.session(eos_token_id=[], draft_length=policy, record=False)
    _scheduled(session, widths)
    order: list[int] = []  # prompt index of each session row

    def collect(update) -> None:
        for row, tokens in enumerate(update.tokens):
            emitted.setdefault(order[row], []).extend(tokens)

    session.streamer = collect
    order += [0, 1]
    session.add_rows(ids[:2], mask[:2], [20, 7])  # row 1 finishes early and retires
    for _ in range(3):
        session.step()
        done = session.finished_rows()
        session.retire(done)
        order[:] = [p for r, p in enumerate(order) if r not in done]
    order.append(2)
    session.add_rows(ids[2:], mask[2:], 20)  # joins a running batch
    while session.room() > 0:
        session.step()
        done = session.finished_rows()
        session.retire(done)
        order[:] = [p for r, p in enumerate(order) if r not in done]
    prompt = ids.shape[1]
    for index, limit in ((0, 20), (1, 7), (2, 20)):
        assert emitted[index] == reference[index, prompt : prompt + limit].tolist(), index
    assert set(widths) == {0, 1, 2, 3}
    assert session.draft_length.rows.batch_size == session.batch_size == 0


def test_load_aware_rounds_follow_the_target_law_when_sampling() -> None:
    """The chosen width never changes the law of the emitted tokens (chi-square, T = 1)."""
    target = tiny_llama(seed=0)
    prompt = torch.tensor([5, 9, 5, 9, 5, 9, 5, 9, 5])
    sampling = SamplingConfig(temperature=1.0)
    first_law, second_law = exact_two_token_law(target, prompt, sampling)
    decoder = SpeculativeDecoder(target, DraftModelDrafter(noisy_copy(target, 0.6)), 3)
    policy = LoadAwareDraftLength(3)
    session = decoder.session(
        sampling=sampling,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(0),
        draft_length=policy,
        record=True,
    )
    widths: list[int] = []
    _scheduled(session, widths)
    rows = 3000
    session.add_rows(prompt[None].repeat(rows, 1), max_new_tokens=4)
    while session.room() > 0:
        session.step()
    new = session.sequences(prompt[None].repeat(rows, 1))[:, prompt.numel() :]
    assert widths[0] == 2  # the first round drafted (the room left, 3 tokens, bounds it to 2)
    assert chi_square_p_value(torch.bincount(new[:, 0], minlength=64), first_law) > 1e-4
    assert chi_square_p_value(torch.bincount(new[:, 1], minlength=64), second_law) > 1e-4
    assert 0.05 < session.stats.fold().alpha_per_position[0] < 0.95
