"""The EAGLE-3 runtime drafter: an :class:`Eagle3Head` next to a Hugging Face target.

Chains draft one head step per token here; dynamic and sampled trees grow in
``draftsmith.decode.drafters.eagle.trees``. Committed entries (target feature, next token) stay in the
head's own KV cache (``draftsmith.decode.drafters.eagle.state``); drafted entries are dropped after each
proposal.

The head reads committed entries lazily: ``commit`` records them and the next proposal runs
one head pass over everything recorded since the last one. A round that drafts nothing (a
plain step chosen by an adaptive length, a round the hybrid drafter gives to prompt lookup)
then costs no head pass, and a run of such rounds costs one pass over all their entries.
Rows that join (``merge``) or leave (``select_rows``) take their unread entries with them, so
continuous batching forces no read either.

A run of rounds without drafts is bounded in one of two ways. By default the head reads its
entries once ``MAX_UNREAD_ENTRIES`` wait. With ``Drafter.forget_after_rounds`` set (the server
sets it where its load-aware policy may stop drafting for long), entries older than that many
rounds are dropped instead: the head's cache then has a gap, which only lowers acceptance,
since every draft is verified. Keeping the head current costs a head pass per committed
token, about a sixth of the demo target's work (a layer, and a fusion of three hidden states,
beside the target's eight layers). With the demo target's head forced never to draft, at 16
rows of short prompts in float32 on the AVX2-only AMD EPYC, that upkeep left the decoder
0.80 of plain decoding (207 against 251-270 tokens/s, one run).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import torch
from draftsmith.decode.drafters.base import (
    Drafter,
    DraftProposal,
    TargetPass,
    TreeSpec,
    require_left_padded,
)
from draftsmith.decode.drafters.eagle.head import Eagle3Head
from draftsmith.decode.drafters.eagle.layers import block_visibility, positions_from_mask
from draftsmith.decode.drafters.eagle.lean import LeanEagle3
from draftsmith.decode.drafters.eagle.state import HeadState, UnreadBlock
from draftsmith.decode.drafters.eagle.trees import dynamic_tree, sampled_tree
from draftsmith.decode.forward.cached_sequence import pad_front
from draftsmith.decode.forward.kv_cache import PreallocatedStack
from draftsmith.decode.forward.llama_math import draft_cache_dtype
from draftsmith.decode.sampling import SamplingConfig, select_tokens
from draftsmith.decode.trees.layout import TreeProposal
from draftsmith.decode.trees.verify import TreeVerification
from torch import nn

# Committed entries the head has not read are read at once when they reach this many, so a
# long run of rounds without drafts keeps its features and its catch-up pass bounded.
MAX_UNREAD_ENTRIES = 64


class Eagle3Drafter(Drafter):
    """Runs an :class:`Eagle3Head` next to a Hugging Face target (chain and dynamic trees).

    The drafter keeps its own KV cache of committed entries (f_t, x_{t+1}): ``prefill`` reads
    the prompt's target features, ``commit`` the verify pass's features of the accepted tokens
    and the pending one. Drafted entries are appended for the proposal and cropped off after
    it. The head runs through :class:`LeanEagle3` (fused products, preallocated cache, logits
    over the pruned draft vocabulary; draft ids are mapped to target ids only when chosen).
    Rows advance independently; slots that some row rejected while another kept them stay as
    masked holes and are compacted when they outnumber the live ones. The head is moved to the
    target's embedding device and dtype.
    """

    kind: ClassVar[str] = "eagle3"
    needs_hidden_states: ClassVar[bool] = True
    supports_trees: ClassVar[bool] = True
    supports_sampled_trees: ClassVar[bool] = True
    supports_external_drafts: ClassVar[bool] = True
    # The decoding-time forward of the head (DFlash's drafter runs its own).
    lean_type: ClassVar[type[LeanEagle3]] = LeanEagle3

    def __init__(self, head: Eagle3Head, target: nn.Module) -> None:
        embed = target.get_input_embeddings()
        config = head.config
        if embed.weight.shape[1] != config.hidden_size:
            raise ValueError(
                f"the head's hidden size {config.hidden_size} differs from the target's "
                f"embedding width {embed.weight.shape[1]}: EAGLE-3 heads are built for one target"
            )
        depth = getattr(getattr(target, "config", None), "num_hidden_layers", None)
        if depth is not None and depth != config.target_num_hidden_layers:
            raise ValueError(
                f"the head reads hidden states {config.aux_hidden_state_layer_ids} of a "
                f"{config.target_num_hidden_layers}-layer target, this target has {depth} layers"
            )
        self.head = head.to(device=embed.weight.device, dtype=embed.weight.dtype).eval()
        self.lean = self.lean_type(self.head)
        self._embed = embed
        self._state: HeadState | None = None
        self.check_compatible(target)

    @classmethod
    def from_pretrained(cls, path: str | Path, target: nn.Module) -> Eagle3Drafter:
        """Load a native or engine-layout folder for ``target``."""
        depth = target.config.num_hidden_layers
        return cls(Eagle3Head.from_pretrained(path, target_num_hidden_layers=depth), target)

    @property
    def vocab_size(self) -> int:
        return self.head.config.target_vocab_size

    # -- protocol -------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,  # [B, T] left-padded prompt
        attention_mask: torch.Tensor,  # [B, T]
        target_pass: TargetPass,
        pending: torch.Tensor,  # [B]
    ) -> None:
        hidden_states = _require_hidden(target_pass, input_ids.shape[1])
        require_left_padded(attention_mask)
        valid = attention_mask.bool()
        next_ids = torch.cat((input_ids[:, 1:], pending[:, None]), dim=1)
        positions = positions_from_mask(attention_mask)
        fused = self.lean.fuse(self.head.gather_aux(hidden_states))
        weight = next(self.head.parameters())  # the head runs in the target's dtype and device
        cache = PreallocatedStack(
            self.head.config.num_hidden_layers, draft_cache_dtype(weight.dtype, weight.device)
        )
        prenorm = self._committed_pass(
            fused,
            self._embed(next_ids),
            positions,
            cache,
            block_visibility(None, valid),
            valid,
            positions[:, -1] + 1,
        )
        last = prenorm[:, -1]
        self._state = HeadState(
            cache=cache,
            valid=valid,
            has_holes=not bool(valid.all()),
            hidden=last,
            logits=self._first_logits(last),
            next_pos=positions[:, -1] + 1,
        )

    @torch.no_grad()
    def propose(
        self, num_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> DraftProposal:
        """Draft ``num_tokens`` tokens per row autoregressively (argmax or sampled)."""
        empty = self._empty_round(num_tokens)
        if empty is not None:
            return empty
        state = self._read_state()
        committed = state.cache.get_seq_length()
        logits, hidden = state.logits, state.hidden
        tokens, probs = [], []
        for step in range(num_tokens):
            draft_id, q = select_tokens(logits, sampling, generator)  # draft vocabulary
            token = self.lean.to_target_ids(draft_id)
            tokens.append(token)
            probs.append(q)
            if step == num_tokens - 1:
                break
            visible = None
            if state.has_holes:  # the new entry sees the valid committed ones and the drafts
                drafted = torch.ones_like(state.valid[:, :1]).expand(-1, step + 1)
                visible = torch.cat((state.valid, drafted), dim=1)[:, None]
            hidden = self.lean.step(
                hidden[:, None],
                self._embed(token)[:, None],
                (state.next_pos + step)[:, None],
                state.cache,
                visible,
            )[:, 0]
            logits = self.lean.draft_logits(hidden)
        state.cache.crop(committed - state.cache.get_seq_length())
        state.drafts = torch.stack(tokens, dim=1)
        q = None if sampling.greedy else self.lean.to_target_probs(torch.stack(probs, dim=1))
        return DraftProposal(tokens=state.drafts, probs=q)

    @torch.no_grad()
    def commit(
        self,
        num_accepted: torch.Tensor,  # [B]
        next_tokens: torch.Tensor,  # [B]
        target_pass: TargetPass,  # verify pass over [pending, d_1 .. d_N]
    ) -> None:
        state = self._require_state()
        if state.drafts is None:
            raise RuntimeError("commit() needs a preceding propose() (use commit_tree for trees)")
        drafts = state.drafts
        hidden_states = _require_hidden(target_pass, drafts.shape[1] + 1)
        self._append_committed(drafts, num_accepted, next_tokens, hidden_states)

    def replace_drafts(
        self,
        tokens: torch.Tensor,  # [B, W]
        replaced: torch.Tensor,  # [B] bool
    ) -> None:
        """Commit reads the target's features of whatever was verified: swap the tokens."""
        state = self._require_state()
        drafts = state.drafts
        if drafts is None:
            raise RuntimeError("replace_drafts() needs a preceding propose()")
        if drafts.shape[1] == 0:
            state.drafts = tokens
        elif tokens.shape[1] != drafts.shape[1]:
            raise ValueError(
                f"replacement drafts have width {tokens.shape[1]}, the proposal {drafts.shape[1]}"
            )
        else:
            state.drafts = torch.where(replaced[:, None], tokens, drafts)

    # -- trees (draftsmith.decode.drafters.eagle.trees) ---------------------------------------------
    @torch.no_grad()
    def propose_tree(self, spec: TreeSpec, depth: int) -> TreeProposal:
        """EAGLE-2 dynamic tree from the head's own log-probabilities
        (:func:`draftsmith.decode.drafters.eagle.trees.dynamic_tree`); commit with :meth:`commit_tree`."""
        state = self._read_state()
        tree = dynamic_tree(state, self.lean, self._embed, spec, depth)
        state.drafts = None
        return tree

    @torch.no_grad()
    def propose_sampled_tree(
        self,
        spec: TreeSpec,
        depth: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        *,
        replacement: bool = False,
    ) -> TreeProposal:
        """A multi-draft tree sampled from the head's own q, for verification at T > 0
        (:func:`draftsmith.decode.drafters.eagle.trees.sampled_tree`); commit with :meth:`commit_tree`."""
        state = self._read_state()
        tree = sampled_tree(
            state, self.lean, self._embed, spec, depth, sampling, generator, replacement=replacement
        )
        state.drafts = None
        return tree

    @torch.no_grad()
    def commit_tree(
        self,
        verification: TreeVerification,
        target_pass: TargetPass,  # the target's pass over [pending, tree nodes]: [B, M + 1, ...]
    ) -> None:
        """Commit the accepted path: gather its features from the tree pass, then as chains."""
        self._require_state()
        path = verification.path_indices()  # [B, D + 1]
        hidden_states = _require_hidden(target_pass, None)
        gathered = tuple(
            h.gather(1, path[..., None].expand(-1, -1, h.shape[-1])) for h in hidden_states
        )
        self._append_committed(
            verification.accepted_tokens,
            verification.num_accepted,
            verification.next_tokens,
            gathered,
        )

    # -- continuous batching ----------------------------------------------------------------
    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep ``rows``, each with its valid entries right-aligned (holes dropped when they
        are many: ``PreallocatedStack.select_rows``) and its unread entries kept for the next
        proposal."""
        state = self._require_state()
        rows = rows.to(state.valid.device, torch.long)
        state.unread = [block.select(rows) for block in state.unread]
        valid = state.valid[rows]  # [R, S]
        order = state.cache.select_rows(rows, valid)  # [R, L] or None: every slot kept
        state.valid = valid if order is None else valid.gather(1, order)
        state.has_holes = not bool(state.valid.all())
        state.hidden, state.logits = state.hidden[rows], state.logits[rows]
        state.next_pos, state.drafts = state.next_pos[rows], None

    def merge(self, other: Drafter) -> None:
        """Append ``other``'s rows, both caches right-aligned (holes in front)."""
        if not isinstance(other, Eagle3Drafter) or other.head is not self.head:
            raise TypeError("only a spawn of this EAGLE-3 drafter can be merged into it")
        # This batch's unread entries stay unread; the new rows have none in those blocks (a
        # spawn just prefilled has nothing unread itself, so reading it costs nothing).
        state, theirs = self._require_state(), other._read_state()
        joining = theirs.valid.shape[0]
        state.unread = [block.with_empty_rows(joining) for block in state.unread]
        slots = max(state.valid.shape[1], theirs.valid.shape[1])
        state.cache.merge_rows(theirs.cache, slots)
        state.valid = torch.cat([pad_front(state.valid, slots), pad_front(theirs.valid, slots)])
        state.has_holes = not bool(state.valid.all())
        state.hidden = torch.cat([state.hidden, theirs.hidden])
        state.logits = torch.cat([state.logits, theirs.logits])
        state.next_pos = torch.cat([state.next_pos, theirs.next_pos])
        state.drafts = None

    # -- internals ------------------------------------------------------------------------
    def _require_state(self) -> HeadState:
        if self._state is None:
            raise RuntimeError("the drafter has no batch: call prefill() first")
        return self._state

    def _append_committed(
        self,
        drafts: torch.Tensor,  # [B, D] drafted tokens; the first num_accepted are accepted
        num_accepted: torch.Tensor,  # [B]
        next_tokens: torch.Tensor,  # [B]
        hidden_states: Sequence[torch.Tensor],  # each [B, D + 1, H]: [pending, d_1 .. d_D]
    ) -> None:
        """Record entries (f_pending, d_1), ..., (f_{d_n}, next) per row for the head's next
        pass (:meth:`_read_state`); the rest are holes.

        Entries past the longest kept row are never recorded, so a batch of one never holds
        holes and a round that kept little costs little.
        """
        state = self._require_state()
        # Only the first max(num_accepted) + 1 entries of any row are kept: record those alone.
        fewest, most = (int(n) + 1 for n in torch.aminmax(num_accepted))
        cols = torch.arange(most, device=drafts.device)
        padded = torch.cat((drafts, next_tokens[:, None]), dim=1)[:, :most]
        state.unread.append(
            UnreadBlock(
                tokens=torch.where(cols < num_accepted[:, None], padded, next_tokens[:, None]),
                valid=cols <= num_accepted[:, None],
                positions=state.next_pos[:, None] + cols,
                features=self.head.gather_aux([h[:, :most] for h in hidden_states]),
                last=num_accepted,
                holes=fewest < most,
            )
        )
        state.next_pos = state.next_pos + num_accepted + 1
        state.drafts = None
        rounds_kept = self.forget_after_rounds
        if rounds_kept is not None:  # the module docstring: a gap instead of a read
            del state.unread[: max(len(state.unread) - rounds_kept, 0)]
        elif sum(block.tokens.shape[1] for block in state.unread) >= MAX_UNREAD_ENTRIES:
            self._read_state()

    @torch.inference_mode()  # select_rows and merge run outside the engine's inference mode
    def _read_state(self) -> HeadState:
        """The state once the head has read every recorded entry: one pass over the unread
        blocks side by side (each entry sees the valid ones before it, holes masked), the
        last kept entry's output and first draft logits refreshed."""
        state = self._require_state()
        if not state.unread:
            return state
        blocks, state.unread = state.unread, []
        last = blocks[-1]
        tokens, valid, positions, features = (  # [B, W], [B, W], [B, W], [B, W, A*H]
            (last.tokens, last.valid, last.positions, last.features)
            if len(blocks) == 1  # the usual case: the round just committed
            else (
                torch.cat([getattr(block, name) for block in blocks], dim=1)
                for name in ("tokens", "valid", "positions", "features")
            )
        )
        visible = None
        if tokens.shape[1] > 1 or state.has_holes:
            visible = block_visibility(state.valid, valid)
        seen = torch.cat((state.valid, valid), 1)
        prenorm = self._committed_pass(
            self.lean.fuse(features),
            self._embed(tokens),
            positions,
            state.cache,
            visible,
            seen,
            state.next_pos,
        )
        state.valid = seen
        state.has_holes = state.has_holes or any(block.holes for block in blocks)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        hidden = prenorm[rows, tokens.shape[1] - last.tokens.shape[1] + last.last]  # [B, H]
        # Rows merged in after these entries were recorded have none of them (every commit
        # gives each row an entry, so a row with any has one in the last block): they keep
        # the output they had.
        state.hidden = torch.where(last.valid.any(1)[:, None], hidden, state.hidden)
        state.logits = self._first_logits(state.hidden)
        if state.has_holes:
            live = int(state.valid.sum(1).max())
            if state.valid.shape[1] > 2 * live:  # amortised: each compaction halves the cache
                self._compact(live)
        return state

    def _empty_round(self, num_tokens: int) -> DraftProposal | None:
        """The proposal of a round without drafts (``num_tokens == 0``; commit still records its
        features), None when there are drafts to make; a negative count is refused."""
        state = self._require_state()
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_tokens:
            return None
        state.drafts = state.logits.new_empty(state.logits.shape[0], 0, dtype=torch.long)
        return DraftProposal(tokens=state.drafts, probs=None)

    def _committed_pass(
        self,
        fused: torch.Tensor,  # [B, W, H] fused target features of the new committed entries
        embeds: torch.Tensor,  # [B, W, H] embeddings of their paired tokens
        positions: torch.Tensor,  # [B, W]
        cache: PreallocatedStack,  # the block's keys/values are appended
        visible: torch.Tensor | None,  # [B, W, S + W] bool, or None: every slot
        seen: torch.Tensor,  # [B, S + W] bool: the valid committed entries after this block
        next_pos: torch.Tensor,  # [B] position of the entry after this block
    ) -> torch.Tensor:  # [B, W, H] pre-norm outputs
        """One head pass over newly committed entries (P-EAGLE adds its mask rows here)."""
        del seen, next_pos  # a chain drafts from the last output alone
        return self.lean.step(fused, embeds, positions, cache, visible)

    def _first_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, V_draft]
        """The first draft position's logits, from the last committed entry's output (P-EAGLE
        projects its mask rows in the same product)."""
        return self.lean.draft_logits(hidden)

    def _compact(self, live: int) -> None:
        """Drop holes: keep each row's valid entries in order, right-aligned in ``live`` slots."""
        state = self._require_state()
        order = torch.sort(state.valid.long(), dim=1, stable=True).indices[:, -live:]  # [B, L]
        state.cache.keep_slots(0, order)
        state.valid = state.valid.gather(1, order)
        state.has_holes = not bool(state.valid.all())


def _require_hidden(target_pass: TargetPass, width: int | None) -> tuple[torch.Tensor, ...]:
    hidden_states = target_pass.hidden_states
    if hidden_states is None:
        raise ValueError(
            "this drafter reads the target's hidden states: run the target with "
            "output_hidden_states=True on prefill and verify passes"
        )
    if width is not None and hidden_states[0].shape[1] != width:
        raise ValueError(
            f"expected target hidden states over {width} positions, got {hidden_states[0].shape[1]}"
        )
    return tuple(hidden_states)


def load_runtime_drafter(path: str | Path | None, target: nn.Module) -> Eagle3Drafter:
    """Registry entry (``draftsmith.decode.drafters.registry``): an EAGLE-3 folder as a runtime drafter."""
    if path is None:
        raise ValueError("the eagle3 drafter needs a folder: pass --drafter PATH")
    return Eagle3Drafter.from_pretrained(path, target)
