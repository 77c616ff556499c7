"""Keys and values of a decoder's layers in buffers with spare capacity.

With ``transformers`` 5.x, ``DynamicCache.crop`` takes a negative count of tokens to drop, and
the forward argument is ``cache`` (``past_key_values`` is deprecated). Its ``DynamicLayer``
concatenates every step's keys onto the whole cache, a copy that grows with the sequence; the
layers here are ``PreallocatedLayer``s instead, which write into spare capacity (doubling when
full) and hand attention a view, so a step copies only its own keys. ``PreallocatedStack``
moves the slots of several layers at once (a drafter's own cache); the rows and holes of a
batch are ``draftsmith.decode.forward.cached_sequence``'s. Buffers keep spare rows too, so that
a request joining a running batch is written after its rows rather than the whole cache being
copied into a new buffer (continuous batching, ``merge_rows``).
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

    ``keys`` / ``values`` are views of the first ``rows`` rows and ``length`` slots of a buffer
    ([B, heads, S, d] of [B', heads, C, d]); ``update`` writes the new slots in place and
    ``crop`` only moves the end, so a decoding step costs a copy of its own keys rather than of
    the whole cache. Capacity doubles when exhausted, in slots and in rows.
    ``storage_dtype`` (default: the first keys' dtype) is the dtype the slots are kept in; a
    drafter keeps float32 slots on CPU (``llama_math.draft_cache_dtype``).
    """

    def __init__(self, storage_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.storage_dtype = storage_dtype

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.length = 0
        self.rows = key_states.shape[0]
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
        start, width, rows = self.length, key_states.shape[2], self.rows
        if start + width > self._key_buffer.shape[2]:
            self._key_buffer = _grown(self._key_buffer, rows, start, start + width)
            self._value_buffer = _grown(self._value_buffer, rows, start, start + width)
        self._key_buffer[:rows, :, start : start + width] = key_states
        self._value_buffer[:rows, :, start : start + width] = value_states
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
        self._key_buffer[: self.rows, :, start : start + width] = kept_keys
        self._value_buffer[: self.rows, :, start : start + width] = kept_values
        self._set_length(start + width)

    def select_slots(
        self,
        rows: torch.Tensor,  # [R] batch rows to keep
        index: torch.Tensor,  # [R, L] slots of each kept row, in their new order
    ) -> None:
        """Keep ``rows`` only, each with the listed slots (row selection plus compaction),
        written back to the front of the same buffers: their spare rows and slots stay for the
        requests that join next. Spare capacity stays unwritten, as everywhere here: a slot is
        written before any view holds it (zeroing it cost more than the gather at 16 rows)."""
        if not self.is_initialized:
            return
        keys = _gather_slots(self.keys, index, rows)  # [R, KV, L, D], a copy
        values = _gather_slots(self.values, index, rows)
        kept, slots = keys.shape[0], keys.shape[2]
        self._key_buffer[:kept, :, :slots] = keys
        self._value_buffer[:kept, :, :slots] = values
        self.rows = kept
        self._set_length(slots)

    def move_rows(
        self,
        destinations: torch.Tensor,  # [M] rows to overwrite
        sources: torch.Tensor,  # [M] the rows whose slots they take (read before any write)
        rows: int,  # rows held afterwards
    ) -> None:
        """Copy whole rows within the buffers, then hold the first ``rows`` (a selection of rows
        that keeps every slot: ``PreallocatedStack.select_rows``).

        Rows moving up to rows not read later (``sources`` increasing, each above its
        destination: rows leaving a batch) are copied one by one in place, each a few
        contiguous blocks; any other order reads the sources into a copy first. Indexed
        assignment of the rows took 3.7 ms a layer at 16 rows of the demo target (AVX2 EPYC,
        float32), most of a retirement's time."""
        if not self.is_initialized:
            return
        length = self.length
        pairs = list(zip(destinations.tolist(), sources.tolist(), strict=True))
        ordered = sources.tolist() == sorted(set(sources.tolist()))
        in_place = ordered and all(destination < source for destination, source in pairs)
        for buffer in (self._key_buffer, self._value_buffer):
            if in_place:
                for destination, source in pairs:
                    buffer[destination, :, :length].copy_(buffer[source, :, :length])
            elif pairs:
                moved = buffer[:, :, :length].index_select(0, sources)  # [M, heads, S, d]
                buffer[:, :, :length].index_copy_(0, destinations, moved)
        self.rows = rows
        self._set_length(length)

    def merge_rows(self, other: PreallocatedLayer, slots: int) -> None:
        """Append ``other``'s rows, both right-aligned in ``slots`` slots (zeros in front).

        When this layer already holds ``slots`` slots and has spare rows for ``other``'s (the
        usual join: a short new prompt beside longer running rows), only ``other``'s rows are
        written; otherwise both are copied into a new buffer with as many rows again to spare.
        """
        if not (self.is_initialized and other.is_initialized):
            raise ValueError("only cache layers that hold slots (after a prefill) can be merged")
        rows = self.rows + other.rows
        if slots == self.length and rows <= self._key_buffer.shape[0]:
            for buffer, states in (
                (self._key_buffer, other.keys),
                (self._value_buffer, other.values),
            ):
                _write_right_aligned(buffer[self.rows : rows], states, slots)
        else:
            self._key_buffer = _stacked_rows(self.keys, other.keys, slots)
            self._value_buffer = _stacked_rows(self.values, other.values, slots)
        self.rows = rows
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
        self.keys = self._key_buffer[: self.rows, :, :length]
        self.values = self._value_buffer[: self.rows, :, :length]


# ``PreallocatedStack.select_rows`` drops holes when they exceed this share of the slots.
COMPACT_ABOVE = 0.25


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

    def select_rows(
        self,
        rows: torch.Tensor,  # [R] batch rows to keep, in their new order
        valid: torch.Tensor,  # [R, S] bool: the kept rows' valid slots
    ) -> torch.Tensor | None:  # [R, L] the slot order kept when compacted; None: slots kept
        """Keep ``rows``; drop the holes too when they are worth a copy of every row.

        The holes that can go are the slots before the longest kept row's valid ones (rows stay
        right-aligned). Where they are more than ``COMPACT_ABOVE`` of the slots, every kept
        row's valid slots are gathered, in order, into the last ``L`` (``select_slots``);
        otherwise only the rows whose place changes are copied, whole, and holes stay masked
        (a request leaving a running batch usually leaves few: the attention reads them, a
        gather of every row costs more).

        Timed in a session of 16 rows that retire at 128 tokens and are replaced one by one
        (the load test's prompts, the demo target and its head, float32, AVX2-only AMD EPYC,
        medians of one run each): a retirement took 48-65 ms when every row was gathered into a
        new buffer and 18-21 ms now; a join 67-78 ms, now 40-47 ms (its prefill ~29 ms of it:
        ``merge_rows`` writes into spare rows).
        """
        kept, slots = valid.shape
        live = int(valid.sum(1).max()) if kept else 0
        if slots - live > COMPACT_ABOVE * slots:
            order = torch.sort(valid.long(), dim=1, stable=True).indices[:, slots - live :]
            self.select_slots(rows, order)
            return order
        moved = torch.nonzero(rows != torch.arange(kept, device=rows.device)).flatten()  # [M]
        for layer in self.layers:
            layer.move_rows(moved, rows[moved], kept)
        return None


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
    """A new buffer holding both parts' rows, zeros in front of the shorter's slots, and spare
    capacity after them (as many rows and slots again), each part copied once. Padding,
    concatenating and then copying into a zeroed buffer moved the cache five times over: at
    16 rows of the demo target in float32 on the AVX2 EPYC a request joining a batch took
    150-170 ms, four rounds' time."""
    rows = first.shape[0]
    shape = (rows + second.shape[0], *first.shape[1:])
    buffer = first.new_empty(_buffer_shape(shape, slots, spare_rows=True))
    _write_right_aligned(buffer[:rows], first, slots)
    _write_right_aligned(buffer[rows : shape[0]], second, slots)
    return buffer


def _write_right_aligned(
    rows: torch.Tensor,  # [R, heads, C, d] buffer rows, C >= slots
    states: torch.Tensor,  # [R, heads, S, d], S <= slots
    slots: int,
) -> None:
    """``states`` in the last of the first ``slots`` slots of ``rows``, zeros in front (finite:
    masked slots must not hold NaN, which a zero attention weight would still spread)."""
    hole = slots - states.shape[2]
    rows[:, :, :hole] = 0
    rows[:, :, hole:slots] = states


def _buffer_shape(shape: tuple[int, ...], needed: int, spare_rows: bool = False) -> tuple[int, ...]:
    """A buffer for ``shape`` ([B, heads, S, d]) with room for ``needed`` slots and as many
    again (at least 256), and with ``spare_rows`` as many rows again."""
    batch, heads, _, dim = shape
    return (2 * batch if spare_rows else batch, heads, max(256, 2 * needed), dim)


def _grown(
    buffer: torch.Tensor,  # [B', heads, C, d]
    rows: int,
    used: int,
    needed: int,
) -> torch.Tensor:  # [B', heads, C', d] with C' >= needed; the first rows' ``used`` slots copied
    grown = buffer.new_empty(_buffer_shape(buffer.shape, needed))
    grown[:rows, :, :used] = buffer[:rows, :, :used]
    return grown
