"""Draft trees from an EAGLE-3 head: EAGLE-2 dynamic trees (T = 0) and sampled trees (T > 0).

Both grow from a :class:`draftsmith.decode.drafters.eagle.state.HeadState` whose committed entries the
head has read: every level runs the head once over the level's expanded nodes as a [B, F]
block (``TreeSpec.frontier``; F = 1 makes each level a chain's one-row step), each node seeing
the valid committed entries and its own ancestors, and the drafted entries are cropped off the
cache at the end. Tokens are chosen in the pruned draft vocabulary and mapped
to target ids once chosen.

- :func:`dynamic_tree`: EAGLE-2 (Li et al. 2024) expands the ``top_k`` most likely children by
  cumulative draft log-probability (``draftsmith.decode.trees.layout.build_dynamic_tree``); deterministic, for
  greedy verification (or stochastic verification of a fixed proposal).
- :func:`sampled_tree`: a multi-draft tree of fixed shape, every token drawn from the head's
  q, for speculative sampling over trees (docs/theory.md §4).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from draftsmith.decode.drafters.base import TreeSpec
from draftsmith.decode.drafters.eagle.lean import LeanEagle3
from draftsmith.decode.drafters.eagle.state import HeadState
from draftsmith.decode.sampling import SamplingConfig, logits_to_probs, sample
from draftsmith.decode.trees.layout import (
    Frontier,
    TreeProposal,
    build_dynamic_tree,
    sampled_tree_chain_lengths,
    sampled_tree_layout,
)

Embed = Callable[[torch.Tensor], torch.Tensor]  # target token ids [...] -> embeddings [..., H]


def dynamic_tree(
    state: HeadState, lean: LeanEagle3, embed: Embed, spec: TreeSpec, depth: int
) -> TreeProposal:
    """EAGLE-2 dynamic tree from the head's own log-probabilities (deterministic children).

    Verify it with :func:`draftsmith.decode.trees.verify.verify_tree_greedy` / ``verify_tree_stochastic``
    over the target's pass on ``tree.input_ids(pending)``.
    """
    top_k, width = spec.top_k, spec.expanded
    draft_vocab = lean.head.config.draft_vocab_size
    if top_k > draft_vocab:
        raise ValueError(f"top_k={top_k} exceeds the draft vocabulary ({draft_vocab})")
    # Near the end of generation the depth shrinks; keep as many nodes as still fit.
    total_tokens = min(spec.total_tokens, spec.capacity(depth))
    batch = state.hidden.shape[0]
    committed = state.cache.get_seq_length()
    outputs = state.hidden[:, None].expand(batch, width, -1)  # [B, F, H] parents' outputs
    seen = torch.zeros(batch, width, 0, dtype=torch.bool, device=state.valid.device)
    own = torch.eye(width, dtype=torch.bool, device=seen.device).expand(batch, -1, -1)  # [B, F, F]

    def expand(frontier: Frontier) -> torch.Tensor:  # [B, F, V_draft] children log-probs
        nonlocal outputs, seen
        slots = frontier.parent_slots.clamp(min=0)
        hidden_in = outputs.gather(1, slots[..., None].expand(-1, -1, outputs.shape[-1]))
        ancestors = seen.gather(1, slots[..., None].expand(-1, -1, seen.shape[-1]))
        seen = torch.cat((ancestors, own), dim=-1)
        visible = torch.cat((state.valid[:, None].expand(-1, width, -1), seen), dim=-1)
        positions = (state.next_pos + frontier.step)[:, None].expand(-1, width)
        tokens = lean.to_target_ids(frontier.tokens)
        outputs = lean.step(hidden_in, embed(tokens), positions, state.cache, visible)
        return torch.log_softmax(lean.draft_logits(outputs).float(), dim=-1)

    root = torch.log_softmax(state.logits.float(), dim=-1)
    tree = build_dynamic_tree(
        root, expand, top_k=top_k, depth=depth, total_tokens=total_tokens, frontier=width
    )
    state.cache.crop(committed - state.cache.get_seq_length())
    tree.tokens = lean.to_target_ids(tree.tokens)
    return tree


def sampled_tree(
    state: HeadState,
    lean: LeanEagle3,
    embed: Embed,
    spec: TreeSpec,
    depth: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    *,
    replacement: bool = False,
) -> TreeProposal:
    """A multi-draft tree sampled from the head's own q, for verification at T > 0.

    The shape is fixed by ``spec.top_k`` (children of the root), ``depth`` and
    ``spec.total_tokens`` (:func:`draftsmith.decode.trees.layout.sampled_tree_chain_lengths`): the root's
    children, each continued as a chain, every token drawn from the head's q after the
    sampling transforms, so no node's existence depends on a sampled value. The root's
    children are drawn without replacement (child i from q with children 1..i-1 removed and
    renormalised; recursive rejection sampling, Yang et al. 2024), or i.i.d. from q with
    ``replacement`` (SpecInfer, Miao et al. 2024). Should the support run out before the last
    child, that child is drawn from the full q (any proposal fixed by the earlier draws keeps
    verification exact). ``draft_probs`` holds the q each node was drawn from, in the target
    vocabulary; verify with :func:`draftsmith.decode.trees.verify.verify_tree_stochastic` (docs/theory.md
    §4).
    Chains are stepped together as a [B, a] block of head entries (a = chains still alive at
    that level), each seeing the committed entries and its own chain's.
    """
    if sampling.greedy:
        raise ValueError(
            "sampled trees are for temperature > 0: at T = 0 use propose_tree (top-k children)"
        )
    lengths = sampled_tree_chain_lengths(spec.top_k, depth, spec.total_tokens)
    parents, depths = sampled_tree_layout(lengths)
    batch, device = state.hidden.shape[0], state.valid.device
    committed = state.cache.get_seq_length()

    # Level 1: the root's children from q_root.
    q_root = logits_to_probs(state.logits, sampling)  # [B, V_draft]
    level_tokens, level_q = [], []
    remaining = q_root
    for _ in lengths:
        q = remaining
        if not replacement:
            mass = remaining.sum(-1, keepdim=True)
            q = torch.where(mass > 0, remaining / mass.clamp(min=1e-30), q_root)
        token = sample(q, generator)  # [B]
        level_tokens.append(token)
        level_q.append(q)
        if not replacement:
            remaining = q.scatter(1, token[:, None], 0.0)
    tokens = torch.stack(level_tokens, 1)  # [B, k] draft ids of the current level
    all_tokens, all_q = [tokens], [torch.stack(level_q, 1)]  # [B, a], [B, a, V_draft]

    outputs = state.hidden[:, None].expand(batch, len(lengths), -1)  # [B, k, H]
    seen = torch.zeros(batch, len(lengths), 0, dtype=torch.bool, device=device)
    for level in range(1, lengths[0]):  # nodes at depth `level` grow children
        alive = sum(length > level for length in lengths)
        ancestors = seen[:, :alive]
        own = torch.eye(alive, dtype=torch.bool, device=device).expand(batch, -1, -1)
        seen = torch.cat((ancestors, own), dim=-1)  # [B, a, drafted + a]
        visible = torch.cat((state.valid[:, None].expand(-1, alive, -1), seen), dim=-1)
        positions = (state.next_pos + level - 1)[:, None].expand(-1, alive)
        embeds = embed(lean.to_target_ids(tokens[:, :alive]))
        outputs = lean.step(outputs[:, :alive], embeds, positions, state.cache, visible)
        q = logits_to_probs(lean.draft_logits(outputs), sampling)  # [B, a, V_draft]
        tokens = sample(q, generator)  # [B, a]
        all_tokens.append(tokens)
        all_q.append(q)
    state.cache.crop(committed - state.cache.get_seq_length())
    return TreeProposal(
        tokens=lean.to_target_ids(torch.cat(all_tokens, 1)),
        parents=parents.to(device).expand(batch, -1),
        depths=depths.to(device).expand(batch, -1),
        draft_probs=lean.to_target_probs(torch.cat(all_q, 1)),
    )
