"""Keys and values of a decoder's layers in buffers with spare capacity.

With ``transformers`` 5.x, ``DynamicCache.crop`` takes a negative count of tokens to drop, and
the forward argument is ``cache`` (``past_key_values`` is deprecated). Its ``DynamicLayer``
concatenates every step's keys onto the whole cache, a copy that grows with the sequence; the
layers here are ``PreallocatedLayer``s instead, which write into spare capacity (doubling when
full) and hand attention a view, so a step copies only its own keys. ``PreallocatedStack``
moves the slots of several layers at once (a drafter's own cache); the rows and holes of a
batch are ``draftsmith.decode.forward.cached_sequence``'s.
"""

from __future__ import annotations

import torch
from draftsmith.decode.forward.attention_layout import AttentionLayout
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


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
        self._key_buffer = key_states.new_empty(
            _buffer_shape(key_states.shape, needed), dtype=dtype
        )
        self._value_buffer = value_states.new_empty(
            _buffer_shape(value_states.shape, needed), dtype=dtype
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
        keys = _gather_slots(self.keys, index, rows)  # [R, KV, L, D]
        values = _gather_slots(self.values, index, rows)
        # Spare capacity stays unwritten, as everywhere here: a slot is written before any
        # view holds it (zeroing it cost more than the gather at 16 rows).
        self._key_buffer = keys.new_empty(_buffer_shape(keys.shape, keys.shape[2]))
        self._value_buffer = values.new_empty(_buffer_shape(values.shape, values.shape[2]))
        self._key_buffer[:, :, : keys.shape[2]] = keys
        self._value_buffer[:, :, : values.shape[2]] = values
        self._set_length(keys.shape[2])

    def merge_rows(self, other: PreallocatedLayer, slots: int) -> None:
        """Append ``other``'s rows, both right-aligned in ``slots`` slots (zeros in front)."""
        if not (self.is_initialized and other.is_initialized):
            raise ValueError("only cache layers that hold slots (after a prefill) can be merged")
        self._key_buffer = _stacked_rows(self.keys, other.keys, slots)
        self._value_buffer = _stacked_rows(self.values, other.values, slots)
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


def _gather_slots(
    tensor: torch.Tensor,  # [B, heads, S, d]
    index: torch.Tensor,  # [R, P] slot indices
    rows: torch.Tensor | None = None,  # [R] the batch row each index row reads (None: 0 .. R-1)
) -> torch.Tensor:  # [R, heads, P, d]
    """Each listed row's listed slots, in one indexing pass: a slot's [heads, d] block moves
    whole, where ``gather`` with an index expanded over heads and d reads an index per number
    (and selecting the rows first copied the cache once more): 3.4 against 7.6 ms for 15 of 16
    rows x 8 heads x 300 slots x 64 in float32 on the AVX2 EPYC."""
    if rows is None and index.shape[0] == 1:  # one row: a plain index_select
        return tensor.index_select(2, index[0])
    if rows is None:
        rows = torch.arange(index.shape[0], device=index.device)
    by_slot = tensor.permute(0, 2, 1, 3)  # [B, S, heads, d], a view
    return by_slot[rows[:, None], index].permute(0, 2, 1, 3)


def _stacked_rows(
    first: torch.Tensor,  # [B, heads, S, d]
    second: torch.Tensor,  # [B', heads, S', d]
    slots: int,  # >= S, S'
) -> torch.Tensor:  # [B + B', heads, C, d], C >= slots: each part right-aligned in ``slots``
    """A new buffer holding both parts' rows, zeros in front of the shorter's slots (finite:
    masked slots must not hold NaN, which a zero attention weight would still spread) and
    spare capacity after them, each part copied once. Padding, concatenating and then copying
    into a zeroed buffer moved the cache five times over: at 16 rows of the demo target in
    float32 on the AVX2 EPYC a request joining a batch took 150-170 ms, four rounds' time."""
    rows = first.shape[0]
    shape = (rows + second.shape[0], *first.shape[1:])
    buffer = first.new_empty(_buffer_shape(shape, slots))
    for part, states in ((slice(0, rows), first), (slice(rows, None), second)):
        hole = slots - states.shape[2]
        buffer[part, :, :hole] = 0
        buffer[part, :, hole:slots] = states
    return buffer


def _buffer_shape(shape: tuple[int, ...], needed: int) -> tuple[int, ...]:
    """A buffer for ``shape`` ([B, heads, S, d]) with room for ``needed`` slots and as many
    again (at least 256)."""
    batch, heads, _, dim = shape
    return (batch, heads, max(256, 2 * needed), dim)


def _grown(
    buffer: torch.Tensor,  # [B, heads, C, d]
    used: int,
    needed: int,
) -> torch.Tensor:  # [B, heads, C', d] with C' >= needed; the first ``used`` slots copied
    grown = buffer.new_empty(_buffer_shape(buffer.shape, needed))
    grown[:, :, :used] = buffer[:, :, :used]
    return grown
