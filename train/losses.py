"""Distillation losses between a drafter's and the target's next-token distributions.

docs/theory.md §6. Every function compares, position by position, the target distribution
``p`` and the draft distribution ``q``, both taken at the same temperature ``tau``::

    p = softmax(target_logits / tau)        q = softmax(draft_logits / tau)

and returns the mean (or, with ``reduction="sum"``, the sum) over the positions the mask keeps;
a mask that keeps nothing raises ``ValueError`` rather than returning NaN. Shapes are written
[B, T, V] with mask [B, T]; any leading shape works as long as the mask matches
``logits.shape[:-1]``. All work happens in log space
(``log_softmax``, never the log of a softmax), in at least float32, and only on the kept
positions: masked positions never enter the arithmetic, so they have no effect on the value
and receive exactly zero gradient, even when they hold padding garbage.

The target may come as logits, as log-probabilities (``-inf`` marks a probability of exactly 0;
log-probabilities are valid logits), or as probabilities wrapped in :class:`TargetProbs` (the
offline cache's top-k expansion, which may hold exact zeros). Exact zeros in ``p``
contribute nothing, following ``0 * log 0 = 0``; they never produce NaN.

References:
    Leviathan, Kalman, Matias. Fast Inference from Transformers via Speculative Decoding, 2023
    (acceptance rate ``alpha = sum_x min(p, q) = 1 - TV(p, q)``).
    Zhou et al. DistillSpec: Improving Speculative Decoding via Knowledge Distillation, 2024
    (the best divergence depends on the task and the decoding temperature).
    Agarwal et al. On-Policy Distillation of Language Models: Learning from Self-Generated
    Mistakes (GKD), 2024 (generalized Jensen-Shannon divergence).
    Hinton, Vinyals, Dean. Distilling the Knowledge in a Neural Network, 2015 (temperature).
    LK losses, arXiv 2602.23881, 2026 (the adaptive KL/TV hybrid ``lk`` and ``nla``,
    ``-log alpha``; +8-10% tau over KL on targets from 8B to 685B).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

Reduction = Literal["mean", "sum"]

# Reverse KL is infinite where the draft puts mass on a token the target gives probability 0
# (a truncated top-k target does that). Below this the target's log-probability is raised to
# it, which keeps the loss finite; e^-100 ~ 4e-44 is below what float32 probabilities hold.
DEFAULT_MIN_TARGET_LOGPROB = -100.0

# The LK hybrid's lambda = exp(-LK_ETA * alpha): 1 (all KL) at alpha = 0, e^-3 ~ 0.05 at alpha = 1.
LK_ETA = 3.0

# Below this acceptance -log(alpha) continues along its tangent (see negative_log_acceptance):
# the loss stays finite and its gradient weight 1 / alpha stays <= 1 / NLA_MIN_ALPHA.
NLA_MIN_ALPHA = 1e-4


@dataclass(frozen=True)
class TargetProbs:
    """The target distribution given as probabilities instead of logits.

    For targets read back from the offline cache: ``draftsmith.data.cache.topk_to_probs`` expands the
    top-k probabilities to the full vocabulary and spreads the remaining mass uniformly, and
    exact zeros still occur (k == V, an underflowing rest mass, a truncated target). Rows need
    not sum to 1: the losses renormalise over the vocabulary. Temperature applies as
    ``softmax(log p / tau)``, which equals ``softmax(logits / tau)`` for an untruncated ``p``.
    """

    probs: torch.Tensor  # [..., V], >= 0, exact zeros allowed

    def __post_init__(self) -> None:
        if not isinstance(self.probs, torch.Tensor) or not self.probs.is_floating_point():
            raise TypeError(
                "TargetProbs.probs must be a floating-point tensor [..., V], got "
                f"{_describe(self.probs)}"
            )
        if not bool(torch.isfinite(self.probs).all()) or bool((self.probs < 0).any()):
            raise ValueError(
                "TargetProbs.probs must be finite and >= 0; pass probabilities (for example from "
                "draftsmith.data.cache.topk_to_probs), or pass log-probabilities as target logits instead"
            )

    def logprobs(self) -> torch.Tensor:  # [..., V], -inf where probs == 0
        """``log p`` with ``-inf`` at exact zeros, and zero gradient there."""
        positive = self.probs > 0
        safe = torch.where(positive, self.probs, torch.ones_like(self.probs))
        return torch.where(positive, safe.log(), torch.full_like(safe, -math.inf))


Target = torch.Tensor | TargetProbs


# --------------------------------------------------------------------------- public losses


def forward_kl(
    draft_logits: torch.Tensor,  # [B, T, V]
    target_logits: Target,  # [B, T, V] logits or log-probs, or TargetProbs
    mask: torch.Tensor,  # [B, T] bool or 0/1
    temperature: float = 1.0,
    *,
    reduction: Reduction = "mean",
) -> torch.Tensor:  # scalar
    """Forward KL ``KL(p || q) = sum_x p(x) (log p(x) - log q(x))``, mass-covering.

    The usual soft cross-entropy of distillation, up to the target's entropy (a constant for the
    draft). Terms with ``p(x) = 0`` are 0. Reduced over the kept positions by ``reduction``.
    """
    rows = _prepare(draft_logits, target_logits, mask, temperature)
    return _reduce(_forward_kl_rows(rows), reduction)


def reverse_kl(
    draft_logits: torch.Tensor,  # [B, T, V]
    target_logits: Target,  # [B, T, V] logits or log-probs, or TargetProbs
    mask: torch.Tensor,  # [B, T] bool or 0/1
    temperature: float = 1.0,
    *,
    min_target_logprob: float = DEFAULT_MIN_TARGET_LOGPROB,
    reduction: Reduction = "mean",
) -> torch.Tensor:  # scalar
    """Reverse KL ``KL(q || p) = sum_x q(x) (log q(x) - log p(x))``, mode-seeking.

    ``KL(q || p)`` is infinite wherever ``q(x) > 0 = p(x)``, as happens against a truncated
    (top-k) target. To stay finite, ``log p`` is raised to ``min_target_logprob`` where it is
    lower; with the default (-100) this changes the value only where ``p(x) < e^-100``, which
    float32 rounds to 0 anyway. Terms with ``q(x) = 0`` are 0.
    """
    if isinstance(min_target_logprob, bool) or not isinstance(min_target_logprob, (int, float)):
        raise TypeError(f"min_target_logprob must be a number, got {min_target_logprob!r}")
    if not math.isfinite(min_target_logprob) or min_target_logprob >= 0:
        raise ValueError(
            f"min_target_logprob must be finite and < 0 (reverse KL against a zero target "
            f"probability is infinite without it), got {min_target_logprob}"
        )
    rows = _prepare(draft_logits, target_logits, mask, temperature)
    return _reduce(_reverse_kl_rows(rows, min_target_logprob), reduction)


def generalized_jsd(
    draft_logits: torch.Tensor,  # [B, T, V]
    target_logits: Target,  # [B, T, V] logits or log-probs, or TargetProbs
    mask: torch.Tensor,  # [B, T] bool or 0/1
    temperature: float = 1.0,
    *,
    beta: float = 0.5,
    reduction: Reduction = "mean",
) -> torch.Tensor:  # scalar
    """Generalized Jensen-Shannon divergence of GKD (Agarwal et al. 2024), ``0 < beta < 1``::

        m = beta * p + (1 - beta) * q
        JSD_beta(p || q) = beta * KL(p || m) + (1 - beta) * KL(q || m)

    ``beta = 0.5`` is the symmetric Jensen-Shannon divergence (bounded by ``log 2``); in
    general ``JSD_beta(p || q) = JSD_{1-beta}(q || p)``. At ``beta`` = 0 or 1 the formula is
    identically 0; the KLs are its limits after rescaling (``p`` target, ``q`` draft)::

        lim_{beta -> 0} JSD_beta(p || q) / beta       = KL(p || q)   (forward KL)
        lim_{beta -> 1} JSD_beta(p || q) / (1 - beta) = KL(q || p)   (reverse KL)

    (as ``beta -> 0``, ``m -> q`` so ``KL(q || m) = O(beta^2)`` while ``beta KL(p || m) ~ beta
    KL(p || q)``; symmetrically for ``beta -> 1``). Unlike TRL's GKD trainer, which maps
    ``beta`` = 0 and 1 to the KLs themselves, this function rejects them: use
    :func:`forward_kl` or :func:`reverse_kl`. The mixture is formed in log space
    (``logaddexp``), so zeros in ``p`` are safe.
    """
    _check_beta(beta)
    rows = _prepare(draft_logits, target_logits, mask, temperature)
    return _reduce(_jsd_rows(rows, beta), reduction)


def total_variation(
    draft_logits: torch.Tensor,  # [B, T, V]
    target_logits: Target,  # [B, T, V] logits or log-probs, or TargetProbs
    mask: torch.Tensor,  # [B, T] bool or 0/1
    temperature: float = 1.0,
    *,
    reduction: Reduction = "mean",
) -> torch.Tensor:  # scalar
    """Total variation ``TV(p, q) = 1 - sum_x min(p(x), q(x)) = 0.5 * sum_x |p(x) - q(x)|``.

    ``1 - TV`` is the probability that speculative sampling accepts a token drawn from ``q``
    (Leviathan et al. 2023, where ``TV`` is ``D_LK``), so minimising the mean TV maximises the
    expected acceptance rate directly (DistillSpec, Zhou et al. 2024). Computed as the half L1
    distance, which is exactly 0 at ``q == p`` and avoids the cancellation in ``1 - sum min``.
    """
    rows = _prepare(draft_logits, target_logits, mask, temperature)
    return _reduce(_tv_rows(rows), reduction)


def lk_hybrid(
    draft_logits: torch.Tensor,  # [B, T, V]
    target_logits: Target,  # [B, T, V] logits or log-probs, or TargetProbs
    mask: torch.Tensor,  # [B, T] bool or 0/1
    temperature: float = 1.0,
    *,
    reduction: Reduction = "mean",
) -> torch.Tensor:  # scalar
    """The LK hybrid of arXiv 2602.23881: forward KL while far from the target, TV near it.

    Per position, with the acceptance ``alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q)``::

        lambda = exp(-3 * stopgrad(alpha))
        LK(p, q) = lambda * KL(p || q) + (1 - lambda) * TV(p, q)

    ``alpha`` is detached, so ``lambda`` is a per-position weight, not a path for gradients:
    ``grad LK = lambda grad KL + (1 - lambda) grad TV``. Where the draft is far off
    (``alpha -> 0``, ``lambda -> 1``) the smooth, mass-covering KL gradient pulls it in; close
    to the target (``alpha -> 1``, ``lambda -> e^-3 ~ 0.05``) the loss is almost the TV, whose
    minimisation maximises acceptance directly (docs/theory.md §6). Zero at ``q == p``.
    """
    rows = _prepare(draft_logits, target_logits, mask, temperature)
    return _reduce(_lk_rows(rows), reduction)


def negative_log_acceptance(
    draft_logits: torch.Tensor,  # [B, T, V]
    target_logits: Target,  # [B, T, V] logits or log-probs, or TargetProbs
    mask: torch.Tensor,  # [B, T] bool or 0/1
    temperature: float = 1.0,
    *,
    reduction: Reduction = "mean",
) -> torch.Tensor:  # scalar
    """NLA of arXiv 2602.23881: ``-log alpha`` with ``alpha = sum_x min(p, q) = 1 - TV``.

    ``grad(-log alpha) = grad TV / alpha``: the TV gradient, weighted up where acceptance is
    low. For small gaps it is the TV itself, ``-log(1 - TV) = TV + TV^2/2 + ...``, so
    ``TV <= NLA <= TV + TV^2`` while ``TV <= 1/2``. Computed as ``-log1p(-TV)`` (exactly 0 at
    ``q == p``). Safe clamp: below ``alpha = NLA_MIN_ALPHA`` (1e-4) the loss continues along its
    tangent, ``-log(a) + (a - alpha) / a`` with ``a = NLA_MIN_ALPHA`` (``alpha`` summed
    directly there, where ``1 - TV`` would cancel), so it stays finite for disjoint
    distributions and its gradient is ``grad TV / max(alpha, a)``: never NaN, never cut to 0.
    """
    rows = _prepare(draft_logits, target_logits, mask, temperature)
    return _reduce(_nla_rows(rows), reduction)


def cross_entropy(
    draft_logits: torch.Tensor,  # [B, T, V]
    labels: torch.Tensor,  # [B, T] int64 token ids
    mask: torch.Tensor,  # [B, T] bool or 0/1
    *,
    reduction: Reduction = "mean",
) -> torch.Tensor:  # scalar
    """Cross-entropy on hard labels, ``-log q(label)`` with ``q = softmax(draft_logits)``.

    Always at temperature 1: it trains on data, not on a softened target (Hinton et al. 2015
    mix the hard loss at temperature 1 with soft losses at a higher temperature). Labels at
    masked positions are ignored, so any filler (for example -100) may sit there.
    """
    _check_logits(draft_logits, "draft_logits")
    keep = _kept_positions(mask, draft_logits)
    if not isinstance(labels, torch.Tensor) or labels.dtype not in _INTEGER_DTYPES:
        raise TypeError(
            f"labels must be an integer tensor [B, T] of token ids, got {_describe(labels)}"
        )
    if labels.shape != draft_logits.shape[:-1]:
        raise ValueError(
            f"labels has shape {tuple(labels.shape)} but draft_logits has shape "
            f"{tuple(draft_logits.shape)}; labels must be draft_logits.shape[:-1]"
        )
    kept_labels = labels.to(draft_logits.device)[keep]
    vocab = draft_logits.shape[-1]
    if bool(((kept_labels < 0) | (kept_labels >= vocab)).any()):
        raise ValueError(
            f"labels at unmasked positions must lie in [0, {vocab}); mask out ignored positions "
            "(for example label -100) instead of leaving them in the loss"
        )
    log_q = F.log_softmax(_upcast(_kept_rows(draft_logits, keep)), dim=-1)  # [N, V]
    nll = -log_q.gather(-1, kept_labels.long().unsqueeze(-1)).squeeze(-1)  # [N]
    return _reduce(nll, reduction)


@torch.no_grad()
def overlap(
    draft_logits: torch.Tensor,  # [B, T, V]
    target_logits: Target,  # [B, T, V] logits or log-probs, or TargetProbs
    mask: torch.Tensor,  # [B, T] bool or 0/1
    temperature: float = 1.0,
) -> torch.Tensor:  # [B, T] float, 0 at masked positions
    """Per-position overlap ``alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q)``, for evaluation.

    The probability that speculative sampling accepts a draft token drawn from ``q``
    (Leviathan et al. 2023, their ``beta``); the mean over a held-out set predicts the
    decoder's acceptance rate. ``temperature == 0`` means greedy decoding: both distributions
    are one-hot at their argmax and the overlap is 1 where the argmaxes agree, else 0.
    """
    keep, out = _evaluation_rows(draft_logits, mask, temperature)
    if not bool(keep.any()):
        return out
    if temperature == 0:
        log_p = _target_logprobs(target_logits, draft_logits.shape)[keep]
        agree = draft_logits[keep].argmax(-1) == log_p.argmax(-1)
        out[keep] = agree.to(out.dtype)
        return out
    rows = _prepare(draft_logits, target_logits, keep, temperature)
    log_q, log_p = rows.log_q, rows.log_p
    # A float32 head may be scored against a float64 target: compare in the wider dtype.
    common = torch.promote_types(log_q.dtype, log_p.dtype)
    overlaps = torch.minimum(log_q.to(common).exp(), log_p.to(common).exp()).sum(-1)
    out[keep] = overlaps.to(out.dtype)
    return out


@torch.no_grad()
def draftable_mass(
    draft_logits: torch.Tensor,  # [B, T, V] in the target vocabulary, -inf: not draftable
    target_logits: Target,  # [B, T, V] logits or log-probs, or TargetProbs
    mask: torch.Tensor,  # [B, T] bool or 0/1
    temperature: float = 1.0,
) -> torch.Tensor:  # [B, T] float, 0 at masked positions
    """The target's probability on the tokens the draft can propose: a cap on the overlap
    of every draft position, whatever the drafter learns.

    ``alpha = sum_x min(p(x), q(x)) <= sum_{x in V_draft} p(x)``, because ``q`` is 0 outside
    a pruned draft vocabulary (EAGLE-3's, Li et al. 2025; docs/theory.md §6, "The
    vocabulary's cap"). ``temperature == 0`` gives 1 where the target's argmax is draftable,
    else 0.
    """
    keep, out = _evaluation_rows(draft_logits, mask, temperature)
    if not bool(keep.any()):
        return out
    log_p = _upcast(_target_logprobs(target_logits, draft_logits.shape)[keep])  # [N, V]
    draftable = torch.isfinite(draft_logits[keep])  # [N, V]
    if temperature == 0:
        mass = draftable.gather(-1, log_p.argmax(-1, keepdim=True))[:, 0]
    else:
        mass = F.softmax(log_p / temperature, dim=-1).masked_fill(~draftable, 0.0).sum(-1)
    out[keep] = mass.to(out.dtype)
    return out


# --------------------------------------------------------------------------- config mixes

_PARAMETRIC = {"jsd": "beta"}
LOSS_NAMES = ("fkl", "rkl", "jsd", "tv", "lk", "nla", "ce")
_NUMBER = r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?"
_TERM = re.compile(rf"^(?:(?P<weight>{_NUMBER})\s*\*\s*)?(?P<name>[A-Za-z_]+)(?::(?P<param>\S+))?$")


@dataclass(frozen=True)
class LossTerm:
    """One weighted term of a loss mix: ``weight * name[:param]``."""

    name: str
    weight: float = 1.0
    param: float | None = None

    @property
    def key(self) -> str:
        """The term without its weight, e.g. ``"jsd:0.5"``; the key of :meth:`Loss.parts`."""
        return self.name if self.param is None else f"{self.name}:{self.param!r}"

    def __str__(self) -> str:
        return self.key if self.weight == 1.0 else f"{self.weight!r}*{self.key}"


@dataclass(frozen=True)
class LossSpec:
    """A loss mix parsed from a config string.

    Grammar: terms joined by ``+``, each ``[weight*]name[:param]`` with a positive weight
    (default 1). Names: ``fkl`` (:func:`forward_kl`), ``rkl`` (:func:`reverse_kl`),
    ``jsd:beta`` (:func:`generalized_jsd`, ``0 < beta < 1`` required), ``tv``
    (:func:`total_variation`), ``lk`` (:func:`lk_hybrid`), ``nla``
    (:func:`negative_log_acceptance`), ``ce`` (:func:`cross_entropy` on hard labels). Examples:
    ``"tv"``, ``"lk"``, ``"jsd:0.5"``, ``"0.5*fkl+0.5*tv"``, ``"nla+0.1*ce"``. ``str(spec)`` gives a
    canonical string that parses back to an equal spec.
    """

    terms: tuple[LossTerm, ...]

    @classmethod
    def parse(cls, text: str) -> LossSpec:
        if not isinstance(text, str) or not text.strip():
            raise ValueError(
                f"loss spec must be a non-empty string such as 'tv' or '0.5*fkl+0.5*tv', "
                f"got {text!r}"
            )
        terms = tuple(_parse_term(part.strip(), text) for part in text.split("+"))
        return cls(terms)

    def __str__(self) -> str:
        return "+".join(str(term) for term in self.terms)

    @property
    def needs_target(self) -> bool:
        """Whether any term compares against the target's distribution."""
        return any(term.name != "ce" for term in self.terms)

    @property
    def needs_labels(self) -> bool:
        """Whether any term is the hard-label cross-entropy."""
        return any(term.name == "ce" for term in self.terms)


class Loss:
    """A callable weighted sum of losses, built by :func:`build_loss`.

    ``loss(draft_logits, target_logits, mask, temperature, labels=...)`` returns
    ``sum_i weight_i * term_i``, each term reduced over the kept positions. The draft and target
    log-probabilities are computed once and shared by all soft terms. ``target_logits`` may be
    ``None`` when :attr:`needs_target` is false (pure ``ce``); ``labels`` [B, T] are required
    when :attr:`needs_labels` is true.
    """

    def __init__(self, spec: LossSpec) -> None:
        self.spec = spec

    @property
    def needs_target(self) -> bool:
        return self.spec.needs_target

    @property
    def needs_labels(self) -> bool:
        return self.spec.needs_labels

    def __repr__(self) -> str:
        return f"Loss({str(self.spec)!r})"

    def parts(
        self,
        draft_logits: torch.Tensor,  # [B, T, V]
        target_logits: Target | None,  # [B, T, V], or None for a pure "ce" spec
        mask: torch.Tensor,  # [B, T] bool or 0/1
        temperature: float = 1.0,
        *,
        labels: torch.Tensor | None = None,  # [B, T] int64, needed by "ce"
        reduction: Reduction = "mean",
    ) -> dict[str, torch.Tensor]:  # term key -> unweighted scalar
        """Each term's unweighted value, keyed by :attr:`LossTerm.key` (for logging)."""
        if self.needs_target and target_logits is None:
            raise ValueError(
                f"loss {str(self.spec)!r} compares against the target: pass target logits, "
                "log-probabilities or TargetProbs"
            )
        if self.needs_labels and labels is None:
            raise ValueError(f"loss {str(self.spec)!r} contains 'ce': pass labels [B, T]")
        out: dict[str, torch.Tensor] = {}
        rows = None  # shared by the soft terms: what one computes, the others reuse
        for term in self.spec.terms:
            if term.key in out:
                continue
            if term.name == "ce":
                assert labels is not None
                out[term.key] = cross_entropy(draft_logits, labels, mask, reduction=reduction)
                continue
            if rows is None:
                assert target_logits is not None
                rows = _prepare(draft_logits, target_logits, mask, temperature)
            out[term.key] = _reduce(_ROWS[term.name](rows, term.param), reduction)
        return out

    def __call__(
        self,
        draft_logits: torch.Tensor,  # [B, T, V]
        target_logits: Target | None,  # [B, T, V], or None for a pure "ce" spec
        mask: torch.Tensor,  # [B, T] bool or 0/1
        temperature: float = 1.0,
        *,
        labels: torch.Tensor | None = None,  # [B, T] int64, needed by "ce"
        reduction: Reduction = "mean",
    ) -> torch.Tensor:  # scalar
        parts = self.parts(
            draft_logits, target_logits, mask, temperature, labels=labels, reduction=reduction
        )
        return self.combine(parts)

    def combine(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:  # scalar
        """``sum_i weight_i * term_i`` from the unweighted values :meth:`parts` returned.

        The one place the mix is summed: objectives that log the parts call :meth:`parts`
        once and combine them here instead of evaluating the loss twice.
        """
        missing = [term.key for term in self.spec.terms if term.key not in parts]
        if missing:
            raise KeyError(f"loss {str(self.spec)!r}: parts lack the term(s) {missing}")
        first, *rest = self.spec.terms
        total = first.weight * parts[first.key]
        for term in rest:
            total = total + term.weight * parts[term.key]
        return total


def build_loss(spec: str | LossSpec) -> Loss:
    """Build the callable loss for a config string such as ``"0.5*fkl+0.5*tv"``.

    Raises ``ValueError`` naming an unknown loss and listing the valid names.
    """
    return Loss(spec if isinstance(spec, LossSpec) else LossSpec.parse(spec))


def _parse_term(part: str, text: str) -> LossTerm:
    match = _TERM.match(part)
    if match is None:
        raise ValueError(
            f"cannot parse loss term {part!r} in {text!r}; write terms as [weight*]name[:param] "
            f"joined by '+', e.g. '0.5*fkl+0.5*tv' or 'jsd:0.5' (names: {', '.join(LOSS_NAMES)})"
        )
    name = match["name"].lower()
    if name not in LOSS_NAMES:
        raise ValueError(
            f"unknown loss {match['name']!r} in {text!r}; valid names: {', '.join(LOSS_NAMES)}"
        )
    weight = float(match["weight"]) if match["weight"] is not None else 1.0
    if not weight > 0 or not math.isfinite(weight):
        raise ValueError(f"loss weight must be a positive number, got {weight} in {text!r}")
    raw = match["param"]
    if name in _PARAMETRIC:
        if raw is None:
            raise ValueError(
                f"loss {name!r} needs its {_PARAMETRIC[name]}, e.g. '{name}:0.5' (in {text!r})"
            )
        try:
            param = float(raw)
        except ValueError:
            raise ValueError(
                f"{_PARAMETRIC[name]} of {name!r} must be a number, got {raw!r} in {text!r}"
            ) from None
        _check_beta(param)
        return LossTerm(name, weight, param)
    if raw is not None:
        raise ValueError(f"loss {name!r} takes no parameter, got {name}:{raw} in {text!r}")
    return LossTerm(name, weight, None)


# --------------------------------------------------------------------------- per-position math


def _kl_rows(
    log_w: torch.Tensor,  # [N, V] log of the weighting distribution, -inf allowed
    log_v: torch.Tensor,  # [N, V]
) -> torch.Tensor:  # [N]
    """``KL(w || v) = sum_x w (log w - log v)`` with ``0 log 0 = 0``, gradient-safe.

    Entries with ``w = 0`` are replaced before any arithmetic, so no ``inf - inf`` or
    ``0 * inf`` ever appears, in the value or in the backward pass.
    """
    absent = torch.isneginf(log_w)
    log_w = log_w.masked_fill(absent, 0.0)
    log_v = log_v.masked_fill(absent, 0.0)
    return (log_w.exp() * (log_w - log_v)).masked_fill(absent, 0.0).sum(-1)


class _ForwardKLAndTV(torch.autograd.Function):
    """Forward KL and TV per row in one pass over the vocabulary, with their analytic gradients.

    For ``q = softmax(z)`` and a fixed ``p``: ``KL(p || q) = sum_x p (log p - log q)`` has
    ``d KL / d z = q - p``, and ``TV = 0.5 sum_x |q - p|`` has ``d TV / d z_j = q_j (s_j -
    sum_x q_x s_x)`` with ``s = 0.5 sign(q - p)``. Autograd through ``log_softmax``, ``exp``,
    the masking of ``p = 0`` and ``abs`` keeps about three times as many ``[N, V]`` tensors
    and passes; this keeps two (``q`` and ``q - p``). On a 2-core CPU the recipes' mix over a
    pruned 2048-token vocabulary and 2,040 positions took 40 ms forward and backward against
    83 ms, per draft position: about 6% of an EAGLE-3 training step on the demo target, more
    with a wider vocabulary. Terms with ``p(x) = 0`` are 0. docs/theory.md §6 has the
    gradients.
    """

    @staticmethod
    def forward(ctx, draft: torch.Tensor, log_p: torch.Tensor):  # [N, V] each -> [N], [N]
        log_q = torch.log_softmax(draft, dim=-1)
        q = log_q.exp()
        gap = log_p - log_q  # [N, V]
        absent = torch.isneginf(log_p)  # p = 0: the term is 0, not 0 * -inf
        if bool(absent.any()):
            gap = gap.masked_fill(absent, 0.0)
        p = log_p.exp()
        kl = (p * gap).sum(-1)
        q_minus_p = q - p
        tv = 0.5 * q_minus_p.abs().sum(-1)
        # A target that carries a gradient (rare: targets are frozen) needs p and the gap too.
        ctx.save_for_backward(q, q_minus_p, *((p, gap) if ctx.needs_input_grad[1] else ()))
        return kl, tv

    @staticmethod
    def backward(ctx, grad_kl: torch.Tensor | None, grad_tv: torch.Tensor | None):
        q, q_minus_p, *target_side = ctx.saved_tensors
        s = q_minus_p.sign().mul_(0.5)  # d TV / d q
        if grad_tv is not None:  # [N, V] d / d draft
            q_s = s * q
            grad = q_s.sub_(q * q_s.sum(-1, keepdim=True)).mul_(grad_tv[:, None])
        else:
            grad = torch.zeros_like(q)
        if grad_kl is not None:
            grad.add_(q_minus_p * grad_kl[:, None])
        if not target_side:
            return grad, None
        p, gap = target_side  # d KL / d log p = p (gap + 1), d TV / d log p = -p s
        grad_p = torch.zeros_like(p)
        if grad_kl is not None:
            grad_p.add_(p * (gap + 1.0) * grad_kl[:, None])
        if grad_tv is not None:
            grad_p.sub_(p * s * grad_tv[:, None])
        return grad, grad_p


class _Rows:
    """One loss call's kept rows at its temperature: the draft's logits (with their gradient)
    and the target's log-probabilities, plus what the terms compute from them, each computed
    once however many terms use it."""

    def __init__(self, draft: torch.Tensor, log_p: torch.Tensor) -> None:  # [N, V] each
        self.draft = draft  # logits / temperature
        self.log_p = log_p  # log-softmax of the target's logits / temperature (frozen, usually)
        self._log_q: torch.Tensor | None = None
        self._kl_tv: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def log_q(self) -> torch.Tensor:  # [N, V]
        if self._log_q is None:
            self._log_q = F.log_softmax(self.draft, dim=-1)
        return self._log_q

    def forward_kl_and_tv(self) -> tuple[torch.Tensor, torch.Tensor]:  # [N], [N]
        if self._kl_tv is None:
            self._kl_tv = _ForwardKLAndTV.apply(self.draft, self.log_p)
        return self._kl_tv


def _forward_kl_rows(rows: _Rows, _param: float | None = None) -> torch.Tensor:  # [N]
    return rows.forward_kl_and_tv()[0]


def _reverse_kl_rows(
    rows: _Rows,
    min_target_logprob: float | None = DEFAULT_MIN_TARGET_LOGPROB,
) -> torch.Tensor:  # [N]
    floor = DEFAULT_MIN_TARGET_LOGPROB if min_target_logprob is None else min_target_logprob
    return _kl_rows(rows.log_q, rows.log_p.clamp_min(floor))


def _jsd_rows(rows: _Rows, beta: float | None) -> torch.Tensor:  # [N]
    assert beta is not None
    log_q, log_p = rows.log_q, rows.log_p
    # Where both are -inf (both probabilities 0) logaddexp's backward is NaN; those entries
    # carry no weight in either KL, so any finite stand-in is exact.
    both_absent = torch.isneginf(log_p) & torch.isneginf(log_q)
    log_m = torch.logaddexp(
        log_p.masked_fill(both_absent, 0.0) + math.log(beta),
        log_q.masked_fill(both_absent, 0.0) + math.log1p(-beta),
    )  # [N, V]
    return beta * _kl_rows(log_p, log_m) + (1.0 - beta) * _kl_rows(log_q, log_m)


def _tv_rows(rows: _Rows, _param: float | None = None) -> torch.Tensor:  # [N]
    return rows.forward_kl_and_tv()[1]


def _lk_rows(rows: _Rows, _param: float | None = None) -> torch.Tensor:  # [N]
    kl, tv = rows.forward_kl_and_tv()
    weight = torch.exp(-LK_ETA * (1.0 - tv.detach()))  # lambda = exp(-eta * alpha), detached
    return weight * kl + (1.0 - weight) * tv


def _nla_rows(rows: _Rows, _param: float | None = None) -> torch.Tensor:  # [N]
    tv = _tv_rows(rows)
    floor = NLA_MIN_ALPHA
    # Both branches are evaluated; each is kept finite (and so NaN-free in the backward pass)
    # where it is not the one selected.
    exact = -torch.log1p(-tv.clamp_max(1.0 - floor))
    alpha = torch.minimum(rows.log_q, rows.log_p).exp().sum(-1)  # direct sum: accurate if tiny
    tangent = -math.log(floor) + (floor - alpha) / floor
    return torch.where(tv <= 1.0 - floor, exact, tangent)


_ROWS: dict[str, Callable[[_Rows, float | None], torch.Tensor]] = {
    "fkl": _forward_kl_rows,
    "rkl": _reverse_kl_rows,
    "jsd": _jsd_rows,
    "tv": _tv_rows,
    "lk": _lk_rows,
    "nla": _nla_rows,
}


# --------------------------------------------------------------------------- input handling

_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _prepare(
    draft_logits: torch.Tensor,  # [..., V]
    target_logits: Target,  # [..., V]
    mask: torch.Tensor,  # [...]
    temperature: float,
) -> _Rows:  # the kept positions' rows [N, V] at the temperature
    """Validate, keep the unmasked positions, and return the draft's logits and the target's
    log-probabilities there, both at ``tau``."""
    _check_temperature(temperature)
    _check_logits(draft_logits, "draft_logits")
    keep = _kept_positions(mask, draft_logits)
    log_p_all = _target_logprobs(target_logits, draft_logits.shape)
    dtype = torch.promote_types(_compute_dtype(draft_logits), _compute_dtype(log_p_all))
    kept_target = _kept_rows(log_p_all, keep)  # [N, V]
    if bool(torch.isneginf(kept_target).all(-1).any()):
        raise ValueError(
            "the target gives zero probability to every token at some unmasked position; "
            "mask that position out or fix the target probabilities"
        )
    draft = _kept_rows(draft_logits, keep).to(dtype) / temperature
    return _Rows(draft, F.log_softmax(kept_target.to(dtype) / temperature, dim=-1))


def _kept_rows(
    values: torch.Tensor,  # [..., V]
    keep: torch.Tensor,  # [...] bool
) -> torch.Tensor:  # [N, V]
    """The rows of ``values`` at the kept positions, in order. Where every position is kept
    (packed training blocks) this is a reshape, whose backward is a copy: boolean indexing's
    backward scatters into a zero tensor of the full size, several times slower."""
    if bool(keep.all()):
        return values.reshape(-1, values.shape[-1])
    return values[keep]


def _target_logprobs(
    target_logits: Target,
    shape: torch.Size,
) -> torch.Tensor:  # [..., V] unnormalised log-probabilities
    if isinstance(target_logits, TargetProbs):
        logits = target_logits.logprobs()
    elif isinstance(target_logits, torch.Tensor):
        _check_logits(target_logits, "target_logits")
        logits = target_logits
    else:
        raise TypeError(
            "target_logits must be a tensor of logits or log-probabilities [B, T, V] or a "
            f"TargetProbs wrapping probabilities, got {type(target_logits).__name__}"
        )
    if logits.shape != shape:
        raise ValueError(
            f"target has shape {tuple(logits.shape)} but draft_logits has shape {tuple(shape)}; "
            "both must be [B, T, V] over the same vocabulary"
        )
    return logits


def _check_logits(logits: torch.Tensor, name: str) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor [B, T, V], got {_describe(logits)}"
        )
    if logits.dim() < 2 or logits.shape[-1] < 1:
        raise ValueError(f"{name} must have shape [B, T, V], got {tuple(logits.shape)}")


def _kept_positions(
    mask: torch.Tensor,  # [...] bool or 0/1
    logits: torch.Tensor,  # [..., V]
) -> torch.Tensor:  # [...] bool, at least one True
    keep = _check_mask(mask, logits)
    if not bool(keep.any()):
        raise ValueError(
            "mask keeps no position, so the loss is undefined (a mean over nothing is NaN); "
            "skip this batch or make sure each batch has at least one trained position"
        )
    return keep


def _check_mask(
    mask: torch.Tensor,  # [...] bool or 0/1
    logits: torch.Tensor,  # [..., V]
) -> torch.Tensor:  # [...] bool on the logits' device
    shape = logits.shape[:-1]
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a bool or 0/1 tensor [B, T], got {type(mask).__name__}")
    if mask.shape != shape:
        raise ValueError(
            f"mask has shape {tuple(mask.shape)} but the logits need {tuple(shape)} "
            "(logits.shape[:-1])"
        )
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("mask must be bool or hold only 0 and 1 (1 = position is trained on)")
        mask = mask != 0
    return mask.to(logits.device)


def _check_temperature(temperature: float) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a positive number, got {temperature!r}")
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(
            f"temperature must be finite and > 0 for a training loss, got {temperature}; "
            "for greedy acceptance use overlap(..., temperature=0)"
        )


def _evaluation_rows(
    draft_logits: torch.Tensor,  # [B, T, V]
    mask: torch.Tensor,  # [B, T] bool or 0/1
    temperature: float,  # a decoding temperature: >= 0, 0 = greedy
) -> tuple[torch.Tensor, torch.Tensor]:  # kept positions [B, T] bool, zeros [B, T]
    """An evaluation metric's checked inputs and its output, 0 until filled at the kept rows."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number >= 0, got {temperature!r}")
    if temperature < 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature}")
    _check_logits(draft_logits, "draft_logits")
    keep = _check_mask(mask, draft_logits)
    out = torch.zeros(keep.shape, dtype=_compute_dtype(draft_logits), device=draft_logits.device)
    return keep, out


def _check_beta(beta: float) -> None:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 < beta < 1.0:
        raise ValueError(
            f"generalized JSD needs 0 < beta < 1, got {beta!r}; at the ends it is 0, and its "
            "rescaled limits are the KLs: use 'fkl' for beta -> 0 or 'rkl' for beta -> 1"
        )


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.promote_types(tensor.dtype, torch.float32)


def _upcast(tensor: torch.Tensor) -> torch.Tensor:
    """Half precision loses too much in log-softmax sums: compute in at least float32."""
    return tensor.to(_compute_dtype(tensor))


def _reduce(rows: torch.Tensor, reduction: Reduction) -> torch.Tensor:  # [N] -> scalar
    if reduction == "mean":
        return rows.mean()
    if reduction == "sum":
        return rows.sum()
    raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
