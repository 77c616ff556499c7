"""EAGLE-3 draft head: the head, its draft vocabulary and its folders (its layers are in
``draftsmith.decode.drafters.eagle.layers``, its config in ``draftsmith.decode.drafters.eagle.config``, the runtime
drafter in ``draftsmith.decode.drafters.eagle.drafter``).

EAGLE-3 (Li et al., 2025) drafts from the target's own features. For target position t let
``g_t = fc(cat(h^low_t, h^mid_t, h^high_t))`` fuse three of the target's hidden states. A
Llama decoder layer reads the *pair* (feature, next token):

    x_t   = cat(input_layernorm(E[x_{t+1}]), hidden_norm(g_t))       # [2H]
    r_t   = g_t + o_proj(attention(q/k/v_proj(x_t), causal over t))  # residual is g_t
    h_t   = r_t + mlp(post_attention_layernorm(r_t))                 # "pre-norm" output
    logits_t = lm_head(norm(h_t))                                    # predicts x_{t+2}

A head of ``num_hidden_layers`` = L > 1 layers (vLLM's multi-layer EAGLE-3, the model its
parallel drafting for P-EAGLE runs too) runs L - 1 plain pre-norm Llama layers over H inputs after
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

Aux hidden-state ids follow the convention stated in ``draftsmith.decode.drafters.eagle.config``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import torch
from draftsmith.decode.drafters.eagle.config import (
    Eagle3Config,
    check_layer_count,
    config_from_engine_dict,
    default_aux_layer_ids,
    unused_engine_norm,
)
from draftsmith.decode.drafters.eagle.layers import (
    DecoderLayer,
    LayerKV,
    MidLayer,
    RMSNorm,
    append_kv,
    block_visibility,
    positions_from_mask,
)
from draftsmith.decode.drafters.feature_head import FeatureHead
from draftsmith.decode.drafters.folder import read_folder, save_native_folder
from torch import nn

__all__ = [
    "EAGLE3_ARCHITECTURE",
    "Eagle3Config",
    "Eagle3Head",
    "build_vocab_maps",
    "default_aux_layer_ids",
]

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
# What an EAGLE-3 folder's config.json may name: SGLang's and SpecForge's name, vLLM's own, and
# the plain Llama name the EAGLE authors' heads carry (vLLM maps it to Eagle3LlamaForCausalLM
# for method eagle3). The weights decide: a folder whose keys are not a head's is refused.
EAGLE3_ENGINE_ARCHITECTURES = (EAGLE3_ARCHITECTURE, "Eagle3LlamaForCausalLM", "LlamaForCausalLM")


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


class Eagle3Head(FeatureHead):
    """The EAGLE-3 draft head (see the module docstring for the math and the weight layout).

    The head never embeds tokens itself: callers pass the *target's* embeddings
    (``target.get_input_embeddings()``), which EAGLE-3 shares with the target. ``kind`` and
    ``config_type`` name the native folder's drafter kind and config class (P-EAGLE's head,
    ``draftsmith.decode.drafters.eagle.peagle``, extends this one).
    """

    kind: ClassVar[str] = "eagle3"
    config_type: ClassVar[type[Eagle3Config]] = Eagle3Config

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        num_aux = len(config.aux_hidden_state_layer_ids)
        if config.fc_norm:  # EAGLE-3.1: one RMSNorm per captured state, named fc_norm.{i}
            self.fc_norm = nn.ModuleList(
                RMSNorm(hidden, config.rms_norm_eps) for _ in range(num_aux)
            )
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)
        self.midlayer = MidLayer(config)
        # Keyed "1".."L-1" so that the weights are named layers.{i}.* as vLLM names them.
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(config) for i in range(1, config.num_hidden_layers)}
        )
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)

    # -- forward pieces -------------------------------------------------------------------
    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:  # [B, T, A*H] -> [B, T, H]
        """``g = fc(cat(low, mid, high))``: fuse the target's features in id order; with
        ``fc_norm`` (EAGLE-3.1) ``g = fc(cat(n_1(low), n_2(mid), n_3(high)))``."""
        if self.config.fc_norm:
            chunks = aux_hidden.chunk(len(self.fc_norm), dim=-1)
            aux_hidden = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks, strict=True)], -1)
        return self.fc(aux_hidden)

    def forward(
        self,
        hidden: torch.Tensor,  # [B, T, H] fused features (step 0) or previous outputs (step k)
        embeds: torch.Tensor,  # [B, T, H] target embeddings of the token paired with each entry
        positions: torch.Tensor,  # [B, T] rotary positions
        past: Sequence[LayerKV] | None = None,  # per layer: keys, values [B, KV, S, D]
        visible: torch.Tensor | None = None,  # [B, T, S + T] bool; None = see all past + causal
    ) -> tuple[torch.Tensor, list[LayerKV]]:  # [B, T, H] output, the block's k/v per layer
        """Run the decoder layers; returns the step's output (the last layer's pre-norm ``h``,
        or ``norm(h)`` with ``norm_output``: what the next step reads, vLLM's ``aux_output``)
        and, per layer, the block's keys/values."""
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
        return (self.norm(hidden) if self.config.norm_output else hidden), new

    def compute_logits(self, output: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V_draft]
        """``lm_head(norm(h))`` from a step's output (already ``norm(h)`` with ``norm_output``)."""
        return self.lm_head(output if self.config.norm_output else self.norm(output))

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
        past: list[LayerKV] | None = None  # per layer: every earlier step's keys/values
        outputs = []
        for k in range(steps):
            visible = causal if k == 0 else torch.cat([causal, *([eye] * k)], dim=-1)
            prenorm, kv = self.forward(hidden, embeds, base_pos + k, past, visible)
            past = kv if past is None else append_kv(past, kv)
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
        raw, native, state = read_folder(path, cls.kind, EAGLE3_ENGINE_ARCHITECTURES)
        if native:
            config = cls.config_type.from_dict(raw)
        else:
            config = config_from_engine_dict(raw, target_num_hidden_layers)
        return cls.from_state(config, state)

    @classmethod
    def from_state(cls, config: Eagle3Config, state: dict[str, torch.Tensor]) -> Eagle3Head:
        """A head of ``config`` holding the weights ``state`` (ours or an engine's names), its
        layer count checked against the weights before anything is built."""
        check_layer_count(config, state)
        head = cls(config)
        head._load_weights(state)
        return head

    def _load_weights(self, state: dict[str, torch.Tensor]) -> None:
        self.load_checked_weights(
            state, ignored=lambda name: "embed_tokens" in name or unused_engine_norm(name)
        )
