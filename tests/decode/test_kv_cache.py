"""Rollback keeps exactly the committed sequence: crop + step equals a fresh prefill."""

from __future__ import annotations

import torch
from tiny_models import tiny_llama, tiny_qwen2

from decode.kv_cache import CachedSequence, PreallocatedLayer
from decode.output_head import OutputHead


def test_rollback_then_step_equals_fresh_prefill() -> None:
    model = tiny_llama(seed=0)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 64, (2, 6), generator=generator)
    block = torch.randint(3, 64, (2, 4), generator=generator)
    follow = torch.randint(3, 64, (2, 1), generator=generator)
    keep = torch.tensor([1, 3])  # row 0 keeps 1 of the 4 block tokens, row 1 keeps 3

    with torch.no_grad():
        sequence = CachedSequence(model, 2, torch.device("cpu"))
        sequence.extend(prompt)
        sequence.extend(block)
        sequence.rollback(4, keep)
        assert sequence.num_slots == 6 + 3  # slots past the longest kept row are cropped
        assert sequence.lengths.tolist() == [7, 9]
        stepped = sequence.extend(follow).logits[:, -1]

        for row in range(2):
            committed = torch.cat([prompt[row], block[row, : keep[row]], follow[row]])
            fresh = model(committed[None]).logits[0, -1]
            assert torch.allclose(stepped[row], fresh, atol=1e-10)


def test_keep_path_keeps_a_tree_branch() -> None:
    model = tiny_llama(seed=0)
    prompt = torch.tensor([[5, 6, 7]])
    # Flattened "tree": nodes 0..3; keep the branch 0 -> 2 (nodes 1 and 3 are discarded).
    nodes = torch.tensor([[10, 11, 12, 13]])
    tree_mask = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool
    )
    positions = torch.tensor([[3, 4, 4, 5]])
    with torch.no_grad():
        sequence = CachedSequence(model, 1, torch.device("cpu"))
        sequence.extend(prompt)
        sequence.extend(nodes, tree_mask=tree_mask, positions=positions)
        sequence.keep_path(4, torch.tensor([[0, 2]]), torch.tensor([[True, True]]))
        stepped = sequence.extend(torch.tensor([[20]])).logits[0, -1]
        fresh = model(torch.tensor([[5, 6, 7, 10, 12, 20]])).logits[0, -1]
    assert torch.allclose(stepped, fresh, atol=1e-10)


def test_cache_growth_past_capacity_matches_fresh_prefill() -> None:
    """A block that crosses the capacity the prefill allocated (at least 256 slots) grows it."""
    model = tiny_llama(seed=1)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 64, (1, 250), generator=generator)
    block = torch.randint(3, 64, (1, 12), generator=generator)
    with torch.no_grad():
        sequence = CachedSequence(model, 1, torch.device("cpu"), OutputHead.for_model(model))
        sequence.extend(prompt[:, :10])  # capacity 256
        sequence.extend(prompt[:, 10:])  # 250 slots: fits
        stepped = sequence.extend(block).logits[0]  # 262 slots: grows
        assert isinstance(sequence.cache.layers[0], PreallocatedLayer)
        assert sequence.cache.layers[0]._key_buffer.shape[2] >= 262
        assert sequence.cache.get_seq_length() == 262
        fresh = model(torch.cat([prompt, block], dim=1)).logits[0, -12:]
    assert torch.allclose(stepped, fresh, atol=1e-10)


def test_output_head_equals_the_model_head_and_follows_weight_updates() -> None:
    model = tiny_qwen2(seed=2)
    head = OutputHead.for_model(model)
    assert head is not None
    hidden = torch.randn(2, 3, model.config.hidden_size, dtype=model.dtype)
    with torch.no_grad():
        assert torch.allclose(head(hidden), model.lm_head(hidden), atol=1e-12)
        model.lm_head.weight.mul_(2.0)  # an in-place update must not leave a stale copy
        assert torch.allclose(head(hidden), model.lm_head(hidden), atol=1e-12)


def test_output_head_layouts_agree_for_every_row_count_in_float32() -> None:
    """1-3 rows, 4-8 rows and longer blocks take different products (oneDNN for the last)."""
    model = tiny_llama(seed=5, dtype=torch.float32)
    head = OutputHead.for_model(model)
    with torch.no_grad():
        for rows in (1, 2, 3, 5, 8, 9, 13, 40):
            hidden = torch.randn(1, rows, model.config.hidden_size)
            assert torch.allclose(head(hidden), model.lm_head(hidden), atol=1e-4), rows


def test_output_head_falls_back_for_heads_it_does_not_know() -> None:
    model = tiny_llama(seed=0)
    model.config.model_type = "gemma2"  # logits soft-capped after the projection
    assert OutputHead.for_model(model) is None
