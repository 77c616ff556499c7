"""Sampled trees (children drawn from the drafter's q) keep speculative sampling exact.

The EAGLE-3 drafter's ``propose_sampled_tree`` draws the root's children without replacement
(recursive rejection sampling) or i.i.d. (SpecInfer) and continues each as a sampled chain;
``verify_tree_stochastic`` accepts with min(1, p/q) and carries norm(max(0, p - q)) to the next
sibling (docs/theory.md §4). The joint law of emitted tokens is compared with the target's
exact law by chi-square tests, in one batch of many rows and over many batch-1 calls.
"""

from __future__ import annotations

import functools

import pytest
import torch
from decode_helpers import chi_square_p_value, tiny_eagle_drafter
from draftsmith.decode import SpeculativeDecoder
from draftsmith.decode.drafters.base import TreeSpec
from draftsmith.decode.sampling import SamplingConfig
from draftsmith.decode.trees.layout import (
    TreeProposal,
    sampled_tree_chain_lengths,
    sampled_tree_layout,
)
from draftsmith.decode.trees.verify import verify_tree_stochastic
from tiny_models import tiny_llama
from tree_helpers import (
    P_VALUE_FLOOR,
    PROMPT,
    SETTINGS,
    VOCAB,
    assert_follows,
    three_token_law,
)


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(num_layers=4, seed=0)


def _decoder(target: torch.nn.Module, replacement: bool, spec: TreeSpec) -> SpeculativeDecoder:
    drafter = tiny_eagle_drafter(target)
    if replacement:  # SpecInfer's i.i.d. children instead of the default without replacement
        drafter.propose_sampled_tree = functools.partial(
            drafter.propose_sampled_tree, replacement=True
        )
    return SpeculativeDecoder(target, drafter, 3, tree=spec)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "replacement"),
    [(t, k, p, False) for t, k, p in SETTINGS] + [(0.7, 10, 1.0, True), (1.0, 0, 1.0, True)],
)
def test_sampled_tree_batch_follows_target_law(
    target: torch.nn.Module, temperature: float, top_k: int, top_p: float, replacement: bool
) -> None:
    """Many rows of one prompt in one batch; the first round drafts a depth-3 tree.

    The random head rarely gets two tokens right in a row under top-k/top-p; at plain T = 1 it
    does, so the chains' second level is seen accepted there.
    """
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    prompt = torch.tensor(PROMPT)
    decoder = _decoder(target, replacement, TreeSpec(top_k=3, total_tokens=7))
    out = decoder.generate(
        prompt[None].repeat(2500, 1),
        max_new_tokens=5,  # the prefill emits x1, the first round drafts 3 levels
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(0),
    )
    new = out.sequences[:, prompt.numel() :]
    assert_follows(new, three_token_law(target, prompt, sampling), f"batch {replacement}")
    assert out.stats.accepted_per_position[0] > 0  # the tree's drafts were really verified
    if top_k == 0 and top_p == 1.0:
        assert out.stats.accepted_per_position[1] > 0  # and their chains too


@pytest.mark.slow
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_sampled_tree_batch_one_follows_target_law(
    target: torch.nn.Module, temperature: float, top_k: int, top_p: float
) -> None:
    """Many batch-1 calls sharing one generator: a cache reused across calls stays exact."""
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    prompt = torch.tensor(PROMPT)
    decoder = _decoder(target, False, TreeSpec(top_k=2, total_tokens=6))
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(1000):
        out = decoder.generate(
            prompt[None],
            max_new_tokens=5,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_token_id=[],
            generator=generator,
        )
        rows.append(out.sequences[0, prompt.numel() :])
    assert_follows(torch.stack(rows), three_token_law(target, prompt, sampling), "batch 1")


def test_sampled_tree_shape_ignores_sampled_values(target: torch.nn.Module) -> None:
    drafter = tiny_eagle_drafter(target)
    decoder = SpeculativeDecoder(target, drafter, 3, tree=TreeSpec(top_k=3, total_tokens=8))
    spec, sampling = decoder.tree, SamplingConfig(temperature=1.0)
    prompt = torch.tensor([PROMPT, PROMPT[::-1]])
    with torch.no_grad():
        prefill = target(prompt, output_hidden_states=True)
    from draftsmith.decode.drafters.base import TargetPass

    drafter.prefill(
        prompt,
        torch.ones_like(prompt),
        TargetPass(prefill.logits, prefill.hidden_states),
        torch.tensor([1, 2]),
    )
    committed = drafter._state.cache.get_seq_length()
    trees = [
        drafter.propose_sampled_tree(spec, 4, sampling, torch.Generator().manual_seed(seed))
        for seed in range(6)
    ]
    assert drafter._state.cache.get_seq_length() == committed  # drafted entries cropped off
    parents, depths = sampled_tree_layout(sampled_tree_chain_lengths(3, 4, 8))
    for tree in trees:
        assert torch.equal(tree.parents, parents.expand(2, -1))
        assert torch.equal(tree.depths, depths.expand(2, -1))
        q = tree.draft_probs
        assert torch.allclose(q.sum(-1), torch.ones_like(q.sum(-1)))
        assert bool((q.gather(2, tree.tokens[..., None]) > 0).all())  # each node drawn from its q
        root_children = tree.tokens[:, :3]
        for row in root_children:  # without replacement: distinct siblings
            assert row.unique().numel() == 3
    assert len({tuple(t.tokens.flatten().tolist()) for t in trees}) > 1  # values do vary
    with pytest.raises(ValueError, match="temperature > 0"):
        drafter.propose_sampled_tree(spec, 4, SamplingConfig(temperature=0.0), None)


def test_chain_lengths_and_layout() -> None:
    assert sampled_tree_chain_lengths(2, 4, 8) == [4, 4]
    assert sampled_tree_chain_lengths(3, 4, 8) == [4, 2, 2]
    assert sampled_tree_chain_lengths(3, 5, 8) == [5, 2, 1]
    assert sampled_tree_chain_lengths(4, 4, 3) == [1, 1, 1]
    assert sampled_tree_chain_lengths(2, 1, 8) == [1, 1]
    parents, depths = sampled_tree_layout([3, 2])
    assert parents.tolist() == [-1, -1, 0, 1, 2]
    assert depths.tolist() == [1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="non-increasing"):
        sampled_tree_layout([1, 2])
    with pytest.raises(ValueError, match=">= 1"):
        sampled_tree_chain_lengths(0, 4, 8)


@pytest.mark.parametrize("replacement", [False, True])
def test_multi_draft_root_is_exact(replacement: bool) -> None:
    """Verification alone: 3 root children from q, the first emitted token's law is p."""
    generator = torch.Generator().manual_seed(3)
    vocab, rows, k = 6, 60000, 3
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.0])
    q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])  # q puts mass where p has none
    draws, qs, remaining = [], [], q.expand(rows, -1)
    for _ in range(k):
        current = remaining / remaining.sum(-1, keepdim=True) if not replacement else q
        current = current.expand(rows, -1)
        token = torch.multinomial(current, 1, generator=generator)[:, 0]
        draws.append(token)
        qs.append(current)
        if not replacement:
            remaining = current.scatter(1, token[:, None], 0.0)
    tree = TreeProposal(
        tokens=torch.stack(draws, 1),
        parents=torch.full((rows, k), -1),
        depths=torch.ones(rows, k, dtype=torch.long),
        draft_probs=torch.stack(qs, 1),
    )
    target_probs = p.expand(rows, k + 1, vocab).double()
    outcome = verify_tree_stochastic(tree, target_probs, generator)
    first = torch.where(
        outcome.num_accepted > 0, outcome.accepted_tokens[:, 0], outcome.next_tokens
    )
    counts = torch.bincount(first, minlength=vocab)
    assert chi_square_p_value(counts, p) > P_VALUE_FLOOR
    accepted = (outcome.num_accepted > 0).double().mean()
    single = torch.minimum(p, q).sum()  # one draft's acceptance
    assert accepted > single + 0.1  # extra siblings add acceptance


def test_zero_q_child_is_never_accepted() -> None:
    tree = TreeProposal(
        tokens=torch.tensor([[0]]),
        parents=torch.tensor([[-1]]),
        depths=torch.tensor([[1]]),
        draft_probs=torch.tensor([[[0.0, 1.0]]]),
    )
    probs = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]])
    outcome = verify_tree_stochastic(tree, probs, torch.Generator().manual_seed(0))
    assert int(outcome.num_accepted) == 0 and int(outcome.next_tokens) == 0


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_top_k_tree_still_equals_generate(target: torch.nn.Module, batch: int) -> None:
    """At T = 0 the engine keeps top-k trees even for a drafter with sampled trees."""
    ids = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))[:batch]
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :4] = 0
        ids = ids.masked_fill(mask == 0, 0)
    reference = target.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False
    )
    drafter = tiny_eagle_drafter(target)
    calls = []
    drafter.propose_sampled_tree = lambda *a, **k: calls.append(a)  # must not be asked
    decoder = SpeculativeDecoder(target, drafter, 3, tree=TreeSpec(top_k=2, total_tokens=8))
    out = decoder.generate(ids, mask, max_new_tokens=16)
    assert torch.equal(out.sequences, reference)
    assert not calls


def test_one_child_sampled_tree_is_the_sampled_chain(target: torch.nn.Module) -> None:
    """With one child the tree is the chain: same draws, same q, on a ragged (padded) batch."""
    from draftsmith.decode.drafters.base import TargetPass

    drafter = tiny_eagle_drafter(target)
    ids = torch.tensor([[*PROMPT, 3, 4], [0, 0, *PROMPT]])
    mask = (ids != 0).long()
    with torch.no_grad():
        prefill = target(ids, attention_mask=mask, output_hidden_states=True)
    drafter.prefill(
        ids, mask, TargetPass(prefill.logits, prefill.hidden_states), torch.tensor([1, 2])
    )
    sampling = SamplingConfig(temperature=0.8, top_k=20)
    chain = drafter.propose(4, sampling, torch.Generator().manual_seed(5))
    tree = drafter.propose_sampled_tree(
        TreeSpec(top_k=1, total_tokens=4), 4, sampling, torch.Generator().manual_seed(5)
    )
    assert torch.equal(tree.tokens, chain.tokens)
    assert torch.allclose(tree.draft_probs, chain.probs)
    assert tree.parents.tolist() == [[-1, 0, 1, 2]] * 2


def test_second_chain_sees_its_own_entries(target: torch.nn.Module) -> None:
    """Where i.i.d. root children coincide, both chains must continue from the same q."""
    from draftsmith.decode.drafters.base import TargetPass

    drafter = tiny_eagle_drafter(target)
    ids = torch.tensor([PROMPT] * 16)
    ids[:, 0] = torch.arange(16)  # rows differ a little
    with torch.no_grad():
        prefill = target(ids, output_hidden_states=True)
    drafter.prefill(
        ids,
        torch.ones_like(ids),
        TargetPass(prefill.logits, prefill.hidden_states),
        torch.arange(16) % 7,
    )
    sampling = SamplingConfig(temperature=0.5, top_k=2)
    tree = drafter.propose_sampled_tree(
        TreeSpec(top_k=2, total_tokens=6),
        3,
        sampling,
        torch.Generator().manual_seed(2),
        replacement=True,
    )
    assert tree.parents[0].tolist() == [-1, -1, 0, 1, 2, 3]
    same = tree.tokens[:, 0] == tree.tokens[:, 1]
    differ = ~same & (tree.draft_probs[:, 2] - tree.draft_probs[:, 3]).abs().amax(-1).gt(1e-6)
    assert bool(same.any()) and bool((~same).any())
    assert torch.allclose(tree.draft_probs[same, 2], tree.draft_probs[same, 3])
    assert bool(differ.any())  # a different first token does change what follows
