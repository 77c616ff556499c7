"""DFlash: a block drafter that fills B - 1 mask positions in one pass, from the target's features.

DFlash (Chen et al. 2026, arXiv 2602.06036; z-lab/dflash) drafts a whole block at once. For a
committed prefix ``x_<=t`` whose target features are known up to position t - 1 and whose newest
token ``x_t`` (the pending one) is not yet in the target's cache, the block is

    row 0:      E[x_t]                 at position t          (the anchor: a known token)
    row j >= 1: E[m]                   at position t + j      (m = mask_token_id)

and ``L`` decoder layers run over the B rows with attention that is *not causal inside the
block* and sees, as extra keys and values, the fused target features of every committed
position s < t:

    c_s     = hidden_norm(fc(cat(h^(1)_s, ..., h^(A)_s)))            the context, [H]
    layer:  a = n_in(x);  q = n_q(W_q a),  k = [n_k(W_k c_<t), n_k(W_k a)],  v = [W_v c_<t, W_v a]
            x <- x + W_o attn(rope(q), rope(k), v)               (block rows see every block row)
            x <- x + W_down(silu(W_gate n(x)) * W_up n(x))
    q_j     = softmax(lm_head(norm(x_j)))                      guesses x_{t+j}, j = 1..B-1

(Qwen3's per-head ``q_norm``/``k_norm``, the layout vLLM's ``qwen3_dflash`` reads). The context
enters every layer through that layer's own key and value projections only: it is not
transformed by the layers, so committing a token costs one K/V projection per layer, and a
round costs one pass over B rows, which on CPU in bfloat16 costs about what one row costs
(docs/theory.md §9). ``E`` is the target's embedding (the mask token's row included, frozen);
the output head is the target's, full or pruned to a draft vocabulary with EAGLE-3's
``d2t``/``t2d`` maps (``draftsmith.decode.drafters.feature_head``), and is trained with the head.

DSpark (arXiv 2607.05147) adds two small heads, both options here:

- a low-rank *Markov* head (``markov_rank`` r > 0) that biases position j by the token drawn
  before it: ``z_j += B (A[x_{t+j-1}] * (P h_j))`` with ``A`` [V, r], ``P`` [r, H], ``B``
  [V_draft, r] (``B`` starts at zero, so a fresh head is plain DFlash). Position j's law then
  depends on the draft at j - 1, so decoding draws the positions *in order*, each from the law
  given the token actually drawn before it (docs/theory.md §2: any proposal drawn from the q
  it reports keeps speculative sampling exact);
- a *confidence* head ``c_j = sigmoid(w . [n(h_j), log max q_j] + b)``, trained (BCE) towards
  position j's acceptance ``sum_x min(p_j, q_j)`` given a correct prefix, which decides how
  much of a block to verify from the drafter's own outputs alone
  (``draftsmith.decode.drafters.dflash.drafter``).

Training (``draftsmith.train.objectives.dflash``) samples anchors and runs many blocks of a
sequence in one pass under :func:`block_visibility`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from draftsmith.decode.drafters.eagle.config import Eagle3Config, eagle3_values_from_layer
from draftsmith.decode.drafters.eagle.layers import MLP, RMSNorm, rope_tables
from draftsmith.decode.drafters.feature_head import FeatureHead
from draftsmith.decode.drafters.folder import config_from_fields, read_folder, save_native_folder
from draftsmith.decode.forward.llama_math import apply_rope
from draftsmith.decode.loading import LoadError
from torch import nn

DFLASH_ARCHITECTURE = "DFlashDraftModel"
SPECULATORS_DFLASH_ARCHITECTURE = "DFlashSpeculator"  # speculators 0.9's name; vLLM ignores it
DFLASH_ENGINE_ARCHITECTURES = (DFLASH_ARCHITECTURE, SPECULATORS_DFLASH_ARCHITECTURE)


@dataclass
class DFlashConfig(Eagle3Config):
    """:class:`Eagle3Config`'s shape fields (the head's width, heads, vocabularies, captured
    layers, rope) plus the block, the mask token and DSpark's options. ``num_hidden_layers``
    is the drafter's layer count L."""

    ZERO_ALLOWED: ClassVar[frozenset[str]] = frozenset({"markov_rank"})  # 0: no Markov head

    block_size: int = 16  # B: rows per pass, B - 1 drafted tokens
    mask_token_id: int | None = None  # None: the last id of the target vocabulary
    markov_rank: int = 0  # DSpark's Markov head rank; 0 = plain DFlash
    confidence_head: bool = False  # DSpark's confidence head (decides the verify width)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.block_size, bool) or self.block_size < 2:
            raise ValueError(f"block_size must be an integer >= 2, got {self.block_size!r}")
        if self.mask_token_id is None:
            self.mask_token_id = self.target_vocab_size - 1
        if not 0 <= self.mask_token_id < self.target_vocab_size:
            raise ValueError(
                f"mask_token_id must lie in [0, {self.target_vocab_size}), got {self.mask_token_id}"
            )
        if isinstance(self.markov_rank, bool) or self.markov_rank < 0:
            raise ValueError(f"markov_rank must be an integer >= 0, got {self.markov_rank!r}")
        variants = [
            f for f in ("norm_before_residual", "fc_norm", "norm_output") if getattr(self, f)
        ]
        if self.rope_scaling is not None:
            variants.append(f"rope_scaling {self.rope_scaling.get('rope_type')}")
        if variants:
            raise ValueError(
                f"{', '.join(variants)}: EAGLE-3 options the DFlash block drafter does not "
                "implement (its layers are Qwen3's with plain rope); train or export the head "
                "without them"
            )

    @property
    def draft_tokens(self) -> int:
        """Tokens one block drafts (B - 1)."""
        return self.block_size - 1


class BlockAttention(nn.Module):
    """Grouped-query attention of block rows over [context, block] (Qwen3 names and norms)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        hidden, dim = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            dim,
        )
        self.eps, self.rope_theta = config.rms_norm_eps, config.rope_theta
        self.q_proj = nn.Linear(hidden, self.num_heads * dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * dim, hidden, bias=False)
        self.q_norm = RMSNorm(dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(dim, config.rms_norm_eps)

    def keys_values(
        self,
        x: torch.Tensor,  # [B, T, H] normed block rows or fused context
        positions: torch.Tensor,  # [B, T]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # keys, values [B, KV, T, D] (keys rotated)
        batch, length, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        cos, sin = rope_tables(positions, self.head_dim, self.rope_theta, k.dtype)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,  # [B, R, H] normed block rows
        positions: torch.Tensor,  # [B, R]
        context: tuple[torch.Tensor, torch.Tensor],  # keys, values [B, KV, S, D] of c_<t
        visible: torch.Tensor,  # [B, R, S + R] bool
    ) -> torch.Tensor:  # [B, R, H]
        batch, rows, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, rows, self.num_heads, self.head_dim))
        cos, sin = rope_tables(positions, self.head_dim, self.rope_theta, q.dtype)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k, v = self.keys_values(x, positions)
        keys, values = torch.cat((context[0], k), 2), torch.cat((context[1], v), 2)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=visible[:, None], enable_gqa=self.num_heads != keys.shape[1]
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, rows, self.num_heads * self.head_dim))


class BlockLayer(nn.Module):
    """One pre-norm DFlash layer (module docstring); Hugging Face's module names, so that the
    lean decoding forward (``draftsmith.decode.forward.lean_decoder.fuse_layer``) fuses it."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = BlockAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,  # [B, R, H]
        positions: torch.Tensor,  # [B, R]
        context: torch.Tensor,  # [B, S, H] fused context features
        context_positions: torch.Tensor,  # [B, S]
        visible: torch.Tensor,  # [B, R, S + R] bool
    ) -> torch.Tensor:  # [B, R, H]
        kv = self.self_attn.keys_values(context, context_positions)
        x = x + self.self_attn(self.input_layernorm(x), positions, kv, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """DSpark's low-rank bias of position j by the token before it (module docstring)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        rank = config.markov_rank
        self.previous = nn.Embedding(config.target_vocab_size, rank)  # A [V, r]
        self.project = nn.Linear(config.hidden_size, rank, bias=False)  # P [r, H]
        self.next = nn.Linear(rank, config.draft_vocab_size, bias=False)  # B [V_draft, r]
        with torch.no_grad():
            self.previous.weight.normal_(0.0, 1.0)
            self.next.weight.zero_()

    def forward(
        self,
        normed: torch.Tensor,  # [..., H] the rows' final-normed outputs
        previous: torch.Tensor,  # [...] int64 target ids of the token before each row
    ) -> torch.Tensor:  # [..., V_draft]
        return self.bias(self.project(normed), previous)

    def bias(
        self,
        projected: torch.Tensor,  # [..., r] ``P h_j`` of the rows (``self.project(normed)``)
        previous: torch.Tensor,  # [...] int64 target ids of the token before each row
    ) -> torch.Tensor:  # [..., V_draft]
        """``B (A[x_prev] * P h_j)`` from a projection already made: decoding draws a block's
        positions in order, and projects all of them in one product before the first draw."""
        return self.next(self.previous(previous) * projected)


class ConfidenceHead(nn.Module):
    """DSpark's acceptance estimate ``c_j`` (module docstring); returns logits of c_j."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.score = nn.Linear(config.hidden_size + 1, 1)
        with torch.no_grad():
            self.score.weight.zero_()
            self.score.bias.zero_()

    def forward(
        self,
        normed: torch.Tensor,  # [..., H]
        logits: torch.Tensor,  # [..., V_draft] the row's draft logits (bias included)
    ) -> torch.Tensor:  # [...] logit of the acceptance estimate
        top = torch.log_softmax(logits.float(), dim=-1).amax(-1, keepdim=True)
        return self.score(torch.cat((normed, top.to(normed.dtype)), dim=-1))[..., 0]


def block_visibility(
    context_limit: torch.Tensor,  # [B, R] int: row r sees context slots s < context_limit
    context_valid: torch.Tensor,  # [B, S] bool: real context slots
    block_of: torch.Tensor,  # [B, R] int: the block each row belongs to
    row_valid: torch.Tensor,  # [B, R] bool
) -> torch.Tensor:  # [B, R, S + R] bool
    """DFlash's mask: a row sees the valid context before its block's anchor and every valid
    row of its own block (not causal inside the block). Every row sees itself, so padding
    rows stay finite."""
    slots = torch.arange(context_valid.shape[1], device=context_valid.device)
    context = (slots[None, None, :] < context_limit[:, :, None]) & context_valid[:, None, :]
    same = block_of[:, :, None] == block_of[:, None, :]
    inner = same & row_valid[:, None, :]
    eye = torch.eye(block_of.shape[1], dtype=torch.bool, device=block_of.device)
    return torch.cat((context, inner | eye), dim=-1)


class DFlashHead(FeatureHead):
    """The DFlash drafter (module docstring has the math); saved as the ``dflash`` kind.

    Weight names follow z-lab's ``DFlashDraftModel`` and vLLM's ``qwen3_dflash``: ``fc``,
    ``hidden_norm``, ``layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj,
    self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``norm``;
    plus ``lm_head`` and ``d2t``/``t2d`` (the output head, which those read from the target
    when they share it), ``markov.*`` and ``confidence.*`` for DSpark's options.
    """

    kind: ClassVar[str] = "dflash"
    config_type: ClassVar[type[DFlashConfig]] = DFlashConfig
    config: DFlashConfig

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        num_aux = len(config.aux_hidden_state_layer_ids)
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.markov = MarkovHead(config) if config.markov_rank else None
        self.confidence = ConfidenceHead(config) if config.confidence_head else None

    # -- forward pieces -------------------------------------------------------------------
    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:  # [B, T, A*H] -> [B, T, H]
        """The context ``c = hidden_norm(fc(cat(h^(1), ..., h^(A))))``."""
        return self.hidden_norm(self.fc(aux_hidden))

    def forward(
        self,
        rows: torch.Tensor,  # [B, R, H] embeddings of the block rows
        positions: torch.Tensor,  # [B, R]
        context: torch.Tensor,  # [B, S, H] fused context (:meth:`fuse`)
        context_positions: torch.Tensor,  # [B, S]
        visible: torch.Tensor,  # [B, R, S + R] bool
    ) -> torch.Tensor:  # [B, R, H] final-normed outputs
        x = rows
        for layer in self.layers:
            x = layer(x, positions, context, context_positions, visible)
        return self.norm(x)

    def compute_logits(
        self,
        normed: torch.Tensor,  # [..., H]
        previous: torch.Tensor | None = None,  # [...] target ids before each row (Markov head)
    ) -> torch.Tensor:  # [..., V_draft]
        logits = self.lm_head(normed)
        if self.markov is not None:
            if previous is None:
                raise ValueError("a head with a Markov head needs each row's previous token")
            logits = logits + self.markov(normed, previous)
        return logits

    def blocks(
        self,
        aux_hidden: torch.Tensor,  # [B, T, A*H] target features at each position
        input_ids: torch.Tensor,  # [B, T]
        embed: nn.Module,  # the target's input embedding
        attention_mask: torch.Tensor,  # [B, T] 1 for real tokens (right padding)
        anchors: torch.Tensor,  # [B, M] int64 anchor positions a (1 <= a <= T - 2)
        anchor_valid: torch.Tensor,  # [B, M] bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [B, M, B-1, Vd], conf [B, M, B-1]
        """Training: M blocks per sequence in one pass (module docstring), block m anchored at
        ``a_m`` with rows ``[x_{a_m}, m, ..., m]`` at positions ``a_m .. a_m + B - 1``, seeing
        the context at positions < a_m. Row j's logits guess ``x_{a_m + j}``; the Markov head
        reads the true ``x_{a_m + j - 1}`` before it (teacher forcing: at decoding time that
        token is the draft, which equals it whenever position j is reached)."""
        size = self.config.block_size
        batch, count = anchors.shape
        length = input_ids.shape[1]
        offsets = torch.arange(size, device=anchors.device)
        row_pos = (anchors[:, :, None] + offsets).reshape(batch, count * size)  # [B, M*Bk]
        known = input_ids.gather(1, anchors)  # [B, M]
        ids = torch.full((batch, count, size), self.config.mask_token_id, device=anchors.device)
        ids[:, :, 0] = known
        rows = embed(ids.reshape(batch, count * size)).to(self.fc.weight.dtype)
        block_of = torch.arange(count, device=anchors.device).repeat_interleave(size)
        valid = anchor_valid.repeat_interleave(size, dim=1)  # [B, M*Bk]
        visible = block_visibility(
            anchors.repeat_interleave(size, dim=1),
            attention_mask.bool(),
            block_of.expand(batch, -1),
            valid,
        )
        context_positions = torch.arange(length, device=anchors.device).expand(batch, -1)
        normed = self.forward(
            rows, row_pos, self.fuse(aux_hidden), context_positions, visible
        ).view(batch, count, size, -1)[:, :, 1:]  # [B, M, Bk-1, H]
        previous = None
        if self.markov is not None:
            before = (anchors[:, :, None] + offsets[: size - 1]).clamp(max=length - 1)
            previous = input_ids.gather(1, before.reshape(batch, -1)).view(batch, count, -1)
        logits = self.compute_logits(normed, previous)
        confidence = None
        if self.confidence is not None:
            confidence = self.confidence(normed, logits.detach())
        return logits, confidence

    # -- folders --------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        """Write the native drafter folder: drafter.json, config.json, model.safetensors."""
        save_native_folder(path, self.kind, self.config.to_dict(), self)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DFlashHead:
        """Load a native ``dflash`` folder, or a vLLM ``qwen3_dflash`` or speculators
        ``dflash`` export (``draftsmith.train.export.dflash``)."""
        raw, native, state = read_folder(path, cls.kind, DFLASH_ENGINE_ARCHITECTURES)
        config = DFlashConfig.from_dict(raw) if native else config_from_engine_dict(raw)
        head = cls(config)
        head.load_checked_weights(state)
        return head


def config_from_engine_dict(raw: dict[str, Any]) -> DFlashConfig:
    """A vLLM ``qwen3_dflash`` config.json as a :class:`DFlashConfig`: the captured layers from
    ``eagle_aux_hidden_state_layer_ids`` (our indices), else ``dflash_config.target_layer_ids``
    plus one, as vLLM reads them; a missing ``rope_theta`` is vLLM's DFlash default, 1e6. A
    speculators ``dflash`` config is first read the way vLLM converts it."""
    if raw.get("speculators_model_type") is not None:
        raw = vllm_dict_from_speculators(raw)
    nested = raw.get("dflash_config") or {}
    if not isinstance(nested, dict):
        raise LoadError("config.json: dflash_config must be an object; export the head again")
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or [
        i + 1 for i in nested.get("target_layer_ids") or []
    ]
    missing = [k for k in _ENGINE_REQUIRED if k not in raw] + ([] if ids else ["target_layer_ids"])
    if missing:
        raise LoadError(
            f"config.json: this DFlash export lacks {', '.join(missing)}; export the head again"
        )
    values = eagle3_values_from_layer(raw, raw.get("target_num_hidden_layers", max(ids) + 1),
                                      ids, raw.get("draft_vocab_size"))  # fmt: skip
    values["rope_theta"] = raw.get("rope_theta", 1e6)
    values["block_size"] = raw.get("block_size", nested.get("block_size", 16))
    values["mask_token_id"] = nested.get("mask_token_id", raw.get("mask_token_id"))
    return config_from_fields(DFlashConfig, values)


_ENGINE_REQUIRED = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def vllm_dict_from_speculators(raw: dict[str, Any]) -> dict[str, Any]:
    """A speculators ``dflash`` config.json as the vLLM config it stands for (vLLM 0.32's
    ``update_dflash``: the layer config, plus the drafter's fields), refusing the variants
    this head does not implement by name."""
    if raw.get("speculators_model_type") != "dflash":
        raise LoadError(
            f"config.json: speculators_model_type {raw.get('speculators_model_type')!r} is "
            "not dflash; pass a DFlash folder"
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise LoadError("config.json: a speculators dflash folder needs transformer_layer_config")
    refused = {
        "sample_from_anchor": (raw.get("sample_from_anchor", False), False),
        "projector_type": (raw.get("projector_type", "dflash"), "dflash"),
        "shift_label": (bool(raw.get("shift_label", False)), False),
        "sliding_window_non_causal": (raw.get("sliding_window_non_causal", True), True),
    }
    for key, (value, ours) in refused.items():
        if value != ours:
            raise LoadError(
                f"config.json: {key} {value!r} is a DFlash variant this head does not implement "
                f"(it drafts with {key} {ours!r}); decode it in the engine it was trained for"
            )
    ids = raw.get("aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not ids:
        raise LoadError("config.json: a speculators dflash folder needs aux_hidden_state_layer_ids")
    fields = ("draft_vocab_size", "block_size", "target_num_hidden_layers", "target_hidden_size")
    return {
        **layer,
        **{key: raw[key] for key in fields if raw.get(key) is not None},
        "eagle_aux_hidden_state_layer_ids": ids,
        "dflash_config": {"mask_token_id": raw.get("mask_token_id")},
    }
