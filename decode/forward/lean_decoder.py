"""A lean incremental forward of a Llama-family decoder for CPU decoding (targets and drafts).

A one-layer draft model's step on CPU is mostly overhead, not arithmetic: the Hugging Face
forward builds masks, rotary angles and output records and calls about 150 small operators per
layer, ~2.5 ms of a ~3.5 ms step for a 1 x 256 draft. This module runs the same mathematics
(Touvron et al. 2023: pre-norm RMSNorm, rotary attention with grouped key/value heads, SwiGLU)
with a few fused products per layer:

    h   = x + W_o . attn(rope(W_q n(x)), rope(W_k n(x)), W_v n(x))     (q, k, v one product)
    out = h + W_down (silu(W_gate n(h)) * W_up n(h))                  (gate, up one product)

over the same weights, the same ``PreallocatedLayer`` cache and the same rotary angles, taken
from the model's own ``rotary_emb``. Static rope types (default, linear, yarn, llama3,
proportional) are tabulated once by position. Types whose angles depend on the length of the
call (``dynamic`` NTK and ``longrope``, which Hugging Face switches by the largest position of
each forward: longrope's long factors once it exceeds ``original_max_position_embeddings``)
call ``rotary_emb`` with each call's positions, exactly as the model's forward does, so a
table grown past the threshold can never switch factors for a short sequence. Sliding-window
layers use the per-kind position masks of ``attention_layout.AttentionLayout``, as the model's
forward does on this cache. Its logits match the model's to float rounding, not bit for bit
(docs/theory.md §7 promises no more, as batched verification already differs from one-token
steps in rounding). A drafter may use it freely: rejection sampling is exact for whatever
``q`` the draft computes. A target uses it unless ``SpeculativeDecoder(lean_target=False)``:
the output then follows the target as this forward computes it; a target step falls from
~7.8 to ~5.4 ms on the 4 x 256 demo target.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from draftsmith.decode.forward.attention_layout import AttentionLayout
from draftsmith.decode.forward.kv_cache import PreallocatedLayer
from draftsmith.decode.forward.llama_math import apply_rope, attention, rms_norm
from draftsmith.decode.forward.output_head import LLAMA_FAMILY_MODEL_TYPES
from draftsmith.decode.forward.projection import Layout, Projection, fused_projection, layer_layout
from transformers import DynamicCache

# Rope types whose angles are a fixed function of the position (computed once by the model's
# rope init function); other known types depend on the call (see ``_angles_depend_on_call``).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "yarn", "llama3", "proportional"})


@dataclass
class LeanOutput:
    """What ``CachedSequence`` reads from a decoder call."""

    last_hidden_state: torch.Tensor  # [B, W, H]
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass(frozen=True)
class AttentionShape:
    """A layer's attention heads and its norms' epsilon."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Projection  # H -> (Q + 2 KV) * D
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None  # [D]
    out: Projection  # Q * D -> H
    post_norm: torch.Tensor  # [H]
    gate_up: Projection  # H -> 2 I
    down: Projection  # I -> H


class LeanDecoder:
    """``model.get_decoder()`` for incremental CPU decoding, with fused products.

    Call it like the decoder: ``input_ids`` [B, W], ``attention_mask`` ([B, S + W] 0/1 over
    cache and new slots, a [B, 1, W, S + W] bool mask, or a dict of such masks keyed by layer
    kind, which a model with sliding-window layers needs), ``position_ids`` [B, W] and a
    ``cache`` of ``PreallocatedLayer``s. The fused weights are copies, rebuilt when any weight
    of the model changes in place (tracked by tensor versions). ``choose`` picks the products'
    layouts: a target's ``layer_layout``, or ``draft_layer_layout`` for a draft model, whose
    products over a few rows may use int4 or int8 weights (``draftsmith.decode.forward.projection``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        choose: Callable[[torch.dtype, int], Layout] = layer_layout,
    ) -> None:
        self.model = model
        self._choose = choose
        config = model.config
        num_heads = config.num_attention_heads
        self.shape = AttentionShape(
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            eps=config.rms_norm_eps,
        )
        self.layout = AttentionLayout.for_model(model)
        rope_type = _rope_parameters(config).get("rope_type", "default")
        self._rope_per_call = _angles_depend_on_call(rope_type)
        self._parameters = list(model.get_decoder().parameters())
        self._versions: list[int] = []
        self._layers: list[LayerWeights] = []
        self._cos = self._sin = torch.empty(0)  # [P, D] rotary tables, grown on demand

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        choose: Callable[[torch.dtype, int], Layout] = layer_layout,
    ) -> LeanDecoder | None:
        """A lean decoder for ``model`` when it is a plain Llama-family model on CPU, else None."""
        return cls(model, choose) if _is_plain_llama_on_cpu(model) else None

    def __call__(
        self,
        input_ids: torch.Tensor,  # [B, W]
        attention_mask: torch.Tensor | dict[str, torch.Tensor],  # see the class docstring
        position_ids: torch.Tensor,  # [B, W]
        cache: DynamicCache,
        output_hidden_states: bool = False,
        **_: object,
    ) -> LeanOutput:
        layers = self._current_layers()
        decoder = self.model.get_decoder()
        width = input_ids.shape[1]
        x = decoder.embed_tokens(input_ids)  # [B, W, H]
        cos, sin = self._rotary(position_ids, x)  # [B, 1, W, D] each
        masks = self._layer_masks(attention_mask, width)  # [B, 1, W, S + W] bool or None each
        hidden_states = [x] if output_hidden_states else None
        for weights, cache_layer, mask in zip(layers, cache.layers, masks, strict=True):
            if not isinstance(cache_layer, PreallocatedLayer):
                raise TypeError(
                    "LeanDecoder needs a cache of PreallocatedLayer (decode/forward/kv_cache.py)"
                )
            x = decoder_layer(weights, x, cos, sin, mask, cache_layer, self.shape)
            if hidden_states is not None:
                hidden_states.append(x)
        x = rms_norm(x, decoder.norm.weight, self.shape.eps)
        if hidden_states is not None:
            hidden_states[-1] = x  # as Hugging Face reports it: the last entry is normed
        return LeanOutput(x, None if hidden_states is None else tuple(hidden_states))

    def _layer_masks(
        self,
        attention_mask: torch.Tensor | dict[str, torch.Tensor],
        width: int,
    ) -> list[torch.Tensor | None]:  # per layer: [B, 1, W, S + W] bool or None
        """Each layer's mask: one for all, or the one of its kind."""
        if isinstance(attention_mask, dict):
            by_kind = {kind: _attention_mask(m, width) for kind, m in attention_mask.items()}
            return [by_kind[kind] for kind in self.layout.layer_types]
        if self.layout.sliding and attention_mask.dim() != 4:
            raise ValueError(
                "sliding-window layers need position-based 4-D masks (as CachedSequence builds "
                "them), not a 2-D padding mask"
            )
        return [_attention_mask(attention_mask, width)] * len(self.layout.layer_types)

    def _rotary(
        self,
        positions: torch.Tensor,  # [B, W]
        x: torch.Tensor,  # [B, W, H] the embeddings (their dtype and device)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [B, 1, W, D]
        """The model's rotary angles at ``positions``.

        Call-dependent rope types go through ``rotary_emb`` with these very positions, as the
        model's forward does (the same call, the same state updates); static ones read a table
        indexed by position, built by the same ``rotary_emb`` and grown on demand.
        """
        rotary = self.model.get_decoder().rotary_emb
        if self._rope_per_call:
            cos, sin = rotary(x, positions)  # [B, W, D]
            return cos[:, None], sin[:, None]
        needed = int(positions.max()) + 1 if positions.numel() else 1
        if needed > self._cos.shape[0]:
            size = max(needed, 2 * self._cos.shape[0], 256)
            table_positions = torch.arange(size, device=x.device)[None]  # [1, P]
            cos, sin = rotary(x[:1, :1], table_positions)  # [1, P, D]
            self._cos, self._sin = cos[0], sin[0]
        return self._cos[positions][:, None], self._sin[positions][:, None]

    def _current_layers(self) -> list[LayerWeights]:
        versions = [p._version for p in self._parameters]
        if versions != self._versions:
            with torch.no_grad():
                self._layers = [
                    fuse_layer(layer, self._choose) for layer in self.model.get_decoder().layers
                ]
            self._versions = versions
        return self._layers


def _is_plain_llama_on_cpu(model: torch.nn.Module) -> bool:
    """A Llama-family decoder with SiLU MLPs, full or sliding-window attention, a full-width
    rope of a type ``_rotary`` reproduces, on CPU."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in LLAMA_FAMILY_MODEL_TYPES:
        return False
    decoder = model.get_decoder()
    rope = _rope_parameters(config)
    rope_type = rope.get("rope_type", "default")
    try:
        AttentionLayout.for_model(model)
    except ValueError:
        return False
    return (
        next(model.parameters()).device.type == "cpu"
        and getattr(config, "hidden_act", "silu") == "silu"
        and (rope_type in STATIC_ROPE_TYPES or _angles_depend_on_call(rope_type))
        # Proportional rope pads its table to the full head width; other types would not.
        and (rope.get("partial_rotary_factor", 1.0) == 1.0 or rope_type == "proportional")
        and hasattr(decoder, "rotary_emb")
    )


def _rope_parameters(config: object) -> dict:
    """The config's rope settings (Hugging Face 5.x ``rope_parameters``), or {} without any."""
    return getattr(config, "rope_parameters", None) or {}


def _angles_depend_on_call(rope_type: str) -> bool:
    """Whether Hugging Face recomputes the rope frequencies from each forward's largest position
    (the rule of ``transformers.modeling_rope_utils.dynamic_rope_update``)."""
    return "dynamic" in rope_type or rope_type == "longrope"


def decoder_layer(
    weights: LayerWeights,
    x: torch.Tensor,  # [B, W, H] the residual stream
    cos: torch.Tensor,  # [B, 1, W, D]
    sin: torch.Tensor,  # [B, 1, W, D]
    mask: torch.Tensor | None,  # [B, 1, W, S + W] bool
    cache_layer: PreallocatedLayer,
    shape: AttentionShape,
    normed: torch.Tensor | None = None,  # [B, W, in] the attention's input; None: n(x)
) -> torch.Tensor:  # [B, W, H]
    """One pre-norm Llama block over the cache and the block's entries:

        h   = x + W_o . attn(rope(W_q a), rope(W_k a), W_v a)     a = n(x), q/k/v in one product
        out = h + W_down (silu(W_gate n(h)) * W_up n(h))         gate and up in one product

    The block's keys and values are appended to ``cache_layer``. ``normed`` replaces ``n(x)``
    as the attention's input: EAGLE-3's first layer reads ``[n(E[tok]), n(g)]`` (2H wide) with
    the feature ``g`` as its residual stream."""
    if normed is None:
        normed = rms_norm(x, weights.input_norm, shape.eps)
    batch, width, _ = normed.shape
    heads, kv_heads, dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    qkv = weights.qkv(normed).view(batch, width, heads + 2 * kv_heads, dim)
    if weights.q_norm is None:  # rope is elementwise: rotate q and k in one call
        qk, v = qkv.split((heads + kv_heads, kv_heads), dim=2)  # [B, W, Q + KV | KV, D]
        q, k = apply_rope(qk.transpose(1, 2), cos, sin).split((heads, kv_heads), dim=1)
    else:
        q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=2)  # [B, W, heads, D] each
        q = apply_rope(rms_norm(q, weights.q_norm, shape.eps).transpose(1, 2), cos, sin)
        k = apply_rope(rms_norm(k, weights.k_norm, shape.eps).transpose(1, 2), cos, sin)
    # q [B, Q, W, D], k [B, KV, W, D]
    keys, values = cache_layer.update(k, v.transpose(1, 2))  # [B, KV, S + W, D]
    attended = attention(q, keys, values, mask)  # [B, Q, W, D]
    x = x + weights.out(attended.transpose(1, 2).reshape(batch, width, heads * dim))
    gate, up = weights.gate_up(rms_norm(x, weights.post_norm, shape.eps)).chunk(2, dim=-1)
    return x + weights.down(F.silu(gate) * up)  # gate, up: [B, W, I] each


def fuse_layer(
    layer: torch.nn.Module,
    choose: Callable[[torch.dtype, int], Layout] = layer_layout,
) -> LayerWeights:
    """One decoder layer's weights (Hugging Face's module names), with q/k/v and gate/up
    concatenated into one product each, in the layouts ``choose`` picks (``draftsmith.decode.forward.projection``)."""
    attention, mlp = layer.self_attn, layer.mlp
    q_norm = getattr(attention, "q_norm", None)
    k_norm = getattr(attention, "k_norm", None)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight.detach(),
        qkv=fused_projection((attention.q_proj, attention.k_proj, attention.v_proj), choose),
        q_norm=None if q_norm is None else q_norm.weight.detach(),
        k_norm=None if k_norm is None else k_norm.weight.detach(),
        out=fused_projection((attention.o_proj,), choose),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=fused_projection((mlp.gate_proj, mlp.up_proj), choose),
        down=fused_projection((mlp.down_proj,), choose),
    )


def _attention_mask(
    attention_mask: torch.Tensor,  # [B, S + W] 0/1, or [B, 1, W, S + W] bool
    width: int,
) -> torch.Tensor | None:  # [B, 1, W, S + W] bool, True where attention is allowed
    """The boolean mask for ``scaled_dot_product_attention``; None when every slot is seen.

    Every query also sees its own slot: a padding or hole query would otherwise attend to
    nothing, and its NaN output would reach the next layer's cached values (where a zero
    attention weight times NaN is still NaN). No valid query sees an invalid slot either way.
    """
    total = attention_mask.shape[-1]
    slots = torch.arange(total, device=attention_mask.device)  # [S + W]
    query = slots[total - width :]  # [W] absolute slots of the new tokens
    own_slot = slots[None, :] == query[:, None]  # [W, S + W]
    if attention_mask.dim() == 4:
        return attention_mask.bool() | own_slot
    valid = attention_mask.bool()  # [B, S + W]
    if width == 1 and bool(valid.all()):
        return None
    causal = slots[None, :] <= query[:, None]  # [W, S + W]
    return ((causal[None] & valid[:, None, :]) | own_slot)[:, None]  # [B, 1, W, S + W]
