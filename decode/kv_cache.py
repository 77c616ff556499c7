"""A causal LM's KV cache over a batch whose rows advance by different amounts.

Speculative rounds accept a different number of tokens in each row. Rather than moving cache
memory per row, rejected slots stay in the cache as *holes*: the attention mask marks them
invalid and positions are counted over valid slots only, so each row sees exactly its own
committed sequence. Slots past the longest kept row are cropped off for real, so the cache
never grows by more than what some row accepted.

Sliding-window layers (Mistral, Qwen2/Qwen3 with ``use_sliding_window``, Gemma2/Gemma3's local
layers) are windowed by *token position*, not by cache slot: a query at position ``p`` sees the
valid keys at positions ``p - W < p' <= p``, the window Hugging Face applies to a sequence
without holes. Counting slots instead would let a row's holes eat its window. Every layer keeps
all its slots (nothing is truncated, so a rollback works at any length) and the model gets one
4-D mask per layer kind built from positions (``AttentionLayout``); full-attention models keep
the plain 2-D mask and pay nothing for this.

With ``transformers`` 5.x, ``DynamicCache.crop`` takes a negative count of tokens to drop, and
the forward argument is ``cache`` (``past_key_values`` is deprecated). Its ``DynamicLayer``
concatenates every step's keys onto the whole cache, a copy that grows with the sequence; the
layers here are ``PreallocatedLayer``s instead, which write into spare capacity (doubling when
full) and hand attention a view, so a step copies only its own keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs
from transformers.modeling_outputs import CausalLMOutputWithPast

from decode.output_head import OutputHead

# Hugging Face's names of the two attention kinds this cache serves (``config.layer_types``).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def tree_verification_problem(model: torch.nn.Module) -> str | None:
    """Why ``model``'s forward cannot score a draft tree exactly, or ``None`` if it can.

    A tree's nodes sit side by side in the cache but at their depths' positions, so the
    forward must take explicit positions and a tree-shaped 4-D mask. ALiBi models derive their
    position biases otherwise: BLOOM and Falcon with ``alibi`` from a 2-D padding mask (their
    forward refuses a 4-D one), MPT from the slot order (``single_row_problem``). Chains are
    exact on all of them."""
    if _alibi(model) is None:
        return None
    return (
        f"{type(model).__name__} places tokens with ALiBi biases, which follow cache slots or "
        "a 2-D padding mask, not a draft tree's node depths: draft chains on it (drop the "
        "tree settings)"
    )


def single_row_problem(model: torch.nn.Module) -> str | None:
    """Why ``model`` must decode one row at a time, or ``None``.

    MPT's ALiBi biases a key by its cache slot, whatever the attention mask says. The rows of
    a batch accept different numbers of drafts, so rejected slots stay behind as masked holes
    (and rows that join a running batch bring their own front padding); a hole shifts every
    later key's bias, where Hugging Face's own forward, which never leaves one, does not.
    (BLOOM and Falcon count positions from the 2-D mask, holes excluded: exact.)"""
    if _alibi(model) != "slots":
        return None
    return (
        f"{type(model).__name__} biases attention by cache slot (ALiBi over slot order), which "
        "the holes a batch leaves behind would shift: decode one row at a time (batch size 1)"
    )


def learned_position_limit(model: torch.nn.Module) -> int | None:
    """The positions a model with a learned table of absolute positions can embed (GPT-2's
    ``n_positions``, OPT's and GPT-BigCode's ``max_position_embeddings``), or ``None`` for
    relative schemes (rope, ALiBi), which have no hard end. Past the table its forward fails
    with an index error deep inside torch, as Hugging Face's ``generate`` does."""
    config = model.config.get_text_config(decoder=True)
    size = getattr(config, "max_position_embeddings", None)
    if isinstance(size, bool) or not isinstance(size, int):
        return None
    tokens = model.get_input_embeddings()
    # OPT's table holds two offset rows in front of its max_position_embeddings.
    tables = (
        module
        for module in model.modules()
        if isinstance(module, torch.nn.Embedding) and module is not tokens
    )
    return size if any(table.num_embeddings in (size, size + 2) for table in tables) else None


def _alibi(model: torch.nn.Module) -> str | None:
    """How the model's ALiBi biases count positions: "mask" (BLOOM, Falcon with ``alibi``),
    "slots" (MPT), or ``None`` for a model without ALiBi."""
    config = model.config.get_text_config(decoder=True)
    if getattr(getattr(config, "attn_config", None), "alibi", False) is True:
        return "slots"
    if config.model_type == "bloom" or getattr(config, "alibi", False) is True:
        return "mask"
    return None


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
        """Keep only ``rows`` (indices into the batch, in that order) and drop every hole.

        Each kept row's valid slots move, in order, to the end of ``L`` slots, ``L`` the longest
        kept row's length (padding in front of shorter rows): rows that leave free their slots,
        and holes left by rejected drafts or by rows merged in at different lengths are gone.
        Keys carry their rotary angles already, so moving a slot changes nothing it computes.
        """
        rows = rows.to(self.valid.device, torch.long)
        valid = self.valid[rows]  # [R, S]
        live = int(valid.sum(1).max()) if rows.numel() else 0
        order = torch.sort(valid.long(), dim=1, stable=True).indices[:, valid.shape[1] - live :]
        self._layers.select_slots(rows, order)
        self.valid = valid.gather(1, order)  # [R, L]
        if self.slot_positions is not None:
            self.slot_positions = self.slot_positions[rows].gather(1, order)
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


@dataclass(frozen=True)
class AttentionLayout:
    """Which attention each decoder layer runs, as the model's config defines it.

    ``layer_types[i]`` is layer ``i``'s kind (``"full_attention"`` or ``"sliding_attention"``,
    Hugging Face's names, inferred from ``sliding_window`` for configs without
    ``layer_types``) and ``windows[kind]`` its window ``W`` (None: full causal attention).
    """

    layer_types: tuple[str, ...]
    windows: dict[str, int | None]

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> AttentionLayout:
        """Read the layout the model's ``DynamicCache`` would be built from; raise
        ``ValueError`` for layer kinds this cache cannot serve exactly."""
        config = model.config.get_text_config(decoder=True)
        kinds, per_layer = get_layer_types_and_kwargs(config)
        windows: dict[str, int | None] = {}
        for kind, kwargs in zip(kinds, per_layer, strict=True):
            if kind not in (FULL_ATTENTION, SLIDING_ATTENTION):
                raise ValueError(
                    f"{type(model).__name__} has {kind!r} layers; the speculative decoder's cache "
                    "serves full and sliding-window attention only"
                )
            window = kwargs.get("sliding_window") if kind == SLIDING_ATTENTION else None
            if windows.setdefault(kind, window) != window:
                raise ValueError(
                    f"{type(model).__name__} has {kind!r} layers with different windows "
                    f"({windows[kind]} and {window}); one window per layer kind is supported"
                )
        return cls(tuple(kinds), windows)

    @property
    def sliding(self) -> bool:
        """Whether some layer attends through a window."""
        return any(window is not None for window in self.windows.values())

    def masks(
        self,
        allowed: torch.Tensor,  # [B, 1, W, S + W] bool: causal (or tree) and valid
        key_positions: torch.Tensor,  # [B, S + W] every slot's token position
        query_positions: torch.Tensor,  # [B, W]
    ) -> torch.Tensor | dict[str, torch.Tensor]:  # [B, 1, W, S + W] bool, or one per kind
        """The boolean mask of each layer kind; a bare tensor when all layers share a kind.

        A window keeps the keys with ``query_position - key_position < W``. Every query also
        sees its own slot, so a padding or hole query never attends to nothing (a fully
        masked row gives NaN, which a zero attention weight later would still spread).
        Hugging Face's models take either form: a 4-D tensor is used as given, and the models
        with mixed layer kinds accept a dict keyed by kind.
        """
        width, total = allowed.shape[-2], allowed.shape[-1]
        own_slot = torch.eye(width, dtype=torch.bool, device=allowed.device)  # [W, W]
        own_slot = torch.nn.functional.pad(own_slot, (total - width, 0))  # [W, S + W]
        allowed = allowed | own_slot
        distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]
        masks = {
            kind: allowed if window is None else allowed & ((distance < window) | own_slot)
            for kind, window in self.windows.items()
        }
        return next(iter(masks.values())) if len(masks) == 1 else masks


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


def _gather_slots(
    tensor: torch.Tensor,  # [B, heads, S, d]
    index: torch.Tensor,  # [B, P] slot indices
) -> torch.Tensor:  # [B, heads, P, d]
    if index.shape[0] == 1:  # one row: a plain index_select, half the cost of gather on CPU
        return tensor.index_select(2, index[0])
    return tensor.gather(
        2, index[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
    )


def preallocated_cache(model: torch.nn.Module) -> DynamicCache:
    """A ``DynamicCache`` for ``model`` whose every layer is a ``PreallocatedLayer``.

    Sliding-window layers too: they keep every slot (the window is applied by the masks of
    ``AttentionLayout``), where Hugging Face's ``DynamicSlidingWindowLayer`` would drop old
    slots and could not be cropped back once full. Raises ``ValueError`` for layer kinds other
    than full and sliding-window attention.
    """
    layout = AttentionLayout.for_model(model)
    cache = DynamicCache(config=model.config)
    cache.layers = [PreallocatedLayer() for _ in layout.layer_types]
    return cache


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in a buffer with spare capacity along the sequence.

    ``keys`` / ``values`` are views of the first ``length`` slots ([B, heads, S, d]); ``update``
    writes the new slots in place and ``crop`` only moves the end, so a decoding step costs a
    copy of its own keys rather than of the whole cache. Capacity doubles when exhausted.
    ``storage_dtype`` (default: the first keys' dtype) is the dtype the slots are kept in; a
    drafter keeps float32 slots on CPU (``llama_math.draft_cache_dtype``).
    """

    def __init__(self, storage_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.storage_dtype = storage_dtype

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.length = 0
        needed = key_states.shape[2]  # the first update (a prefill) sizes the buffer
        dtype = self.storage_dtype or key_states.dtype
        self._key_buffer = key_states.new_empty(_buffer_shape(key_states, needed), dtype=dtype)
        self._value_buffer = value_states.new_empty(
            _buffer_shape(value_states, needed), dtype=dtype
        )
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, width = self.length, key_states.shape[2]
        if start + width > self._key_buffer.shape[2]:
            self._key_buffer = _grown(self._key_buffer, start, start + width)
            self._value_buffer = _grown(self._value_buffer, start, start + width)
        self._key_buffer[:, :, start : start + width] = key_states
        self._value_buffer[:, :, start : start + width] = value_states
        self._set_length(start + width)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop takes a negative count of tokens to remove, got {tokens_to_remove}"
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._set_length(max(0, self.length + tokens_to_remove))

    def keep_slots(
        self,
        start: int,
        index: torch.Tensor,  # [B, P] slots (>= start) to move to start .. start + P, in order
    ) -> None:
        """Replace the slots from ``start`` on by the listed ones (a tree's accepted branch)."""
        width = index.shape[1]
        kept_keys = _gather_slots(self.keys, index)
        kept_values = _gather_slots(self.values, index)
        self._key_buffer[:, :, start : start + width] = kept_keys
        self._value_buffer[:, :, start : start + width] = kept_values
        self._set_length(start + width)

    def select_slots(
        self,
        rows: torch.Tensor,  # [R] batch rows to keep
        index: torch.Tensor,  # [R, L] slots of each kept row, in their new order
    ) -> None:
        """Keep ``rows`` only, each with the listed slots (row selection plus compaction)."""
        if not self.is_initialized:
            return
        keys = _gather_slots(self.keys[rows], index)  # [R, KV, L, D]
        values = _gather_slots(self.values[rows], index)
        self._key_buffer = keys.new_zeros(_buffer_shape(keys, keys.shape[2]))
        self._value_buffer = values.new_zeros(_buffer_shape(values, values.shape[2]))
        self._key_buffer[:, :, : keys.shape[2]] = keys
        self._value_buffer[:, :, : values.shape[2]] = values
        self._set_length(keys.shape[2])

    def merge_rows(self, other: PreallocatedLayer, slots: int) -> None:
        """Append ``other``'s rows, both right-aligned in ``slots`` slots (zeros in front)."""
        if not (self.is_initialized and other.is_initialized):
            raise ValueError("only cache layers that hold slots (after a prefill) can be merged")
        parts_k = [_left_pad_slots(self.keys, slots), _left_pad_slots(other.keys, slots)]
        parts_v = [_left_pad_slots(self.values, slots), _left_pad_slots(other.values, slots)]
        keys, values = torch.cat(parts_k), torch.cat(parts_v)  # [B + B', KV, slots, D]
        self._key_buffer = keys.new_zeros(_buffer_shape(keys, slots))
        self._value_buffer = values.new_zeros(_buffer_shape(values, slots))
        self._key_buffer[:, :, :slots] = keys
        self._value_buffer[:, :, :slots] = values
        self._set_length(slots)

    def reset(self) -> None:
        self.length = 0
        super().reset()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("PreallocatedLayer serves the speculative decoder only")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("PreallocatedLayer serves the speculative decoder only")

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys = self._key_buffer[:, :, :length]
        self.values = self._value_buffer[:, :, :length]


class PreallocatedStack:
    """A model's ``PreallocatedLayer``s, cropped, reordered and merged together: every layer
    holds the same slots (a multi-layer drafter's cache, or the layers of a target's
    ``DynamicCache`` that ``CachedSequence`` moves)."""

    def __init__(
        self, layers: int | list[PreallocatedLayer], storage_dtype: torch.dtype | None = None
    ) -> None:
        """``layers``: a count of new, empty layers (keeping slots in ``storage_dtype``, default
        the keys' own), or existing layers (shared, not copied)."""
        self.layers = (
            [PreallocatedLayer(storage_dtype) for _ in range(layers)]
            if isinstance(layers, int)
            else layers
        )

    def get_seq_length(self) -> int:
        return self.layers[0].get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def keep_slots(self, start: int, index: torch.Tensor) -> None:  # index [B, P]
        for layer in self.layers:
            layer.keep_slots(start, index)

    def select_slots(self, rows: torch.Tensor, index: torch.Tensor) -> None:  # [R], [R, L]
        for layer in self.layers:
            layer.select_slots(rows, index)

    def merge_rows(self, other: PreallocatedStack, slots: int) -> None:
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.merge_rows(theirs, slots)


def _left_pad_slots(states: torch.Tensor, slots: int) -> torch.Tensor:
    """[B, heads, S, d] -> [B, heads, slots, d] with zeros in front (finite: masked slots must
    not hold NaN, which a zero attention weight would still spread)."""
    return torch.nn.functional.pad(states, (0, 0, slots - states.shape[2], 0))


def _buffer_shape(states: torch.Tensor, needed: int) -> tuple[int, ...]:
    batch, heads, _, dim = states.shape
    return (batch, heads, max(256, 2 * needed), dim)


def _grown(
    buffer: torch.Tensor,  # [B, heads, C, d]
    used: int,
    needed: int,
) -> torch.Tensor:  # [B, heads, C', d] with C' >= needed; the first ``used`` slots copied
    grown = buffer.new_empty(_buffer_shape(buffer, needed))
    grown[:, :, :used] = buffer[:, :, :used]
    return grown
