"""The lean EAGLE-3 forward computes the head's own mathematics (fused layouts, one cache per
layer)."""

from __future__ import annotations

import pytest
import torch
from draftsmith.decode.drafters.eagle.head import Eagle3Config, Eagle3Head, build_vocab_maps
from draftsmith.decode.drafters.eagle.layers import append_kv, block_visibility
from draftsmith.decode.drafters.eagle.lean import LeanEagle3
from draftsmith.decode.forward.kv_cache import PreallocatedStack
from tiny_models import tiny_llama


def _head(draft_vocab: int, kv_heads: int, layers: int = 1) -> Eagle3Head:
    target = tiny_llama(seed=0)
    torch.manual_seed(0)
    config = Eagle3Config.for_target(
        target.config,
        draft_vocab_size=draft_vocab,
        num_key_value_heads=kv_heads,
        num_hidden_layers=layers,
    )
    head = Eagle3Head(config).double()
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0, 0.3)
    counts = torch.arange(config.target_vocab_size, dtype=torch.float64).flip(0)
    head.set_vocab_maps(*build_vocab_maps(counts, draft_vocab))
    return head


@pytest.mark.parametrize(
    ("draft_vocab", "kv_heads", "layers"), [(64, 4, 1), (20, 2, 1), (20, 1, 1), (20, 2, 3)]
)
def test_lean_steps_equal_the_module(draft_vocab: int, kv_heads: int, layers: int) -> None:
    head = _head(draft_vocab, kv_heads, layers)
    lean = LeanEagle3(head)
    hidden = head.config.hidden_size
    generator = torch.Generator().manual_seed(1)
    num_aux = len(head.config.aux_hidden_state_layer_ids)
    aux = torch.randn(2, 7, num_aux * hidden, generator=generator, dtype=torch.float64)
    embeds = torch.randn(2, 10, hidden, generator=generator, dtype=torch.float64)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, :2] = False  # a left-padded row
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        # A 7-entry block over an empty cache, then three one-entry steps.
        visible = block_visibility(None, valid)
        fused = lean.fuse(aux)
        cache = PreallocatedStack(layers)
        got = lean.step(fused, embeds[:, :7], positions, cache, visible)
        want, past = head(head.fuse(aux), embeds[:, :7], positions, None, visible)
        torch.testing.assert_close(fused, head.fuse(aux), rtol=0, atol=1e-12)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        previous = want[:, -1:]
        for step in range(3):
            block = torch.ones(2, 1, dtype=torch.bool)
            visible = block_visibility(valid, block)
            valid = torch.cat((valid, block), 1)
            step_positions = positions[:, -1:] + 1 + step
            got = lean.step(
                previous, embeds[:, 7 + step : 8 + step], step_positions, cache, visible
            )
            want, new = head(
                previous, embeds[:, 7 + step : 8 + step], step_positions, past, visible
            )
            past = append_kv(past, new)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
            previous = want
        draft = lean.draft_logits(previous)
        torch.testing.assert_close(draft, head.compute_logits(previous), rtol=0, atol=1e-10)
        # Draft-vocabulary choices map to the target ids the head's own scatter gives.
        full = head.to_target_logits(head.compute_logits(previous))
        assert torch.equal(lean.to_target_ids(draft.argmax(-1)), full.argmax(-1))
        probs = torch.softmax(draft, -1)
        torch.testing.assert_close(lean.to_target_probs(probs), torch.softmax(full, -1))


def test_lean_weights_follow_in_place_updates() -> None:
    head = _head(64, 4)
    lean = LeanEagle3(head)
    x = torch.randn(1, 1, head.config.hidden_size, dtype=torch.float64)
    before = lean.draft_logits(x)
    with torch.no_grad():
        head.lm_head.weight.mul_(2.0)
        head.norm.weight.add_(0.5)
    after = lean.draft_logits(x)
    torch.testing.assert_close(after, head.compute_logits(x), rtol=0, atol=1e-10)
    assert not torch.allclose(before, after)
