"""EAGLE-3 draft head: building blocks and folder formats (the runtime drafter is in
``decode.drafters.eagle_drafter``).

EAGLE-3 (Li et al., 2025) drafts from the target's own features. For target position t let
``g_t = fc(cat(h^low_t, h^mid_t, h^high_t))`` fuse three of the target's hidden states. A
Llama decoder layer reads the *pair* (feature, next token):

    x_t   = cat(input_layernorm(E[x_{t+1}]), hidden_norm(g_t))       # [2H]
    r_t   = g_t + o_proj(attention(q/k/v_proj(x_t), causal over t))  # residual is g_t
    h_t   = r_t + mlp(post_attention_layernorm(r_t))                 # "pre-norm" output
    logits_t = lm_head(norm(h_t))                                    # predicts x_{t+2}

A head of ``num_hidden_layers`` = L > 1 layers (vLLM's multi-layer EAGLE-3, which P-EAGLE's
published heads use: Hui et al. 2026) runs L - 1 plain pre-norm Llama layers over H inputs after
that first one, ``h <- h + attn(n(h)); h <- h + mlp(n(h))``, each with its own attention over
the same entries; ``h_t`` is then the last layer's output, which a chain feeds back.

``E`` is the target's embedding (not stored by the head). Drafting further steps feeds the
head its own output: the entry at position t+k is (h from step k-1, the token drafted at step
k), which is also what training-time test unrolls (:meth:`Eagle3Head.unroll`).

Weight names and shapes follow the reference EAGLE-3 checkpoints that vLLM
(``vllm/model_executor/models/llama_eagle3.py``) and SGLang
(``sglang/srt/models/llama_eagle3.py``) load: ``fc.weight`` [H, 3H], ``midlayer.*`` (q/k/v
projections over 2H inputs, ``hidden_norm``, ``input_layernorm``, ``post_attention_layernorm``,
``mlp.{gate,up,down}_proj``), ``norm.weight``, ``lm_head.weight`` [V_draft, H], ``d2t`` [V_draft]
int64 (target_id = draft_id + d2t[draft_id]) and ``t2d`` [V_target] bool; no ``embed_tokens``.
Layers after the first are ``layers.{i}.*`` (i = 1..L-1), as vLLM names them.

Hidden-state indexing convention (stored as ``aux_hidden_state_layer_ids``): an id ``i`` selects
``output_hidden_states[i]`` of the Hugging Face target, whose tuple holds the embeddings at index
0 and the output of decoder layer ``i - 1`` at index ``i`` (the last entry, index L, is after the
final norm and is never used). This equals vLLM's ``eagle_aux_hidden_state_layer_ids`` (the input
of layer i, 0 being the embedding output); SGLang/SpecForge's
``eagle_config.eagle_aux_hidden_state_layer_ids`` count layer outputs and are ours minus one.
Both engines keep each captured layer once and concatenate in ascending layer order, so ids
must be strictly increasing: a repeated id would feed ``fc`` fewer features than it was
trained on. The default, EAGLE-3's ``(2, L//2, L-3)``, is :func:`default_aux_layer_ids`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from decode.drafters.folder import read_folder, save_native_folder
from decode.llama_math import apply_rope, rms_norm

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low/mid/high feature layers as hidden-state tuple indices, always distinct.

    The reference rule is ``(2, L//2, L-3)`` (vLLM's default; SpecForge's ``(1, L//2-1, L-4)``
    counted as layer outputs). Targets shallower than 7 layers spread the ids as
    ``(1, L//2, L-1)`` (4 to 6 layers), take the embedding output too at 3 layers
    (``(0, 1, 2)``), and fuse the only two distinct states of a 2-layer target (``(0, 1)``):
    engines capture each layer once, so a repeated id could not be served.
    """
    if num_target_layers < 2:
        raise ValueError(
            f"EAGLE-3 needs a target with at least 2 decoder layers, got {num_target_layers}: "
            "use a draft LM or Medusa heads for single-layer targets"
        )
    ids = (2, num_target_layers // 2, num_target_layers - 3)
    if 1 <= ids[0] < ids[1] < ids[2] <= num_target_layers - 1:
        return ids
    if num_target_layers >= 4:
        return (1, num_target_layers // 2, num_target_layers - 1)
    return tuple(range(num_target_layers))


@dataclass
class Eagle3Config:
    """Shape of an EAGLE-3 head; ``aux_hidden_state_layer_ids`` follow the module docstring."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    target_vocab_size: int
    target_num_hidden_layers: int
    draft_vocab_size: int | None = None  # None: the full target vocabulary
    aux_hidden_state_layer_ids: tuple[int, ...] | None = None  # None: default_aux_layer_ids
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    num_hidden_layers: int = 1  # the head's decoder layers (the first reads 2H inputs)

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"num_hidden_layers must be an integer >= 1, got {layers!r}")
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.target_vocab_size
        if self.aux_hidden_state_layer_ids is None:
            self.aux_hidden_state_layer_ids = default_aux_layer_ids(self.target_num_hidden_layers)
        self.aux_hidden_state_layer_ids = tuple(int(i) for i in self.aux_hidden_state_layer_ids)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not 1 <= self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(
                f"draft_vocab_size must lie in [1, target_vocab_size={self.target_vocab_size}], "
                f"got {self.draft_vocab_size}"
            )
        top = self.target_num_hidden_layers - 1
        bad = [i for i in self.aux_hidden_state_layer_ids if not 0 <= i <= top]
        if bad or not self.aux_hidden_state_layer_ids:
            raise ValueError(
                f"aux_hidden_state_layer_ids {self.aux_hidden_state_layer_ids} must be non-empty "
                f"hidden-state indices in [0, {top}] for a {self.target_num_hidden_layers}-layer "
                "target (index i = output of layer i-1; the post-norm last state is excluded)"
            )
        ids = self.aux_hidden_state_layer_ids
        if list(ids) != sorted(set(ids)):
            raise ValueError(
                f"aux_hidden_state_layer_ids {ids} must be strictly increasing: vLLM and SGLang "
                "capture each target layer once, in layer order, so repeated or unordered ids "
                f"cannot be served; use e.g. {default_aux_layer_ids(self.target_num_hidden_layers)}"
            )

    @classmethod
    def for_target(cls, target_config: Any, **overrides: Any) -> Eagle3Config:
        """Defaults copied from a Hugging Face target config (same width, heads, rope).

        Rope and context are one deliberate choice: plain rope with the target's theta and no
        scaling (the reference EAGLE-3 heads' choice, even for a llama3-scaled target) over the
        target's whole context, so the engines' cos/sin caches cover every position the target
        serves; a head with a shorter ``max_position_embeddings`` is refused (an engine would
        index past its cache, or clamp the positions, beyond it).
        """
        rope = getattr(target_config, "rope_parameters", None) or {}
        values: dict[str, Any] = {
            "hidden_size": target_config.hidden_size,
            "num_attention_heads": target_config.num_attention_heads,
            "num_key_value_heads": getattr(
                target_config, "num_key_value_heads", target_config.num_attention_heads
            ),
            "intermediate_size": target_config.intermediate_size,
            "target_vocab_size": target_config.vocab_size,
            "target_num_hidden_layers": target_config.num_hidden_layers,
            "head_dim": getattr(target_config, "head_dim", None),
            "rms_norm_eps": getattr(target_config, "rms_norm_eps", 1e-6),
            "rope_theta": rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0)),
            "max_position_embeddings": getattr(target_config, "max_position_embeddings", 4096),
        }
        context = values["max_position_embeddings"]
        values.update(overrides)
        if values["max_position_embeddings"] < context:
            raise ValueError(
                f"max_position_embeddings {values['max_position_embeddings']} is below the "
                f"target's {context}: engines build the head's rope cache that long and would "
                "clamp or overrun past it; leave it at the target's context"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["aux_hidden_state_layer_ids"] = list(self.aux_hidden_state_layer_ids)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Eagle3Config:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown Eagle3Config fields {unknown}; expected a subset of {known}")
        return cls(**values)


def build_vocab_maps(
    token_counts: torch.Tensor,  # [V_target] how often each token occurs in the training data
    draft_vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # d2t [V_draft] int64, t2d [V_target] bool
    """Keep the ``draft_vocab_size`` most frequent target tokens (EAGLE-3's pruned LM head).

    Ties are broken towards lower token ids. Draft ids follow ascending target ids, so
    ``target_id = draft_id + d2t[draft_id]`` with non-negative, non-decreasing offsets, and
    ``t2d[target_id]`` marks the kept tokens.
    """
    if token_counts.ndim != 1:
        raise ValueError(
            f"token_counts must be 1-D [V_target], got shape {tuple(token_counts.shape)}"
        )
    if (token_counts < 0).any():
        raise ValueError("token_counts must be non-negative counts")
    vocab = token_counts.shape[0]
    if not 1 <= draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must lie in [1, {vocab}], got {draft_vocab_size}")
    order = torch.sort(token_counts.double(), descending=True, stable=True).indices
    kept = torch.sort(order[:draft_vocab_size]).values
    d2t = kept - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return d2t.long(), t2d


class _RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): ``w * x / sqrt(mean(x^2) + eps)``, computed in fp32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        return rms_norm(x, self.weight, self.eps)


def rope_inverse_frequencies(dim: int, theta: float) -> torch.Tensor:  # [D/2] float32
    """Plain rope's inverse frequencies ``theta^(-2i/D)``, in float32 as vLLM, SGLang and
    Hugging Face compute them (``1 / theta ** (arange(0, D, 2) / D)``), bit for bit."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def rope_tables(
    positions: torch.Tensor,  # [B, T]
    dim: int,
    theta: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [B, 1, T, D]
    """Rotary angles (Su et al. 2021) ``position * theta^(-2i/D)``, for queries and keys alike.

    Computed in float32 exactly as the engines build their cos/sin caches (vLLM's and SGLang's
    ``RotaryEmbedding._compute_cos_sin_cache``: float32 positions times float32 inverse
    frequencies), so training, our decoder and a served head rotate by the same angles at
    every position; float64 angles would differ from the engines' by ~1e-3 radians at 32k.
    """
    inverse = rope_inverse_frequencies(dim, theta).to(positions.device)  # [D/2]
    angles = positions.to(torch.float32)[..., None] * inverse  # [B, T, D/2]
    angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, T, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


class _Attention(nn.Module):
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
        self.rope_theta = config.rope_theta
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
        cos, sin = rope_tables(positions, self.head_dim, self.rope_theta, q.dtype)
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


class _MLP(nn.Module):
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


class _MidLayer(nn.Module):
    """EAGLE-3's first decoder layer; names match ``midlayer.*`` in the reference weights."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = _RMSNorm(config.hidden_size, eps)
        self.hidden_norm = _RMSNorm(config.hidden_size, eps)
        self.self_attn = _Attention(config, 2 * config.hidden_size)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, eps)
        self.mlp = _MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden: torch.Tensor,  # [B, T, H] fused target features or the previous step's output
        embeds: torch.Tensor,  # [B, T, H] target embeddings of the paired tokens
        positions: torch.Tensor,  # [B, T]
        past: tuple[torch.Tensor, torch.Tensor] | None,
        visible: torch.Tensor,  # [B, T, S + T] bool
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        attended, new_kv = self.self_attn(x, positions, past, visible)
        residual = hidden + attended
        return residual + self.mlp(self.post_attention_layernorm(residual)), new_kv


class _DecoderLayer(nn.Module):
    """A later layer of a multi-layer head: the plain pre-norm Llama block over H inputs
    (Touvron et al. 2023), with Hugging Face's module names (``decode.lean_decoder`` fuses it).

    Its two residual branches end in zero matrices at initialisation (``o_proj``, ``down_proj``;
    the "skip-init" of De & Smith 2020), so a fresh L-layer head computes what its first layer
    alone does and training grows the later layers from there instead of from random noise on
    the features the first layer passes on."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = _RMSNorm(config.hidden_size, eps)
        self.self_attn = _Attention(config, config.hidden_size)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, eps)
        self.mlp = _MLP(config.hidden_size, config.intermediate_size)
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


class Eagle3Head(nn.Module):
    """The EAGLE-3 draft head (see the module docstring for the math and the weight layout).

    The head never embeds tokens itself: callers pass the *target's* embeddings
    (``target.get_input_embeddings()``), which EAGLE-3 shares with the target. ``kind`` and
    ``config_type`` name the native folder's drafter kind and config class (P-EAGLE's head,
    ``decode.drafters.peagle``, extends this one).
    """

    kind: ClassVar[str] = "eagle3"
    config_type: ClassVar[type[Eagle3Config]] = Eagle3Config

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        num_aux = len(config.aux_hidden_state_layer_ids)
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)
        self.midlayer = _MidLayer(config)
        # Keyed "1".."L-1" so that the weights are named layers.{i}.* as vLLM names them.
        self.layers = nn.ModuleDict(
            {str(i): _DecoderLayer(config) for i in range(1, config.num_hidden_layers)}
        )
        self.norm = _RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.target_vocab_size, dtype=torch.bool))
        if config.draft_vocab_size != config.target_vocab_size:
            self.t2d.zero_()
            self.t2d[: config.draft_vocab_size] = True

    # -- vocabulary -----------------------------------------------------------------------
    def set_vocab_maps(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install maps from :func:`build_vocab_maps` (checked for consistency)."""
        vd, vt = self.config.draft_vocab_size, self.config.target_vocab_size
        if d2t.shape != (vd,) or t2d.shape != (vt,):
            raise ValueError(
                f"vocab maps must have shapes d2t [{vd}] and t2d [{vt}], got "
                f"{tuple(d2t.shape)} and {tuple(t2d.shape)}"
            )
        ids = torch.arange(vd) + d2t.long().cpu()
        if ids.min() < 0 or ids.max() >= vt or (vd > 1 and (ids.diff() <= 0).any()):
            raise ValueError(
                "d2t must map draft ids to strictly increasing target ids inside the vocabulary "
                "(as build_vocab_maps does)"
            )
        expected = torch.zeros(vt, dtype=torch.bool)
        expected[ids] = True
        if not torch.equal(expected, t2d.bool().cpu()):
            raise ValueError("t2d must mark exactly the target ids that d2t maps to")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_to_target_ids(self) -> torch.Tensor:  # [V_draft] int64
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target_logits(
        self, draft_logits: torch.Tensor
    ) -> torch.Tensor:  # [..., Vd] -> [..., Vt]
        """Scatter draft-vocabulary logits into the target vocabulary (-inf elsewhere)."""
        if self.config.draft_vocab_size == self.config.target_vocab_size:
            return draft_logits  # increasing draft ids over the whole vocabulary: the identity
        out = draft_logits.new_full(
            (*draft_logits.shape[:-1], self.config.target_vocab_size), float("-inf")
        )
        out[..., self.draft_to_target_ids] = draft_logits
        return out

    def to_draft_vocab(self, target_values: torch.Tensor) -> torch.Tensor:  # [..., Vt] -> [..., Vd]
        """Select the draft vocabulary's entries of target-vocabulary values (e.g. target logits)."""
        return target_values[..., self.draft_to_target_ids]

    # -- forward pieces -------------------------------------------------------------------
    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:  # [B, T, A*H] -> [B, T, H]
        """``g = fc(cat(low, mid, high))``: fuse the target's features in id order."""
        return self.fc(aux_hidden)

    def gather_aux(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:  # -> [B, T, A*H]
        """Concatenate the configured entries of an ``output_hidden_states`` tuple."""
        needed = max(self.config.aux_hidden_state_layer_ids)
        if len(hidden_states) <= needed:
            raise ValueError(
                f"the target returned {len(hidden_states)} hidden states but the head reads index "
                f"{needed}: run the target with output_hidden_states=True and check "
                "aux_hidden_state_layer_ids against its depth"
            )
        return torch.cat([hidden_states[i] for i in self.config.aux_hidden_state_layer_ids], -1)

    def forward(
        self,
        hidden: torch.Tensor,  # [B, T, H] fused features (step 0) or previous outputs (step k)
        embeds: torch.Tensor,  # [B, T, H] target embeddings of the token paired with each entry
        positions: torch.Tensor,  # [B, T] rotary positions
        past: Sequence[LayerKV] | None = None,  # per layer: keys, values [B, KV, S, D]
        visible: torch.Tensor | None = None,  # [B, T, S + T] bool; None = see all past + causal
    ) -> tuple[torch.Tensor, list[LayerKV]]:  # [B, T, H] pre-norm, the block's k/v per layer
        """Run the decoder layers; returns the last one's pre-norm output and, per layer, the
        block's keys/values."""
        layers = self.config.num_hidden_layers
        if past is not None and len(past) != layers:
            raise ValueError(f"past holds {len(past)} layers' keys/values, the head has {layers}")
        if visible is None:
            batch, length = hidden.shape[:2]
            past_valid = None
            if past is not None:
                past_valid = torch.ones(
                    batch, past[0][0].shape[2], dtype=torch.bool, device=hidden.device
                )
            block = torch.ones(batch, length, dtype=torch.bool, device=hidden.device)
            visible = block_visibility(past_valid, block)
        pasts = [None] * layers if past is None else list(past)
        hidden, first = self.midlayer(hidden, embeds, positions, pasts[0], visible)
        new = [first]
        for layer, layer_past in zip(self.layers.values(), pasts[1:], strict=True):
            hidden, kv = layer(hidden, positions, layer_past, visible)
            new.append(kv)
        return hidden, new

    def compute_logits(self, prenorm: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V_draft]
        return self.lm_head(self.norm(prenorm))

    def unroll(
        self,
        aux_hidden: torch.Tensor,  # [B, T, A*H] target features at each position t
        next_embeds: torch.Tensor,  # [B, T, H] target embedding of token t+1 at index t
        attention_mask: torch.Tensor,  # [B, T] 1 for real tokens (left or right padding)
        steps: int,
    ) -> list[torch.Tensor]:  # `steps` tensors [B, T, V_draft]
        """Training-time test (EAGLE-3 section 3): unroll the head ``steps`` times.

        Step 0 reads (g_t, x_{t+1}) at position t and its logits predict x_{t+2}. Step k >= 1
        reads (h^{k-1}_t, x_{t+1+k}) -- its own previous output, the ground-truth token --
        at position t+k, and predicts x_{t+2+k}. A step-k query at t sees the step-0 entries at
        positions <= t and its own chain's entries of steps 1..k, exactly the keys the runtime
        drafter holds when it drafts k tokens past committed position t. Index t of step k
        is meaningful only where t+2+k < T (the caller masks the loss). Returns logits over the
        draft vocabulary; compare them with ``to_draft_vocab(target_logits[:, 1+k+t])``.
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        batch, length = attention_mask.shape
        valid = attention_mask.bool()
        base_pos = positions_from_mask(attention_mask)
        eye = torch.eye(length, dtype=torch.bool, device=valid.device).expand(batch, length, length)
        causal = block_visibility(None, valid)  # [B, T, T]
        hidden = self.fuse(aux_hidden)
        embeds = next_embeds
        steps_kv: list[list[LayerKV]] = []  # per step, per layer
        outputs = []
        for k in range(steps):
            past = None
            if k:
                past = [
                    (
                        torch.cat([s[i][0] for s in steps_kv], 2),
                        torch.cat([s[i][1] for s in steps_kv], 2),
                    )
                    for i in range(self.config.num_hidden_layers)
                ]
            visible = causal if k == 0 else torch.cat([causal, *([eye] * k)], dim=-1)
            prenorm, kv = self.forward(hidden, embeds, base_pos + k, past, visible)
            steps_kv.append(kv)
            outputs.append(self.compute_logits(prenorm))
            hidden = prenorm
            embeds = torch.cat((embeds[:, 1:], torch.zeros_like(embeds[:, :1])), dim=1)
        return outputs

    # -- folders --------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        """Write the native drafter folder: drafter.json, config.json, model.safetensors."""
        save_native_folder(path, self.kind, self.config.to_dict(), self)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, target_num_hidden_layers: int | None = None
    ) -> Eagle3Head:
        """Load a native folder, or a vLLM/SGLang ``LlamaForCausalLMEagle3`` export.

        Engine exports do not record the target's depth; pass ``target_num_hidden_layers``
        when the export names no aux layer ids (engines then use the EAGLE-3 default).
        """
        raw, native, state = read_folder(path, cls.kind, EAGLE3_ARCHITECTURE)
        if native:
            config = cls.config_type.from_dict(raw)
        else:
            config = config_from_engine_dict(raw, target_num_hidden_layers)
        check_layer_count(config, state)
        head = cls(config)
        head._load_weights(state)
        return head

    def _load_weights(self, state: dict[str, torch.Tensor]) -> None:
        state = {
            k.removeprefix("model."): v
            for k, v in state.items()
            if "embed_tokens" not in k and not _unused_engine_norm(k.removeprefix("model."))
        }
        if "d2t" not in state:  # engines treat a missing map as the identity
            state["d2t"] = torch.zeros(self.config.draft_vocab_size, dtype=torch.long)
        if "t2d" not in state:
            t2d = torch.zeros(self.config.target_vocab_size, dtype=torch.bool)
            t2d[torch.arange(self.config.draft_vocab_size) + state["d2t"].long()] = True
            state["t2d"] = t2d
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"{self.kind} weights do not match the config: missing {missing}, "
                f"unexpected {unexpected}"
            )
        for name, tensor in state.items():
            if tensor.shape != expected[name].shape:
                raise ValueError(
                    f"weight {name} has shape {tuple(tensor.shape)}, the config "
                    f"implies {tuple(expected[name].shape)}"
                )
        dtype = state["fc.weight"].dtype
        self.to(dtype)
        self.load_state_dict(state)
        self.set_vocab_maps(self.d2t.clone(), self.t2d.clone())


def check_layer_count(config: Eagle3Config, state: dict[str, torch.Tensor]) -> None:
    """Refuse a config whose layer count the weights do not hold, before building the head (a
    hostile ``num_hidden_layers`` would otherwise allocate that many layers first)."""
    later = {
        parts[1]
        for parts in (name.removeprefix("model.").split(".") for name in state)
        if len(parts) > 2 and parts[0] == "layers" and parts[1] != "0"
    }
    count = config.num_hidden_layers
    if later != {str(i) for i in range(1, min(count, len(later) + 1))} or len(later) != count - 1:
        raise ValueError(
            f"the config declares {count} decoder layer(s) but the weights hold later layers "
            f"{sorted(later)} (expected 1 .. {count - 1}): the folder's config.json and "
            "model.safetensors do not belong together"
        )


def _unused_engine_norm(name: str) -> bool:
    """vLLM builds a ``hidden_norm`` in every layer of a multi-layer head but uses only the
    first layer's, so exports carry ``layers.{i}.hidden_norm.weight`` (i >= 1) for its loader."""
    parts = name.split(".")
    return (
        len(parts) == 4 and parts[0] == "layers" and parts[1] != "0" and parts[2] == "hidden_norm"
    )


def config_from_engine_dict(
    raw: dict[str, Any], target_num_hidden_layers: int | None
) -> Eagle3Config:
    """Read a vLLM/SGLang ``LlamaForCausalLMEagle3`` config.json.

    vLLM's top-level ``eagle_aux_hidden_state_layer_ids`` are hidden-state indices (ours);
    SGLang's ``eagle_config.eagle_aux_hidden_state_layer_ids`` count layer outputs (ours - 1).
    """
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        ids: tuple[int, ...] | None = tuple(raw["eagle_aux_hidden_state_layer_ids"])
    elif nested:
        ids = tuple(int(i) + 1 for i in nested)
    else:
        ids = None
    depth = raw.get("target_num_hidden_layers", target_num_hidden_layers)
    if depth is None:
        if ids is None:
            raise ValueError(
                "this EAGLE-3 export names no aux layer ids and not the target's depth: pass "
                "target_num_hidden_layers=<target config.num_hidden_layers>"
            )
        depth = max(ids) + 1
    return Eagle3Config(
        hidden_size=raw["hidden_size"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
        intermediate_size=raw["intermediate_size"],
        target_vocab_size=raw["vocab_size"],
        target_num_hidden_layers=depth,
        draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
        aux_hidden_state_layer_ids=ids,
        head_dim=raw.get("head_dim"),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=raw.get(
            "rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        ),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        num_hidden_layers=raw.get("num_hidden_layers", 1),
    )
