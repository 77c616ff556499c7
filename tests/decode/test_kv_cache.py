"""Rollback keeps exactly the committed sequence: crop + step equals a fresh prefill."""

from __future__ import annotations

import torch
from tiny_models import tiny_llama

from decode.kv_cache import CachedSequence


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
