"""The hybrid drafter (prompt lookup + a learned drafter) is exact like every other kind."""

from __future__ import annotations

import pytest
import torch
from decode_helpers import (
    ScriptedWidths,
    chi_square_p_value,
    exact_two_token_law,
    noisy_copy,
    tiny_dflash_drafter,
    tiny_eagle_drafter,
    tiny_medusa_drafter,
    tiny_peagle_drafter,
)
from draftsmith.decode import DraftModelDrafter, SpeculativeDecoder
from draftsmith.decode.defaults import LOOKUP_DRAFT_TOKENS
from draftsmith.decode.drafters.hybrid import DECAY, PROBE_EVERY, HybridDrafter, _Yield
from draftsmith.decode.sampling import SamplingConfig
from tiny_models import tiny_llama

# Row 0 repeats itself (lookup matches), row 1 does not at first (the learned drafter drafts).
REPEATING = [5, 9, 12, 5, 9, 12, 5, 9, 12, 5]
PLAIN = [3, 17, 40, 22, 8, 31, 14, 60, 27, 11]
# Every token once: whatever token is sampled next occurred before (lookup drafts); one token
# over and over: almost nothing sampled next occurred before (the learned drafter drafts).
EVERY_TOKEN = list(range(64))
ONE_TOKEN = [7] * 64


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(seed=0)


def _learned(target: torch.nn.Module, kind: str):
    if kind == "draft_lm":
        return DraftModelDrafter(noisy_copy(target, 0.5))
    if kind == "peagle":
        return tiny_peagle_drafter(target)
    if kind == "dflash":  # a block of 5 rows: the 4 drafts the tests ask for
        return tiny_dflash_drafter(target, block_size=5)
    return tiny_eagle_drafter(target)


@pytest.mark.parametrize("kind", ["draft_lm", "eagle3", "peagle", "dflash"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_hybrid_greedy_equals_target_generate(
    target: torch.nn.Module, kind: str, adaptive: bool
) -> None:
    ids = torch.tensor([REPEATING, PLAIN, [0, 0, 0, *REPEATING[:7]]])
    mask = (torch.arange(10)[None] >= torch.tensor([0, 0, 3])[:, None]).long()
    reference = target.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False
    )
    for num_draft_tokens in (1, 4):
        hybrid = HybridDrafter(_learned(target, kind))
        decoder = SpeculativeDecoder(target, hybrid, num_draft_tokens, adaptive=adaptive)
        for rows in (slice(0, 1), slice(0, 3)):  # batch 1, then a ragged batch of 3
            out = decoder.generate(ids[rows], attention_mask=mask[rows], max_new_tokens=20)
            assert torch.equal(out.sequences, reference[rows]), (kind, num_draft_tokens, rows)
        usage = hybrid.usage()
        assert usage["lookup_rows"] > 0 and usage["learned_rows"] > 0, usage


@pytest.mark.parametrize("kind", ["draft_lm", "eagle3", "peagle", "dflash"])
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 10, 0.9)])
def test_hybrid_mixed_rounds_follow_target_law(
    target: torch.nn.Module, kind: str, temperature: float, top_k: int, top_p: float
) -> None:
    """Half the batch drafts by lookup and half by the learned drafter in the same rounds;
    each half's first two tokens follow its own prompt's exact law."""
    rows = 1500
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    prompts = torch.tensor([EVERY_TOKEN] * rows + [ONE_TOKEN] * rows)
    hybrid = HybridDrafter(_learned(target, kind))
    decoder = SpeculativeDecoder(target, hybrid, 3)
    out = decoder.generate(
        prompts,
        max_new_tokens=3,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(0),
    )
    new = out.sequences[:, prompts.shape[1] :]
    for half, prompt in ((slice(0, rows), EVERY_TOKEN), (slice(rows, None), ONE_TOKEN)):
        first_law, second_law = exact_two_token_law(target, torch.tensor(prompt), sampling)
        first = torch.bincount(new[half, 0], minlength=64)
        second = torch.bincount(new[half, 1], minlength=64)
        assert chi_square_p_value(first, first_law) > 1e-4, (kind, half)
        assert chi_square_p_value(second, second_law) > 1e-4, (kind, half)
    usage = hybrid.usage()
    assert usage["lookup_rows"] >= rows and usage["learned_rows"] >= rows, usage


def test_hybrid_counts_every_round(target: torch.nn.Module) -> None:
    hybrid = HybridDrafter(DraftModelDrafter(noisy_copy(target, 0.5)))
    decoder = SpeculativeDecoder(target, hybrid, 4)
    out = decoder.generate(torch.tensor([REPEATING]), max_new_tokens=24, eos_token_id=[])
    usage = hybrid.usage()
    assert usage["lookup_rows"] + usage["learned_rows"] + usage["plain_rows"] == out.stats.rounds
    accepted = usage["lookup_mean_accepted"] * usage["lookup_rows"]
    accepted += usage["learned_mean_accepted"] * usage["learned_rows"]
    assert round(accepted) == sum(out.stats.accepted_per_position)


def test_every_round_the_policy_asks_to_draft_drafts(target: torch.nn.Module) -> None:
    """Whether to draft is the draft-length policy's choice, not the hybrid's: under a fixed N
    a row lookup does not draft is drafted by the learned drafter, even when its measured
    yield is poor (the hybrid once stepped such rows plainly on its own, noisy, yields)."""
    hybrid = HybridDrafter(DraftModelDrafter(noisy_copy(target, 3.0)))
    for _ in range(30):  # a learned drafter measured at 10 tokens/s
        hybrid._yields[True].learned.add(1.0, 0.1)
    decoder = SpeculativeDecoder(target, hybrid, 3)
    prompt = torch.tensor([PLAIN])
    out = decoder.generate(prompt, max_new_tokens=30, eos_token_id=[])
    reference = target.generate(input_ids=prompt, max_new_tokens=30, do_sample=False)
    assert torch.equal(out.sequences, reference)
    usage = hybrid.usage()
    assert usage["plain_rows"] == 0 and usage["lookup_rows"] + usage["learned_rows"] == (
        out.stats.rounds
    ), usage


def test_plain_steps_the_policy_chooses_are_counted_as_plain_rows(
    target: torch.nn.Module,
) -> None:
    hybrid = HybridDrafter(DraftModelDrafter(noisy_copy(target, 0.5)))
    decoder = SpeculativeDecoder(target, hybrid, 3)
    session = decoder.session(draft_length=ScriptedWidths([3, 0]))
    session.add_rows(torch.tensor([PLAIN]), max_new_tokens=20)
    session.step()  # three drafts
    session.step()  # a plain step
    usage = hybrid.usage()
    assert (usage["learned_rows"], usage["plain_rows"]) == (1, 1), usage


def test_rounds_given_to_lookup_run_no_head_pass(target: torch.nn.Module) -> None:
    """The EAGLE-3 head reads the entries of lookup rounds in its next drafting pass, so a
    round whose rows all draft by lookup runs the target alone."""
    learned = tiny_eagle_drafter(target)
    passes = []
    counted = learned._committed_pass
    learned._committed_pass = lambda *args: (passes.append(args[0].shape[1]), counted(*args))[1]
    hybrid = HybridDrafter(learned)
    decoder = SpeculativeDecoder(target, hybrid, 4)
    out = decoder.generate(torch.tensor([REPEATING]), max_new_tokens=40, eos_token_id=[])
    usage = hybrid.usage()
    assert usage["rounds_without_network"] > 0, usage
    network_rounds = out.stats.rounds - usage["rounds_without_network"]
    assert len(passes) - 1 <= network_rounds  # the prefill, then at most one per drafting round


def test_hybrid_refuses_a_drafter_that_cannot_commit_other_drafts(
    target: torch.nn.Module,
) -> None:
    with pytest.raises(ValueError, match="cannot commit drafts it did not propose"):
        HybridDrafter(tiny_medusa_drafter(target))


def test_a_sources_first_round_is_a_warm_up_it_does_not_count() -> None:
    source = _Yield()
    source.add(3.0, 5.0)  # a stall: a kernel built for a new row count
    assert source.rate == float("inf")  # still unmeasured: tried again
    source.add(3.0, 0.02)
    source.add(1.0, 0.01)
    assert source.rate == pytest.approx((DECAY * 3.0 + 1.0) / (DECAY * 0.02 + 0.01))


def test_lookup_and_the_learned_drafter_are_compared_in_the_same_context(
    target: torch.nn.Module,
) -> None:
    """After a one-token match the learned drafter's guesses earn less than where nothing
    matched; lookup of that match is weighed against the former, not against the learned
    drafter's mean over all rows, once that context has been seen often enough."""
    hybrid = HybridDrafter(tiny_eagle_drafter(target))

    def measured(source: _Yield, tokens: float, seconds: float, rounds: int = 3) -> None:
        for _ in range(rounds):  # the first round is a warm-up
            source.add(tokens, seconds)

    def learned(context: int, tokens: float, seconds: float, rounds: int) -> None:
        measured(hybrid._yields[True].learned, tokens, seconds, rounds)
        measured(hybrid._yields[True].learned_by_context[context], tokens, seconds, rounds)

    learned(0, 3.0, 0.010, rounds=40)  # 300 tokens/s where nothing matched
    measured(hybrid._yields[True].lookup[1], 1.7, 0.0125)  # 136 tokens/s
    learned(1, 1.0, 0.016, rounds=2)  # one measured round after a one-token match: 62 tokens/s
    assert not hybrid._yields[True].prefers_lookup(1)  # one round does not outweigh the pool
    for _ in range(20):  # both contexts in turn: the pool earns 154 tokens/s
        learned(0, 3.0, 0.010, rounds=1)
        learned(1, 1.0, 0.016, rounds=1)
    assert hybrid._yields[True].prefers_lookup(1)  # many rounds do
    assert hybrid._yields[True].learned_rate(1) < 136 < hybrid._yields[True].learned.rate
    measured(hybrid._yields[True].lookup[2], 2.5, 0.0125)  # 200 tokens/s
    learned(2, 2.0, 0.008, rounds=40)  # 250 tokens/s
    assert not hybrid._yields[True].prefers_lookup(2)


def test_a_losing_source_is_probed_less_often_the_further_it_trails(
    target: torch.nn.Module,
) -> None:
    """Lookup of a one-token match at a quarter of the learned drafter's rate (sampling) is
    tried once every 4 x PROBE_EVERY decisions; one that trails by a tenth, every 1.1 x."""
    hybrid = HybridDrafter(tiny_eagle_drafter(target))
    for source, tokens, seconds in (
        (hybrid._yields[True].learned, 2.0, 0.010),  # 200 tokens/s
        (hybrid._yields[True].lookup[1], 1.0, 0.020),  # 50 tokens/s
        (hybrid._yields[True].lookup[2], 1.8, 0.010),  # 180 tokens/s
    ):
        for _ in range(3):  # the first round is a warm-up
            source.add(tokens, seconds)
    decisions = 8 * PROBE_EVERY
    far = [i for i in range(decisions) if hybrid._yields[True].prefers_lookup(1)]
    near = [i for i in range(decisions) if hybrid._yields[True].prefers_lookup(2)]
    assert len(far) == decisions // (4 * PROBE_EVERY)
    assert far[1] - far[0] == 4 * PROBE_EVERY
    assert len(near) == decisions // 18 and near[1] - near[0] == 18  # ceil(16 x 200 / 180)


def test_rounds_without_the_network_copy_up_to_lookup_tokens(target: torch.nn.Module) -> None:
    """A round that only copies is not bound by N (a copy costs no drafting): its width reaches
    past N, never past ``lookup_tokens``, and the output is still the target's greedy one."""
    ids = torch.tensor([REPEATING])
    reference = target.generate(input_ids=ids, max_new_tokens=30, do_sample=False)
    hybrid = HybridDrafter(tiny_eagle_drafter(target), lookup_tokens=6)
    widths = []
    proposed = hybrid.propose
    hybrid.propose = lambda *args: (lambda p: (widths.append(p.tokens.shape[1]), p)[1])(
        proposed(*args)
    )
    decoder = SpeculativeDecoder(target, hybrid, 2)
    out = decoder.generate(ids, max_new_tokens=30)
    assert torch.equal(out.sequences, reference)
    assert hybrid.usage()["rounds_without_network"] > 0
    assert max(widths) > 2 and max(widths) <= 6, widths
    assert 2 < len(out.stats.accepted_per_position) <= 6  # positions past N were verified


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (True, TypeError), (2.0, TypeError)])
def test_lookup_tokens_must_be_a_positive_int(
    target: torch.nn.Module, value: object, error: type
) -> None:
    with pytest.raises(error, match="lookup_tokens"):
        HybridDrafter(tiny_eagle_drafter(target), lookup_tokens=value)


def test_copies_stop_at_the_requests_last_position(
    target: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy may run past N, never past the request's room: no verify pass reaches a
    position beyond the prompt plus max_new_tokens (a rope that switches frequencies past the
    model's context, or an absolute position table, would otherwise see positions a plain
    decoding of the same request never reaches)."""
    from draftsmith.decode.forward.cached_sequence import CachedSequence

    ids = torch.tensor([REPEATING])
    reach = []
    extend = CachedSequence.extend

    def recorded(self, *args, **kwargs):
        out = extend(self, *args, **kwargs)
        if self.model is target:
            reach.append(int(self.lengths.max()))
        return out

    monkeypatch.setattr(CachedSequence, "extend", recorded)
    for max_new_tokens in (3, 7, 12):
        reach.clear()
        hybrid = HybridDrafter(tiny_eagle_drafter(target), lookup_tokens=10)
        decoder = SpeculativeDecoder(target, hybrid, 2)
        out = decoder.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=[])
        reference = target.generate(
            input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None
        )
        assert torch.equal(out.sequences, reference)
        # As far as a chain's last round reaches (it drafts one token even with one left).
        assert max(reach) <= ids.shape[1] + max_new_tokens, (max_new_tokens, reach)


def test_wide_lookup_rounds_follow_target_law(target: torch.nn.Module) -> None:
    """Every row copies (a round without the network, up to ``lookup_tokens`` past N) when
    sampling: the first two tokens still follow the prompt's exact law."""
    rows = 1500
    sampling = SamplingConfig(temperature=1.0)
    prompts = torch.tensor([EVERY_TOKEN] * rows)
    hybrid = HybridDrafter(_learned(target, "eagle3"), lookup_tokens=6)
    widths = []
    proposed = hybrid.propose
    hybrid.propose = lambda *args: (lambda p: (widths.append(p.tokens.shape[1]), p)[1])(
        proposed(*args)
    )
    decoder = SpeculativeDecoder(target, hybrid, 2)
    out = decoder.generate(
        prompts,
        max_new_tokens=8,
        temperature=1.0,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(0),
    )
    assert widths[0] > 2 and hybrid.usage()["rounds_without_network"] >= 1, widths
    new = out.sequences[:, prompts.shape[1] :]
    first_law, second_law = exact_two_token_law(target, torch.tensor(EVERY_TOKEN), sampling)
    assert chi_square_p_value(torch.bincount(new[:, 0], minlength=64), first_law) > 1e-4
    assert chi_square_p_value(torch.bincount(new[:, 1], minlength=64), second_law) > 1e-4


def test_lookup_tokens_applies_to_a_hybrid_only(target: torch.nn.Module) -> None:
    from draftsmith.decode.drafters.hybrid import set_lookup_tokens

    hybrid = HybridDrafter(tiny_eagle_drafter(target))
    set_lookup_tokens(hybrid, None, "--lookup-tokens")  # None keeps the default
    assert hybrid.lookup_tokens == LOOKUP_DRAFT_TOKENS
    set_lookup_tokens(hybrid, 3, "--lookup-tokens")
    assert hybrid.lookup_tokens == 3
    with pytest.raises(ValueError, match="lookup_tokens must be >= 1"):
        hybrid.lookup_tokens = 0
    with pytest.raises(ValueError, match=r"--lookup-tokens sets .* this drafter is eagle3"):
        set_lookup_tokens(tiny_eagle_drafter(target), 3, "--lookup-tokens")


def test_greedy_and_sampled_rows_keep_their_own_yields(target: torch.nn.Module) -> None:
    """Lookup's one-hot drafts are accepted far more often greedily: what greedy rounds
    measured does not choose for sampled rows (a server's lanes share one hybrid's yields),
    and the reverse."""
    hybrid = HybridDrafter(DraftModelDrafter(noisy_copy(target, 0.5)))
    greedy, sampled = hybrid._yields[True], hybrid._yields[False]
    for _ in range(3):  # the first round is a warm-up
        for matched in range(1, len(greedy.lookup)):
            greedy.lookup[matched].add(1.0, 0.1)  # greedily, lookup at 10 tokens/s
            sampled.lookup[matched].add(8.0, 0.01)  # sampling, at 800
        greedy.learned.add(4.0, 0.01)  # the learned drafter at 400 tokens/s
        sampled.learned.add(1.0, 0.01)  # and at 100
    decoder = SpeculativeDecoder(target, hybrid, 3)
    prompt = torch.tensor([REPEATING])
    decoder.generate(prompt, max_new_tokens=12, eos_token_id=[])
    after_greedy = hybrid.usage()
    assert after_greedy["lookup_rows"] == 0 < after_greedy["learned_rows"], after_greedy
    decoder.generate(
        prompt,
        max_new_tokens=12,
        eos_token_id=[],
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    assert hybrid.usage()["lookup_rows"] > 0, hybrid.usage()
