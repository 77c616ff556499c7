"""A draft LM with a pruned draft vocabulary stays exact: greedy output equals the target's own
``generate``, sampled output follows the target's law (chi-square on the first two tokens), and
its proposals lie in the draft vocabulary with ``q`` zero elsewhere (docs/theory.md §1, §7)."""

from __future__ import annotations

import copy

import pytest
import torch
from decode_helpers import chi_square_p_value, exact_two_token_law, noisy_copy
from draftsmith.decode import DraftModelDrafter, SpeculativeDecoder
from draftsmith.decode.drafters.vocab_map import (
    VocabMap,
    to_draft_ids,
    to_target_ids,
    to_target_probs,
)
from draftsmith.decode.sampling import SamplingConfig
from tiny_models import TINY_VOCAB, tiny_llama, tiny_qwen2

DRAFT_VOCAB = 40
ROWS = 3000
P_VALUE_FLOOR = 1e-4


def _kept_ids(seed: int = 3) -> torch.Tensor:  # [DRAFT_VOCAB] strictly increasing target ids
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(TINY_VOCAB, generator=generator)[:DRAFT_VOCAB].sort().values


def pruned_drafter(model: torch.nn.Module, ids: torch.Tensor) -> DraftModelDrafter:
    """``model`` with its output layer cut to the rows ``ids`` (the draft vocabulary)."""
    pruned = copy.deepcopy(model)
    full = pruned.get_output_embeddings().weight
    head = torch.nn.Linear(full.shape[1], ids.numel(), bias=False, dtype=full.dtype)
    with torch.no_grad():
        head.weight.copy_(full[ids])
    pruned.set_output_embeddings(head)
    return DraftModelDrafter(pruned, VocabMap(ids, TINY_VOCAB))


def test_vocab_map_round_trip_and_checks() -> None:
    ids = _kept_ids()
    vocab_map = VocabMap(ids, TINY_VOCAB)
    d2t, t2d = vocab_map.maps()
    assert torch.equal(VocabMap.from_maps(d2t, t2d).draft_to_target, ids)
    draft = torch.arange(DRAFT_VOCAB)
    assert torch.equal(to_draft_ids(to_target_ids(draft, ids), ids, TINY_VOCAB), draft)
    assert int((to_draft_ids(torch.arange(TINY_VOCAB), ids, TINY_VOCAB) >= 0).sum()) == DRAFT_VOCAB
    probs = torch.softmax(torch.randn(2, DRAFT_VOCAB), -1)
    placed = to_target_probs(probs, ids, TINY_VOCAB)
    assert torch.equal(placed[:, ids], probs) and float(placed[:, ~t2d].abs().sum()) == 0.0
    with pytest.raises(ValueError, match="strictly increasing"):
        VocabMap.from_maps(d2t.flip(0), t2d)
    wrong = t2d.clone()
    wrong[int(torch.nonzero(~t2d)[0])] = True
    with pytest.raises(ValueError, match="t2d must mark exactly"):
        VocabMap.from_maps(d2t, wrong)


def test_head_rows_must_match_the_map() -> None:
    with pytest.raises(ValueError, match="output layer has 64 rows"):
        DraftModelDrafter(tiny_llama(seed=1), VocabMap(_kept_ids(), TINY_VOCAB))


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_target_generate(architecture: str, batch: int) -> None:
    build = tiny_llama if architecture == "llama" else tiny_qwen2
    target = build(seed=0)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, TINY_VOCAB, (batch, 10), generator=generator)
    mask = torch.ones_like(ids)
    mask[1:, :3] = 0
    ids[mask == 0] = 0
    reference = target.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False
    )
    kept = _kept_ids()
    alphas = {}
    for name, model in {"target": target, "noisy": noisy_copy(target, 0.5)}.items():
        for num_draft_tokens in (1, 4):
            drafter = pruned_drafter(model, kept)
            decoder = SpeculativeDecoder(target, drafter, num_draft_tokens=num_draft_tokens)
            out = decoder.generate(ids, attention_mask=mask, max_new_tokens=16)
            assert torch.equal(out.sequences, reference), (name, num_draft_tokens)
            alphas[name, num_draft_tokens] = out.stats.alpha_per_position[0]
    # The target's own pruned copy is right exactly where the target's choice was kept.
    emitted = reference[:, ids.shape[1] :]
    if bool(torch.isin(emitted, kept).all()) or not bool(torch.isin(emitted, kept).any()):
        pytest.fail("the draft vocabulary must keep some and drop some of the emitted tokens")
    assert 0.0 < alphas["target", 1] < 1.0


@pytest.mark.parametrize(
    ("temperature", "top_k"), [(1.0, 0), pytest.param(0.7, 10, marks=pytest.mark.slow)]
)
def test_emitted_tokens_follow_target_law(temperature: float, top_k: int) -> None:
    target = tiny_llama(seed=0)
    prompt = torch.tensor([5, 9, 5, 9, 5, 9, 5, 9, 5])
    sampling = SamplingConfig(temperature=temperature, top_k=top_k)
    first_law, second_law = exact_two_token_law(target, prompt, sampling)
    drafter = pruned_drafter(noisy_copy(target, 0.6), _kept_ids())
    decoder = SpeculativeDecoder(target, drafter, 3)
    out = decoder.generate(
        prompt[None].repeat(ROWS, 1),
        max_new_tokens=2,
        temperature=temperature,
        top_k=top_k,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(0),
    )
    new = out.sequences[:, prompt.numel() :]
    assert chi_square_p_value(torch.bincount(new[:, 0], minlength=64), first_law) > P_VALUE_FLOOR
    assert chi_square_p_value(torch.bincount(new[:, 1], minlength=64), second_law) > P_VALUE_FLOOR
    assert 0.05 < out.stats.alpha_per_position[0] < 0.95


def test_proposals_lie_in_the_draft_vocabulary() -> None:
    target = tiny_llama(seed=0)
    kept = _kept_ids()
    drafter = pruned_drafter(noisy_copy(target, 0.6), kept)
    assert drafter.vocab_size == TINY_VOCAB
    prompt = torch.randint(3, TINY_VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))
    drafter.prefill(prompt, torch.ones_like(prompt), None, prompt[:, -1])
    proposal = drafter.propose(5, SamplingConfig(temperature=1.0), torch.Generator())
    assert bool(torch.isin(proposal.tokens, kept).all())
    assert proposal.probs.shape == (4, 5, TINY_VOCAB)
    outside = torch.ones(TINY_VOCAB, dtype=torch.bool)
    outside[kept] = False
    assert float(proposal.probs[..., outside].abs().sum()) == 0.0
    assert torch.allclose(proposal.probs.sum(-1), torch.ones(4, 5, dtype=proposal.probs.dtype))
    chosen = proposal.probs.gather(-1, proposal.tokens[..., None])
    assert bool((chosen > 0).all())
