"""Exactness over the configuration space of the families the decoder serves.

Greedy speculative output equals Hugging Face ``generate(do_sample=False)`` for every rope type
transformers offers these families, sliding windows smaller than the sequence (Mistral, Qwen2,
Qwen3, Gemma2, Gemma3), grouped/multi-query attention, biases and tied heads: batch 1 and a
ragged left-padded batch of 3, the lean forward on and off, drafts of 1 and 4 tokens from
drafters that get rejected (so the target's cache has holes). The lean forward's logits are
compared with the model's own forward directly, in float32.
"""

from __future__ import annotations

import pytest
import torch
from decode_helpers import AdversarialDrafter, noisy_copy
from draftsmith.decode import DraftModelDrafter, SpeculativeDecoder
from draftsmith.decode.forward.cached_sequence import CachedSequence
from draftsmith.decode.forward.lean_decoder import LeanDecoder
from draftsmith.decode.forward.output_head import OutputHead
from family_variants import (
    LEAN_FAMILIES,
    NEW_TOKENS,
    VARIANTS,
    VOCAB,
    build_variant,
    longrope,
    ragged_prompts,
)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_greedy_speculative_output_equals_generate(name: str) -> None:
    target = build_variant(name, torch.float32 if name.startswith("gemma2") else torch.float64)
    lean_options = (True, False) if VARIANTS[name][0] in LEAN_FAMILIES else (False,)
    noisy = DraftModelDrafter(noisy_copy(target, 0.5))
    drafters = ((1, noisy), (4, noisy), (4, AdversarialDrafter(target)))  # rejections: holes
    for batch in (1, 3):
        ids, mask = ragged_prompts(batch)
        reference = target.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False
        )
        for lean in lean_options:
            for num_draft_tokens, drafter in drafters:
                decoder = SpeculativeDecoder(target, drafter, num_draft_tokens, lean_target=lean)
                assert (decoder._target_decoder is not None) == lean
                out = decoder.generate(ids, mask, max_new_tokens=NEW_TOKENS)
                assert torch.equal(out.sequences, reference), (
                    batch,
                    lean,
                    num_draft_tokens,
                    drafter.kind,
                )


def _steps(batch: int, generator: torch.Generator) -> list[dict]:
    """Prefill with left padding, a step, a block with a hole, a long block."""
    prompt = torch.randint(3, VOCAB, (batch, 7), generator=generator)
    prompt_valid = torch.ones_like(prompt, dtype=torch.bool)
    prompt_valid[1:, :3] = False
    hole = torch.ones(batch, 2, dtype=torch.bool)
    hole[1:, 0] = False
    return [
        dict(tokens=prompt, valid=prompt_valid, output_hidden_states=True),
        dict(tokens=torch.randint(3, VOCAB, (batch, 1), generator=generator)),
        dict(tokens=torch.randint(3, VOCAB, (batch, 2), generator=generator), valid=hole),
        dict(tokens=torch.randint(3, VOCAB, (batch, 4), generator=generator)),
    ]


def _assert_close(reference, lean, valid: torch.Tensor | None = None) -> None:
    keep = slice(None) if valid is None else valid  # [B, W] bool: padding/holes are never read
    error = (lean.logits[keep] - reference.logits[keep]).abs().max()
    assert error <= 1e-4, float(error)


def _compare_lean_with_model(model: torch.nn.Module, rounds: int = 1) -> None:
    """The lean and the model forward, driven through the same calls: holes, rollbacks, trees."""
    head, lean = OutputHead.for_model(model), LeanDecoder.for_model(model)
    assert head is not None and lean is not None
    cpu = torch.device("cpu")
    reference, mine = CachedSequence(model, 2, cpu, head), CachedSequence(model, 2, cpu, head, lean)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for step in _steps(2, generator):
            _assert_close(reference.extend(**step), mine.extend(**step), step.get("valid"))
        for _ in range(rounds):
            block = dict(tokens=torch.randint(3, VOCAB, (2, 4), generator=generator))
            _assert_close(reference.extend(**block), mine.extend(**block))
            keep = torch.tensor([1, 3])
            reference.rollback(4, keep)
            mine.rollback(4, keep)
            tree = dict(
                tokens=torch.randint(3, VOCAB, (2, 3), generator=generator),
                tree_mask=torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool),
                positions=mine.lengths[:, None] + torch.tensor([[0, 1, 1]]),
            )
            _assert_close(reference.extend(**tree), mine.extend(**tree))
            path, path_valid = torch.tensor([[0, 2], [0, 1]]), torch.ones(2, 2, dtype=torch.bool)
            reference.keep_path(3, path, path_valid)
            mine.keep_path(3, path, path_valid)
            last = dict(tokens=torch.randint(3, VOCAB, (2, 1), generator=generator))
            _assert_close(reference.extend(**last), mine.extend(**last))


@pytest.mark.parametrize(
    "name", sorted(name for name, (kind, _) in VARIANTS.items() if kind in LEAN_FAMILIES)
)
def test_lean_logits_equal_the_model_forward_in_float32(name: str) -> None:
    _compare_lean_with_model(build_variant(name, torch.float32), rounds=2)


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        # Dynamic NTK past max_position_embeddings: the frequencies follow each call's largest
        # position, as the model's forward recomputes them.
        ("llama-dynamic", dict(max_position_embeddings=12)),
        # Longrope crossing original_max_position_embeddings part-way (short, then long).
        ("llama-longrope-short", dict(rope_parameters=longrope(14))),
    ],
)
def test_lean_follows_call_dependent_rope_past_its_threshold(name: str, extra: dict) -> None:
    _compare_lean_with_model(build_variant(name, torch.float32, **extra), rounds=4)


def test_lean_longrope_keeps_short_factors_for_short_sequences() -> None:
    """A lean table grown past original_max_position_embeddings (by a long sequence, or by
    rounding its size up) must not hand a short sequence the long factors."""
    model = build_variant("llama-longrope-short", torch.float32, rope_parameters=longrope(16))
    head, lean = OutputHead.for_model(model), LeanDecoder.for_model(model)
    cpu = torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(3, VOCAB, (1, 24), generator=generator)
    short_prompt = torch.randint(3, VOCAB, (1, 6), generator=generator)
    with torch.no_grad():
        for prompt in (short_prompt, long_prompt, short_prompt):
            expected = model(prompt).logits
            got = CachedSequence(model, 1, cpu, head, lean).extend(prompt).logits
            assert (got - expected).abs().max() <= 1e-4
