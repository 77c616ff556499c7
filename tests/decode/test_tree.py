"""Trees: layouts, masks and positions against a real target, and exact verification."""

from __future__ import annotations

import pytest
import torch
from draftsmith.decode.drafters.base import TreeSpec
from draftsmith.decode.forward.cached_sequence import CachedSequence
from draftsmith.decode.trees.layout import (
    Frontier,
    StaticTree,
    TreeProposal,
    build_dynamic_tree,
    tree_attention_mask,
    tree_depths,
    tree_positions,
)
from draftsmith.decode.trees.verify import verify_tree_greedy, verify_tree_stochastic
from tiny_models import tiny_llama

# A known tree:      root
#                   /    \
#                  0      1
#                 / \      \
#                2   3      4
#                |
#                5
PARENTS = torch.tensor([-1, -1, 0, 0, 1, 2])


def test_depths_mask_and_positions_of_a_known_tree() -> None:
    assert tree_depths(PARENTS).tolist() == [1, 1, 2, 2, 2, 3]
    expected = torch.zeros(7, 7, dtype=torch.bool)
    ancestors = {
        0: [0],
        1: [0, 1],
        2: [0, 2],
        3: [0, 1, 3],
        4: [0, 1, 4],
        5: [0, 2, 5],
        6: [0, 1, 3, 6],
    }
    for row, cols in ancestors.items():
        expected[row, cols] = True
    assert torch.equal(tree_attention_mask(PARENTS), expected)
    assert torch.equal(tree_attention_mask(PARENTS.expand(2, -1)), expected.expand(2, 7, 7))
    positions = tree_positions(tree_depths(PARENTS), torch.tensor([5, 9]))
    assert positions.tolist() == [[5, 6, 6, 7, 7, 7, 8], [9, 10, 10, 11, 11, 11, 12]]


def test_parents_must_come_first() -> None:
    with pytest.raises(ValueError, match="parents come before their children"):
        tree_attention_mask(torch.tensor([-1, 2, 0]))
    with pytest.raises(ValueError, match="parents come before their children"):
        TreeProposal(
            tokens=torch.zeros(1, 2, dtype=torch.long),
            parents=torch.tensor([[-1, 1]]),
            depths=torch.ones(1, 2, dtype=torch.long),
        )


def test_tree_verify_pass_equals_running_each_path() -> None:
    """The engine's verify pass (cache + tree mask + positions) shows each node its own path."""
    target = tiny_llama()
    prompts = torch.tensor([[0, 0, 5, 6, 7], [4, 9, 8, 3, 2]])
    attention = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pending = torch.tensor([11, 12])
    tokens = torch.tensor([[20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35]])
    tree = TreeProposal(
        tokens=tokens, parents=PARENTS.expand(2, -1), depths=tree_depths(PARENTS).expand(2, -1)
    )
    with torch.no_grad():
        cached = CachedSequence(target, batch_size=2, device=torch.device("cpu"))
        cached.extend(prompts, attention.bool())
        assert cached.lengths.tolist() == attention.sum(1).tolist()
        verify = cached.extend(
            tree.input_ids(pending),
            tree_mask=tree.attention_mask(),
            positions=tree.positions(cached.lengths),
        ).logits
        for row in range(2):
            real = prompts[row, attention[row].bool()]
            for node in range(-1, 6):
                path, walk = [], node
                while walk >= 0:
                    path.insert(0, int(tokens[row, walk]))
                    walk = int(PARENTS[walk])
                sequence = torch.cat(
                    (real, pending[row : row + 1], torch.tensor(path, dtype=torch.long))
                )
                expected = target(sequence[None]).logits[0, -1]
                torch.testing.assert_close(verify[row, node + 1], expected)


def test_static_tree_from_medusa_choices() -> None:
    tree = StaticTree.from_choices([[1], [0, 1], [0], [0, 0], [0, 0, 0]])
    assert tree.parents.tolist() == [-1, -1, 0, 0, 2]
    assert tree.depths.tolist() == [1, 1, 2, 2, 3]
    assert tree.ranks.tolist() == [0, 1, 0, 1, 0]
    head_logits = torch.tensor([[[0.0, 3.0, 2.0, 1.0], [5.0, 0.0, 1.0, 4.0], [0.0, 0.0, 9.0, 0.0]]])
    proposal = tree.propose(head_logits)
    assert proposal.tokens.tolist() == [[1, 2, 0, 3, 2]]
    assert proposal.draft_probs is None
    with pytest.raises(ValueError, match="prefix-closed"):
        StaticTree.from_choices([[0], [1, 0]])
    with pytest.raises(ValueError, match="only 2 heads"):
        tree.propose(head_logits[:, :2])
    assert StaticTree.chain(3).parents.tolist() == [-1, 0, 1]


def test_greedy_verification_follows_the_argmax_path() -> None:
    tokens = torch.tensor([[3, 1, 2, 0, 1, 3]])
    tree = TreeProposal(tokens=tokens, parents=PARENTS[None], depths=tree_depths(PARENTS)[None])
    logits = torch.zeros(2, 7, 4)
    # Row 0: the argmax at the root is 1 (node 1), then 1 (node 4), then at the leaf 2 (bonus).
    logits[0, 0, 1] = logits[0, 2, 1] = logits[0, 5, 2] = 5.0
    # Row 1: the root argmax is 3 (node 0), then 0 (node 3), a leaf whose argmax 3 is the bonus.
    logits[1, 0, 3] = logits[1, 1, 0] = logits[1, 4, 3] = 5.0
    result = verify_tree_greedy(
        TreeProposal(tokens.expand(2, -1), PARENTS.expand(2, -1), tree.depths.expand(2, -1)), logits
    )
    assert result.num_accepted.tolist() == [2, 2]
    assert result.accepted_nodes.tolist() == [[1, 4, -1], [0, 3, -1]]
    assert result.accepted_tokens.tolist() == [[1, 1, 0], [3, 0, 0]]
    assert result.next_tokens.tolist() == [2, 3]
    assert result.path_indices().tolist() == [[0, 2, 5, 0], [0, 1, 4, 0]]
    # A root argmax that no child proposes: nothing accepted, the argmax is emitted.
    logits[0, 0, 0] = 9.0
    first = verify_tree_greedy(TreeProposal(tokens, PARENTS[None], tree.depths), logits[:1])
    assert first.num_accepted.tolist() == [0] and first.next_tokens.tolist() == [0]


def _law(generator: torch.Generator, vocab: int, sharp: float = 1.5) -> torch.Tensor:
    return torch.softmax(torch.randn(vocab, generator=generator, dtype=torch.float64) * sharp, -1)


def _chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * counts.sum()
    assert (counts[expected_probs == 0] == 0).all(), "an impossible outcome occurred"
    keep = expected_probs > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("sampled", [False, True])
def test_chain_shaped_tree_verifies_like_a_chain(sampled: bool) -> None:
    """The law of (accepted count, next token) on a chain is the chain rule's, exactly."""
    vocab, length, trials = 5, 3, 30000
    generator = torch.Generator().manual_seed(3)
    p = torch.stack([_law(generator, vocab) for _ in range(length + 1)])  # [N + 1, V]
    q = torch.stack([_law(generator, vocab) for _ in range(length)])  # [N, V]
    drafts = torch.tensor([int(torch.argmax(q[j])) for j in range(length)])
    accept = p[torch.arange(length), drafts]
    if sampled:
        accept = (accept / q[torch.arange(length), drafts]).clamp(max=1)
        residual = (p[:length] - q).clamp(min=0)
    else:
        residual = p[:length].scatter(1, drafts[:, None], 0.0)
    residual = residual / residual.sum(-1, keepdim=True)
    law = torch.zeros(length + 1, vocab, dtype=torch.float64)
    reach = 1.0
    for k in range(length):
        law[k] = reach * (1 - accept[k]) * residual[k]
        reach = reach * accept[k]
    law[length] = reach * p[length]

    tree = TreeProposal(
        tokens=drafts.expand(trials, -1),
        parents=torch.arange(-1, length - 1).expand(trials, -1),
        depths=torch.arange(1, length + 1).expand(trials, -1),
        draft_probs=q.expand(trials, -1, -1) if sampled else None,
    )
    result = verify_tree_stochastic(
        tree, p.expand(trials, -1, -1), torch.Generator().manual_seed(4)
    )
    counts = torch.zeros(length + 1, vocab, dtype=torch.float64)
    counts.index_put_(
        (result.num_accepted, result.next_tokens),
        torch.ones(trials, dtype=torch.float64),
        accumulate=True,
    )
    assert _chi_square(counts.flatten(), law.flatten()) < 45.0  # df <= 19, p ~ 1e-3


class _Laws:
    """Fixed random target and draft laws p(. | prefix), q(. | prefix) for prefixes of length <= 2."""

    def __init__(self, vocab: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.p = [_law(generator, vocab)]
        self.q = [_law(generator, vocab, sharp=0.7)]
        self.p1 = torch.stack([_law(generator, vocab) for _ in range(vocab)])  # [V, V]
        self.q1 = torch.stack([_law(generator, vocab, sharp=0.7) for _ in range(vocab)])
        self.p2 = torch.stack(
            [torch.stack([_law(generator, vocab) for _ in range(vocab)]) for _ in range(vocab)]
        )


def _two_level_tree(
    laws: _Laws, first: torch.Tensor | None, sampled: bool, generator: torch.Generator
) -> tuple[TreeProposal, torch.Tensor]:
    """A 2-level tree (2 children, then 2, 1) under the root, and the target laws on it.

    ``first`` is None for the root of the sequence, else the emitted first token [B] (the tree
    then predicts position 2 and deeper levels need p(. | y1, a)).
    """
    batch = first.shape[0] if first is not None else 30000
    parents = torch.tensor([-1, -1, 0, 0, 1]).expand(batch, -1)
    depths = torch.tensor([1, 1, 2, 2, 2]).expand(batch, -1)
    if first is None:
        q_root = laws.q[0].expand(batch, -1)
        p_root = laws.p[0].expand(batch, -1)
    else:
        q_root, p_root = laws.q1[first], laws.p1[first]
    if sampled:
        level1 = torch.multinomial(q_root, 2, replacement=True, generator=generator)
    else:
        level1 = q_root.topk(2, dim=-1).indices
    q_child = laws.q1[level1]  # draft law below each level-1 child (any fixed law is valid)
    if sampled:
        below0 = torch.multinomial(q_child[:, 0], 2, replacement=True, generator=generator)
        below1 = torch.multinomial(q_child[:, 1], 1, replacement=True, generator=generator)
    else:
        below0 = q_child[:, 0].topk(2, dim=-1).indices
        below1 = q_child[:, 1].topk(1, dim=-1).indices
    tokens = torch.cat((level1, below0, below1), dim=1)
    if first is None:
        p_level1 = laws.p1[level1]  # [B, 2, V]
        p_level2 = laws.p2[level1[:, [0, 0, 1]], tokens[:, 2:]]  # [B, 3, V]
    else:  # deeper than two positions only matters for the bonus law: any fixed law works
        p_level1 = laws.p2[first[:, None].expand(-1, 2), level1]
        p_level2 = laws.p2[level1[:, [0, 0, 1]], tokens[:, 2:]]
    target = torch.cat((p_root[:, None], p_level1, p_level2), dim=1)
    draft = None
    if sampled:
        draft = torch.cat((q_root[:, None].expand(-1, 2, -1), q_child[:, [0, 0, 1]]), dim=1)
    return TreeProposal(tokens, parents, depths, draft), target


@pytest.mark.parametrize("sampled", [False, True])
def test_tree_verification_emits_the_target_law_over_two_positions(sampled: bool) -> None:
    """Chi-square on the joint law of the first two emitted tokens, batch of 30000 rows."""
    laws = _Laws(vocab=4, seed=11)
    generator = torch.Generator().manual_seed(12)
    tree, target = _two_level_tree(laws, None, sampled, generator)
    result = verify_tree_stochastic(tree, target, generator)
    emitted = torch.cat((result.accepted_tokens, result.next_tokens[:, None]), dim=1)
    y1 = torch.where(result.num_accepted >= 1, result.accepted_tokens[:, 0], result.next_tokens)
    y2 = torch.where(result.num_accepted >= 2, emitted[:, 1], result.next_tokens)
    needs_second_round = result.num_accepted == 0
    assert needs_second_round.any() and (result.num_accepted == 2).any()
    tree2, target2 = _two_level_tree(laws, y1[needs_second_round], sampled, generator)
    second = verify_tree_stochastic(tree2, target2, generator)
    y2[needs_second_round] = torch.where(
        second.num_accepted >= 1, second.accepted_tokens[:, 0], second.next_tokens
    )
    counts = torch.zeros(4, 4, dtype=torch.float64)
    counts.index_put_((y1, y2), torch.ones_like(y1, dtype=torch.float64), accumulate=True)
    law = laws.p[0][:, None] * laws.p1
    assert _chi_square(counts.flatten(), law.flatten()) < 40.0  # df 15, p ~ 1e-3


@pytest.mark.parametrize(
    ("vocab", "top_k", "frontier", "depth", "total"),
    [(6, 2, 0, 3, 7), (9, 3, 1, 4, 12), (9, 3, 2, 3, 11), (9, 3, 1, 3, 5), (7, 4, 3, 3, 14)],
)
def test_dynamic_tree_keeps_the_best_candidates_with_their_ancestors(
    vocab: int, top_k: int, frontier: int, depth: int, total: int
) -> None:
    """EAGLE-2's tree (frontier 0: as many nodes expanded per level as children) and narrower
    frontiers, against the expansion written out with lists."""
    generator = torch.Generator().manual_seed(5)
    table = torch.log_softmax(torch.randn(vocab, vocab, generator=generator), -1)  # q(next | last)
    root = torch.log_softmax(torch.randn(2, vocab, generator=generator), -1)
    calls: list[Frontier] = []

    def expand(frontier: Frontier) -> torch.Tensor:
        calls.append(frontier)
        return table[frontier.tokens]

    tree = build_dynamic_tree(
        root, expand, top_k=top_k, depth=depth, total_tokens=total, frontier=frontier
    )
    width = frontier or top_k
    assert [c.step for c in calls] == list(range(depth - 1))
    assert all(c.tokens.shape == (2, width) for c in calls)  # one row per expanded node
    assert tree.tokens.shape == (2, total) and tree.draft_probs is None
    for row in range(2):
        # Reference EAGLE-2 expansion, written out with lists.
        candidates = []  # (score, path)
        frontier = []
        for token in root[row].topk(top_k).indices.tolist():
            candidates.append((float(root[row, token]), (token,)))
            frontier.append(candidates[-1])
        frontier = frontier[:width]  # topk sorts: the best first
        for _ in range(1, depth):
            level = []
            for score, path in frontier:
                for token in table[path[-1]].topk(top_k).indices.tolist():
                    level.append((score + float(table[path[-1], token]), (*path, token)))
            candidates.extend(level)
            frontier = sorted(level, key=lambda c: -c[0])[:width]
        best = sorted(candidates, key=lambda c: -c[0])[:total]
        paths = set()
        for m in range(total):
            path, walk = [], m
            while walk >= 0:
                path.insert(0, int(tree.tokens[row, walk]))
                walk = int(tree.parents[row, walk])
            paths.add(tuple(path))
        assert paths == {path for _, path in best}
        assert all(path[:-1] in paths for path in paths if len(path) > 1)
    with pytest.raises(ValueError, match="total_tokens"):
        build_dynamic_tree(root, expand, top_k=2, depth=2, total_tokens=7)
    with pytest.raises(ValueError, match="total_tokens"):  # 2 + 2 x 1 x 2 nodes at frontier 1
        build_dynamic_tree(root, expand, top_k=2, depth=3, total_tokens=7, frontier=1)
    with pytest.raises(ValueError, match="frontier"):
        build_dynamic_tree(root, expand, top_k=2, depth=3, total_tokens=4, frontier=3)


def test_frontier_one_is_the_greedy_chain_with_its_runners_up() -> None:
    """Every level's first-ranked child continues the chain; the others are leaves."""
    vocab, top_k, depth = 11, 3, 4
    generator = torch.Generator().manual_seed(2)
    table = torch.log_softmax(torch.randn(vocab, vocab, generator=generator), -1)
    root = torch.log_softmax(torch.randn(1, vocab, generator=generator), -1)
    total = top_k * depth
    tree = build_dynamic_tree(
        root,
        lambda frontier: table[frontier.tokens],
        top_k=top_k,
        depth=depth,
        total_tokens=total,
        frontier=1,
    )
    chain = [int(root[0].argmax())]
    for _ in range(1, depth):
        chain.append(int(table[chain[-1]].argmax()))
    tokens, parents = tree.tokens[0].tolist(), tree.parents[0].tolist()
    children = {p: [m for m, q in enumerate(parents) if q == p] for p in [-1, *range(total)]}
    node, walked = -1, []
    while children[node]:
        assert len(children[node]) == top_k  # the chain's next node and its runners-up
        first, *runners_up = children[node]  # created in rank order
        assert all(not children[m] for m in runners_up)  # only the chain grows
        node = first
        walked.append(tokens[node])
    assert walked == chain


def _random_tree(generator: torch.Generator, nodes: int) -> torch.Tensor:  # [M] parents
    """Parents of a random tree in topological order (each node under the root or earlier)."""
    return torch.tensor(
        [int(torch.randint(-1, m, (1,), generator=generator)) for m in range(nodes)],
        dtype=torch.long,
    )


def _reference_depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def _reference_greedy_walk(
    tokens: list[int], parents: list[int], choice: list[int]
) -> tuple[list[int], int]:
    """The definition: from the root, take the first child (index order) whose token is the
    argmax at the current entry; stop where none is. Returns (path nodes, next token)."""
    path, current = [], -1
    while True:
        children = [m for m, p in enumerate(parents) if p == current]
        taken = [m for m in children if tokens[m] == choice[current + 1]]
        if not taken:
            return path, choice[current + 1]
        current = taken[0]
        path.append(current)


def test_depths_and_mask_of_random_and_deep_trees_match_their_definition() -> None:
    generator = torch.Generator().manual_seed(0)
    shapes = [_random_tree(generator, nodes) for nodes in (1, 2, 5, 13, 40)]
    shapes.append(torch.arange(-1, 63))  # a chain of 64: the deepest closure
    for parents in shapes:
        depths = _reference_depths(parents.tolist())
        assert tree_depths(parents).tolist() == depths
        mask = tree_attention_mask(parents)
        for node, parent in enumerate(parents.tolist()):
            ancestors = {0, node + 1}
            while parent >= 0:
                ancestors.add(parent + 1)
                parent = int(parents[parent])
            assert mask[node + 1].nonzero().flatten().tolist() == sorted(ancestors)


def test_greedy_verification_equals_the_walk_on_random_trees() -> None:
    """Duplicate siblings included: the first matching sibling is the one followed."""
    generator = torch.Generator().manual_seed(1)
    vocab = 3  # few tokens: many matches and many duplicate siblings
    for nodes in (1, 4, 9, 17, 30):
        parents = torch.stack([_random_tree(generator, nodes) for _ in range(6)])  # [B, M]
        depths = torch.stack([torch.tensor(_reference_depths(p.tolist())) for p in parents])
        tokens = torch.randint(0, vocab, (6, nodes), generator=generator)
        logits = torch.randn(6, nodes + 1, vocab, generator=generator)
        result = verify_tree_greedy(TreeProposal(tokens, parents, depths), logits)
        choice = logits.argmax(-1)
        for row in range(6):
            path, next_token = _reference_greedy_walk(
                tokens[row].tolist(), parents[row].tolist(), choice[row].tolist()
            )
            width = int(depths.max())  # the batch's deepest level
            assert result.accepted_nodes[row].tolist()[: len(path)] == path
            assert result.accepted_nodes[row].tolist()[len(path) :] == [-1] * (width - len(path))
            assert int(result.num_accepted[row]) == len(path)
            assert result.accepted_tokens[row, : len(path)].tolist() == [
                int(tokens[row, m]) for m in path
            ]
            assert int(result.next_tokens[row]) == next_token


def test_tree_spec_frontier_is_checked_and_sizes_the_tree() -> None:
    assert TreeSpec(top_k=4, total_tokens=12).expanded == 4  # EAGLE-2: as many as children
    assert TreeSpec(top_k=4, total_tokens=12).capacity(4) == 4 + 3 * 4 * 4
    assert TreeSpec(top_k=3, total_tokens=9, frontier=1).capacity(4) == 3 + 3 * 1 * 3
    for frontier in (-1, 4):
        with pytest.raises(ValueError, match=r"tree frontier must lie in \[0, top_k=3\]"):
            TreeSpec(top_k=3, total_tokens=9, frontier=frontier)
