"""Tree drafting in the engine: EAGLE-3 dynamic trees and Medusa static trees stay exact."""

from __future__ import annotations

import pytest
import torch
from decode_helpers import (
    chi_square_p_value,
    exact_two_token_law,
    tiny_eagle_drafter,
    tiny_medusa_drafter,
)
from draftsmith.decode import SpeculativeDecoder
from draftsmith.decode.drafters.base import TreeSpec
from draftsmith.decode.sampling import SamplingConfig
from tiny_models import tiny_llama

CHAIN_OF_THREE = TreeSpec(choices=((0,), (0, 0), (0, 0, 0)))


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(num_layers=4, seed=0)


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 64, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :2] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize(
    ("name", "tree"),
    [
        ("eagle", None),
        ("eagle", TreeSpec(top_k=3, total_tokens=10)),
        ("eagle", TreeSpec(top_k=3, total_tokens=9, frontier=1)),
        ("eagle", TreeSpec(top_k=3, total_tokens=11, frontier=2)),
        ("eagle_two_layers", TreeSpec(top_k=3, total_tokens=10)),
        ("medusa", None),
        ("medusa", TreeSpec()),
        ("medusa", CHAIN_OF_THREE),
    ],
)
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tree_equals_target_generate(target, name, tree, batch) -> None:
    ids, mask = _prompts()
    ids, mask = ids[:batch], mask[:batch]
    reference = target.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False
    )
    drafter = {
        "eagle": lambda: tiny_eagle_drafter(target),
        "eagle_two_layers": lambda: tiny_eagle_drafter(target, num_layers=2),
        "medusa": lambda: tiny_medusa_drafter(target),
    }[name]()
    out = SpeculativeDecoder(target, drafter, num_draft_tokens=3, tree=tree).generate(
        ids, mask, max_new_tokens=20
    )
    assert torch.equal(out.sequences, reference)


def test_chain_shaped_tree_decodes_like_the_chain(target) -> None:
    ids, mask = _prompts()
    chain = SpeculativeDecoder(target, tiny_medusa_drafter(target), 3).generate(
        ids, mask, max_new_tokens=16
    )
    tree = SpeculativeDecoder(target, tiny_medusa_drafter(target), 3, tree=CHAIN_OF_THREE).generate(
        ids, mask, max_new_tokens=16
    )
    assert torch.equal(chain.sequences, tree.sequences)
    assert chain.stats.accepted_per_position == tree.stats.accepted_per_position
    assert chain.stats.target_forward_passes == tree.stats.target_forward_passes


@pytest.mark.parametrize("name", ["eagle", "medusa"])
def test_sampled_tree_output_follows_target_law(target, name) -> None:
    prompt = torch.tensor([5, 9, 5, 9, 5, 9, 5])
    sampling = SamplingConfig(temperature=1.0)
    first_law, second_law = exact_two_token_law(target, prompt, sampling)
    drafter = tiny_eagle_drafter(target) if name == "eagle" else tiny_medusa_drafter(target)
    tree = TreeSpec(top_k=3, total_tokens=9) if name == "eagle" else TreeSpec()
    out = SpeculativeDecoder(target, drafter, 3, tree=tree).generate(
        prompt[None].repeat(3000, 1),
        max_new_tokens=2,
        temperature=1.0,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(0),
    )
    new = out.sequences[:, prompt.numel() :]
    assert chi_square_p_value(torch.bincount(new[:, 0], minlength=64), first_law) > 1e-4
    assert chi_square_p_value(torch.bincount(new[:, 1], minlength=64), second_law) > 1e-4
    assert out.stats.accepted_per_position[0] > 0  # the tree's drafts were really verified


def test_chain_only_drafter_refuses_tree_settings(target) -> None:
    from draftsmith.decode import DraftModelDrafter

    with pytest.raises(ValueError, match="drafts chains only"):
        SpeculativeDecoder(target, DraftModelDrafter(target), 3, tree=TreeSpec())


def test_adaptive_rounds_deeper_than_medusas_heads_stay_exact(target) -> None:
    """An adaptive decoder's rounds stop at the heads' count (head i drafts the token i + 1
    places ahead), tree and chain alike: its N is a bound, lowered to the drafter's; a fixed
    chain decoder refuses a longer chain before any forward pass."""
    ids, mask = _prompts()
    reference = target.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False
    )
    for tree in (TreeSpec(), None):
        decoder = SpeculativeDecoder(
            target, tiny_medusa_drafter(target, num_heads=2), 4, tree=tree, adaptive=True
        )
        assert decoder.draft_length is not None
        out = decoder.generate(ids, mask, max_new_tokens=20)
        assert torch.equal(out.sequences, reference)
        assert len(out.stats.accepted_per_position) <= 2
    with pytest.raises(ValueError, match="at most 2 tokens per chain"):
        SpeculativeDecoder(target, tiny_medusa_drafter(target, num_heads=2), 4)
