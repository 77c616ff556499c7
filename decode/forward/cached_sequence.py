"""Incremental forward passes of a causal LM over a batch whose rows advance by different amounts.

Speculative rounds accept a different number of tokens in each row. Rather than moving cache
memory per row, rejected slots stay in the cache as *holes*: the attention mask marks them
invalid and positions are counted over valid slots only, so each row sees exactly its own
committed sequence. Slots past the longest kept row are cropped off for real, so the cache
never grows by more than what some row accepted. The keys and values live in
``draftsmith.decode.forward.kv_cache``'s preallocated layers; which attention each layer runs, and the masks of
sliding windows, come from ``draftsmith.decode.forward.attention_layout``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from draftsmith.decode.forward.attention_layout import AttentionLayout, learned_position_limit
from draftsmith.decode.forward.kv_cache import PreallocatedStack, preallocated_cache
from draftsmith.decode.forward.output_head import OutputHead
from transformers.modeling_outputs import CausalLMOutputWithPast


class CachedSequence:
    """Incremental forward passes of one model over a batch, with a rollback."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch_size: int,
        device: torch.device,
        head: OutputHead | None = None,
        decoder: Callable[..., Any] | None = None,
    ) -> None:
        """``head`` (``OutputHead.for_model(model)``) projects the decoder's last hidden states
        to logits; ``None`` runs the whole model. ``decoder`` replaces ``model.get_decoder()``
        on that path (a ``LeanDecoder``); it gets boolean masks, the model's own forward gets
        them in the form its attention implementation reads."""
        self.model = model
        self.head = head
        self.decoder = decoder
        self.layout = AttentionLayout.for_model(model)
        # A learned position table's size (GPT-2, OPT): rows that finished, or drafts past a
        # row's own limit, may run past it while other rows decode; their outputs are never
        # emitted, so their positions are clamped to the table's last row.
        self.position_limit = learned_position_limit(model)
        self.cache = preallocated_cache(model)
        self._layers = PreallocatedStack(self.cache.layers)  # the same layer objects
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # [B, S]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]
        # [B, S] each slot's token position, kept only when some layer has a window.
        self.slot_positions = (
            torch.zeros(batch_size, 0, dtype=torch.long, device=device)
            if self.layout.sliding
            else None
        )

    @property
    def num_slots(self) -> int:
        """Cache slots held, holes included."""
        return self.valid.shape[1]

    def extend(
        self,
        tokens: torch.Tensor,  # [B, W]
        valid: torch.Tensor | None = None,  # [B, W] bool; None means all valid
        *,
        tree_mask: torch.Tensor | None = None,  # [W, W] or [B, W, W] bool: i sees j
        positions: torch.Tensor | None = None,  # [B, W] explicit positions (trees)
        logits_to_keep: int = 0,
        output_hidden_states: bool = False,
    ) -> CausalLMOutputWithPast:
        """Run the model on ``tokens`` appended after the cache and keep their keys/values."""
        batch, width = tokens.shape
        if valid is None:
            valid = torch.ones(batch, width, dtype=torch.bool, device=tokens.device)
        if positions is None:
            positions = self.lengths[:, None] + valid.long().cumsum(-1) - 1
            positions = positions.clamp(min=0)
        if self.position_limit is not None:
            positions = positions.clamp(max=self.position_limit - 1)
        full_valid = torch.cat([self.valid, valid], dim=1)  # [B, S + W]
        slot_positions = None
        if self.slot_positions is not None:
            slot_positions = torch.cat([self.slot_positions, positions], dim=1)  # [B, S + W]
            attention_mask = self.layout.masks(
                _four_d_mask(self.valid, valid, tree_mask), slot_positions, positions
            )
        elif tree_mask is None:
            attention_mask = full_valid.long()
        else:
            attention_mask = _four_d_mask(self.valid, valid, tree_mask)
        if self.decoder is None:  # the model's own forward reads masks in its own format
            attention_mask = _for_attention_implementation(attention_mask, self.model)
        inputs = {
            "input_ids": tokens,
            "attention_mask": attention_mask,
            "position_ids": positions,
            "cache": self.cache,
            "use_cache": True,
            "output_hidden_states": output_hidden_states,
        }
        if self.head is None:
            output = self.model(**inputs, logits_to_keep=logits_to_keep)
        else:
            decoder = self.decoder or self.model.get_decoder()
            decoded = decoder(**inputs)
            last = decoded.last_hidden_state  # [B, W, H]
            output = CausalLMOutputWithPast(
                logits=self.head(last[:, -logits_to_keep:] if logits_to_keep else last),
                hidden_states=decoded.hidden_states,
            )
        self.valid = full_valid
        self.slot_positions = slot_positions
        self.lengths = self.lengths + valid.sum(-1)
        return output

    def rollback(
        self,
        num_recent: int,
        keep: torch.Tensor,  # [B] how many of the last num_recent slots each row keeps
    ) -> None:
        """Keep, per row, only the first ``keep[b]`` of the last ``num_recent`` slots.

        The recent slots must all have been valid. Dropped slots become holes; slots past the
        largest ``keep`` are removed from the cache.
        """
        if num_recent == 0:
            return
        start = self.num_slots - num_recent
        max_keep = int(keep.max())
        drop = num_recent - max_keep
        if drop > 0:
            self.cache.crop(-drop)
        recent = torch.arange(max_keep, device=keep.device)[None, :] < keep[:, None]  # [B, k]
        self.valid = torch.cat([self.valid[:, :start], recent], dim=1)
        if self.slot_positions is not None:
            self.slot_positions = self.slot_positions[:, : start + max_keep]
        self.lengths = self.lengths - (num_recent - keep)

    def keep_path(
        self,
        num_recent: int,
        path: torch.Tensor,  # [B, P] slot offsets (within the recent block) to keep, in order
        path_valid: torch.Tensor,  # [B, P] bool
    ) -> None:
        """Keep, per row, the recent slots listed in ``path`` (a tree's accepted branch).

        The kept slots are moved to the front of the recent block in path order; the rest of
        the block is removed. Used after tree verification, where the accepted nodes are not a
        prefix of the flattened tree.
        """
        start = self.num_slots - num_recent
        index = (start + path.clamp(min=0)).to(torch.long)  # [B, P]
        self._layers.keep_slots(start, index)
        self.valid = torch.cat([self.valid[:, :start], path_valid], dim=1)
        if self.slot_positions is not None:
            kept = self.slot_positions.gather(1, index)  # [B, P]
            self.slot_positions = torch.cat([self.slot_positions[:, :start], kept], dim=1)
        self.lengths = self.lengths - num_recent + path_valid.sum(-1)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the batch, in that order); drop the holes when
        they are many (``PreallocatedStack.select_rows``).

        Dropping them moves each kept row's valid slots, in order, to the end of ``L`` slots,
        ``L`` the longest kept row's length (padding in front of shorter rows): holes left by
        rejected drafts, by rows merged in at different lengths or by rows that left are gone.
        Keys carry their rotary angles already, so moving a slot changes nothing it computes.
        """
        rows = rows.to(self.valid.device, torch.long)
        valid = self.valid[rows]  # [R, S]
        order = self._layers.select_rows(rows, valid)  # [R, L] or None: every slot kept
        self.valid = valid if order is None else valid.gather(1, order)
        if self.slot_positions is not None:
            positions = self.slot_positions[rows]
            self.slot_positions = positions if order is None else positions.gather(1, order)
        self.lengths = self.lengths[rows]

    def merge(self, other: CachedSequence) -> None:
        """Append ``other``'s rows (the same model, e.g. a prefill of new prompts) to this batch.

        The shorter cache gets holes in front of its slots so both have as many; every row
        keeps its own slots, positions and length.
        """
        if other.model is not self.model:
            raise ValueError("only caches of the same model can be merged")
        slots = max(self.num_slots, other.num_slots)
        self._layers.merge_rows(other._layers, slots)
        self.valid = torch.cat([pad_front(self.valid, slots), pad_front(other.valid, slots)])
        if self.slot_positions is not None and other.slot_positions is not None:
            self.slot_positions = torch.cat(
                [pad_front(self.slot_positions, slots), pad_front(other.slot_positions, slots)]
            )
        self.lengths = torch.cat([self.lengths, other.lengths])


def pad_front(values: torch.Tensor, width: int) -> torch.Tensor:  # [B, S] -> [B, width]
    """Zeros (False for masks: holes) in front of ``values`` up to ``width`` columns; how rows
    of different lengths are merged (kept slots stay last, where each row's next ones go)."""
    return torch.nn.functional.pad(values, (width - values.shape[1], 0))


def _four_d_mask(
    cached_valid: torch.Tensor,  # [B, S]
    new_valid: torch.Tensor,  # [B, W]
    tree_mask: torch.Tensor | None,  # [W, W] or [B, W, W] bool; None: causal
) -> torch.Tensor:  # [B, 1, W, S + W] bool, True where attention is allowed
    batch, width = new_valid.shape
    if tree_mask is None:
        tree_mask = torch.ones(width, width, dtype=torch.bool, device=new_valid.device).tril()
    past = cached_valid[:, None, None, :].expand(batch, 1, width, cached_valid.shape[1])
    tree_mask = tree_mask.expand(batch, width, width)[:, None]
    new = tree_mask & new_valid[:, None, None, :]
    return torch.cat([past, new], dim=-1)


def _for_attention_implementation(
    mask: torch.Tensor | dict[str, torch.Tensor],  # [B, S + W] 0/1, or [B, 1, W, S + W] bool
    model: torch.nn.Module,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """A 4-D boolean mask as the model's attention reads it: ``sdpa`` takes booleans, ``eager``
    adds the mask to its scores (0 where allowed, the dtype's minimum elsewhere)."""
    if isinstance(mask, dict):
        return {kind: _for_attention_implementation(m, model) for kind, m in mask.items()}
    if mask.dim() != 4:
        return mask
    implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if implementation == "sdpa":
        return mask
    if implementation == "eager":
        dtype = next(model.parameters()).dtype
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return additive.masked_fill_(~mask, torch.finfo(dtype).min)
    raise ValueError(
        f"attn_implementation={implementation!r} cannot take the 4-D attention masks that "
        "trees and sliding windows need here: load the model with attn_implementation='sdpa'"
    )
