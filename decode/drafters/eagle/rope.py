"""The rotary embedding an EAGLE-3 head applies, read from its folder as the engines read it.

A head's rope is plain rope (Su et al. 2021) with base ``rope_theta`` or one of the scaled
kinds a Llama config names in ``rope_scaling`` (``rope_parameters`` in transformers 5), and
vLLM, SGLang and speculators all build the head's cos/sin tables from those fields. Published
heads differ: the EAGLE authors' Llama-3.1-8B head names no theta at all (so 10000) and a
2048-token context, SpecForge's Llama-3.3-70B head carries the target's llama3 scaling. Each
kind's inverse frequencies ``inv_i`` (i < D/2) in float32, as transformers' rope init
functions and vLLM's rotary embeddings compute them (docs/theory.md §1, EAGLE-3 paragraph):

* ``default``: ``inv_i = theta^(-2i/D)``;
* ``linear`` (position interpolation, Chen et al. 2023): ``inv_i / factor``;
* ``llama3``: wavelengths ``2 pi / inv_i`` shorter than ``L / high_freq_factor`` keep
  ``inv_i``, longer than ``L / low_freq_factor`` take ``inv_i / factor``, and the band between
  blends ``(1 - s) inv_i / factor + s inv_i`` with ``s = (L / wavelength - low) / (high -
  low)``; ``L`` = ``original_max_position_embeddings``;
* ``yarn`` (Peng et al. 2023): interpolated ``inv_i / factor`` below the correction range of
  ``beta_fast``/``beta_slow`` rotations over ``L``, extrapolated ``inv_i`` above it, a linear
  ramp inside; the tables are scaled by ``attention_factor`` (``0.1 ln(factor) + 1`` unless
  given).

The angle of position p is ``p * inv_i`` in float32 (``rope_tables``). Kinds whose angles
depend on more than the position are refused by name: ``dynamic`` NTK (transformers rescales
theta by the running sequence length, vLLM builds one fixed table at ``factor`` times the
context, so the engines disagree with each other), ``longrope`` (switches factor sets by the
call's length) and partial rotary dimensions.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# Keys each supported kind reads (beyond ``rope_type`` and ``factor``); others are refused.
_KIND_KEYS: dict[str, frozenset[str]] = {
    "linear": frozenset(),
    "llama3": frozenset(
        {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "yarn": frozenset(
        {
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "attention_factor",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
}
_REFUSED: dict[str, str] = {
    "dynamic": (
        "its angles depend on the running sequence length in transformers but are one fixed "
        "table at factor x context in vLLM, so no decoder can match both"
    ),
    "longrope": "it switches between two factor sets by the length of each call",
}
# Keys a rope dict may carry without changing the angles.
_IGNORED_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "partial_rotary_factor"})


def rope_scaling_from_layer(layer: dict[str, Any]) -> dict[str, Any] | None:
    """The rope scaling of a Llama-style layer config (``rope_scaling``, or transformers 5's
    ``rope_parameters``), checked by :func:`checked_rope_scaling`; None for plain rope."""
    raw = layer.get("rope_scaling")
    if raw is None:
        raw = layer.get("rope_parameters")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(
            f"rope_scaling must be an object such as {{'rope_type': 'llama3', ...}} or null, "
            f"got {raw!r}"
        )
    return checked_rope_scaling(raw)


def checked_rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    """``raw`` normalised (``rope_type`` spelled out, theta dropped: it is ``rope_theta``), or
    None for plain rope; a kind this head cannot apply exactly is a ``ValueError`` naming it,
    the reason and the fix."""
    kind = raw.get("rope_type", raw.get("type", "default"))
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(_refusal(kind, "it rotates only part of each head's dimensions"))
    if kind == "default":  # transformers reads no factor for plain rope
        return None
    if kind in _REFUSED:
        raise ValueError(_refusal(kind, _REFUSED[kind]))
    if kind not in _KIND_KEYS:
        raise ValueError(_refusal(kind, "this decoder implements default, linear, llama3, yarn"))
    unknown = sorted(set(raw) - _IGNORED_KEYS - _KIND_KEYS[kind])
    if unknown:
        raise ValueError(_refusal(kind, f"it carries keys this decoder does not apply: {unknown}"))
    factor = raw.get("factor")
    if not _number(factor) or factor <= 0:
        raise ValueError(f"rope_scaling of type {kind!r} needs a positive 'factor', got {factor!r}")
    out = {"rope_type": kind, "factor": float(factor)}
    for key in sorted(_KIND_KEYS[kind] & set(raw)):
        value = raw[key]
        if value is not None and not (_number(value) or isinstance(value, bool)):
            raise ValueError(f"rope_scaling.{key} must be a number, got {value!r}")
        out[key] = value
    if kind == "llama3":
        missing = [k for k in _KIND_KEYS["llama3"] if out.get(k) is None]
        if missing:
            raise ValueError(f"llama3 rope_scaling lacks {sorted(missing)}")
        if out["low_freq_factor"] >= out["high_freq_factor"]:
            raise ValueError("llama3 rope_scaling needs low_freq_factor < high_freq_factor")
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _refusal(kind: str, reason: str) -> str:
    return (
        f"rope type {kind!r} is not supported by the EAGLE-3 head: {reason}. Serve this head in "
        "an engine that implements it, or train a head with plain rope (rope_scaling null) or "
        "one of default, linear, llama3, yarn"
    )


def rope_inverse_frequencies(
    dim: int, theta: float, scaling: dict[str, Any] | None = None, context: int | None = None
) -> tuple[torch.Tensor, float]:  # [D/2] float32, the tables' scale
    """Inverse frequencies of ``scaling`` (None: plain rope; see the module docstring) and the
    factor the cos/sin tables are multiplied by (1 except YaRN). ``context`` is the head's
    ``max_position_embeddings``, YaRN's original context when the scaling names none."""
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if scaling is None:
        return base, 1.0
    kind, factor = scaling["rope_type"], scaling["factor"]
    if kind == "linear":
        return base / factor, 1.0
    if kind == "llama3":
        return _llama3(base, scaling), 1.0
    original = scaling.get("original_max_position_embeddings") or context
    if original is None:
        raise ValueError("yarn rope_scaling needs original_max_position_embeddings")
    return _yarn(dim, theta, factor, original, scaling), _yarn_attention_factor(factor, scaling)


def _llama3(base: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:  # [D/2]
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / base
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * base / factor + smooth * base
    scaled = torch.where(wavelength > context / low, base / factor, blended)
    return torch.where(wavelength < context / high, base, scaled)


def _yarn(
    dim: int, theta: float, factor: float, original: int, scaling: dict[str, Any]
) -> torch.Tensor:  # [D/2]
    powers = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction(rotations: float) -> float:  # the dimension that turns `rotations` times
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction(fast), correction(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return (1.0 / (factor * powers)) * (1 - extrapolated) + (1.0 / powers) * extrapolated


def _yarn_attention_factor(factor: float, scaling: dict[str, Any]) -> float:
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    weight, weight_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if weight and weight_all:
        return float(mscale(factor, weight) / mscale(factor, weight_all))
    return mscale(factor)
