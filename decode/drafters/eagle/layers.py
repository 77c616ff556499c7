"""The layers of an EAGLE-3 head (``draftsmith.decode.drafters.eagle.head``): RMSNorm, plain rope, grouped-query
attention, SwiGLU, the first layer over (embedding, feature) pairs and the plain Llama layers a
multi-layer head adds, and the visibility masks its training and decoding share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from draftsmith.decode.drafters.eagle.rope import rope_inverse_frequencies
from draftsmith.decode.forward.llama_math import apply_rope, rms_norm
from torch import nn

if TYPE_CHECKING:
    from draftsmith.decode.drafters.eagle.config import Eagle3Config


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): ``w * x / sqrt(mean(x^2) + eps)``, computed in fp32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        return rms_norm(x, self.weight, self.eps)


def rope_tables(
    positions: torch.Tensor,  # [B, T]
    dim: int,
    theta: float,
    dtype: torch.dtype,
    scaling: dict[str, Any] | None = None,
    context: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [B, 1, T, D]
    """Rotary angles (Su et al. 2021) ``position * inv_i``, for queries and keys alike, with
    the inverse frequencies of ``scaling`` (``draftsmith.decode.drafters.eagle.rope``; None:
    plain rope ``theta^(-2i/D)``) and YaRN's table scale.

    Computed in float32 exactly as the engines build their cos/sin caches (vLLM's and SGLang's
    ``RotaryEmbedding._compute_cos_sin_cache``: float32 positions times float32 inverse
    frequencies), so training, our decoder and a served head rotate by the same angles at
    every position; float64 angles would differ from the engines' by ~1e-3 radians at 32k.
    """
    inverse, scale = rope_inverse_frequencies(dim, theta, scaling, context)
    angles = positions.to(torch.float32)[..., None] * inverse.to(positions.device)  # [B, T, D/2]
    angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, T, D]
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


class Attention(nn.Module):
    """Grouped-query self-attention over ``width``-wide inputs (2H in the first layer: embedding
    and feature side by side; H in later layers)."""

    def __init__(self, config: Eagle3Config, width: int) -> None:
        super().__init__()
        hidden, dim = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            dim,
        )
        self.rope_theta, self.rope_scaling = config.rope_theta, config.rope_scaling
        self.context = config.max_position_embeddings
        self.q_proj = nn.Linear(width, self.num_heads * dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * dim, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, width]
        positions: torch.Tensor,  # [B, T]
        past: tuple[torch.Tensor, torch.Tensor] | None,  # keys, values [B, KV, S, D]
        visible: torch.Tensor,  # [B, T, S + T] bool, True where a query may attend
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:  # [B, T, H], new keys/values
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope_tables(
            positions, self.head_dim, self.rope_theta, q.dtype, self.rope_scaling, self.context
        )
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = (
            (k, v) if past is None else (torch.cat((past[0], k), 2), torch.cat((past[1], v), 2))
        )
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:  # grouped-query attention: each key/value head serves `groups` queries
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None])
        out = out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)
        return self.o_proj(out), (k, v)


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# Keys and values of one layer: [B, KV, S, D] each.
LayerKV = tuple[torch.Tensor, torch.Tensor]


def append_kv(past: list[LayerKV], new: list[LayerKV]) -> list[LayerKV]:
    """Per layer, ``new``'s keys and values after ``past``'s (along the sequence)."""
    return [
        (torch.cat((past_k, new_k), 2), torch.cat((past_v, new_v), 2))
        for (past_k, past_v), (new_k, new_v) in zip(past, new, strict=True)
    ]


class MidLayer(nn.Module):
    """EAGLE-3's first decoder layer; names match ``midlayer.*`` in the reference weights."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.hidden_norm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Attention(config, 2 * config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.norm_before_residual = config.norm_before_residual

    def forward(
        self,
        hidden: torch.Tensor,  # [B, T, H] fused target features or the previous step's output
        embeds: torch.Tensor,  # [B, T, H] target embeddings of the paired tokens
        positions: torch.Tensor,  # [B, T]
        past: tuple[torch.Tensor, torch.Tensor] | None,
        visible: torch.Tensor,  # [B, T, S + T] bool
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        normed = self.hidden_norm(hidden)
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        attended, new_kv = self.self_attn(x, positions, past, visible)
        # speculators' norm_before_residual: the residual stream starts from hidden_norm(g)
        residual = (normed if self.norm_before_residual else hidden) + attended
        return residual + self.mlp(self.post_attention_layernorm(residual)), new_kv


class DecoderLayer(nn.Module):
    """A later layer of a multi-layer head: the plain pre-norm Llama block over H inputs
    (Touvron et al. 2023), with Hugging Face's module names (``draftsmith.decode.forward.lean_decoder`` fuses it).

    Its two residual branches end in zero matrices at initialisation (``o_proj``, ``down_proj``;
    the "skip-init" of De & Smith 2020), so a fresh L-layer head computes what its first layer
    alone does and training grows the later layers from there instead of from random noise on
    the features the first layer passes on."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Attention(config, config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        with torch.no_grad():
            self.self_attn.o_proj.weight.zero_()
            self.mlp.down_proj.weight.zero_()

    def forward(
        self,
        hidden: torch.Tensor,  # [B, T, H] the previous layer's output
        positions: torch.Tensor,  # [B, T]
        past: LayerKV | None,
        visible: torch.Tensor,  # [B, T, S + T] bool
    ) -> tuple[torch.Tensor, LayerKV]:
        attended, new_kv = self.self_attn(self.input_layernorm(hidden), positions, past, visible)
        residual = hidden + attended
        return residual + self.mlp(self.post_attention_layernorm(residual)), new_kv


def block_visibility(
    past_valid: torch.Tensor | None,  # [B, S] bool: cache entries a query may see
    block_valid: torch.Tensor,  # [B, T] bool: real entries of the new block
    block_mask: torch.Tensor | None = None,  # [T, T] or [B, T, T] bool; None = causal
) -> torch.Tensor:  # [B, T, S + T] bool
    """Visibility of [cache + block] for each query of the block.

    Queries see valid cache entries and, inside the block, ``block_mask`` (causal by default,
    a tree mask for tree drafting) restricted to valid entries. Each query always sees itself,
    so padded queries stay finite (their outputs are never used).
    """
    batch, length = block_valid.shape
    eye = torch.eye(length, dtype=torch.bool, device=block_valid.device)
    if block_mask is None:
        block_mask = torch.ones(length, length, dtype=torch.bool, device=block_valid.device).tril()
    inner = (block_mask & block_valid[:, None, :]) | eye
    inner = inner.expand(batch, length, length)
    if past_valid is None:
        return inner
    outer = past_valid[:, None, :].expand(batch, length, past_valid.shape[1])
    return torch.cat((outer, inner), dim=-1)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T] int64
    """Position ids of a left-padded batch: 0 at each row's first real token (padding gets 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
