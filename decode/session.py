"""A decoding session: rows that decode together round by round, joining and leaving.

``SpeculativeDecoder.session`` opens one (``generate`` is one session); the server keeps one
per lane of requests that sample alike (decode/serving/scheduler.py). The session holds the
rows' state between rounds: the target's cache (``CachedSequence``), the drafter's, each
row's pending token, count, limit and whether it is still active; ``emit`` cuts each row's
new tokens at EOS and its ``max_new_tokens`` and hands them to the streamer as a
``RoundUpdate``. The round itself (draft, verify, roll back) is the decoder's
(``decode/engine.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import TYPE_CHECKING

import torch
from draftsmith.decode.draft_length import (
    FORGET_AFTER_ROUNDS,
    AdaptiveDraftLength,
    LoadAwareDraftLength,
    SessionDraftLength,
)
from draftsmith.decode.drafters.base import Drafter, TargetPass, TreeSpec
from draftsmith.decode.forward.attention_layout import single_row_problem
from draftsmith.decode.forward.cached_sequence import CachedSequence
from draftsmith.decode.sampling import SamplingConfig, select_tokens
from draftsmith.decode.stats import DecodeStats

if TYPE_CHECKING:
    from draftsmith.decode.engine import SpeculativeDecoder


@dataclass(frozen=True)
class RoundUpdate:
    """What one round (or one prefill) emitted, per row of the session's batch.

    ``tokens[b]`` are row ``b``'s new tokens (empty for a row that took no part: finished, or
    not among a prefill's new rows); ``accepted[b]`` the drafts row ``b`` accepted in this
    verification pass and ``drafted`` the drafts per row it verified (chain length or tree
    depth). A prefill emits each new row's first token with ``accepted = None``, ``drafted = 0``.
    """

    tokens: list[list[int]]
    accepted: list[int] | None
    drafted: int


# Called after every prefill and round; returning False stops ``generate`` early.
Streamer = Callable[[RoundUpdate], "bool | None"]


class DecodeSession:
    """Rows that decode together round by round, joining and leaving between rounds.

    Continuous batching: ``add_rows`` prefills new prompts as a batch of their own (the target
    and a ``spawn`` of the drafter) and merges them into the running caches
    (``CachedSequence.merge``, ``Drafter.merge``); ``step`` runs one round for every row;
    ``retire`` drops rows (``select_rows``), freeing their cache slots. Each row's tokens
    depend on its own prompt alone: greedy rows equal the target's greedy decoding whenever
    they joined. Rows share the sampling settings and the generator (sampled rows of a seeded
    request are reproducible only alone in their session). ``generate`` is one session.
    """

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        drafter: Drafter,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        eos: torch.Tensor,  # [E]
        pad: int,
        streamer: Streamer | None,
        record: bool,
        tree: TreeSpec | None,
        draft_length: AdaptiveDraftLength | LoadAwareDraftLength | None = None,
    ) -> None:
        device = decoder.device
        self.decoder = decoder
        self.tree = tree  # None: chain rounds
        self.drafter = drafter
        self.sampling = sampling
        self.generator = generator
        self.eos = eos
        self.pad = pad
        self.streamer = streamer
        self.stats = DecodeStats()
        # The chain-length policy (None: fixed N); a load-aware one keeps these rows' acceptance
        # and lets the drafter forget what it skipped while no width pays (its docstring).
        self.draft_length = draft_length
        if isinstance(draft_length, LoadAwareDraftLength):
            self.draft_length = draft_length.for_session(self)
            drafter.forget_after_rounds = FORGET_AFTER_ROUNDS
        # (start, verify start, verify end, end) of the last round, for a profile of its parts.
        self.last_round_times: tuple[float, float, float, float] | None = None
        self.target: CachedSequence | None = None
        self.pending = torch.zeros(0, dtype=torch.long, device=device)  # [B] not yet in caches
        self.count = torch.zeros(0, dtype=torch.long, device=device)  # [B] tokens emitted
        self.limit = torch.zeros(0, dtype=torch.long, device=device)  # [B] max_new_tokens
        self.active = torch.zeros(0, dtype=torch.bool, device=device)  # [B]
        # [B, C + 1] every emitted token (record=True) in C columns, grown on demand (a
        # max_new_tokens that EOS ends early costs nothing); the last column takes masked-out
        # writes. _most_emitted bounds every row's count from the host, without a sync.
        self.tokens = torch.full((0, 1), pad, dtype=torch.long, device=device) if record else None
        self._most_emitted = 0
        self._largest_limit = 0
        self._stopped = False

    @property
    def batch_size(self) -> int:
        return self.pending.shape[0]

    @torch.inference_mode()
    def add_rows(
        self,
        input_ids: torch.Tensor,  # [R, T] left-padded
        attention_mask: torch.Tensor | None = None,  # [R, T]
        max_new_tokens: int | Sequence[int] = 128,
    ) -> None:
        """Prefill ``R`` new rows as their own batch, merge them after the running rows (rows
        ``batch_size .. batch_size + R - 1``) and emit each one's first token."""
        decoder = self.decoder
        input_ids, attention_mask = decoder._check_inputs(input_ids, attention_mask, 1)
        if self.batch_size + input_ids.shape[0] > 1:
            problem = single_row_problem(decoder.target)
            if problem is not None:
                raise ValueError(problem)
        limits = row_limits(max_new_tokens, input_ids.shape[0])
        check_position_table(decoder.position_table, attention_mask, limits)
        start = device_clock(decoder.device)
        drafter = self.drafter if self.batch_size == 0 else self.drafter.spawn()
        target = CachedSequence(
            decoder.target,
            input_ids.shape[0],
            decoder.device,
            decoder._target_head,
            decoder._target_decoder,
        )
        prefill = target.extend(
            input_ids,
            attention_mask.bool(),
            output_hidden_states=drafter.needs_hidden_states,
            logits_to_keep=1,
        )
        pending, _ = select_tokens(prefill.logits[:, -1], self.sampling, self.generator)  # [R]
        old = self.batch_size
        # A new row's first token is its pending token whatever it is (EOS included, and every
        # limit is >= 1): stream it now, before the drafter's prefill and the merges, which
        # would otherwise add their time to the requests' time to first token.
        first_tokens = [[token] for token in pending.tolist()]
        self._stream(RoundUpdate([[] for _ in range(old)] + first_tokens, None, 0))
        drafter.prefill(
            input_ids, attention_mask, TargetPass(prefill.logits, prefill.hidden_states), pending
        )
        if old == 0:
            self.target = target
        else:
            self.target.merge(target)
            self.drafter.merge(drafter)
        device = self.pending.device
        self.pending = torch.cat([self.pending, pending])
        self.count = torch.cat([self.count, torch.zeros_like(pending)])
        self.limit = torch.cat([self.limit, limits.to(device)])
        self.active = torch.cat([self.active, torch.ones_like(pending, dtype=torch.bool)])
        self._largest_limit = max(self._largest_limit, int(limits.max()))
        if isinstance(self.draft_length, SessionDraftLength):
            self.draft_length.add_rows(input_ids.shape[0])
        if self.tokens is not None:
            self._grow_record(self.tokens.shape[1] - 1)
        new_rows = torch.arange(self.batch_size, device=device) >= old
        self.emit(self.pending[:, None], new_rows.long(), None, 0, stream=False)  # streamed above
        self.stats.prefill_seconds += device_clock(decoder.device) - start

    @torch.inference_mode()
    def step(self) -> None:
        """One speculative round for every row (a no-op when no row may emit more)."""
        room = self.room()
        if room == 0:
            return
        decoder = self.decoder
        # A round emits up to width + 1 tokens: no more drafts than the room left, and at
        # least one unless the adaptive policy chooses a plain step.
        limit = min(decoder.num_draft_tokens, room - 1)
        self.drafter.draft_room = max(1, room - 1)
        policy = self.draft_length
        width = max(1, limit) if policy is None else policy.choose(limit)
        round_fn = decoder._chain_round if self.tree is None else decoder._tree_round
        self.pending = round_fn(self, width)

    @torch.inference_mode()  # the caches' buffers, made in inference mode, are written in place
    def retire(self, rows: Sequence[int]) -> None:
        """Drop ``rows`` (indices into the current batch); the others keep their order."""
        dropped = set(rows)
        keep = [row for row in range(self.batch_size) if row not in dropped]
        if isinstance(self.draft_length, SessionDraftLength):
            self.draft_length.select_rows(torch.tensor(keep, dtype=torch.long))
        if not keep:
            self.target = None
            self.pending, self.count = self.pending[:0], self.count[:0]
            self.limit, self.active = self.limit[:0], self.active[:0]
            if self.tokens is not None:
                self.tokens = self.tokens[:0]
            self._stopped = False
            return
        if len(keep) == self.batch_size:
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.pending.device)
        self.target.select_rows(index)
        self.drafter.select_rows(index)
        self.pending, self.count = self.pending[index], self.count[index]
        self.limit, self.active = self.limit[index], self.active[index]
        if self.tokens is not None:
            self.tokens = self.tokens[index]

    def finished_rows(self) -> list[int]:
        """Rows that will emit nothing more (EOS or their ``max_new_tokens``), in one sync."""
        return torch.nonzero(~self.active).flatten().tolist()

    def room(self) -> int:
        """The most tokens any active row may still emit (0 when every row is done), in one
        host sync."""
        if self._stopped or self.batch_size == 0:
            return 0
        return max(0, int(torch.where(self.active, self.limit - self.count, 0).max()))

    def emit(
        self,
        new_tokens: torch.Tensor,  # [B, W]
        num_new: torch.Tensor,  # [B] valid prefix length of each row of new_tokens
        num_accepted: torch.Tensor | None,  # [B] drafts accepted this round; None: a prefill
        drafted: int,
        stream: bool = True,
    ) -> None:
        """Record each row's valid new tokens, cut at EOS and its limit, and (``stream``) hand
        them to the streamer; rows that emitted EOS or reached their limit become inactive."""
        width = new_tokens.shape[1]
        columns = torch.arange(width, device=new_tokens.device)[None, :]
        num_new = torch.where(self.active, num_new, 0)
        num_new = torch.minimum(num_new, self.limit - self.count)
        if self.eos.numel():
            is_eos = torch.isin(new_tokens, self.eos) & (columns < num_new[:, None])
            hit = is_eos.any(1)
            num_new = torch.where(hit, is_eos.long().argmax(1) + 1, num_new)
        else:
            hit = torch.zeros_like(self.active)
        if self.tokens is not None:
            self._most_emitted = min(self._most_emitted + width, self._largest_limit)
            self._grow_record(self._most_emitted)
            spare = self.tokens.shape[1] - 1
            written = columns < num_new[:, None]
            target_column = torch.where(written, self.count[:, None] + columns, spare)
            self.tokens.scatter_(1, target_column, new_tokens)
        self.count += num_new
        if self.streamer is not None and stream:
            rows = [row[:n] for row, n in zip(new_tokens.tolist(), num_new.tolist(), strict=True)]
            accepted = None if num_accepted is None else num_accepted.tolist()
            self._stream(RoundUpdate(rows, accepted, drafted))
        self.active &= ~hit & (self.count < self.limit)

    def _stream(self, update: RoundUpdate) -> None:
        """Hand ``update`` to the streamer; one that returns False stops the session."""
        if self.streamer is not None and self.streamer(update) is False:
            self._stopped = True

    def _grow_record(self, columns: int) -> None:
        """Give ``tokens`` a row per session row and at least ``columns`` columns before the
        spare one (doubling, so a long request copies its tokens O(log) times)."""
        tokens, have = self.tokens, self.tokens.shape[1] - 1
        if tokens.shape[0] == self.batch_size and columns <= have:
            return
        width = max(columns, 2 * have) if columns > have else have
        grown = torch.full(
            (self.batch_size, width + 1), self.pad, dtype=torch.long, device=tokens.device
        )
        grown[: tokens.shape[0], :have] = tokens[:, :have]  # the old spare column is dropped
        self.tokens = grown

    def finish_round(
        self,
        accepted_tokens: torch.Tensor,  # [B, D] drafts along the verified path
        num_accepted: torch.Tensor,  # [B]
        next_tokens: torch.Tensor,  # [B]
    ) -> None:
        """Record the round's acceptance and emit the accepted drafts plus the next token."""
        self.stats.record_round(num_accepted, accepted_tokens.shape[1], self.active)
        emitted = torch.cat([accepted_tokens, next_tokens[:, None]], dim=1)
        emitted.scatter_(1, num_accepted[:, None], next_tokens[:, None])
        self.emit(emitted, num_accepted + 1, num_accepted, accepted_tokens.shape[1])

    def add_times(self, start: float, verify_start: float, verify_end: float, end: float) -> None:
        self.last_round_times = (start, verify_start, verify_end, end)
        self.stats.verify_seconds += verify_end - verify_start
        self.stats.draft_seconds += (verify_start - start) + (end - verify_end)

    def sequences(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, T + new]
        """The prompts followed by every emitted token (``record=True``), padded."""
        if self.tokens is None:
            raise RuntimeError("the session keeps no tokens: open it with record=True")
        longest = int(self.count.max())
        return torch.cat([input_ids, self.tokens[:, :longest]], dim=1)


def check_position_table(
    table: int | None,  # the target's learned position table (``learned_position_limit``)
    attention_mask: torch.Tensor,  # [R, T] the rows' prompts, left-padded
    limits: torch.Tensor,  # [R] max_new_tokens of each row
) -> None:
    """``ValueError`` when a row's prompt and new tokens need positions past the target's
    learned table (the last new token is never fed back; padding takes no position)."""
    if table is None:
        return
    prompt_lengths = attention_mask.sum(-1).cpu()  # [R] real tokens of each row
    needed = prompt_lengths + limits - 1  # [R]
    row = int(needed.argmax())
    if int(needed[row]) > table:
        prompt, most_new = int(prompt_lengths[row]), int(limits[row])
        raise ValueError(
            f"the prompt ({prompt} tokens) and max_new_tokens={most_new} need {int(needed[row])} "
            f"positions, past the {table} of this target's learned position table: shorten "
            f"the prompt or pass max_new_tokens <= {max(table - prompt + 1, 0)}"
        )


# Limits are int64 tensors to which counts and widths are added: far from overflowing.
LARGEST_MAX_NEW_TOKENS = 2**62


def row_limits(max_new_tokens: int | Sequence[int], rows: int) -> torch.Tensor:
    """``max_new_tokens`` per row ([R] int64): one int for every row, or one per row."""
    values = [max_new_tokens] * rows if is_token_id(max_new_tokens) else max_new_tokens
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if len(values) != rows:
        raise ValueError(f"max_new_tokens gives {len(values)} limits for {rows} prompt rows")
    for value in values:
        if not is_token_id(value):
            raise TypeError(f"max_new_tokens must be an int, got {value!r}")
        check_max_new_tokens(value)
    return torch.tensor([int(v) for v in values], dtype=torch.long)


def check_max_new_tokens(max_new_tokens: int) -> None:
    if not 1 <= max_new_tokens <= LARGEST_MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must lie in [1, 2**62], got {max_new_tokens}")


def device_clock(device: torch.device) -> float:
    """Wall time, after the device finished its queued work (kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def is_token_id(value: object) -> bool:
    """An integer that is not a bool (a token id, a count)."""
    return isinstance(value, Integral) and not isinstance(value, bool)
