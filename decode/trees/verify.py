"""Verification of token trees (:mod:`draftsmith.decode.trees.layout`): which drafted branch the target keeps.

Verification (docs/theory.md §4) walks from the root. At each node it tries the children:
* children chosen deterministically (top-k, distinct; ``draft_probs is None``): accept child c
  with probability p(c); on rejection set p(c) = 0 and renormalise, then try the next child;
* children drawn from q (``draft_probs`` = the q each child was drawn from; SpecInfer, Miao
  et al. 2024): accept with probability min(1, p(c)/q(c)); on rejection p <- norm(max(0, p - q)).
  The q of a child may depend on its earlier siblings: drawn i.i.d., every child carries its
  parent's q; drawn without replacement (recursive rejection sampling, Yang et al. 2024; Sequoia,
  Chen et al. 2024), child i carries q_i = norm(q_{i-1} with c_{i-1} set to 0), q_1 = q. Both
  are exact by one induction: a round with target p and ANY proposal q' fixed by what happened
  before emits y with probability min(p(y), q'(y)) + (1 - sum_x min(p(x), q'(x))) p'(y) = p(y)
  when the rest of the walk emits p' = norm(max(0, p - q')) exactly, which holds for the next
  round by the same argument (and trivially for the final sample from p'). A rejected c has
  p(c) < q'(c), so p'(c) = 0: dropping c from the next sibling's q loses no mass the target
  still needs, which is why children without replacement are never duplicates and each extra
  sibling adds acceptance.
If no child is accepted, the next token is sampled from what remains of p (recovered token); at
a leaf it is sampled from the target's distribution there (bonus token). The residual is carried
only down the accepted branch: an accepted child starts from the target's fresh p at its node.
Either way the emitted tokens are distributed exactly as the target's. Greedy verification
follows the child equal to the target's argmax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from draftsmith.decode.sampling import greedy_tokens, sample
from draftsmith.decode.trees.layout import TreeProposal


@dataclass
class TreeVerification:
    """Outcome of verifying a tree: the accepted path and the token after it, per row."""

    accepted_nodes: torch.Tensor  # [B, D] node indices along the accepted path, -1 padded
    num_accepted: torch.Tensor  # [B] int64
    accepted_tokens: torch.Tensor  # [B, D] tokens of the accepted nodes, 0 padded
    next_tokens: torch.Tensor  # [B] recovered or bonus token: the new pending token

    def path_indices(self) -> torch.Tensor:  # [B, D + 1] int64
        """Tree-space indices of [root, accepted nodes...]; padding repeats the root (0).

        Gather the verify pass's hidden states / KV entries with these (the first
        ``1 + num_accepted`` columns of each row are the real ones).
        """
        path = torch.where(self.accepted_nodes >= 0, self.accepted_nodes + 1, 0)
        return torch.cat((torch.zeros_like(path[:, :1]), path), dim=1)


def _earlier_siblings(parents: torch.Tensor) -> torch.Tensor:  # [B, M] -> [B, M, M] bool
    """``[b, m, j]``: node j has m's parent and comes before m (siblings are tried in order)."""
    nodes = parents.shape[1]
    earlier = torch.ones(nodes, nodes, dtype=torch.bool, device=parents.device).tril(-1)
    return (parents[:, :, None] == parents[:, None, :]) & earlier


def _children_table(parents: torch.Tensor) -> torch.Tensor:  # [B, M] -> [B, M + 1, C] (-1 pad)
    """Children of each tree-space entry, in sibling (index) order."""
    batch, nodes = parents.shape
    rank = _earlier_siblings(parents).sum(-1)  # [B, M] position among siblings
    width = int(rank.max()) + 1 if nodes else 1
    table = torch.full((batch, nodes + 1, width), -1, dtype=torch.long, device=parents.device)
    node_index = torch.arange(nodes, device=parents.device).expand(batch, -1)
    flat = (parents + 1) * width + rank
    table.view(batch, -1).scatter_(1, flat, node_index)
    return table


def verify_tree_greedy(
    tree: TreeProposal,
    target_logits: torch.Tensor,  # [B, M + 1, V] the verify pass over [root, nodes]
) -> TreeVerification:
    """Follow the child equal to the target's argmax; emit the argmax where none matches.

    The walk is computed in one pass over all nodes, not level by level: node m matches when
    its token is the argmax at its parent, and the walk takes the first matching sibling (in
    index order), so node m is on the accepted path exactly when it and every ancestor are
    their siblings' first match. Those nodes form one chain from the root, at most one per
    depth.
    """
    _check_verify_shapes(tree, target_logits)
    batch, nodes = tree.tokens.shape
    device = tree.tokens.device
    choice = greedy_tokens(target_logits)  # [B, M + 1]
    max_depth = int(tree.depths.max()) if nodes else 0
    matches = tree.tokens == choice.gather(1, tree.parents + 1)  # [B, M]
    # an earlier sibling matched: the walk never tries this node
    shadowed = (_earlier_siblings(tree.parents) & matches[:, None, :]).any(-1)  # [B, M]
    taken = matches & ~shadowed  # [B, M]
    ancestors = tree.attention_mask()[:, 1:, 1:]  # [B, M, M] m sees itself and its ancestors
    on_path = ~(ancestors & ~taken[:, None, :]).any(-1)  # [B, M]
    # One accepted node per depth: scatter node m into column depth(m) - 1; nodes off the
    # path go to a spare last column that is dropped.
    column = torch.where(on_path, tree.depths - 1, max_depth)  # [B, M]
    nodes_index = torch.arange(nodes, device=device).expand(batch, -1)
    accepted_nodes = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=device)
    accepted_nodes = accepted_nodes.scatter(1, column, nodes_index)[:, :max_depth]  # [B, D]
    num_accepted = on_path.sum(1)  # [B]
    current = torch.zeros(batch, dtype=torch.long, device=device)  # the path's end, tree space
    if max_depth:
        last = accepted_nodes.gather(1, (num_accepted - 1).clamp(min=0)[:, None]).squeeze(1)
        current = torch.where(num_accepted > 0, last + 1, current)
    return _verification(tree, accepted_nodes, choice.gather(1, current[:, None]).squeeze(1))


def verify_tree_stochastic(
    tree: TreeProposal,
    target_probs: torch.Tensor,  # [B, M + 1, V] after the sampling transforms
    generator: torch.Generator | None,
) -> TreeVerification:
    """Exact tree verification (docs/theory.md §4); see the module docstring."""
    _check_verify_shapes(tree, target_probs)
    batch = target_probs.shape[0]
    rows = torch.arange(batch, device=target_probs.device)
    draft_probs = tree.draft_probs

    def accept(
        current: torch.Tensor, child: torch.Tensor, token: torch.Tensor, p: torch.Tensor
    ) -> torch.Tensor:  # [B] bool
        p_token = p.gather(1, token[:, None]).squeeze(1)
        uniform = torch.rand(batch, generator=generator, device=p.device, dtype=p.dtype)
        if draft_probs is None:
            return uniform < p_token
        q_token = draft_probs[rows, child.clamp(min=0), token].to(p.dtype)  # [B]
        # u < p/q; q(token) > 0 as token ~ q (a zero would accept for free: refuse it)
        return (uniform * q_token < p_token) & (q_token > 0)

    def residual(child: torch.Tensor, token: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """What remains of p after the child's rejection, renormalised: [B, V]."""
        if draft_probs is None:
            left = p.scatter(1, token[:, None], 0.0)
        else:
            left = (p - draft_probs[rows, child.clamp(min=0)].to(p.dtype)).clamp(min=0)
        mass = left.sum(-1, keepdim=True)
        # mass == 0 only when p is within rounding of the rejected law; keep p then.
        return torch.where(mass > 0, left / mass.clamp(min=1e-30), p)

    def finish(current: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return sample(p, generator)

    start = target_probs[:, 0].clone()
    return _walk(tree, accept, residual, finish, state=start, reset=target_probs)


def _check_verify_shapes(tree: TreeProposal, scores: torch.Tensor) -> None:
    expected = (tree.tokens.shape[0], tree.num_nodes + 1)
    if scores.ndim != 3 or tuple(scores.shape[:2]) != expected:
        raise ValueError(
            f"the verify pass must score [root, nodes]: expected [B, M + 1, V] with "
            f"[B, M + 1] = {expected}, got {tuple(scores.shape)}"
        )


def _walk(
    tree: TreeProposal,
    accept: Callable[..., torch.Tensor],
    residual: Callable[..., torch.Tensor],
    finish: Callable[..., torch.Tensor],
    state: torch.Tensor,  # [B, V] the distribution still in play
    reset: torch.Tensor,  # [B, M + 1, V] fresh distribution at each tree-space entry
) -> TreeVerification:
    """The sampled walk: try children in order, move down on acceptance, stop when none is taken.

    ``accept(current, child, token, state) -> accepted [B]``; a row that rejects its child
    continues with ``residual(child, token, state)`` ([B, V], computed only when some row
    rejected), and ``state`` is replaced by ``reset[:, child + 1]`` when a row moves down.
    """
    batch, nodes = tree.tokens.shape
    device = tree.tokens.device
    rows = torch.arange(batch, device=device)
    children = _children_table(tree.parents)  # [B, M + 1, C]
    max_depth = int(tree.depths.max()) if nodes else 0
    current = torch.zeros(batch, dtype=torch.long, device=device)  # tree-space index
    active = torch.ones(batch, dtype=torch.bool, device=device)
    accepted_nodes = torch.full((batch, max_depth), -1, dtype=torch.long, device=device)
    for level in range(max_depth):
        moved_to = torch.full((batch,), -1, dtype=torch.long, device=device)
        for slot in range(children.shape[-1]):
            child = children[rows, current, slot]  # [B]
            trying = active & (moved_to < 0) & (child >= 0)
            if not trying.any():
                continue
            token = tree.tokens[rows, child.clamp(min=0)]
            accepted = accept(current, child, token, state) & trying
            rejected = trying & ~accepted
            if rejected.any():
                state = torch.where(rejected[:, None], residual(child, token, state), state)
            moved_to = torch.where(accepted, child, moved_to)
        moved = moved_to >= 0
        accepted_nodes[:, level] = moved_to
        current = torch.where(moved, moved_to + 1, current)
        state = torch.where(moved[:, None], reset[rows, current], state)
        active = active & moved
        if not active.any():
            break
    return _verification(tree, accepted_nodes, finish(current, state))


def _verification(
    tree: TreeProposal,
    accepted_nodes: torch.Tensor,  # [B, D] the accepted path's nodes, -1 padded
    next_tokens: torch.Tensor,  # [B]
) -> TreeVerification:
    return TreeVerification(
        accepted_nodes=accepted_nodes,
        num_accepted=(accepted_nodes >= 0).sum(1),
        accepted_tokens=torch.where(
            accepted_nodes >= 0, tree.tokens.gather(1, accepted_nodes.clamp(min=0)), 0
        ),
        next_tokens=next_tokens,
    )
