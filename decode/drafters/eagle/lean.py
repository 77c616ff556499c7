"""The EAGLE-3 head's forward for decoding: fused products over a preallocated KV cache.

A drafted token costs one pass of the head's layers plus its output projection. Run as
``nn.Module`` calls with a concatenated cache, that is ~40 small operators and a cache copy per
step (~2-4 ms on 2 CPU cores for a 256-wide head, as much as half a target step). This module
computes the same mathematics as :class:`draftsmith.decode.drafters.eagle.head.Eagle3Head` (docs/theory.md §1:
a draft step must cost a small fraction of a target step for drafting to pay):

    x   = [n_in(E[tok]), n_hid(g)] @ W_qkv              (q, k, v in one product over 2H)
    r   = g + attn(rope(q), rope(k), v) @ W_o
    h   = r + W_down (silu(W_gate n(r)) * W_up n(r))     (gate, up in one product)
    h  <- layer_i(h), i = 1..L-1                         (a multi-layer head's later layers)
    z   = n_out(h) @ W_head                              (the pruned draft vocabulary only)

with the head's variants applied where the head applies them (``fc_norm``,
``norm_before_residual``, ``norm_output``: ``draftsmith.decode.drafters.eagle.head``), and
the head's own weights (copied once into the fused layouts, rebuilt when a weight changes
in place; a bfloat16 product over up to four rows multiplies an int4 or int8 copy,
``draftsmith.decode.forward.projection``), rotary tables computed once in float32 as the head computes them (its rope scaling included), and
keys/values written into a :class:`draftsmith.decode.forward.kv_cache.PreallocatedStack` (one layer per head
layer) that drafting appends to and crops back (never a concatenation of the whole cache).
Logits stay in the draft vocabulary (``V_draft``, e.g. 2048 of 8192): sampling and top-k run
there and only the chosen ids are mapped to the target's (``target_id = draft_id +
d2t[draft_id]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from draftsmith.decode.drafters.eagle.head import Eagle3Head
from draftsmith.decode.drafters.eagle.layers import rope_tables
from draftsmith.decode.drafters.vocab_map import to_target_ids, to_target_probs
from draftsmith.decode.forward.kv_cache import PreallocatedStack
from draftsmith.decode.forward.lean_decoder import (
    AttentionShape,
    LayerWeights,
    decoder_layer,
    fuse_layer,
)
from draftsmith.decode.forward.llama_math import rms_norm
from draftsmith.decode.forward.output_head import DRAFT_LOGITS_DTYPE, OutputHead
from draftsmith.decode.forward.projection import (
    Projection,
    draft_layer_layout,
    draft_vocab_layout,
    fused_projection,
)


@dataclass
class _FusedWeights:
    fc: Projection  # A * H -> H
    hidden_norm: torch.Tensor  # [H]
    first: LayerWeights  # the first layer (its input_norm normalises the embeddings; qkv 2H ->)
    later: list[LayerWeights]  # layers 1..L-1 of a multi-layer head
    final_norm: torch.Tensor  # [H]
    draft_to_target: torch.Tensor  # [V_draft] int64 target ids of the draft vocabulary


class LeanEagle3:
    """Decoding-time forward of an :class:`Eagle3Head` (same weights, fused layouts)."""

    def __init__(self, head: Eagle3Head) -> None:
        self.head = head
        config = head.config
        self.shape = AttentionShape(
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            eps=config.rms_norm_eps,
        )
        self.config = config
        self.full_vocab = config.draft_vocab_size == config.target_vocab_size
        self._output = OutputHead(head.lm_head.weight, DRAFT_LOGITS_DTYPE, draft_vocab_layout)
        self._parameters = [*head.parameters(), head.d2t]
        self._versions: list[int] = []
        self._weights: _FusedWeights | None = None
        self._cos = self._sin = torch.empty(0)  # [P, D] rotary tables, grown on demand

    # -- weights --------------------------------------------------------------------------
    def weights(self) -> _FusedWeights:
        versions = [p._version for p in self._parameters]
        if self._weights is None or versions != self._versions:
            self._weights = self._fuse()
            self._versions = versions
        return self._weights

    @torch.no_grad()
    def _fuse(self) -> _FusedWeights:
        head = self.head
        return _FusedWeights(
            fc=fused_projection((head.fc,), draft_layer_layout),
            hidden_norm=head.midlayer.hidden_norm.weight.detach(),
            first=fuse_layer(head.midlayer, draft_layer_layout),
            later=[fuse_layer(layer, draft_layer_layout) for layer in head.layers.values()],
            final_norm=head.norm.weight.detach(),
            draft_to_target=head.draft_to_target_ids.clone(),
        )

    # -- forward --------------------------------------------------------------------------
    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:  # [B, T, A*H] -> [B, T, H]
        """``g = fc(cat(low, mid, high))``, each state normalised first with ``fc_norm``."""
        if self.config.fc_norm:
            norms = self.head.fc_norm
            chunks = aux_hidden.chunk(len(norms), dim=-1)
            eps = self.shape.eps
            aux_hidden = torch.cat(
                [rms_norm(c, n.weight.detach(), eps) for c, n in zip(chunks, norms, strict=True)],
                dim=-1,
            )
        return self.weights().fc(aux_hidden)

    def step(
        self,
        hidden: torch.Tensor,  # [B, T, H] fused features or the previous step's outputs
        embeds: torch.Tensor,  # [B, T, H] target embeddings of the paired tokens
        positions: torch.Tensor,  # [B, T]
        cache: PreallocatedStack,  # keys/values of earlier entries; the block's are appended
        visible: torch.Tensor | None,  # [B, T, S + T] bool; None: every entry sees every slot
    ) -> torch.Tensor:  # [B, T, H] outputs (Eagle3Head.forward's: h, or norm(h))
        """One pass of the head's decoder layers over a block of entries."""
        w, eps = self.weights(), self.shape.eps
        normed = rms_norm(hidden, w.hidden_norm, eps)
        x = torch.cat((rms_norm(embeds, w.first.input_norm, eps), normed), dim=-1)  # [B, T, 2H]
        if self.config.norm_before_residual:
            hidden = normed  # the residual stream starts from hidden_norm(g)
        cos, sin = self._rotary(positions, x.dtype)  # [B, 1, T, D]
        mask = None if visible is None else visible[:, None]  # [B, 1, T, S + T]
        layers = cache.layers
        h = decoder_layer(w.first, hidden, cos, sin, mask, layers[0], self.shape, normed=x)
        for weights, cache_layer in zip(w.later, layers[1:], strict=True):
            h = decoder_layer(weights, h, cos, sin, mask, cache_layer, self.shape)
        return rms_norm(h, w.final_norm, eps) if self.config.norm_output else h

    def draft_logits(self, output: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V_draft]
        """``lm_head(norm(h))`` from a step's output (already ``norm(h)`` with ``norm_output``)."""
        if not self.config.norm_output:
            output = rms_norm(output, self.weights().final_norm, self.shape.eps)
        return self._output(output)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [...] int64
        return to_target_ids(draft_ids, self._draft_to_target())

    def to_target_probs(self, probs: torch.Tensor) -> torch.Tensor:  # [..., Vd] -> [..., Vt]
        """Draft-vocabulary probabilities placed in the target vocabulary (0 elsewhere)."""
        return to_target_probs(probs, self._draft_to_target(), self.head.config.target_vocab_size)

    def _draft_to_target(self) -> torch.Tensor | None:  # [V_draft] int64; None: full vocabulary
        return None if self.full_vocab else self.weights().draft_to_target

    def _rotary(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [B, 1, T, D]
        """The head's own rotary angles (``rope_tables``), looked up in a table grown on demand."""
        needed = int(positions.max()) + 1 if positions.numel() else 1
        if needed > self._cos.shape[0] or self._cos.dtype != dtype:
            size = max(needed, 2 * self._cos.shape[0], 256)
            table = torch.arange(size, device=positions.device)[None]  # [1, P]
            c = self.config
            cos, sin = rope_tables(  # [1, 1, P, D]
                table, c.head_dim, c.rope_theta, dtype, c.rope_scaling, c.max_position_embeddings
            )
            self._cos, self._sin = cos[0, 0], sin[0, 0]
        return self._cos[positions][:, None], self._sin[positions][:, None]
