"""The DFlash runtime drafter: a :class:`DFlashHead` next to a Hugging Face target.

One round (docs/theory.md §9) is one pass of the head over the block ``[x_t, m, ..., m]``
(``block_size`` rows) after the committed context; row j's logits give ``q_j`` and the round
drafts the first N of the B - 1 positions (the engine's N, at most B - 1; the block always runs
whole, as it was trained, and costs about what a narrower one would on CPU). Committing a round
appends the accepted positions' fused target features to the context, which costs one key and
value projection per layer and no layer pass.

The context lives in a :class:`PreallocatedStack` (per layer: rotated keys ``n_k(W_k c)`` and
values ``W_v c``) managed as :class:`draftsmith.decode.drafters.eagle.drafter.Eagle3Drafter`
manages its committed entries (lazy reading, holes, compaction, continuous batching, the
hybrid's replaced drafts), which this class inherits: the entry recorded for position s holds
the target's features at s, and its paired token, the one after s, is what the next block
starts from (the head's state keeps the pending token's embedding, the block's row 0).

Exactness. Without the Markov head every q_j depends on the committed context alone, so the
B - 1 drafts are drawn independently, each from its own q_j; with it, position j's law is
computed after drawing position j - 1 and the draft is drawn from that law, in order. Either
way each draft comes from the q reported with it, which is all speculative sampling needs
(docs/theory.md §2): greedy output equals the target's and sampled output follows its law.

The verify width. With a confidence head the drafter keeps the first w drafts, w the largest
width whose estimated chance of being reached, ``prod_{i <= w} c_i``, is at least
``confidence_threshold`` (at least one draft). The rule reads the drafter's own outputs only,
never the target's, so the verified tokens stay a proposal fixed before verification.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from draftsmith.decode.drafters.base import Drafter, DraftProposal, TargetPass
from draftsmith.decode.drafters.dflash.head import DFlashHead
from draftsmith.decode.drafters.eagle.drafter import Eagle3Drafter
from draftsmith.decode.drafters.eagle.lean import LeanEagle3, _FusedWeights
from draftsmith.decode.forward.kv_cache import PreallocatedStack
from draftsmith.decode.forward.lean_decoder import decoder_layer, fuse_layer
from draftsmith.decode.forward.llama_math import apply_rope, rms_norm
from draftsmith.decode.forward.projection import Projection, draft_layer_layout, fused_projection
from draftsmith.decode.sampling import SamplingConfig, select_tokens
from torch import nn

# Default of ``DFlashDrafter.confidence_threshold`` (the module docstring's width rule).
CONFIDENCE_THRESHOLD = 0.1


@dataclass
class _BlockWeights(_FusedWeights):
    context_kv: list[Projection]  # per layer: H -> 2 KV * D, the context's keys and values
    k_norms: list[torch.Tensor]  # per layer: [D]


class LeanDFlash(LeanEagle3):
    """Decoding-time forward of a :class:`DFlashHead`: the context's keys and values appended
    to a cache, the block's pass through the lean decoder layer (``decoder_layer``, fused
    products in the draft layouts of ``draftsmith.decode.forward.projection``), logits over
    the draft vocabulary. The rotary tables, the output head and the vocabulary maps are
    :class:`LeanEagle3`'s."""

    head: DFlashHead

    @torch.no_grad()
    def _fuse(self) -> _BlockWeights:
        head = self.head
        layers = [fuse_layer(layer, draft_layer_layout) for layer in head.layers]
        return _BlockWeights(
            fc=fused_projection((head.fc,), draft_layer_layout),
            hidden_norm=head.hidden_norm.weight.detach(),
            first=layers[0],
            later=layers[1:],
            final_norm=head.norm.weight.detach(),
            draft_to_target=head.draft_to_target_ids.clone(),
            context_kv=[
                fused_projection(
                    (layer.self_attn.k_proj, layer.self_attn.v_proj), draft_layer_layout
                )
                for layer in head.layers
            ],
            k_norms=[layer.self_attn.k_norm.weight.detach() for layer in head.layers],
        )

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:  # [B, T, A*H] -> [B, T, H]
        """The context ``c = hidden_norm(fc(features))``."""
        w = self.weights()
        return rms_norm(w.fc(aux_hidden), w.hidden_norm, self.shape.eps)

    def append_context(
        self,
        context: torch.Tensor,  # [B, W, H] fused context of newly committed positions
        positions: torch.Tensor,  # [B, W]
        cache: PreallocatedStack,
    ) -> None:
        """Each layer's rotated keys and values of the new context, appended to its cache."""
        w, shape = self.weights(), self.shape
        batch, width, _ = context.shape
        cos, sin = self._rotary(positions, context.dtype)
        for projection, k_norm, layer in zip(w.context_kv, w.k_norms, cache.layers, strict=True):
            kv = projection(context).view(batch, width, 2 * shape.num_kv_heads, shape.head_dim)
            k, v = kv.split((shape.num_kv_heads, shape.num_kv_heads), dim=2)
            k = apply_rope(rms_norm(k, k_norm, shape.eps).transpose(1, 2), cos, sin)
            layer.update(k, v.transpose(1, 2))

    def block(
        self,
        rows: torch.Tensor,  # [B, R, H] embeddings of the block rows
        positions: torch.Tensor,  # [B, R]
        cache: PreallocatedStack,  # the context; the block's keys/values are cropped off after
        visible: torch.Tensor | None,  # [B, R, S + R] bool; None: every slot
    ) -> torch.Tensor:  # [B, R, H] final-normed outputs
        """One pass of the head's layers over the block (not causal inside it)."""
        w = self.weights()
        cos, sin = self._rotary(positions, rows.dtype)
        mask = None if visible is None else visible[:, None]
        x = rows
        for weights, layer in zip([w.first, *w.later], cache.layers, strict=True):
            x = decoder_layer(weights, x, cos, sin, mask, layer, self.shape)
        cache.crop(-rows.shape[1])
        return rms_norm(x, w.final_norm, self.shape.eps)

    def output(self, normed: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V_draft]
        return self._output(normed)


class DFlashDrafter(Eagle3Drafter):
    """Runs a :class:`DFlashHead` next to a Hugging Face target (chains of up to B - 1 drafts
    from one block pass; module docstring)."""

    kind: ClassVar[str] = "dflash"
    supports_trees: ClassVar[bool] = False
    supports_sampled_trees: ClassVar[bool] = False
    lean_type: ClassVar[type[LeanEagle3]] = LeanDFlash

    head: DFlashHead
    lean: LeanDFlash

    def __init__(self, head: DFlashHead, target: nn.Module) -> None:
        super().__init__(head, target)
        self.confidence_threshold = CONFIDENCE_THRESHOLD
        self._pending: torch.Tensor | None = None  # [B] the token each row's block starts from
        self._mask_row: torch.Tensor | None = None  # [H] the target's embedding of the mask

    @classmethod
    def from_pretrained(cls, path: str | Path, target: nn.Module) -> DFlashDrafter:
        """Load a native ``dflash`` folder, or a vLLM ``qwen3_dflash`` export, for ``target``."""
        return cls(DFlashHead.from_pretrained(path), target)

    @property
    def max_draft_tokens(self) -> int:
        return self.head.config.draft_tokens

    propose_tree = Drafter.propose_tree
    propose_sampled_tree = Drafter.propose_sampled_tree
    commit_tree = Drafter.commit_tree

    # -- protocol -------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor,  # [B, T]
        target_pass: TargetPass,
        pending: torch.Tensor,  # [B]
    ) -> None:
        super().prefill(input_ids, attention_mask, target_pass, pending)
        self._pending = pending.clone()

    @torch.no_grad()
    def propose(
        self, num_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> DraftProposal:
        """The first N drafts of one block pass (N at most B - 1)."""
        empty = self._empty_round(num_tokens)
        if empty is not None:
            return empty
        if num_tokens > self.max_draft_tokens:
            raise ValueError(
                f"a dflash block of {self.head.config.block_size} drafts at most "
                f"{self.max_draft_tokens} tokens, asked for {num_tokens}"
            )
        state = self._read_state()
        normed = self._block_outputs(state)[:, 1 : 1 + num_tokens]  # [B, N, H]
        base = self.lean.output(normed)  # [B, N, V_draft]
        if self.head.markov is None:
            draft_ids, q = select_tokens(base, sampling, generator)
            logits = base
        else:
            draft_ids, q, logits = self._in_order(normed, base, sampling, generator)
        tokens = self.lean.to_target_ids(draft_ids)
        if self.head.confidence is not None:
            keep = self._verify_width(normed, logits)
            tokens, draft_ids = tokens[:, :keep], draft_ids[:, :keep]
            q = None if q is None else q[:, :keep]
        state.drafts = tokens
        probs = None if q is None else self.lean.to_target_probs(q)
        return DraftProposal(tokens=tokens, probs=probs)

    @torch.no_grad()
    def commit(
        self, num_accepted: torch.Tensor, next_tokens: torch.Tensor, target_pass: TargetPass
    ) -> None:
        super().commit(num_accepted, next_tokens, target_pass)
        self._pending = next_tokens.clone()

    # -- continuous batching ----------------------------------------------------------------
    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        pending = self._require_pending()
        self._pending = pending[rows.to(pending.device, torch.long)]

    def merge(self, other: Drafter) -> None:
        if not isinstance(other, DFlashDrafter):
            raise TypeError("only a spawn of this DFlash drafter can be merged into it")
        mine, theirs = self._require_pending(), other._require_pending()
        super().merge(other)
        self._pending = torch.cat((mine, theirs))

    # -- internals ------------------------------------------------------------------------
    def _committed_pass(
        self,
        fused: torch.Tensor,  # [B, W, H] fused context of the new committed positions
        embeds: torch.Tensor,  # [B, W, H] embeddings of the tokens after them
        positions: torch.Tensor,  # [B, W]
        cache: PreallocatedStack,
        visible: torch.Tensor | None,
        seen: torch.Tensor,
        next_pos: torch.Tensor,
    ) -> torch.Tensor:  # [B, W, H]: the embeddings, whose last kept entry is the block's row 0
        """Committing is appending the context's keys and values: no layer pass."""
        del visible, seen, next_pos
        self.lean.append_context(fused, positions, cache)
        return embeds

    def _first_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, H]
        """A block has no logits before its pass: the state keeps row 0's embedding."""
        return hidden

    def _block_outputs(self, state) -> torch.Tensor:  # [B, Bk, H] final-normed outputs
        size = self.head.config.block_size
        batch = state.hidden.shape[0]
        rows = torch.cat(
            (state.hidden[:, None], self._mask_embedding(state.hidden).expand(batch, size - 1, -1)),
            dim=1,
        )  # [B, Bk, H]
        positions = state.next_pos[:, None] + torch.arange(size, device=state.next_pos.device)
        visible = None
        if state.has_holes:
            block = torch.ones(batch, size, size, dtype=torch.bool, device=rows.device)
            visible = torch.cat((state.valid[:, None].expand(batch, size, -1), block), dim=2)
        return self.lean.block(rows, positions, state.cache, visible)

    def _mask_embedding(self, like: torch.Tensor) -> torch.Tensor:  # [1, 1, H]
        if self._mask_row is None or self._mask_row.dtype != like.dtype:
            ids = torch.tensor([[self.head.config.mask_token_id]], device=like.device)
            self._mask_row = self._embed(ids).to(like.dtype)
        return self._mask_row

    def _in_order(
        self,
        normed: torch.Tensor,  # [B, N, H]
        base: torch.Tensor,  # [B, N, V_draft] logits without the Markov bias
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:  # ids, q, logits
        """Draw positions 1..N in order, each from its law given the draft before it; only the
        token-dependent half of the Markov bias runs per position."""
        markov = self.head.markov
        previous = self._require_pending()
        projected = markov.project(normed.to(markov.next.weight.dtype))  # [B, N, r]
        ids, probs, logits = [], [], []
        for j in range(base.shape[1]):
            bias = markov.bias(projected[:, j], previous)  # [B, V_draft]
            z = base[:, j] + bias.to(base.dtype)
            draft, q = select_tokens(z, sampling, generator)
            ids.append(draft)
            probs.append(q)
            logits.append(z)
            previous = self.lean.to_target_ids(draft)
        q_all = None if probs[0] is None else torch.stack(probs, dim=1)
        return torch.stack(ids, dim=1), q_all, torch.stack(logits, dim=1)

    def _verify_width(
        self, normed: torch.Tensor, logits: torch.Tensor
    ) -> int:  # the drafts to keep, >= 1
        """The module docstring's rule, over the rows of the batch (the widest row decides:
        a batch verifies one width)."""
        confidence = self.head.confidence
        chance = torch.sigmoid(
            confidence(normed.to(confidence.score.weight.dtype), logits).float()
        ).cumprod(dim=1)  # [B, N]
        reached = (chance >= self.confidence_threshold).sum(dim=1)
        return max(1, int(reached.max()))

    def _require_pending(self) -> torch.Tensor:
        if self._pending is None:
            raise RuntimeError("the drafter has no batch: call prefill() first")
        return self._pending


def load_runtime_drafter(path: str | Path | None, target: nn.Module) -> DFlashDrafter:
    """Registry entry (``draftsmith.decode.drafters.registry``): a DFlash folder as a runtime
    drafter."""
    if path is None:
        raise ValueError("the dflash drafter needs a folder: pass --drafter PATH")
    return DFlashDrafter.from_pretrained(path, target)
