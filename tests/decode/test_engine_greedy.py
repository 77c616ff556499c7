"""Greedy speculative output equals the target's own greedy ``generate``, token for token."""

from __future__ import annotations

import pytest
import torch
from decode_helpers import AdversarialDrafter, noisy_copy
from draftsmith.decode import DraftModelDrafter, NgramDrafter, NoDrafter, SpeculativeDecoder
from tiny_models import tiny_llama, tiny_qwen2


def _ragged_prompts(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (batch, 10), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        mask[row, : (3 * row) % 9] = 0
    ids[mask == 0] = 0
    return ids, mask


def _drafters(target: torch.nn.Module, other_draft: torch.nn.Module) -> dict[str, object]:
    return {
        "perfect": DraftModelDrafter(target),
        "noisy": DraftModelDrafter(noisy_copy(target, 0.5)),
        "random": DraftModelDrafter(other_draft),
        "adversarial": AdversarialDrafter(target),
        "ngram": NgramDrafter(vocab_size=64),
        "none": NoDrafter(vocab_size=64),
    }


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("lean_target", [True, False])
def test_greedy_equals_target_generate(architecture: str, batch: int, lean_target: bool) -> None:
    build = tiny_llama if architecture == "llama" else tiny_qwen2
    target, other = build(seed=0), build(num_layers=1, seed=1)
    ids, mask = _ragged_prompts(batch)
    reference = target.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False
    )
    for name, drafter in _drafters(target, other).items():
        for num_draft_tokens in (1, 3, 8):
            decoder = SpeculativeDecoder(
                target, drafter, num_draft_tokens=num_draft_tokens, lean_target=lean_target
            )
            assert (decoder._target_decoder is not None) == lean_target
            out = decoder.generate(ids, attention_mask=mask, max_new_tokens=16)
            assert torch.equal(out.sequences, reference), (name, num_draft_tokens)


def test_no_drafter_decodes_one_token_per_target_pass() -> None:
    target = tiny_llama(seed=0)
    ids, mask = _ragged_prompts(2)
    out = SpeculativeDecoder(target, NoDrafter(vocab_size=64), 4).generate(
        ids, mask, max_new_tokens=12, eos_token_id=[]
    )
    assert out.stats.tau == 1.0
    assert out.stats.target_forward_passes == 11  # the prefill emits the first token


def test_acceptance_matches_drafter_quality() -> None:
    target = tiny_llama(seed=0)
    ids, mask = _ragged_prompts(2)
    perfect = SpeculativeDecoder(target, DraftModelDrafter(target), 4).generate(
        ids, mask, max_new_tokens=30, eos_token_id=[]
    )
    adversarial = SpeculativeDecoder(target, AdversarialDrafter(target), 4).generate(
        ids, mask, max_new_tokens=30, eos_token_id=[]
    )
    assert perfect.stats.alpha_per_position == [1.0] * 4
    assert adversarial.stats.alpha_per_position[0] == 0.0
    assert adversarial.stats.tau == 1.0
    # Every pass after the prefill emits 1 + accepted tokens per row.
    assert perfect.stats.tokens_emitted == 2 * 30
    assert perfect.stats.predicted_tau == pytest.approx(perfect.stats.tau, rel=0.1)


def test_eos_stops_row_and_max_new_tokens_is_respected() -> None:
    target = tiny_llama(seed=0)
    ids, mask = _ragged_prompts(4, seed=3)
    plain = target.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=[]
    )
    # Pick, as EOS, a token that row 0 emits part-way through its continuation.
    eos = int(plain[0, ids.shape[1] + 5])
    reference = target.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=20,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    decoder = SpeculativeDecoder(target, DraftModelDrafter(noisy_copy(target, 0.3)), 4)
    out = decoder.generate(ids, mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out.sequences, reference)
    new = out.sequences[0, ids.shape[1] :].tolist()
    assert eos in new and all(token == 0 for token in new[new.index(eos) + 1 :])
    for max_new in (1, 2, 7):
        out = decoder.generate(ids, mask, max_new_tokens=max_new, eos_token_id=[])
        assert out.sequences.shape[1] == ids.shape[1] + max_new
        assert out.stats.tokens_emitted == 4 * max_new


def test_greedy_equality_holds_on_the_whole_model_path() -> None:
    """Architectures without a known plain head run the full model forward instead."""
    target = tiny_llama(seed=0)
    target.config.model_type = "unlisted"  # OutputHead.for_model declines it
    ids, mask = _ragged_prompts(4)
    reference = target.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False
    )
    decoder = SpeculativeDecoder(target, DraftModelDrafter(noisy_copy(target, 0.5)), 3)
    assert decoder._target_head is None and decoder.drafter._head is None
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=16)
    assert torch.equal(out.sequences, reference)
