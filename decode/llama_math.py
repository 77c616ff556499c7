"""The two elementwise pieces of a Llama block shared by the lean forward and the EAGLE-3 head."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., H]
    """RMSNorm (Zhang & Sennrich 2019) in fp32: ``w * x / sqrt(mean(x^2) + eps)``."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rope(
    x: torch.Tensor,  # [B, heads, T, D]
    cos: torch.Tensor,  # [B, 1, T, D]
    sin: torch.Tensor,  # [B, 1, T, D]
) -> torch.Tensor:  # [B, heads, T, D]
    """Rotary embedding (Su et al. 2021) in the half-split ("neox") layout Llama uses:
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half([a, b]) = [-b, a]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
