"""The tree-size policy: its menu and arithmetic, its choices, and exactness of the rounds it
shapes (greedy equality; chi-square of the joint law of the first emitted tokens)."""

from __future__ import annotations

import pytest
import torch
from decode_helpers import ragged_greedy_batch, tiny_eagle_drafter, tiny_medusa_drafter
from draftsmith.decode import SpeculativeDecoder
from draftsmith.decode.drafters.base import TreeSpec
from draftsmith.decode.sampling import SamplingConfig
from draftsmith.decode.trees.layout import sampled_tree_layout
from draftsmith.decode.trees.policy import (
    CHAIN,
    SAMPLED,
    TOP_K,
    RoundCost,
    RoundShape,
    TreeSizePolicy,
    _features,
    shape_menu,
)
from tiny_models import tiny_llama
from tree_helpers import PROMPT, SETTINGS, assert_follows, three_token_law

SPEC = TreeSpec(top_k=3, total_tokens=8)


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(num_layers=4, seed=0)


# -- menu and arithmetic -----------------------------------------------------------------------
def test_menu_holds_plain_step_chains_and_trees_of_fixed_layout() -> None:
    menu = shape_menu(SPEC, 3, sampled=True, vary=True)
    assert menu[:4] == [RoundShape.chain(w) for w in range(4)]
    trees = menu[4:]
    assert {s.kind for s in trees} == {SAMPLED}
    assert len(set(menu)) == len(menu)
    for shape in trees:
        lengths = shape.chain_lengths()
        assert len(lengths) == shape.children and lengths[0] == shape.depth
        assert sum(lengths) == shape.nodes <= SPEC.total_tokens
        parents, _ = sampled_tree_layout(lengths)  # the shape alone fixes the layout
        assert parents.numel() == shape.nodes
    assert RoundShape(SAMPLED, 3, 2, 6) in trees and RoundShape(SAMPLED, 3, 3, 8) in trees
    top_k = shape_menu(TreeSpec(top_k=4, total_tokens=12), 3, sampled=False, vary=True)[4:]
    assert {(s.kind, s.depth) for s in top_k} == {(TOP_K, 3)}
    expected = {(2, 5), (2, 6), (2, 10), (4, 5), (4, 6), (4, 12)}  # 2 x 3 holds 10 nodes
    assert {(s.children, s.nodes) for s in top_k} == expected
    static = TreeSpec(choices=((0,), (1,), (0, 0)))
    (only,) = shape_menu(static, 3, sampled=False, vary=False)[4:]
    assert only.tree_spec(static) is static


def test_menu_keeps_the_users_frontier_within_each_top_k() -> None:
    """A narrow frontier holds fewer nodes: 2 + 2 x 1 x 2 = 6 and 4 + 2 x 1 x 4 = 12 at depth 3."""
    spec = TreeSpec(top_k=4, total_tokens=12, frontier=1)
    top_k = shape_menu(spec, 3, sampled=False, vary=True)[4:]
    assert {(s.children, s.nodes, s.frontier) for s in top_k} == {
        (2, 5, 1),
        (2, 6, 1),
        (4, 5, 1),
        (4, 6, 1),
        (4, 12, 1),
    }
    for shape in top_k:
        built = shape.tree_spec(spec)  # a valid spec of the shape's size
        assert (built.top_k, built.total_tokens, built.expanded) == (shape.children, shape.nodes, 1)
    wide = shape_menu(TreeSpec(top_k=4, total_tokens=12, frontier=3), 3, sampled=False, vary=True)
    assert {s.frontier for s in wide[4:]} == {2, 3}  # capped at top_k = 2


def test_expected_tokens_of_a_sampled_tree_is_the_walk_mean() -> None:
    """The closed form against a simulated walk with the same per-node acceptance rates."""
    policy = TreeSizePolicy(SPEC, 3)
    alpha, beta, gamma = [0.7, 0.6, 0.5], [None, 0.4, 0.3], [None, 0.8, 0.2]
    for j, rate in enumerate(alpha):
        policy._chain[False].reached[j], policy._chain[False].accepted[j] = 1.0, rate
    for i in (1, 2):
        policy._siblings.reached[i], policy._siblings.accepted[i] = 1.0, beta[i]
        policy._side.reached[i], policy._side.accepted[i] = 1.0, gamma[i]
    shape = RoundShape(SAMPLED, 3, 3, 8)  # chains [3, 3, 2]
    assert shape.chain_lengths() == [3, 3, 2]
    draws = 200_000
    uniform = torch.rand(draws, 6, generator=torch.Generator().manual_seed(0))
    # Which root child is accepted (tried in order), then how far down its chain.
    first = torch.full((draws,), -1)
    for rank in range(3):
        rate = alpha[0] if rank == 0 else beta[rank]
        first = torch.where((first < 0) & (uniform[:, rank] < rate), rank, first)
    length = torch.tensor(shape.chain_lengths())[first.clamp(min=0)]
    emitted = 1 + (first >= 0).long()
    alive = first >= 0
    for depth in (2, 3):
        rate = torch.where(first == 0, alpha[depth - 1], gamma[depth - 1])
        alive = alive & (depth <= length) & (uniform[:, 2 + depth] < rate)
        emitted += alive.long()
    total = emitted.double().mean().item()
    assert policy.expected_tokens(shape, greedy=False) == pytest.approx(total, abs=0.01)
    chain = RoundShape.chain(3)
    assert policy.expected_tokens(chain, greedy=False) == pytest.approx(
        1 + 0.7 + 0.7 * 0.6 + 0.7 * 0.6 * 0.5
    )
    assert policy.expected_tokens(RoundShape.chain(0), greedy=False) == 1.0


def test_cost_model_recovers_the_plane_and_resists_stalls() -> None:
    a, b, c, e = 0.010, 0.002, 0.004, 0.003

    def seconds(n, s, tree):
        return a + b * n + c * s + e * tree

    cost = RoundCost(decay=0.99)
    assert cost.predict(_features(5, 3, False)) is None
    points = [(5, 3, False), (1, 0, False), (3, 1, False), (13, 3, True)]
    for n, steps, tree in points * 3:
        cost.add(_features(n, steps, tree), seconds(n, steps, tree))
    assert cost.predict(_features(7, 2, True)) == pytest.approx(seconds(7, 2, True), rel=1e-5)
    cost.add(_features(5, 3, False), 100.0)  # a stall counts as three times the prediction
    assert cost.predict(_features(5, 3, False)) < 2 * seconds(5, 3, False)
    slow = RoundCost(decay=0.9)  # a slower machine later: the fit follows it
    for factor in [1.0] * 20 + [2.0] * 60:
        for n, steps, tree in points:
            slow.add(_features(n, steps, tree), factor * seconds(n, steps, tree))
    assert slow.predict(_features(7, 2, True)) == pytest.approx(2 * seconds(7, 2, True), rel=0.01)
    flat = RoundCost()  # rounds that get faster with more tokens: the slope is held at 0
    for n in (1, 5, 9):
        flat.add(_features(n, 0, False), 0.02 - 0.001 * n)
    assert flat.predict(_features(20, 0, False)) == pytest.approx(
        flat.predict(_features(1, 0, False))
    )


def test_updates_count_acceptance_per_sibling_rank_and_depth() -> None:
    policy = TreeSizePolicy(SPEC, 3, decay=0.5)
    shape = RoundShape(SAMPLED, 3, 2, 5)  # chains [3, 2]: nodes 0, 1 | 2, 3 | 4
    accepted = torch.tensor([[0, 2, 4], [1, 3, -1], [-1, -1, -1], [1, -1, -1]])
    policy.update_tree(shape, accepted, 5, 0.01)
    chain, siblings, side = policy._chain[True], policy._siblings, policy._side
    # rank 0 tried by all 4 rows, taken by 1; rank 1 tried by 3, taken by 2
    assert (chain.reached[0], chain.accepted[0]) == (1.0 + 4, 0.5 + 1)
    assert (siblings.reached[1], siblings.accepted[1]) == (1.0 + 3, 0.5 + 2)
    # the first chain: depth 2 and 3 reached and accepted once; the second: depth 2, 1 of 2
    assert (chain.reached[1], chain.accepted[1]) == (1.0 + 1, 0.5 + 1)
    assert (chain.reached[2], chain.accepted[2]) == (1.0 + 1, 0.5 + 1)
    assert (side.reached[1], side.accepted[1]) == (1.0 + 2, 0.5 + 1)
    policy.update(2, torch.tensor([0, 2]), 0.01)  # a chain round counts into the same alpha
    assert chain.reached[0] == pytest.approx(0.5 * 5 + 2)


# -- choices -----------------------------------------------------------------------------------
def _measured(policy: TreeSizePolicy, cost, shapes, greedy: bool = False) -> None:
    """Give each shape a measured time ``cost(n, s, tree)`` without touching the acceptance
    (after a warm-up round whose time the policy ignores)."""
    policy._greedy = greedy
    for shape in shapes:
        for _ in range(2):
            policy._time(shape, shape.scored_tokens, _cost(cost, shape))


def test_a_shapes_first_round_is_a_warm_up_whose_time_is_ignored() -> None:
    policy = TreeSizePolicy(SPEC, 3, probe_every=0)
    tree = RoundShape(SAMPLED, 3, 3, 8)
    first = [*map(RoundShape.chain, (3, 0, 2)), tree]
    assert policy.choose_shape(3, greedy=False, sampled=True) == first[0]
    policy.update(3, torch.tensor([1]), 9.0)  # one-time costs of a new row count
    assert policy.cost.coefficients() is None
    assert policy._chain[False].reached[0] == pytest.approx(0.99 * 2.0 + 1)  # counted
    assert policy.choose_shape(3, greedy=False, sampled=True) == first[0]  # timed now

    def cost(n, s, tree):
        return 0.010 + 0.002 * n + 0.003 * s + 0.004 * tree

    policy.update(3, torch.tensor([1]), _cost(cost, first[0]))
    for shape in first[1:]:
        for warm_up in (True, False):
            assert policy.choose_shape(3, greedy=False, sampled=True) == shape
            seconds = 50.0 if warm_up else _cost(cost, shape)
            if shape.kind == CHAIN:
                policy.update(shape.depth, torch.tensor([0]), seconds)
            else:
                policy.update_tree(shape, torch.full((1, shape.depth), -1), shape.nodes, seconds)
    for shape in policy.menus[SAMPLED]:  # the stalls of the warm-up rounds left no trace
        assert policy.round_seconds(shape) == pytest.approx(_cost(cost, shape), rel=1e-4)


def _cost(cost, shape: RoundShape) -> float:
    """``cost`` of the shape's scored tokens, draft steps and tree flag."""
    return cost(shape.scored_tokens, max(shape.depth - 1, 0), shape.kind != CHAIN)


def _set_rates(policy: TreeSizePolicy, alpha: float, beta: float, side: float) -> None:
    for rates, rate in ((policy._chain[False], alpha), (policy._siblings, beta)):
        rates.reached = [1.0] * len(rates.reached)
        rates.accepted = [rate] * len(rates.reached)
    policy._side.reached = [1.0] * len(policy._side.reached)
    policy._side.accepted = [side] * len(policy._side.reached)


def _best_by_hand(policy: TreeSizePolicy, menu, cost, greedy: bool = False) -> RoundShape:
    return max(
        menu,
        key=lambda s: policy.expected_tokens(s, greedy) / _cost(cost, s),
    )


def test_policy_picks_a_wide_tree_when_nodes_are_cheap_and_siblings_accepted() -> None:
    policy = TreeSizePolicy(SPEC, 3, probe_every=0)
    _set_rates(policy, alpha=0.5, beta=0.6, side=0.5)

    def cost(n, s, tree):  # a GPU-like verify pass: scored tokens nearly free
        return 0.010 + 0.0001 * n + 0.001 * s + 0.0002 * tree

    menu = policy.menus[SAMPLED]
    _measured(policy, cost, [*map(RoundShape.chain, (3, 0, 2)), RoundShape(SAMPLED, 3, 3, 8)])
    shape = policy.choose_shape(3, greedy=False, sampled=True)
    assert shape == _best_by_hand(policy, menu, cost)  # the fitted cost is exact here
    assert shape.kind == SAMPLED and shape.children == 3


def test_policy_picks_a_chain_when_extra_nodes_cost_more_than_they_return() -> None:
    policy = TreeSizePolicy(SPEC, 3, probe_every=0)
    _set_rates(policy, alpha=0.8, beta=0.15, side=0.3)

    def cost(n, s, tree):  # a CPU verify pass: each scored token costs a third of a step
        return 0.010 + 0.0035 * n + 0.002 * s + 0.001 * tree

    _measured(policy, cost, [*map(RoundShape.chain, (3, 0, 2)), RoundShape(SAMPLED, 3, 3, 8)])
    shape = policy.choose_shape(3, greedy=False, sampled=True)
    assert shape == _best_by_hand(policy, policy.menus[SAMPLED], cost)
    assert shape.kind == CHAIN and shape.depth >= 2
    assert policy.choose_shape(1, greedy=False, sampled=True).depth <= 1  # the room left


def test_policy_takes_plain_steps_when_nothing_is_accepted() -> None:
    policy = TreeSizePolicy(TreeSpec(top_k=2, total_tokens=6), 3, probe_every=0)
    policy._greedy = True
    for rates in policy._chain.values():
        rates.accepted = [0.0] * 3
    menu = policy.menus[TOP_K]
    _measured(policy, lambda n, s, tree: 0.010 + 0.002 * n + 0.003 * s, menu, greedy=True)
    for shape in menu[4:]:
        policy.update_tree(shape, torch.full((2, 3), -1), shape.nodes, 0.1)
    assert policy.choose_shape(3, greedy=True, sampled=False) == RoundShape.chain(0)


def test_policy_measures_chains_plain_and_the_largest_tree_first() -> None:
    policy = TreeSizePolicy(SPEC, 3)
    order = []
    for _ in range(8):
        shape = policy.choose_shape(3, greedy=False, sampled=True)
        order.append(shape)
        if shape.kind == CHAIN:
            policy.update(shape.depth, torch.tensor([1]), 0.01)
        else:
            policy.update_tree(shape, torch.tensor([[0, -1, -1]]), shape.nodes, 0.02)
    first = [RoundShape.chain(w) for w in (3, 0, 2)] + [RoundShape(SAMPLED, 3, 3, 8)]
    assert order == [shape for shape in first for _ in range(2)]  # a warm-up, then timed


def test_policy_converges_to_the_best_shape_of_a_simulated_drafter() -> None:
    """Rounds drawn from known rates and noisy costs: the policy ends near their best rate."""
    generator = torch.Generator().manual_seed(0)
    alpha, beta, side = 0.5, 0.6, 0.6

    def cost(n, s, tree):  # trees pay here: the best beats the best chain by 20%
        return 0.010 + 0.0003 * n + 0.001 * s + 0.0005 * tree

    truth = TreeSizePolicy(SPEC, 3)
    _set_rates(truth, alpha, beta, side)
    best = _best_by_hand(truth, truth.menus[SAMPLED], cost)
    policy = TreeSizePolicy(SPEC, 3, probe_every=8)
    chosen = []
    for step in range(400):
        shape = policy.choose_shape(3, greedy=False, sampled=True)
        chosen.append(shape)
        rows = 4
        jitter = 0.8 + 0.4 * float(torch.rand((), generator=generator))  # a shared machine
        seconds = _cost(cost, shape) * jitter * (5.0 if step % 25 == 0 else 1.0)  # and stalls
        if shape.kind == CHAIN:
            u = torch.rand(rows, max(shape.depth, 1), generator=generator) < alpha
            accepted = u[:, : shape.depth].long().cumprod(1).sum(1)
            policy.update(shape.depth, accepted, seconds)
            continue
        lengths = shape.chain_lengths()
        parents, _ = sampled_tree_layout(lengths)
        paths = torch.full((rows, shape.depth), -1)
        for row in range(rows):
            u = torch.rand(len(lengths) + shape.depth, generator=generator).tolist()
            first = next((r for r in range(len(lengths)) if u[r] < (alpha if r == 0 else beta)), -1)
            if first < 0:
                continue
            node, paths[row, 0] = first, first
            for level in range(1, lengths[first]):
                rate = alpha if first == 0 else side
                if u[len(lengths) + level] >= rate:
                    break
                node = int((parents == node).nonzero()[0])
                paths[row, level] = node
        policy.update_tree(shape, paths, shape.nodes, seconds)

    def rate(shape: RoundShape) -> float:  # true tokens per second
        return truth.expected_tokens(shape, False) / _cost(cost, shape)

    tail = chosen[-100:]
    assert sum(rate(s) for s in tail) / len(tail) >= 0.93 * rate(best), (best, tail[-5:])
    assert sum(s.kind == SAMPLED for s in tail) >= 80  # here trees pay


# -- exactness in the engine -------------------------------------------------------------------
def _noisy_eagle(target: torch.nn.Module):
    """The tiny EAGLE-3 drafter with Gaussian noise on its head: right less often."""
    drafter = tiny_eagle_drafter(target)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in drafter.head.parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            param.add_(noise * 0.5 * param.std().clamp(min=1e-3))
    return drafter


DRAFTERS = {
    "eagle": (tiny_eagle_drafter, TreeSpec(top_k=3, total_tokens=10)),
    "noisy eagle": (_noisy_eagle, TreeSpec(top_k=2, total_tokens=6)),
    "eagle frontier 1": (tiny_eagle_drafter, TreeSpec(top_k=3, total_tokens=9, frontier=1)),
    "medusa": (tiny_medusa_drafter, TreeSpec()),
    "medusa choices": (tiny_medusa_drafter, TreeSpec(choices=((0,), (1,), (0, 0), (0, 0, 0)))),
}


def _recording(decoder: SpeculativeDecoder, first: RoundShape | None = None) -> list[RoundShape]:
    """Record the policy's shapes; ``first`` replaces its first answer (the rounds stay
    exact for any shape fixed before drafting, and this one makes the tested round a tree)."""
    shapes: list[RoundShape] = []
    choose = decoder.tree_policy.choose_shape

    def recorded(*args, **kwargs) -> RoundShape:
        shape = choose(*args, **kwargs)
        shapes.append(first if first is not None and not shapes else shape)
        return shapes[-1]

    decoder.tree_policy.choose_shape = recorded
    return shapes


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_adaptive_tree_keeps_greedy_output_exact(target, name: str) -> None:
    make, spec = DRAFTERS[name]
    ids, mask, reference = ragged_greedy_batch(target, 24)
    decoder = SpeculativeDecoder(target, make(target), 3, tree=spec, adaptive=True)
    decoder.tree_policy.probe_every = 2  # visit many shapes in a short run
    shapes = _recording(decoder)
    for batch in (3, 1):  # the second call starts from the first call's estimates
        out = decoder.generate(ids[:batch], attention_mask=mask[:batch], max_new_tokens=24)
        assert torch.equal(out.sequences, reference[:batch])
    kinds = {s.kind for s in shapes}
    assert {CHAIN, TOP_K} <= kinds and RoundShape.chain(0) in shapes


def test_adaptive_tree_is_refused_only_for_chain_drafters(target) -> None:
    from draftsmith.decode import DraftModelDrafter

    with pytest.raises(ValueError, match="drafts chains only"):
        SpeculativeDecoder(target, DraftModelDrafter(target), 3, tree=SPEC, adaptive=True)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_adaptive_tree_batch_follows_target_law(target, temperature, top_k, top_p) -> None:
    """One batch of many rows of one prompt after a warm-up call: a 3-child sampled tree
    first, then the rounds the warmed-up policy shapes (every round a probe)."""
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    prompt = torch.tensor(PROMPT)
    decoder = SpeculativeDecoder(
        target, tiny_eagle_drafter(target), 3, tree=TreeSpec(top_k=3, total_tokens=7), adaptive=True
    )
    decoder.tree_policy.probe_every = 1  # every round a probe: the batch meets other shapes
    generator = torch.Generator().manual_seed(0)
    kwargs = dict(sampling=sampling, eos_token_id=[], generator=generator)
    decoder.generate(prompt[None].repeat(8, 1), max_new_tokens=24, **kwargs)  # warm-up
    shapes = _recording(decoder, first=RoundShape(SAMPLED, 3, 3, 7))
    out = decoder.generate(prompt[None].repeat(2500, 1), max_new_tokens=5, **kwargs)
    new = out.sequences[:, prompt.numel() :]
    assert_follows(new, three_token_law(target, prompt, sampling), f"adaptive {temperature}")
    assert len(shapes) >= 2  # the policy's own shapes follow the forced first tree
    assert out.stats.accepted_per_position[0] > 0  # the tree's drafts were really verified


@pytest.mark.slow
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_adaptive_tree_batch_one_follows_target_law(target, temperature, top_k, top_p) -> None:
    """Many batch-1 calls: the policy's state carries over and its shapes vary between calls."""
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    prompt = torch.tensor(PROMPT)
    decoder = SpeculativeDecoder(
        target, tiny_eagle_drafter(target), 3, tree=TreeSpec(top_k=2, total_tokens=6), adaptive=True
    )
    decoder.tree_policy.probe_every = 2
    shapes = _recording(decoder)
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(1000):
        out = decoder.generate(
            prompt[None], max_new_tokens=5, sampling=sampling, eos_token_id=[], generator=generator
        )
        rows.append(out.sequences[0, prompt.numel() :])
    assert_follows(torch.stack(rows), three_token_law(target, prompt, sampling), "batch 1")
    assert {CHAIN, SAMPLED} <= {s.kind for s in shapes}


def test_a_shape_off_the_plane_keeps_its_own_ratio() -> None:
    """A top-k tree whose draft steps cost more than the plane says: its ratio corrects it."""
    policy = TreeSizePolicy(TreeSpec(top_k=2, total_tokens=6), 3)
    wide = RoundShape(TOP_K, 3, 2, 6)

    def cost(n, s, tree):
        return 0.010 + 0.002 * n + 0.003 * s + 0.001 * tree

    shapes = [*map(RoundShape.chain, (3, 0, 2, 1)), RoundShape(TOP_K, 3, 2, 5)]
    for _ in range(40):
        _measured(policy, cost, shapes, greedy=True)
        policy._time(wide, wide.scored_tokens, 1.3 * _cost(cost, wide))
    assert policy.round_seconds(shapes[0]) == pytest.approx(_cost(cost, shapes[0]), rel=0.05)
    assert policy.round_seconds(wide) == pytest.approx(1.3 * _cost(cost, wide), rel=0.05)
