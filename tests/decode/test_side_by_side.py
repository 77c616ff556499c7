"""``draftsmith.decode.measure.side_by_side``: repeated interleaved passes time each prompt by its fastest
reproduction, and every method re-seeds per prompt so that a repeat decodes the same tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from draftsmith.decode.drafters.draft_lm import DraftModelDrafter
from draftsmith.decode.drafters.registry import load_drafter
from draftsmith.decode.measure import side_by_side
from draftsmith.decode.measure.side_by_side import (
    EvalSettings,
    measure_side_by_side,
    plain_method,
    prompt_seed,
    speculative_method,
)
from draftsmith.decode.stats import DecodeStats

PROMPTS = [torch.tensor([[5, 17, 9, 33, 2, 40]]), torch.tensor([[7, 21, 8]])]


class ScriptedClock:
    """A ``time`` stand-in whose clock moves only when a scripted method says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def scripted_method(clock: ScriptedClock, durations: dict[int, list[float]], outputs=None):
    """A method that takes ``durations[index][call]`` seconds and returns the prompt plus one
    token (or ``outputs[index][call]``), with stats whose draft time names the call."""
    calls: dict[int, int] = {}

    def run(ids: torch.Tensor, index: int):
        call = calls.get(index, 0)
        calls[index] = call + 1
        clock.now += durations[index][call]
        new = torch.tensor([[1 if outputs is None else outputs[index][call]]])
        return torch.cat((ids, new), dim=1), DecodeStats(draft_seconds=float(call))

    return run


def test_each_prompt_is_timed_by_its_fastest_repeat(monkeypatch) -> None:
    clock = ScriptedClock()
    monkeypatch.setattr(side_by_side, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    durations = {0: [3.0, 1.0, 2.0], 1: [0.5, 4.0, 0.75]}
    method = scripted_method(clock, durations)
    results = measure_side_by_side(
        torch.nn.Linear(2, 2), {"m": method}, PROMPTS, warmup=False, repeats=3
    )
    result = results["m"]
    assert result.seconds == pytest.approx(1.0 + 0.5)  # the minimum per prompt, summed
    assert result.tokens == 2 and len(result.outputs) == 2  # counted once, not per repeat
    assert result.unreproduced == 0
    # The stats come from the timed calls: repeat 1 for prompt 0, repeat 0 for prompt 1.
    assert result.stats.draft_seconds == pytest.approx(1.0 + 0.0)


def test_without_a_reproducing_method_a_changing_prompt_keeps_its_first_pass(monkeypatch) -> None:
    clock = ScriptedClock()
    monkeypatch.setattr(side_by_side, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    durations = {0: [3.0, 1.0], 1: [2.0, 0.5]}
    outputs = {0: [4, 9], 1: [6, 6]}  # prompt 0's repeat decodes another token
    method = scripted_method(clock, durations, outputs)
    results = measure_side_by_side(
        torch.nn.Linear(2, 2), {"m": method}, PROMPTS, warmup=False, repeats=2
    )
    assert results["m"].seconds == pytest.approx(3.0 + 0.5)
    assert results["m"].unreproduced == 1
    assert results["m"].outputs[0][0, -1].item() == 4  # the first repeat's output stays


def test_a_method_that_does_not_reproduce_is_timed_on_the_quietest_pass(monkeypatch) -> None:
    """Its own fastest pass would also be its luckiest sample: it takes the pass in which the
    reproducing methods together ran fastest, with that pass's tokens and counters."""
    clock = ScriptedClock()
    monkeypatch.setattr(side_by_side, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    steady = {0: [2.0, 1.0, 3.0], 1: [1.0, 2.0, 3.0]}  # prompt 0: pass 1 quietest; 1: pass 0
    other = {0: [1.0, 0.5, 0.25], 1: [6.0, 4.0, 5.0]}
    methods = {
        "reference": scripted_method(clock, {0: [5.0, 5.0, 5.0], 1: [1.0, 1.0, 1.0]}),
        "steady": scripted_method(clock, steady),
        "adaptive": scripted_method(clock, other, outputs={0: [4, 9, 9], 1: [6, 7, 6]}),
    }
    results = measure_side_by_side(torch.nn.Linear(2, 2), methods, PROMPTS, warmup=False, repeats=3)
    adaptive = results["adaptive"]
    assert adaptive.unreproduced == 2 + 1
    assert adaptive.seconds == pytest.approx(0.5 + 6.0)  # passes 1 and 0; its own: 0.25 + 4
    assert [out[0, -1].item() for out in adaptive.outputs] == [9, 6]
    assert adaptive.stats.draft_seconds == pytest.approx(1.0 + 0.0)  # the same passes' stats
    assert results["steady"].seconds == pytest.approx(1.0 + 1.0)  # its own fastest, as ever
    assert results["steady"].unreproduced == 0


def test_repeats_must_be_positive() -> None:
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        measure_side_by_side(torch.nn.Linear(2, 2), {}, PROMPTS, repeats=0)


def test_prompt_seeds_differ_between_prompts_and_runs() -> None:
    seeds = {prompt_seed(seed, index) for seed in range(5) for index in range(100)}
    assert len(seeds) == 500


@pytest.mark.parametrize("kind", ["ngram", "draft_lm"])
def test_sampled_decoding_repeats_exactly(llama_target, llama_draft, kind: str) -> None:
    """At T = 1 every repeat of every method decodes the same tokens: ours (seeded per prompt)
    and HF ``generate`` (the global generator, seeded per prompt), so the minimum is honest."""
    settings = EvalSettings(num_draft_tokens=3, max_new_tokens=10, temperature=1.0, seed=3)
    drafter = (
        DraftModelDrafter(llama_draft)
        if kind == "draft_lm"
        else load_drafter(None, llama_target, kind=kind)
    )
    methods = {
        "hf": plain_method(llama_target, settings),
        "ours": speculative_method(llama_target, drafter, settings),
    }
    once = measure_side_by_side(llama_target, methods, PROMPTS, warmup=False)
    thrice = measure_side_by_side(llama_target, methods, PROMPTS, warmup=False, repeats=3)
    for name in methods:
        assert thrice[name].unreproduced == 0
        for a, b in zip(once[name].outputs, thrice[name].outputs, strict=True):
            assert torch.equal(a, b)  # a seed per prompt: the same draws on every pass
    assert thrice["ours"].stats.rounds == once["ours"].stats.rounds


def test_flag_types_refuse_bad_values() -> None:
    """Temperatures, top-p, top-k and seeds out of range are argparse errors, not traces."""
    import argparse

    from draftsmith.decode.measure.side_by_side import (
        at_least_zero,
        seed_value,
        temperature_value,
        top_p_value,
    )

    assert temperature_value("0.7") == 0.7 and top_p_value("1") == 1.0
    assert at_least_zero("0") == 0 and seed_value("4294967295") == 2**32 - 1
    for parse, texts in (
        (temperature_value, ("nan", "inf", "-1", "hot")),
        (top_p_value, ("nan", "0", "1.5", "x")),
        (at_least_zero, ("-1", "2.5")),
        (seed_value, ("-1", str(2**64), "x")),
    ):
        for text in texts:
            with pytest.raises(argparse.ArgumentTypeError, match="must be"):
                parse(text)


def test_device_context_and_chat_template_checks(tiny_pair_dirs) -> None:
    from draftsmith.decode.loading import check_device
    from draftsmith.decode.measure.side_by_side import check_context, encode_prompt
    from transformers import AutoTokenizer

    assert check_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="not a device torch knows"):
        check_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device; pass --device cpu"):
            check_device("cuda")
    target = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=32, rope_scaling=None))
    check_context(target, [torch.zeros(1, 10)], 22)
    with pytest.raises(ValueError, match="pass --max-new-tokens 22 or less"):
        check_context(target, [torch.zeros(1, 10)], 23)
    target.config.rope_scaling = {"rope_type": "dynamic"}  # scales past its context: allowed
    check_context(target, [torch.zeros(1, 10)], 1000)
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair_dirs[0])
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="tokenizer has no chat template"):
        encode_prompt(tokenizer, [{"role": "user", "content": "hi"}])


def test_tree_flags_without_tree_are_refused() -> None:
    from draftsmith.decode.measure.side_by_side import tree_flags_problem

    def args(**kw):
        base = dict(tree=False, tree_when_sampling=False, tree_top_k=4, tree_total_tokens=12)
        return SimpleNamespace(**(base | {"tree_frontier": 0} | kw))

    from draftsmith.decode.defaults import TREE_TOP_K, TREE_TOTAL_TOKENS

    plain = args(tree_top_k=TREE_TOP_K, tree_total_tokens=TREE_TOTAL_TOKENS)
    assert tree_flags_problem(plain) is None
    problem = tree_flags_problem(
        args(tree_top_k=TREE_TOP_K + 1, tree_total_tokens=TREE_TOTAL_TOKENS)
    )
    assert problem == "--tree-top-k only apply with --tree: add --tree, or drop them"
    problem = tree_flags_problem(
        args(tree_top_k=TREE_TOP_K, tree_total_tokens=TREE_TOTAL_TOKENS, tree_when_sampling=True)
    )
    assert "--tree-when-sampling" in problem
    assert "frontier must lie" in tree_flags_problem(args(tree=True, tree_frontier=-1))
