"""Pieces of a Llama block shared by the lean forward and the EAGLE-3 head: RMSNorm, rotary
embedding and the attention product over a cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Narrow dtypes whose single-query attention on CPU runs on float32 copies (``attention``).
_WIDENED_FOR_ONE_QUERY = (torch.bfloat16, torch.float16)


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


def attention(
    q: torch.Tensor,  # [B, heads, W, D]
    keys: torch.Tensor,  # [B, kv_heads, S + W, D]
    values: torch.Tensor,  # [B, kv_heads, S + W, D]
    mask: torch.Tensor | None,  # [B, 1, W, S + W] bool, True where attention is allowed
) -> torch.Tensor:  # [B, heads, W, D]
    """``softmax(q k^T / sqrt(D) + mask) v`` (Vaswani et al. 2017), each key/value head serving
    ``heads / kv_heads`` queries (grouped-query attention, Ainslie et al. 2023).

    ATen's CPU flash-attention kernel in bfloat16 is slow for one query row, the shape of every
    plain decoding step and every chain draft step: its cost grows with the cache about three
    times as fast as for two rows. Measured on an AMD EPYC (Zen 5, AVX512-BF16, 2 threads; 8
    heads x 64, median microseconds for 300 / 600 / 1200 cached slots): bfloat16 one query
    135 / 274 / 513, the same on float32 copies of q, k and v 53 / 83 / 104, bfloat16 two
    queries 57 / 100 / 173 (float32 copies 83 / 135 / 246). So a single bfloat16 or float16
    query on CPU attends over float32 copies (the kernel accumulates in float32 either way; the
    output is rounded back to the input's dtype) and every other shape keeps the kernel.

    Keys and values kept in a wider dtype than ``q`` (a drafter's float32 cache,
    ``draft_cache_dtype``) are attended in their own dtype, with no copy of the cache.
    """
    grouped = keys.shape[1] != q.shape[1]
    if keys.dtype != q.dtype:  # a wider cache: attend in its dtype
        wide = torch.promote_types(q.dtype, keys.dtype)
    elif q.shape[2] == 1 and q.device.type == "cpu" and q.dtype in _WIDENED_FOR_ONE_QUERY:
        wide = torch.float32
    else:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=grouped)
    out = F.scaled_dot_product_attention(
        q.to(wide), keys.to(wide), values.to(wide), attn_mask=mask, enable_gqa=grouped
    )
    return out.to(q.dtype)


def draft_cache_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a drafter keeps its keys and values in: float32 for a bfloat16 or float16 head
    on CPU, else its own.

    Most of a chain's draft steps attend with one query, which on CPU runs on float32 copies of
    the whole cache (``attention``): kept in float32, the cache needs no copy. A head's cache is
    one layer or a few, so twice the bytes cost little. Measured on the AMD EPYC (Zen 5, 2
    threads; 8 heads x 64, ~320 cached slots, the main job's head): the copies took 51 of a
    draft step's ~340 microseconds warm, and far more where each copy's fresh allocation
    faulted its pages in (1-2 ms per copy in a profiled decoding run). Float32 attention over
    2-17 query rows costs what the bfloat16 kernel does (55 against 57 microseconds for 5 rows
    over 300 slots), so tree and commit passes lose nothing. In the decoder (the main job's
    head, 6 held-out prompts x 128 tokens, N = 4, interleaved passes against the head's own
    dtype): drafting per round 2.21 against 2.28 ms at T = 0 (the same greedy outputs) and
    2.66 against 2.83 ms at T = 1.
    """
    if device.type == "cpu" and dtype in _WIDENED_FOR_ONE_QUERY:
        return torch.float32
    return dtype
