"""The acceptance ceiling of parallel drafting: what no P-EAGLE head can exceed on a target.

A parallel drafter (``draftsmith.decode.drafters.eagle.peagle``) fixes its depth-k proposal ``q_k(. | c)`` from
the committed context c alone, while the target checks depth k against
``p(. | c, y_1..y_{k-1})``, the law after the tokens accepted before it. Taking the accepted
path ``y = (y_1..y_{k-1})`` to follow the target's own law, ``w(y) = prod_i p(y_i | c, y_<i)``
(as it does when the earlier proposals are the target's), depth k's expected acceptance at
T = 1 (docs/theory.md §2, §8) is

    A_k(q) = sum_y w(y) sum_x min(p(x | c, y), q(x)).

A chain drafter (EAGLE-3) sees y and can reach 1; a parallel one is capped by
``max_q A_k(q)`` over distributions q. Each ``f_x(t) = sum_y w(y) min(p(x | c, y), t)`` is
concave and piecewise linear in t with slope ``s_x(t) = sum_y w(y) [p(x | c, y) >= t]``, so
the maximum is a water-filling (:func:`best_shared_overlap`): for a level lambda,
``q_x(lambda)`` is the largest t with ``s_x(t) >= lambda``; the lambda where
``sum_x q_x = 1`` gives the optimum. Forward KL, the loss most recipes weight, converges instead
to the mixture ``m = sum_y w(y) p(. | c, y)`` (:func:`mixture_overlap`), at or below the cap.

At T = 0 the target's continuation is a function of c, so the cap is 1 at every depth: a
parallel head's greedy shortfall is what it has not learnt, not what it cannot see.

:func:`parallel_ceilings` measures both on a target by beam expansion: at each level the
paths are extended by their ``top_k`` most likely tokens and the ``beam`` most likely paths
kept; w is renormalised over the kept paths, whose share of the probability (``coverage``)
is reported beside the figures. The paths left out bracket the true cap: the kept paths'
optimum accepts at least ``coverage * ceiling`` over all paths, and no proposal accepts more
than ``coverage * ceiling + 1 - coverage`` (``lower`` and ``upper``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def mixture_overlap(
    probs: torch.Tensor,  # [J, V] p(. | c, y_j) per path j
    weights: torch.Tensor,  # [J] path weights (normalised here)
) -> float:
    """``A(m)`` for the mixture ``m = sum_j w_j p_j``: the acceptance a forward-KL optimum gets."""
    probs = probs.double()
    w = (weights / weights.sum()).double()
    mixture = w @ probs  # [V]
    return float((w[:, None] * torch.minimum(probs, mixture)).sum())


def best_shared_overlap(
    probs: torch.Tensor,  # [J, V] p(. | c, y_j) per path j
    weights: torch.Tensor,  # [J] path weights (normalised here)
    iterations: int = 60,
) -> float:
    """``max_q sum_j w_j sum_x min(p_j(x), q(x))`` over distributions q (module docstring).

    Bisection on the level lambda: ``q(lambda)`` sums to more than 1 below the optimal level
    and to at most 1 above it; the mass left below 1 at the upper end is worth lambda per unit
    (the slope where it would go), which completes the value.
    """
    probs = probs.double()
    w = (weights / weights.sum()).double()
    values, order = probs.sort(dim=0, descending=True)  # [J, V]
    cumulative = w[order].cumsum(0)  # [J, V]: weight of the paths with p_j(x) >= values[r, x]
    last = probs.shape[0] - 1

    def level(lam: float) -> torch.Tensor:  # [V] q_x(lambda)
        rank = (cumulative < lam - 1e-12).sum(0).clamp(max=last)  # first r with cumulative >= lam
        return values.gather(0, rank[None]).squeeze(0)

    low, high = 0.0, 1.0
    for _ in range(iterations):
        middle = (low + high) / 2
        if float(level(middle).sum()) > 1.0:
            low = middle
        else:
            high = middle
    q = level(high)  # [V], sums to <= 1
    value = float((w[:, None] * torch.minimum(probs, q)).sum())
    return value + high * max(0.0, 1.0 - float(q.sum()))


@dataclass
class DepthCeiling:
    """One depth's figures, averaged over the contexts measured."""

    depth: int  # k: the draft position (1 = the next token)
    ceiling: float  # mean max_q A_k(q): the best any parallel drafter can accept at T = 1
    mixture: float  # mean A_k(m): what the forward-KL optimum accepts
    coverage: float  # mean share of the paths' probability the beam kept
    contexts: int
    lower: float = 1.0  # mean coverage * ceiling: the cap over all paths is at least this
    upper: float = 1.0  # mean coverage * ceiling + 1 - coverage: and at most this


@torch.no_grad()
def _next_probs(target: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:  # [R, L] -> [R, V]
    """The target's float32 law of the token after each row (full rows of equal length)."""
    logits = target(input_ids=rows).logits[:, -1]
    return torch.softmax(logits.float(), dim=-1)


@torch.no_grad()
def context_ceilings(
    target: torch.nn.Module,
    context: torch.Tensor,  # [L] committed token ids
    depths: int,
    top_k: int = 16,
    beam: int = 64,
) -> list[tuple[float, float, float]]:  # per depth 2..depths: (ceiling, mixture, coverage)
    """Depths 2..``depths`` of one context by beam expansion (module docstring)."""
    paths = context[None]  # [J, L + level]
    weights = torch.ones(1, dtype=torch.float64)  # [J] joint probability of each path
    probs = _next_probs(target, paths)  # [J, V]: the law after each path
    figures = []
    for _ in range(depths - 1):
        top_p, top_ids = probs.topk(min(top_k, probs.shape[1]), dim=-1)  # [J, K]
        joint = (weights[:, None] * top_p.double()).flatten()  # [J * K]
        keep = joint.topk(min(beam, joint.numel())).indices
        parents = keep // top_p.shape[1]
        paths = torch.cat((paths[parents], top_ids.flatten()[keep][:, None]), dim=1)
        weights = joint[keep]
        probs = _next_probs(target, paths)  # [J', V]: p(. | c, y), extended at the next depth
        figures.append(
            (
                best_shared_overlap(probs, weights),
                mixture_overlap(probs, weights),
                float(weights.sum()),
            )
        )
    return figures


def parallel_ceilings(
    target: torch.nn.Module,
    contexts: Sequence[torch.Tensor],  # each [L] committed token ids
    depths: int = 4,
    top_k: int = 16,
    beam: int = 64,
) -> list[DepthCeiling]:
    """:func:`context_ceilings` averaged over ``contexts``; depth 1 is 1 by definition."""
    if depths < 2:
        raise ValueError(f"depths must be >= 2 (depth 1 is never capped), got {depths}")
    if top_k < 1 or beam < 1:
        raise ValueError(f"top_k and beam must be >= 1, got {top_k} and {beam}")
    if not contexts:
        raise ValueError("no context to measure: pass at least one")
    per_context = [context_ceilings(target, c, depths, top_k, beam) for c in contexts]
    out = [DepthCeiling(1, 1.0, 1.0, 1.0, len(contexts))]  # depth 1 sees all it needs
    for index in range(depths - 1):
        column = torch.tensor([figures[index] for figures in per_context], dtype=torch.float64)
        ceiling, mixture, coverage = column.mean(0).tolist()
        lower = float((column[:, 0] * column[:, 2]).mean())
        upper = lower + 1.0 - coverage
        out.append(DepthCeiling(index + 2, ceiling, mixture, coverage, len(contexts), lower, upper))
    return out


def tau_cap(ceilings: Sequence[DepthCeiling], num_draft_tokens: int) -> float:
    """Tokens per verify pass of a chain of ``num_draft_tokens`` parallel drafts accepted at the
    caps: ``1 + sum_n prod_{k <= n} ceiling_k`` (docs/theory.md §5; a chain drafter's cap is
    ``num_draft_tokens + 1``). Depths past the measured ones keep the deepest cap."""
    tau, survive = 1.0, 1.0
    for n in range(num_draft_tokens):
        survive *= ceilings[min(n, len(ceilings) - 1)].ceiling
        tau += survive
    return tau
