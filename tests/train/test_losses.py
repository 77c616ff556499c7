"""Exact properties of the distillation losses in train/losses.py (docs/theory.md §6)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from draftsmith.train.losses import (
    LK_ETA,
    LOSS_NAMES,
    NLA_MIN_ALPHA,
    Loss,
    LossSpec,
    LossTerm,
    TargetProbs,
    build_loss,
    cross_entropy,
    draftable_mass,
    forward_kl,
    generalized_jsd,
    lk_hybrid,
    negative_log_acceptance,
    overlap,
    reverse_kl,
    total_variation,
)

B, T, V = 3, 5, 11

DIVERGENCES: dict[str, Callable[..., torch.Tensor]] = {
    "fkl": forward_kl,
    "rkl": reverse_kl,
    "jsd:0.1": lambda *a, **k: generalized_jsd(*a, beta=0.1, **k),
    "jsd:0.5": lambda *a, **k: generalized_jsd(*a, beta=0.5, **k),
    "jsd:0.9": lambda *a, **k: generalized_jsd(*a, beta=0.9, **k),
    "tv": total_variation,
    "lk": lk_hybrid,
    "nla": negative_log_acceptance,
}


def _logits(seed: int, scale: float = 2.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, V, generator=g, dtype=torch.float64) * scale).to(dtype)


def _mask(seed: int = 0) -> torch.Tensor:  # [B, T] bool with kept and masked positions
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[0, 0], mask[-1, -1] = True, False
    return mask


def _labels(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g)


def _ref_rows(name: str, draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Straightforward per-position references in float64 from full-support distributions."""
    q = torch.softmax(draft.double(), -1)
    p = torch.softmax(target.double(), -1)
    if name == "fkl":
        return (p * (p.log() - q.log())).sum(-1)
    if name == "rkl":
        return (q * (q.log() - p.log())).sum(-1)
    if name.startswith("jsd:"):
        beta = float(name.split(":")[1])
        m = beta * p + (1 - beta) * q
        return beta * (p * (p / m).log()).sum(-1) + (1 - beta) * (q * (q / m).log()).sum(-1)
    if name == "tv":
        return 1 - torch.minimum(p, q).sum(-1)
    if name == "lk":
        alpha = torch.minimum(p, q).sum(-1)
        weight = torch.exp(-3 * alpha)
        return weight * _ref_rows("fkl", draft, target) + (1 - weight) * (1 - alpha)
    if name == "nla":
        return -torch.minimum(p, q).sum(-1).log()
    raise AssertionError(name)


# ------------------------------------------------------------------------- values


@pytest.mark.parametrize("name", DIVERGENCES)
def test_matches_reference_formula(name: str) -> None:
    draft, target, mask = _logits(1), _logits(2), _mask()
    got = DIVERGENCES[name](draft, target, mask)
    want = _ref_rows(name, draft, target)[mask].mean()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert want > 1e-3  # the inputs differ, so the comparison is not trivially 0 == 0


@pytest.mark.parametrize("name", DIVERGENCES)
def test_zero_at_identity(name: str) -> None:
    logits, mask = _logits(3), _mask()
    assert abs(DIVERGENCES[name](logits, logits, mask).item()) < 1e-6
    probs = TargetProbs(torch.softmax(logits, -1))
    assert abs(DIVERGENCES[name](logits, probs, mask).item()) < 1e-6


@pytest.mark.parametrize("name", DIVERGENCES)
@pytest.mark.parametrize("seed", range(5))
def test_nonnegative_on_random_inputs(name: str, seed: int) -> None:
    draft, target = _logits(10 + seed, scale=3.0), _logits(20 + seed, scale=3.0)
    per_position = torch.ones(B, T, dtype=torch.bool)
    value = DIVERGENCES[name](draft, target, per_position)
    assert value > 0
    for b in range(B):  # every single position too, not only the mean
        one = torch.zeros(B, T, dtype=torch.bool)
        one[b, seed % T] = True
        assert DIVERGENCES[name](draft, target, one) >= 0


@pytest.mark.parametrize("spec", ["fkl", "tv", "lk", "0.5*fkl+0.5*tv", "fkl+0.3*tv+0.2*nla"])
@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_gradients_match_autograd_through_the_reference_formula(spec: str, tau: float) -> None:
    """The fused forward-KL/TV pass's analytic gradient equals autograd's through the plain
    formula (float64), with respect to the draft and to a target that carries a gradient."""
    loss = build_loss(spec)
    draft, target, mask = _logits(61).double(), _logits(62).double(), _mask()
    weights = {t.name: t.weight for t in loss.spec.terms}

    def reference(draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        total = draft.new_zeros(())
        for name, weight in weights.items():
            if name == "lk":  # its lambda = exp(-3 alpha) is a constant for the gradient
                kl = _ref_rows("fkl", draft / tau, target / tau)
                tv = _ref_rows("tv", draft / tau, target / tau)
                lam = torch.exp(-3 * (1 - tv.detach()))
                rows = lam * kl + (1 - lam) * tv
            else:
                rows = _ref_rows(name, draft / tau, target / tau)
            total = total + weight * rows[mask].mean()
        return total

    got_draft = draft.clone().requires_grad_()
    got_target = target.clone().requires_grad_()
    loss(got_draft, got_target, mask, tau).backward()
    want_draft = draft.clone().requires_grad_()
    want_target = target.clone().requires_grad_()
    reference(want_draft, want_target).backward()
    torch.testing.assert_close(got_draft.grad, want_draft.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got_target.grad, want_target.grad, rtol=1e-9, atol=1e-12)
    assert float(want_draft.grad.abs().max()) > 1e-3  # not trivially 0 == 0


def test_forward_kl_and_tv_gradients_with_exact_zeros_in_the_target() -> None:
    """A cached target with p(x) = 0 entries: those terms are 0, the gradients finite and equal
    to autograd's through a formula that drops them."""
    draft, mask = _logits(63).double(), _mask()
    probs = torch.softmax(_logits(64).double(), -1)
    probs[..., :3] = 0.0  # the entries a top-k cache with k < V may leave at exactly 0
    probs = probs / probs.sum(-1, keepdim=True)
    loss = build_loss("0.5*fkl+0.5*tv")
    got = draft.clone().requires_grad_()
    value = loss(got, TargetProbs(probs), mask)
    value.backward()
    want = draft.clone().requires_grad_()
    q = torch.softmax(want, -1)
    kept = probs > 0
    kl = torch.where(kept, probs * (probs.clamp_min(1e-300).log() - q.log()), 0.0).sum(-1)
    tv = 0.5 * (probs - q).abs().sum(-1)
    reference = (0.5 * kl + 0.5 * tv)[mask].mean()
    reference.backward()
    torch.testing.assert_close(value.detach(), reference.detach())
    assert bool(torch.isfinite(got.grad).all())
    torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-12)


def test_forward_kl_matches_torch_kl_div() -> None:
    draft, target, mask = _logits(4), _logits(5), _mask()
    kl = F.kl_div(
        F.log_softmax(draft[mask], -1),
        F.log_softmax(target[mask], -1),
        reduction="batchmean",
        log_target=True,
    )  # torch's kl_div(input=log q, target=log p) is KL(p || q); batchmean = mean over rows
    torch.testing.assert_close(forward_kl(draft, target, mask), kl)


def test_cross_entropy_matches_torch() -> None:
    draft, labels, mask = _logits(6), _labels(7), _mask()
    want = F.cross_entropy(draft.reshape(-1, V), labels.masked_fill(~mask, -100).reshape(-1))
    torch.testing.assert_close(cross_entropy(draft, labels.masked_fill(~mask, -100), mask), want)


def test_reduction_sum_is_mean_times_kept_positions() -> None:
    draft, target, mask = _logits(8), _logits(9), _mask()
    n = int(mask.sum())
    for name, fn in DIVERGENCES.items():
        torch.testing.assert_close(
            fn(draft, target, mask, reduction="sum"), fn(draft, target, mask) * n, msg=name
        )
    labels = _labels(1)
    torch.testing.assert_close(
        cross_entropy(draft, labels, mask, reduction="sum"), cross_entropy(draft, labels, mask) * n
    )
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        forward_kl(draft, target, mask, reduction="none")  # type: ignore[arg-type]


# ------------------------------------------------------------------------- temperature


@pytest.mark.parametrize("name", DIVERGENCES)
@pytest.mark.parametrize("tau", [0.5, 2.0])
def test_temperature_divides_both_logits(name: str, tau: float) -> None:
    draft, target, mask = _logits(11), _logits(12), _mask()
    got = DIVERGENCES[name](draft, target, mask, tau)
    torch.testing.assert_close(got, DIVERGENCES[name](draft / tau, target / tau, mask))
    assert not torch.allclose(got, DIVERGENCES[name](draft, target, mask))


@pytest.mark.parametrize("name", DIVERGENCES)
@pytest.mark.parametrize("tau", [1.0, 0.7, 2.0])
def test_target_as_logits_logprobs_or_probs_agree(name: str, tau: float) -> None:
    draft, target, mask = _logits(13), _logits(14), _mask()
    fn = DIVERGENCES[name]
    from_logits = fn(draft, target, mask, tau)
    torch.testing.assert_close(fn(draft, F.log_softmax(target, -1), mask, tau), from_logits)
    torch.testing.assert_close(
        fn(draft, TargetProbs(torch.softmax(target, -1)), mask, tau), from_logits
    )


def test_bad_temperature_raises() -> None:
    draft, target, mask = _logits(1), _logits(2), _mask()
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="temperature must be finite and > 0"):
            forward_kl(draft, target, mask, bad)
    with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
        overlap(draft, target, mask, -0.5)


# ------------------------------------------------------------------------- generalized JSD


def test_jsd_beta_limits_recover_the_kls_as_stated() -> None:
    """lim_{b->0} JSD_b / b = KL(p||q) and lim_{b->1} JSD_b / (1-b) = KL(q||p)."""
    # The error is O(beta * sum p^2 / q): moderate logits keep that constant small enough to
    # see the limit in float64 before rounding takes over.
    draft = _logits(15, scale=1.0, dtype=torch.float64)
    target = _logits(16, scale=1.0, dtype=torch.float64)
    mask = _mask()
    fkl, rkl = forward_kl(draft, target, mask), reverse_kl(draft, target, mask)
    assert fkl.dtype == torch.float64

    def low(beta: float) -> float:
        return (generalized_jsd(draft, target, mask, beta=beta) / beta - fkl).abs().item()

    def high(beta: float) -> float:
        jsd = generalized_jsd(draft, target, mask, beta=1 - beta)
        return (jsd / beta - rkl).abs().item()

    assert low(1e-7) < 1e-5 * fkl.item()
    assert high(1e-7) < 1e-5 * rkl.item()
    # and the limits are not swapped: each is far from the other KL
    assert abs(fkl - rkl).item() > 1000 * max(low(1e-7), high(1e-7))
    # the error shrinks linearly in beta (resp. 1 - beta), as the expansion says
    assert low(1e-4) < 0.2 * low(1e-3) and low(1e-3) < 0.2 * low(1e-2)
    assert high(1e-4) < 0.2 * high(1e-3) and high(1e-3) < 0.2 * high(1e-2)


def test_jsd_symmetry() -> None:
    a, b, mask = _logits(17), _logits(18), _mask()
    half_ab = generalized_jsd(a, b, mask, beta=0.5)
    torch.testing.assert_close(half_ab, generalized_jsd(b, a, mask, beta=0.5))
    assert 0 < half_ab <= math.log(2)
    # in general JSD_beta(p || q) = JSD_{1-beta}(q || p)
    torch.testing.assert_close(
        generalized_jsd(a, b, mask, beta=0.2), generalized_jsd(b, a, mask, beta=0.8)
    )
    assert not torch.allclose(
        generalized_jsd(a, b, mask, beta=0.2), generalized_jsd(b, a, mask, beta=0.2)
    )


@pytest.mark.parametrize("beta", [0.0, 1.0, -0.1, 1.5])
def test_jsd_beta_outside_open_interval_raises(beta: float) -> None:
    with pytest.raises(ValueError, match=r"0 < beta < 1.*'fkl'.*'rkl'"):
        generalized_jsd(_logits(1), _logits(2), _mask(), beta=beta)


# ------------------------------------------------------------------------- LK and NLA


def _rows(fn: Callable[..., torch.Tensor], draft: torch.Tensor, target: torch.Tensor):
    """Per-position values [B, T] of a loss (one kept position at a time)."""
    out = torch.empty(draft.shape[:-1], dtype=torch.float64)
    for b in range(draft.shape[0]):
        for t in range(draft.shape[1]):
            one = torch.zeros(draft.shape[:-1], dtype=torch.bool)
            one[b, t] = True
            out[b, t] = fn(draft, target, one).double()
    return out


def _alpha(draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # [B, T] float64
    return torch.minimum(torch.softmax(draft.double(), -1), torch.softmax(target.double(), -1)).sum(
        -1
    )


def test_lk_weights_kl_and_tv_by_exp_minus_3_alpha_per_position() -> None:
    draft = _logits(60, dtype=torch.float64)
    target = _logits(61, dtype=torch.float64)
    alpha = _alpha(draft, target)
    weight = torch.exp(-LK_ETA * alpha)
    want = weight * _rows(forward_kl, draft, target) + (1 - weight) * (1 - alpha)
    torch.testing.assert_close(_rows(lk_hybrid, draft, target), want)
    assert LK_ETA == 3.0
    # lambda differs between positions (it is per position, not one weight for the batch)
    assert weight.max() - weight.min() > 0.05


def test_lk_alpha_is_detached_so_its_gradient_is_the_weighted_kl_and_tv_gradients() -> None:
    draft, target = _logits(62, dtype=torch.float64), _logits(63, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    weight = torch.exp(-LK_ETA * _alpha(draft, target))  # [B, T], a constant for autograd

    def grad(fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        leaf = draft.clone().requires_grad_()
        fn(leaf).backward()
        return leaf.grad

    got = grad(lambda d: lk_hybrid(d, target, mask, reduction="sum"))
    kl_part = grad(
        lambda d: (weight * _rows_graph(forward_kl, d, target)).sum()  # lambda * grad KL
    )
    tv_part = grad(lambda d: ((1 - weight) * _rows_graph(total_variation, d, target)).sum())
    torch.testing.assert_close(got, kl_part + tv_part)
    assert got.abs().sum() > 0 and torch.isfinite(got).all()


def _rows_graph(fn: Callable[..., torch.Tensor], draft: torch.Tensor, target: torch.Tensor):
    """Like :func:`_rows` but differentiable: [B, T] values with the graph attached."""
    values = []
    for b in range(draft.shape[0]):
        for t in range(draft.shape[1]):
            one = torch.zeros(draft.shape[:-1], dtype=torch.bool)
            one[b, t] = True
            values.append(fn(draft, target, one))
    return torch.stack(values).view(draft.shape[:-1])


def test_lk_limits_kl_far_from_the_target_and_mostly_tv_near_it() -> None:
    mask = torch.ones(B, T, dtype=torch.bool)
    # alpha -> 0: the draft is peaked on another token than the target, lambda -> 1, LK -> KL
    target = _logits(64, dtype=torch.float64)
    top = target.argmax(-1, keepdim=True)
    draft = torch.zeros_like(target).scatter(-1, (top + 1) % V, 40.0)
    target = torch.zeros_like(target).scatter(-1, top, 40.0)
    alpha = _alpha(draft, target)
    assert alpha.max() < 1e-15
    fkl = forward_kl(draft, target, mask)
    assert fkl > 30
    torch.testing.assert_close(lk_hybrid(draft, target, mask), fkl, rtol=1e-12, atol=0)
    # alpha -> 1: a small perturbation of the target, lambda -> e^-3 and the weight on TV -> 1-e^-3
    target = _logits(65, dtype=torch.float64)
    for eps in (1e-2, 1e-3, 1e-4):
        draft = target + eps * _logits(66, dtype=torch.float64)
        alpha = _alpha(draft, target)
        weight = torch.exp(-LK_ETA * alpha)
        assert (weight - math.exp(-LK_ETA)).abs().max() < 4 * eps
        mixed = math.exp(-LK_ETA) * _rows(forward_kl, draft, target) + (
            1 - math.exp(-LK_ETA)
        ) * _rows(total_variation, draft, target)
        torch.testing.assert_close(_rows(lk_hybrid, draft, target), mixed, rtol=10 * eps, atol=0)
    # near the target TV (first order in the gap) dominates KL (second order): LK ~ (1-e^-3) TV
    tv = total_variation(draft, target, mask)
    assert lk_hybrid(draft, target, mask).item() == pytest.approx(
        (1 - math.exp(-LK_ETA)) * tv.item(), rel=1e-3
    )


def test_nla_is_minus_log_alpha_and_agrees_with_tv_for_small_gaps() -> None:
    mask = torch.ones(B, T, dtype=torch.bool)
    target = _logits(67, dtype=torch.float64)
    far = _logits(68, dtype=torch.float64)
    torch.testing.assert_close(
        _rows(negative_log_acceptance, far, target), -_alpha(far, target).log()
    )
    for eps in (1e-1, 1e-2, 1e-3):
        draft = target + eps * far
        tv = _rows(total_variation, draft, target)
        nla = _rows(negative_log_acceptance, draft, target)
        assert tv.max() < 0.5
        assert (nla >= tv).all() and (nla <= tv + tv**2).all()  # -log(1 - x) in [x, x + x^2]
    assert negative_log_acceptance(draft, target, mask) == pytest.approx(
        total_variation(draft, target, mask).item(), rel=1e-3
    )
    # its gradient is the TV gradient over alpha, position by position
    leaf = far.clone().requires_grad_()
    negative_log_acceptance(leaf, target, mask, reduction="sum").backward()
    weight = 1 / _alpha(far, target)
    tv_leaf = far.clone().requires_grad_()
    (weight * _rows_graph(total_variation, tv_leaf, target)).sum().backward()
    torch.testing.assert_close(leaf.grad, tv_leaf.grad)


def test_nla_is_finite_with_bounded_gradient_for_disjoint_distributions() -> None:
    mask = torch.ones(B, T, dtype=torch.bool)
    target = _logits(69, dtype=torch.float64)
    top = target.argmax(-1, keepdim=True)
    cases = {
        "alpha ~ e^-40": torch.zeros_like(target).scatter(-1, (top + 1) % V, 40.0),
        "alpha = 0 exactly": torch.full_like(target, -math.inf).scatter(-1, (top + 1) % V, 0.0),
    }
    peaked = TargetProbs(torch.zeros_like(target).scatter(-1, top, 1.0))
    bound = -math.log(NLA_MIN_ALPHA) + 1  # the tangent continuation never exceeds this
    for name, draft in cases.items():
        leaf = draft.clone().requires_grad_()
        value = negative_log_acceptance(leaf, peaked, mask)
        assert math.isfinite(value.item()) and value.item() <= bound + 1e-9, name
        assert value.item() == pytest.approx(bound, abs=1e-6), name  # alpha ~ 0: at the bound
        value.backward()
        assert torch.isfinite(leaf.grad).all(), name
    # either side of the floor: -log(alpha) above it, its tangent below; gradients never vanish
    one = torch.ones(1, 1, dtype=torch.bool)
    target = TargetProbs(torch.tensor([[[0.5, 0.0, 0.5]]], dtype=torch.float64))
    for alpha in (2 * NLA_MIN_ALPHA, NLA_MIN_ALPHA / 2):
        # q = (alpha, 1 - alpha, 0): the overlap with p is q's first entry, alpha
        draft = [[[math.log(alpha), math.log1p(-alpha), -math.inf]]]
        leaf = torch.tensor(draft, dtype=torch.float64, requires_grad=True)
        value = negative_log_acceptance(leaf, target, one)
        if alpha >= NLA_MIN_ALPHA:
            want = -math.log(alpha)
        else:
            want = -math.log(NLA_MIN_ALPHA) + (NLA_MIN_ALPHA - alpha) / NLA_MIN_ALPHA
        assert value.item() == pytest.approx(want, rel=1e-9)
        value.backward()
        assert torch.isfinite(leaf.grad).all() and leaf.grad.abs().sum() > 0


# ------------------------------------------------------------------------- masks


def _all_losses(
    draft: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor
) -> dict[str, torch.Tensor]:
    out = {name: fn(draft, target, mask) for name, fn in DIVERGENCES.items()}
    out["ce"] = cross_entropy(draft, labels, mask)
    out["mix"] = build_loss("0.3*fkl+rkl+0.5*jsd:0.5+2*tv+lk+0.2*nla+0.1*ce")(
        draft, target, mask, labels=labels
    )
    return out


def test_masked_positions_get_zero_gradient_and_do_not_change_the_value() -> None:
    mask, labels = _mask(), _labels(3)
    draft, target = _logits(19), _logits(20)
    reference = _all_losses(draft, target, mask, labels)

    garbage = ~mask
    draft_g, target_g = draft.clone(), target.clone()
    draft_g[garbage] = torch.tensor([math.nan, math.inf, -math.inf, 1e30] * 3)[:V]
    target_g[garbage] = math.nan
    labels_g = labels.masked_fill(garbage, -100)
    for name in reference:
        leaf_d = draft_g.clone().requires_grad_()
        leaf_t = target_g.clone().requires_grad_()
        value = _all_losses(leaf_d, leaf_t, mask, labels_g)[name]
        assert value.item() == pytest.approx(reference[name].item(), rel=1e-6, abs=1e-7), name
        value.backward()
        assert (leaf_t.grad is None) == (name == "ce"), name  # ce never reads the target
        for grad in (leaf_d.grad, leaf_t.grad if name != "ce" else leaf_d.grad):
            assert torch.isfinite(grad).all(), name
            assert (grad[garbage] == 0).all(), name
        assert leaf_d.grad[mask].abs().sum() > 0, name  # the kept positions do get a gradient


def test_a_full_mask_gives_the_values_and_gradients_of_the_same_rows_under_a_partial_one() -> None:
    """A mask that keeps every position takes a reshape instead of boolean indexing: it must
    compute what the indexed path computes for the same rows, gradients included."""
    draft, target, labels = _logits(23), _logits(24), _labels(5)
    full = torch.ones(B, T, dtype=torch.bool)
    # The same rows plus one extra masked-out batch row: the indexed path.
    padded_mask = torch.cat((full, torch.zeros(1, T, dtype=torch.bool)))
    padded_labels = torch.cat((labels, labels[:1]))
    for name in _all_losses(draft, target, full, labels):
        leaf = draft.clone().requires_grad_()
        value = _all_losses(leaf, target, full, labels)[name]
        value.backward()
        padded = torch.cat((draft, _logits(25)[:1])).requires_grad_()
        indexed = _all_losses(padded, torch.cat((target, target[:1])), padded_mask, padded_labels)
        indexed[name].backward()
        torch.testing.assert_close(value, indexed[name], msg=name)
        torch.testing.assert_close(leaf.grad, padded.grad[:B], msg=name)


def test_mask_as_int_or_float_equals_bool() -> None:
    draft, target, mask = _logits(21), _logits(22), _mask()
    want = forward_kl(draft, target, mask)
    torch.testing.assert_close(forward_kl(draft, target, mask.long()), want)
    torch.testing.assert_close(forward_kl(draft, target, mask.float()), want)
    with pytest.raises(ValueError, match="only 0 and 1"):
        forward_kl(draft, target, mask.float() * 2)
    with pytest.raises(ValueError, match="mask has shape"):
        forward_kl(draft, target, mask[:, :-1])


def test_all_masked_raises_instead_of_nan() -> None:
    draft, target, labels = _logits(23), _logits(24), _labels(5)
    nothing = torch.zeros(B, T, dtype=torch.bool)
    for fn in DIVERGENCES.values():
        with pytest.raises(ValueError, match="mask keeps no position"):
            fn(draft, target, nothing)
        with pytest.raises(ValueError, match="mask keeps no position"):
            fn(draft, target, nothing.long(), reduction="sum")
    with pytest.raises(ValueError, match="mask keeps no position"):
        cross_entropy(draft, labels, nothing)
    with pytest.raises(ValueError, match="mask keeps no position"):
        build_loss("fkl+ce")(draft, target, nothing, labels=labels)
    assert (overlap(draft, target, nothing) == 0).all()  # per position: nothing to average


# ------------------------------------------------------------------------- TV and overlap


def test_tv_is_one_minus_overlap_and_half_l1() -> None:
    draft, target, mask = _logits(25), _logits(26), _mask()
    alpha = overlap(draft, target, mask)
    assert alpha.shape == (B, T)
    assert (alpha[~mask] == 0).all()
    assert ((alpha[mask] > 0) & (alpha[mask] <= 1 + 1e-6)).all()
    tv = total_variation(draft, target, mask)
    torch.testing.assert_close(tv, 1 - alpha[mask].mean())
    half_l1 = 0.5 * (torch.softmax(draft, -1) - torch.softmax(target, -1)).abs().sum(-1)
    torch.testing.assert_close(tv, half_l1[mask].mean())
    for b, t in mask.nonzero().tolist():  # per position, not only on average
        one = torch.zeros_like(mask)
        one[b, t] = True
        torch.testing.assert_close(total_variation(draft, target, one), 1 - alpha[b, t])


def test_overlap_is_one_at_identity_and_tracks_temperature() -> None:
    draft, target, mask = _logits(27), _logits(28), _mask()
    torch.testing.assert_close(overlap(draft, draft, mask)[mask], torch.ones(int(mask.sum())))
    hot = overlap(draft, target, mask, 2.0)
    torch.testing.assert_close(hot, overlap(draft / 2, target / 2, mask))
    assert not hot.requires_grad


def test_overlap_at_temperature_zero_is_argmax_agreement() -> None:
    draft, target, mask = _logits(29), _logits(30), _mask()
    target[0, 0] = draft[0, 0] + 0.1  # guarantee one agreeing position
    agree = (draft.argmax(-1) == target.argmax(-1)) & mask
    torch.testing.assert_close(overlap(draft, target, mask, 0), agree.float())
    assert agree.any() and (mask & ~agree).any()
    cached = TargetProbs(torch.softmax(target, -1))
    torch.testing.assert_close(overlap(draft, cached, mask, 0.0), agree.float())


def _pruned(draft: torch.Tensor, keep: int) -> torch.Tensor:  # [B, T, V], -inf off support
    """``draft`` with only its first ``keep`` vocabulary entries draftable."""
    return draft.masked_fill(torch.arange(V) >= keep, -math.inf)


@pytest.mark.parametrize("tau", [0.5, 1.0, 2.0])
def test_draftable_mass_is_the_target_mass_on_the_draft_support_and_caps_the_overlap(
    tau: float,
) -> None:
    target, mask = _logits(31), _mask()
    p = torch.softmax(target / tau, -1)
    expected = p[..., :4].sum(-1) * mask
    mass = draftable_mass(_pruned(_logits(32), 4), target, mask, tau)
    torch.testing.assert_close(mass, expected)
    for seed in range(33, 38):  # any draft on that support stays under the cap
        assert (overlap(_pruned(_logits(seed), 4), target, mask, tau) <= mass + 1e-6).all()
    # p renormalised on the support reaches it: min(p, p / m) = p there, since m <= 1
    reaching = _pruned(target / tau, 4)
    torch.testing.assert_close(overlap(reaching, target / tau, mask), expected)
    as_probs = TargetProbs(torch.softmax(target, -1))  # the offline cache's form
    torch.testing.assert_close(
        draftable_mass(_pruned(_logits(32), 4), as_probs, mask, tau), expected
    )
    full = draftable_mass(_logits(32), target, mask, tau)  # nothing pruned: the whole mass
    torch.testing.assert_close(full, mask.float())


def test_draftable_mass_at_temperature_zero_is_whether_the_target_argmax_is_draftable() -> None:
    target, mask = _logits(38), _mask()
    draftable = target.argmax(-1) < 4
    assert (draftable & mask).any() and (~draftable & mask).any()
    mass = draftable_mass(_pruned(_logits(39), 4), target, mask, 0)
    torch.testing.assert_close(mass, (draftable & mask).float())
    with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
        draftable_mass(_logits(39), target, mask, -1.0)


# ------------------------------------------------------------------------- stability


def _grads_finite(fn: Callable[..., torch.Tensor], draft: torch.Tensor, target, mask) -> float:
    leaf = draft.clone().requires_grad_()
    value = fn(leaf, target, mask)
    value.backward()
    assert torch.isfinite(value), value
    assert torch.isfinite(leaf.grad).all()
    return value.item()


@pytest.mark.parametrize("name", DIVERGENCES)
@pytest.mark.parametrize("tau", [0.5, 1.0, 3.0])
def test_stable_with_very_peaked_logits(name: str, tau: float) -> None:
    fn = DIVERGENCES[name]
    mask = _mask()
    draft = torch.sign(_logits(31)) * 1e4  # +-1e4: several tokens tie at the top
    target = torch.sign(_logits(32)) * 1e4
    for t in (target, draft):  # a different target, and the identity
        value = _grads_finite(lambda d, tt, m: fn(d, tt, m, tau), draft, t, mask)
        assert value >= -1e-6
    assert _grads_finite(lambda d, tt, m: fn(d, tt, m, tau), draft, draft, mask) < 1e-6
    hard = draft.clone()
    hard[..., 0] = 1e4 + 1  # one winner per row
    alpha = overlap(hard, hard, mask, tau)
    assert torch.isfinite(alpha).all()


def test_peaked_half_precision_inputs_are_computed_in_float32() -> None:
    mask = _mask()
    draft, target = _logits(33, scale=30.0), _logits(34, scale=30.0)
    for name, fn in DIVERGENCES.items():
        low = fn(draft.bfloat16(), target.bfloat16(), mask)
        assert low.dtype == torch.float32, name
        want = fn(draft.bfloat16().float(), target.bfloat16().float(), mask)
        torch.testing.assert_close(low, want, msg=name)


def _topk_probs(logits: torch.Tensor, k: int, renormalise: bool) -> torch.Tensor:
    probs = torch.softmax(logits, -1)
    kth = probs.topk(k, -1).values[..., -1:]
    probs = probs * (probs >= kth)
    return probs / probs.sum(-1, keepdim=True) if renormalise else probs


@pytest.mark.parametrize("name", DIVERGENCES)
@pytest.mark.parametrize("renormalise", [True, False])
def test_exact_zeros_in_target_probs_stay_finite(name: str, renormalise: bool) -> None:
    fn = DIVERGENCES[name]
    draft, mask = _logits(35), _mask()
    cached = TargetProbs(_topk_probs(_logits(36), k=3, renormalise=renormalise))
    assert (cached.probs == 0).any()
    for tau in (0.5, 1.0, 2.0):
        value = _grads_finite(lambda d, t, m, tau=tau: fn(d, t, m, tau), draft, cached, mask)
        assert value >= -1e-6
    # a draft that already puts zero mass where the target does (-inf logits) is fine too
    draft_zero = draft.masked_fill(cached.probs == 0, -math.inf)
    _grads_finite(fn, draft_zero, cached, mask)
    # the target's own zeros, as probabilities and as -inf log-probabilities, give the same
    torch.testing.assert_close(fn(draft, cached, mask), fn(draft, cached.logprobs(), mask))


def test_exact_zero_target_values_match_their_definitions() -> None:
    draft, mask = _logits(37), _mask()
    p = _topk_probs(_logits(38), k=3, renormalise=True).double()
    q = torch.softmax(draft.double(), -1)
    cached = TargetProbs(p.float())
    terms = torch.where(p > 0, p * (p.log() - q.log()), torch.zeros_like(p))
    torch.testing.assert_close(
        forward_kl(draft, cached, mask).double(), terms.sum(-1)[mask].mean(), rtol=1e-5, atol=1e-6
    )
    floored = torch.where(p > 0, p.log(), torch.full_like(p, -100.0))
    want_rkl = (q * (q.log() - floored)).sum(-1)[mask].mean()
    torch.testing.assert_close(
        reverse_kl(draft, cached, mask).double(), want_rkl, rtol=1e-5, atol=1e-6
    )
    assert want_rkl > 20  # the floor is active: the draft has mass where p is 0
    m = 0.5 * p + 0.5 * q
    jsd_terms = 0.5 * torch.where(p > 0, p * (p / m).log(), torch.zeros_like(p))
    jsd_terms = jsd_terms + 0.5 * q * (q / m).log()
    torch.testing.assert_close(
        generalized_jsd(draft, cached, mask).double(),
        jsd_terms.sum(-1)[mask].mean(),
        rtol=1e-5,
        atol=1e-6,
    )
    tv = 0.5 * (p - q).abs().sum(-1)[mask].mean()
    torch.testing.assert_close(total_variation(draft, cached, mask).double(), tv)


def test_reverse_kl_floor_is_configurable_and_validated() -> None:
    draft, mask = _logits(39), _mask()
    cached = TargetProbs(_topk_probs(_logits(40), k=2, renormalise=True))
    soft = reverse_kl(draft, cached, mask, min_target_logprob=-10.0)
    hard = reverse_kl(draft, cached, mask)
    assert 0 < soft < hard
    with pytest.raises(ValueError, match="min_target_logprob must be finite and < 0"):
        reverse_kl(draft, cached, mask, min_target_logprob=-math.inf)


def test_bad_targets_raise_clear_errors() -> None:
    draft, mask = _logits(41), _mask()
    with pytest.raises(ValueError, match="finite and >= 0"):
        TargetProbs(torch.full((B, T, V), -0.1))
    with pytest.raises(TypeError, match="floating-point"):
        TargetProbs(torch.ones(B, T, V, dtype=torch.long))
    empty_row = torch.softmax(_logits(42), -1)
    b, t = mask.nonzero()[0].tolist()
    empty_row[b, t] = 0
    with pytest.raises(ValueError, match="zero probability to every token"):
        forward_kl(draft, TargetProbs(empty_row), mask)
    empty_row_masked = torch.softmax(_logits(42), -1)
    empty_row_masked[~mask] = 0  # padding rows without mass are fine when masked
    assert torch.isfinite(forward_kl(draft, TargetProbs(empty_row_masked), mask))
    with pytest.raises(ValueError, match="target has shape"):
        forward_kl(draft, _logits(43)[..., :-1], mask)
    with pytest.raises(TypeError, match="TargetProbs"):
        forward_kl(draft, [[0.0]], mask)  # type: ignore[arg-type]


def test_cross_entropy_rejects_out_of_range_labels_at_kept_positions() -> None:
    draft, mask = _logits(44), _mask()
    labels = _labels(45)
    labels[mask.nonzero()[0].tolist()] = -100
    with pytest.raises(ValueError, match=r"labels at unmasked positions must lie in \[0, 11\)"):
        cross_entropy(draft, labels, mask)
    with pytest.raises(TypeError, match="integer tensor"):
        cross_entropy(draft, labels.float(), mask)


# ------------------------------------------------------------------------- specs and mixes


@pytest.mark.parametrize(
    ("text", "terms"),
    [
        ("tv", (LossTerm("tv"),)),
        ("fkl", (LossTerm("fkl"),)),
        ("rkl", (LossTerm("rkl"),)),
        ("ce", (LossTerm("ce"),)),
        ("jsd:0.5", (LossTerm("jsd", 1.0, 0.5),)),
        ("lk", (LossTerm("lk"),)),
        ("0.5*nla+0.5*lk", (LossTerm("nla", 0.5), LossTerm("lk", 0.5))),
        ("0.5*fkl+0.5*tv", (LossTerm("fkl", 0.5), LossTerm("tv", 0.5))),
        (" 2 * jsd:0.1 + 1e-1*ce ", (LossTerm("jsd", 2.0, 0.1), LossTerm("ce", 0.1))),
    ],
)
def test_spec_parsing_and_round_trip(text: str, terms: tuple[LossTerm, ...]) -> None:
    spec = LossSpec.parse(text)
    assert spec.terms == terms
    assert LossSpec.parse(str(spec)) == spec


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kl", r"unknown loss 'kl'.*valid names: fkl, rkl, jsd, tv, lk, nla, ce"),
        ("0.5*fkl+0.5*mse", r"unknown loss 'mse'.*valid names: fkl, rkl, jsd, tv, lk, nla, ce"),
        ("lk:3", "'lk' takes no parameter"),
        ("", "non-empty string"),
        ("fkl+", "cannot parse loss term ''"),
        ("-1*fkl", "cannot parse loss term '-1\\*fkl'"),
        ("0*fkl", "loss weight must be a positive number"),
        ("jsd", "needs its beta, e.g. 'jsd:0.5'"),
        ("jsd:x", "beta of 'jsd' must be a number"),
        ("jsd:1", "0 < beta < 1"),
        ("jsd:0", "0 < beta < 1"),
        ("fkl:0.3", "'fkl' takes no parameter"),
    ],
)
def test_bad_specs_raise_clear_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_loss(text)


def test_loss_names_are_exactly_the_documented_ones() -> None:
    assert set(LOSS_NAMES) == {"fkl", "rkl", "jsd", "tv", "lk", "nla", "ce"}


def test_mix_equals_weighted_sum_of_its_parts() -> None:
    draft, target, mask, labels = _logits(46), _logits(47), _mask(), _labels(48)
    loss = build_loss("0.5*fkl+0.5*tv")
    assert isinstance(loss, Loss) and loss.needs_target and not loss.needs_labels
    want = 0.5 * forward_kl(draft, target, mask) + 0.5 * total_variation(draft, target, mask)
    torch.testing.assert_close(loss(draft, target, mask), want)
    torch.testing.assert_close(
        loss(draft, target, mask, 2.0),
        0.5 * forward_kl(draft, target, mask, 2.0)
        + 0.5 * total_variation(draft, target, mask, 2.0),
    )

    mix = build_loss("0.2*rkl+jsd:0.3+0.7*ce")
    assert mix.needs_target and mix.needs_labels
    parts = mix.parts(draft, target, mask, 1.5, labels=labels)
    assert set(parts) == {"rkl", "jsd:0.3", "ce"}
    torch.testing.assert_close(
        parts["jsd:0.3"], generalized_jsd(draft, target, mask, 1.5, beta=0.3)
    )
    torch.testing.assert_close(parts["ce"], cross_entropy(draft, labels, mask))
    want = (
        0.2 * reverse_kl(draft, target, mask, 1.5)
        + generalized_jsd(draft, target, mask, 1.5, beta=0.3)
        + 0.7 * cross_entropy(draft, labels, mask)
    )
    torch.testing.assert_close(mix(draft, target, mask, 1.5, labels=labels), want)
    # a repeated term counts with the sum of its weights
    torch.testing.assert_close(
        build_loss("fkl+2*fkl")(draft, target, mask), 3 * forward_kl(draft, target, mask)
    )


def test_single_name_specs_equal_their_functions() -> None:
    draft, target, mask, labels = _logits(49), _logits(50), _mask(), _labels(51)
    torch.testing.assert_close(
        build_loss("fkl")(draft, target, mask), forward_kl(draft, target, mask)
    )
    torch.testing.assert_close(
        build_loss("rkl")(draft, target, mask), reverse_kl(draft, target, mask)
    )
    torch.testing.assert_close(
        build_loss("tv")(draft, target, mask, 0.5), total_variation(draft, target, mask, 0.5)
    )
    ce = build_loss("ce")
    assert ce.needs_labels and not ce.needs_target
    torch.testing.assert_close(
        ce(draft, None, mask, labels=labels), cross_entropy(draft, labels, mask)
    )


def test_loss_reports_missing_inputs() -> None:
    draft, target, mask = _logits(52), _logits(53), _mask()
    with pytest.raises(ValueError, match="compares against the target"):
        build_loss("fkl")(draft, None, mask)
    with pytest.raises(ValueError, match="contains 'ce': pass labels"):
        build_loss("fkl+ce")(draft, target, mask)


# ------------------------------------------------------------------------- they train


@pytest.mark.parametrize(
    "spec", ["fkl", "rkl", "jsd:0.5", "tv", "lk", "nla", "0.5*fkl+0.5*tv", "0.5*lk+0.5*nla"]
)
def test_minimising_each_loss_raises_the_overlap(spec: str) -> None:
    target, mask = _logits(54), _mask()
    draft = _logits(55).requires_grad_()
    loss = build_loss(spec)
    optimiser = torch.optim.Adam([draft], lr=0.3)
    before = overlap(draft, target, mask)[mask].mean()
    first = loss(draft, target, mask).item()
    for _ in range(50):
        optimiser.zero_grad()
        loss(draft, target, mask).backward()
        optimiser.step()
    after = overlap(draft, target, mask)[mask].mean()
    assert loss(draft, target, mask).item() < 0.2 * first
    assert after > before + 0.2 and after > 0.85


def test_overlap_accepts_mixed_precision_inputs() -> None:
    draft = torch.randn(1, 3, 7, dtype=torch.float32)
    target = draft.double()
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert torch.allclose(
        overlap(draft, target, mask).double(), torch.ones(1, 3, dtype=torch.double)
    )
