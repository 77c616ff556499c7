"""Token trees: layouts (static, dynamic and sampled), attention masks and positions.

A tree proposal holds M draft nodes per row under a root, the row's pending token. Node m has a
token, a parent (``-1`` for the root, else an earlier node: parents come before children) and a
depth (1 for the root's children). Siblings are tried in index order. In "tree space" (masks,
positions, the target's verify pass) index 0 is the root and node m is index m + 1.

Verification lives in :mod:`draftsmith.decode.trees.verify`.

Static trees come from Medusa-style choices (Cai et al. 2024); dynamic trees are EAGLE-2's
(Li et al. 2024): expand the top-k children of the k best frontier nodes by cumulative draft
log-probability for ``depth`` levels, re-rank all candidates and keep the best ``total_tokens``.
A narrower frontier (f < k nodes grow children per level) keeps each level's draft pass to f
rows; f = 1 is the greedy chain with its runners-up as leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import torch


@dataclass
class TreeProposal:
    """M draft nodes per row and what verification needs."""

    tokens: torch.Tensor  # [B, M] int64
    parents: torch.Tensor  # [B, M] int64, -1 = the root (pending token), else an earlier node
    depths: torch.Tensor  # [B, M] int64, 1 for the root's children
    draft_probs: torch.Tensor | None = None  # [B, M, V] the q each node was drawn from; None: top-k
    _mask: torch.Tensor | None = field(default=None, init=False, repr=False)  # [B, M+1, M+1]

    def __post_init__(self) -> None:
        check_parents(self.parents)
        if self.tokens.shape != self.parents.shape or self.depths.shape != self.parents.shape:
            raise ValueError(
                f"tokens {tuple(self.tokens.shape)}, parents {tuple(self.parents.shape)} and "
                f"depths {tuple(self.depths.shape)} must all be [B, M]"
            )
        if self.draft_probs is not None and self.draft_probs.shape[:2] != self.tokens.shape:
            raise ValueError(
                f"draft_probs must be [B, M, V] with [B, M] = {tuple(self.tokens.shape)}, got "
                f"{tuple(self.draft_probs.shape)}"
            )

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def input_ids(self, pending: torch.Tensor) -> torch.Tensor:  # [B] -> [B, M + 1]
        """The verify pass's input: the pending token, then every node."""
        return torch.cat((pending[:, None], self.tokens), dim=1)

    def attention_mask(self) -> torch.Tensor:  # [B, M + 1, M + 1] bool
        """``tree_attention_mask`` of the parents, computed once (verification reuses it)."""
        if self._mask is None:
            self._mask = tree_attention_mask(self.parents)
        return self._mask

    def positions(self, start: torch.Tensor) -> torch.Tensor:  # [B] -> [B, M + 1]
        return tree_positions(self.depths, start)


def check_parents(parents: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every parent is -1 or an earlier node."""
    if parents.ndim not in (1, 2):
        raise ValueError(f"parents must be [M] or [B, M], got shape {tuple(parents.shape)}")
    index = torch.arange(parents.shape[-1], device=parents.device)
    if ((parents < -1) | (parents >= index)).any():
        raise ValueError(
            "every parent must be -1 (the root) or the index of an earlier node: order nodes "
            "so that parents come before their children"
        )


def tree_depths(parents: torch.Tensor) -> torch.Tensor:  # [..., M] -> [..., M] int64
    """Depth of each node (1 for the root's children): the number of its ancestors, itself
    included, below the root."""
    return tree_attention_mask(parents)[..., 1:, 1:].sum(-1)


def tree_attention_mask(parents: torch.Tensor) -> torch.Tensor:  # [..., M] -> [..., M+1, M+1]
    """``mask[i, j]``: tree-space entry i may attend to j (j is i itself or an ancestor).

    Index 0 is the root, which every node sees. Built as the transitive closure of the
    parent relation by repeated squaring: after s boolean products every entry sees its
    ancestors up to 2^s levels up, so ceil(log2(M + 1)) products close any tree of M nodes
    (a handful of small products, not one step per node or per level).
    """
    check_parents(parents)
    size = parents.shape[-1] + 1
    batch_shape = parents.shape[:-1]
    parent_of = torch.zeros((*batch_shape, size, size), dtype=torch.bool, device=parents.device)
    parent_of[..., 1:, :].scatter_(-1, (parents + 1)[..., None], True)  # node -> its parent
    reach = torch.eye(size, dtype=torch.bool, device=parents.device).expand_as(parent_of)
    reach = (reach | parent_of).to(torch.float32)  # self or parent: paths of length <= 1
    span = 1
    while span < size - 1:  # the longest path (root to deepest node) has size - 1 edges
        reach = ((reach @ reach) > 0).to(torch.float32)  # paths of length <= 2 * span
        span *= 2
    return reach > 0


def tree_positions(
    depths: torch.Tensor,  # [B, M] or [M]
    start: torch.Tensor,  # [B] position of each row's root (pending token)
) -> torch.Tensor:  # [B, M + 1] int64
    """Rotary positions of [root, nodes]: the root's position plus each node's depth."""
    if depths.ndim == 1:
        depths = depths.expand(start.shape[0], -1)
    offsets = torch.cat((torch.zeros_like(depths[:, :1]), depths), dim=1)
    return start[:, None].long() + offsets


# -- static trees (Medusa) -------------------------------------------------------------------
@dataclass(frozen=True)
class StaticTree:
    """A fixed tree: node m is the ``ranks[m]``-th choice of head ``depths[m] - 1``."""

    parents: torch.Tensor  # [M] int64
    depths: torch.Tensor  # [M] int64
    ranks: torch.Tensor  # [M] int64

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> StaticTree:
        """Build from Medusa choices: each path lists top-k ranks, e.g. [[0], [0, 0], [1]].

        Paths must be distinct, non-empty, non-negative and prefix-closed (every prefix of a path
        is itself a path). Nodes are ordered by depth, then lexicographically, so parents come
        first and siblings in rank order.
        """
        paths = [tuple(int(r) for r in path) for path in choices]
        if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
            raise ValueError("choices must be a non-empty list of non-empty paths of ranks >= 0")
        if len(set(paths)) != len(paths):
            raise ValueError("choices contain a repeated path")
        known = set(paths)
        missing = sorted({p[:-1] for p in paths if len(p) > 1} - known)
        if missing:
            raise ValueError(f"choices must be prefix-closed; missing the paths {missing}")
        paths.sort(key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(paths)}
        parents = [index[p[:-1]] if len(p) > 1 else -1 for p in paths]
        return cls(
            parents=torch.tensor(parents, dtype=torch.long),
            depths=torch.tensor([len(p) for p in paths], dtype=torch.long),
            ranks=torch.tensor([p[-1] for p in paths], dtype=torch.long),
        )

    @classmethod
    def chain(cls, length: int) -> StaticTree:
        """A single path of ``length`` top-1 choices (a chain)."""
        return cls.from_choices([[0] * d for d in range(1, length + 1)])

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def propose(
        self,
        head_logits: torch.Tensor,  # [B, K, V] head k's scores for the token at depth k+1
    ) -> TreeProposal:
        """Fill the tree with each head's top-ranked tokens (deterministic children)."""
        batch, num_heads, vocab = head_logits.shape
        if self.max_depth > num_heads:
            raise ValueError(
                f"the tree is {self.max_depth} levels deep but only {num_heads} heads score it: "
                "use shallower choices or more heads"
            )
        width = int(self.ranks.max()) + 1
        if width > vocab:
            raise ValueError(f"the tree asks for rank {width - 1} in a vocabulary of {vocab}")
        top = head_logits.topk(width, dim=-1).indices  # [B, K, width]
        device = head_logits.device
        tokens = top[:, self.depths.to(device) - 1, self.ranks.to(device)]  # [B, M]
        return TreeProposal(
            tokens=tokens,
            parents=self.parents.to(device).expand(batch, -1),
            depths=self.depths.to(device).expand(batch, -1),
        )


# -- dynamic trees (EAGLE-2) -----------------------------------------------------------------
@dataclass
class Frontier:
    """Nodes to expand at one step of :func:`build_dynamic_tree`."""

    tokens: torch.Tensor  # [B, K] tokens of the nodes
    node_ids: torch.Tensor  # [B, K] their index among all candidates created so far
    parent_slots: torch.Tensor  # [B, K] index of each node's parent in the previous frontier; -1
    step: int  # 0 for the root's children, whose depth is step + 1


ExpandFn = Callable[[Frontier], torch.Tensor]  # -> log-probs [B, K, V] of each node's children


def dynamic_tree_capacity(top_k: int, depth: int, frontier: int) -> int:
    """Nodes a dynamic tree ``depth`` levels deep can hold: the root's ``top_k`` children, then
    ``top_k`` children for each of the ``frontier`` nodes expanded per further level."""
    return top_k + (depth - 1) * frontier * top_k


def build_dynamic_tree(
    root_logprobs: torch.Tensor,  # [B, V] draft log-probs of the token after the pending one
    expand: ExpandFn,
    *,
    top_k: int,
    depth: int,
    total_tokens: int,
    frontier: int = 0,
) -> TreeProposal:
    """EAGLE-2's dynamic draft tree (Li et al. 2024, section 4).

    Level 1 is the top-k of ``root_logprobs``. For ``depth - 1`` further levels, ``expand``
    scores the children of the current frontier (the f best nodes of the last level by
    cumulative score; f = ``frontier``, or EAGLE-2's f = k when 0), whose top-k children each
    become candidates with cumulative log-probability ``score(parent) + log q(child)``; the f
    best of those f*k form the next frontier. Finally the ``total_tokens`` best candidates are
    kept. Scores never increase along a path and ties prefer earlier candidates, so every kept
    node's ancestors are kept too. Children are deterministic (top-k), so ``draft_probs`` is
    None. With f = 1 the frontier is the greedy chain and every level adds its k - 1
    runners-up as leaves.
    """
    batch, vocab = root_logprobs.shape
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must lie in [1, {vocab}], got {top_k}")
    if not 0 <= frontier <= top_k:
        raise ValueError(f"frontier must lie in [0, top_k={top_k}], got {frontier}")
    width = frontier or top_k
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    capacity = dynamic_tree_capacity(top_k, depth, width)
    if not 1 <= total_tokens <= capacity:
        raise ValueError(
            f"total_tokens must lie in [1, {capacity}] for top_k={top_k}, frontier={width} and "
            f"depth={depth}, got {total_tokens}"
        )
    device = root_logprobs.device
    scores, tokens = root_logprobs.float().topk(top_k, dim=-1)  # [B, k]
    all_tokens, all_scores = [tokens], [scores]
    all_parents = [torch.full_like(tokens, -1)]
    best = torch.arange(width, device=device).expand(batch, -1)  # [B, f]: topk sorts its scores
    frontier_nodes = Frontier(
        tokens=tokens.gather(1, best),
        node_ids=best,
        parent_slots=torch.full_like(best, -1),
        step=0,
    )
    frontier_scores, created = scores.gather(1, best), top_k
    for step in range(1, depth):
        logprobs = expand(frontier_nodes)  # [B, f, V]
        if logprobs.shape != (batch, width, vocab):
            raise ValueError(
                f"expand must return log-probs [B, F, V] = {(batch, width, vocab)}, got "
                f"{tuple(logprobs.shape)}"
            )
        child_lp, child_tok = logprobs.float().topk(top_k, dim=-1)  # [B, f, k]
        cumulative = (frontier_scores[:, :, None] + child_lp).flatten(1)  # [B, f*k]
        child_tok = child_tok.flatten(1)
        parent_slot = torch.arange(width, device=device).repeat_interleave(top_k).expand(batch, -1)
        new_ids = created + torch.arange(width * top_k, device=device).expand(batch, -1)
        all_tokens.append(child_tok)
        all_scores.append(cumulative)
        all_parents.append(frontier_nodes.node_ids.gather(1, parent_slot))
        created += width * top_k
        best = cumulative.topk(width, dim=-1).indices  # [B, f]
        frontier_nodes = Frontier(
            tokens=child_tok.gather(1, best),
            node_ids=new_ids.gather(1, best),
            parent_slots=parent_slot.gather(1, best),
            step=step,
        )
        frontier_scores = cumulative.gather(1, best)
    tokens = torch.cat(all_tokens, 1)
    scores = torch.cat(all_scores, 1)
    parents = torch.cat(all_parents, 1)
    depths = torch.cat([torch.full_like(level, d) for d, level in enumerate(all_tokens, 1)], 1)
    # Stable sort: among equal scores, earlier candidates (ancestors) win.
    order = torch.sort(-scores, dim=1, stable=True).indices[:, :total_tokens]
    kept = torch.sort(order, dim=1).values  # creation order is topological
    new_index = torch.full((batch, created), -1, dtype=torch.long, device=device)
    new_index.scatter_(1, kept, torch.arange(total_tokens, device=device).expand(batch, -1))
    kept_parents = parents.gather(1, kept)
    remapped = torch.where(kept_parents < 0, -1, new_index.gather(1, kept_parents.clamp(min=0)))
    if (remapped[kept_parents >= 0] < 0).any():
        raise RuntimeError("dynamic tree lost an ancestor; scores must be log-probabilities")
    return TreeProposal(
        tokens=tokens.gather(1, kept), parents=remapped, depths=depths.gather(1, kept)
    )


# -- sampled trees (multi-draft speculative sampling) ----------------------------------------
def sampled_tree_chain_lengths(num_children: int, depth: int, total_tokens: int) -> list[int]:
    """Lengths of the chains under the root's children in a sampled tree (a fixed shape).

    The root gets ``min(num_children, total_tokens)`` children, each continued as a chain
    drawn from the drafter's own q. The first child's chain is as deep as the budget allows
    (``depth``, keeping one node for every other child); the others share the remaining nodes
    level by level, each at most ``depth`` deep. Sibling i is tried only after siblings
    1..i-1 were all rejected, so its chain is reached less often than the first one's deep
    levels: budget goes to the first chain first. The shape depends only on these three
    numbers, never on the sampled tokens, so which nodes exist reveals nothing about the
    draws and verification stays exact (docs/theory.md §4).
    """
    if num_children < 1 or depth < 1 or total_tokens < 1:
        raise ValueError(
            f"a sampled tree needs num_children, depth and total_tokens >= 1, got "
            f"{num_children}, {depth}, {total_tokens}"
        )
    children = min(num_children, total_tokens)
    lengths = [min(depth, total_tokens - (children - 1))] + [1] * (children - 1)
    budget = total_tokens - sum(lengths)
    for level in range(2, depth + 1):
        for i in range(1, children):
            if budget > 0 and lengths[i] == level - 1:
                lengths[i] += 1
                budget -= 1
    return lengths


def sampled_tree_layout(lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(parents, depths)`` [M] of chains under the root, nodes ordered level by level.

    ``lengths`` must not increase (as :func:`sampled_tree_chain_lengths` returns them), so the
    chains alive at a level are a prefix of the children: level l holds nodes of chains
    0..a_l - 1 in order, and the root's children come first, in sibling (trial) order.
    """
    if not lengths or min(lengths) < 1 or any(a < b for a, b in pairwise(lengths)):
        raise ValueError(f"chain lengths must be >= 1 and non-increasing, got {list(lengths)}")
    parents: list[int] = []
    depths: list[int] = []
    last: list[int] = [-1] * len(lengths)  # each chain's newest node
    for level in range(1, lengths[0] + 1):
        for chain, length in enumerate(lengths):
            if length < level:
                break
            parents.append(last[chain])
            depths.append(level)
            last[chain] = len(parents) - 1
    return torch.tensor(parents, dtype=torch.long), torch.tensor(depths, dtype=torch.long)
