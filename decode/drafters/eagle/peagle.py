"""P-EAGLE: an EAGLE-3 head that drafts all N tokens of a round in one forward pass.

P-EAGLE (parallel EAGLE; Hui et al. 2026, the ``peagle`` model of vllm-project/speculators,
served by vLLM's parallel drafting) keeps EAGLE-3's architecture (``draftsmith.decode.drafters.eagle.head``:
fused target features, its decoder layer(s), the pruned LM head and its d2t/t2d maps) but does
not feed the head its own drafts. For the anchor t (the last committed entry, the pair
``(g_t, x_{t+1})``) depth 1 is EAGLE-3's ordinary row, and every deeper depth k = 2..N is a
*mask row*: a learned token embedding ``m_e`` (the ``mask_token_id`` placeholder) and learned
features ``m_h`` (vLLM's ``mask_hidden``, fused by ``fc`` like real features) at rotary
position ``t + k - 1``:

    row 1:  x = [n_in(E[x_{t+1}]), n_hid(fc(h^low_t, h^mid_t, h^high_t))]   at position t
    row k:  x = [n_in(m_e),         n_hid(fc(m_h))]                          at position t + k - 1

Row k sees the committed entries (the head's KV cache, positions <= t) and rows 2..k-1 of
its own chain, never a drafted token, so q_k(. | x_<=t+1) depends on the committed context
alone and the N rows run as one block: one product per layer for the whole round instead of
N sequential head steps (docs/theory.md §8: the draft term N * T_d becomes about T_d where a
product over a few rows costs what one row does). Each draft is drawn from its own q_k; any
proposal fixed before verification keeps speculative sampling exact (docs/theory.md §2), so
greedy output equals the target's and sampled output follows its law.

At runtime (:class:`PEagleDrafter`) the mask rows of the next round ride along with the
committed entries of the verify pass: ``prefill`` and ``commit`` run the new committed
entries and the ``lookahead - 1`` mask rows in one block (as vLLM's proposer does), keep the
mask rows' logits and crop their keys and values off the cache; ``propose`` then only samples.
``lookahead`` is the width asked for last (the head's trained depth count at first); a wider
request runs the mask rows in a pass of their own.

Embedding. The placeholder is a token id, as in the speculators checkpoint, where the head
carries its own ``embed_tokens`` (the target's with the row of ``mask_token_id`` trained):
:meth:`PEagleHead.embed` returns ``m_e`` for that id everywhere, committed rows included, so
the exported folder and this decoder compute the same function. The id defaults to the
rarest token of the training data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from draftsmith.decode.drafters.base import Drafter, DraftProposal
from draftsmith.decode.drafters.eagle.drafter import Eagle3Drafter
from draftsmith.decode.drafters.eagle.head import Eagle3Config, Eagle3Head
from draftsmith.decode.drafters.eagle.layers import positions_from_mask
from draftsmith.decode.forward.kv_cache import PreallocatedStack
from draftsmith.decode.sampling import SamplingConfig, select_tokens
from torch import nn


@dataclass
class PEagleConfig(Eagle3Config):
    """:class:`Eagle3Config` plus the depths drafted per pass and the placeholder token."""

    num_depths: int = 4  # draft positions trained (the folder's default draft length)
    mask_token_id: int | None = None  # None: the last id of the target vocabulary

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mask_token_id is None:
            self.mask_token_id = self.target_vocab_size - 1
        if not 0 <= self.mask_token_id < self.target_vocab_size:
            raise ValueError(
                f"mask_token_id must lie in [0, {self.target_vocab_size}), got {self.mask_token_id}"
            )
        if self.num_depths < 1:
            raise ValueError(f"num_depths must be >= 1, got {self.num_depths}")


def parallel_visibility(
    depth: torch.Tensor,  # [L] int: 0 for committed (depth-1) rows, k-1 for mask row k
    anchor: torch.Tensor,  # [B, L] int: the committed position each row's chain starts from
    valid: torch.Tensor,  # [B, L] bool: real rows
) -> torch.Tensor:  # [B, L, L] bool, True where a query row may attend
    """P-EAGLE's attention mask over committed rows and mask rows side by side.

    A committed row at t sees the valid committed rows at positions <= t (causal). A mask row
    of anchor a and depth d sees the valid committed rows at positions <= a and the valid mask
    rows of its own chain (anchor a) at depths <= d. Every row sees itself, so padding rows
    stay finite. This is the mask of the speculators ``peagle`` training and, for one anchor,
    what the runtime drafter's cache plus its mask block give.
    """
    q_depth, k_depth = depth[None, :, None], depth[None, None, :]
    q_anchor, k_anchor = anchor[:, :, None], anchor[:, None, :]
    key_valid = valid[:, None, :]
    context = (k_depth == 0) & (k_anchor <= q_anchor) & key_valid
    chain = (k_depth > 0) & (q_depth > 0) & (k_anchor == q_anchor) & (k_depth <= q_depth)
    eye = torch.eye(depth.shape[0], dtype=torch.bool, device=depth.device)
    return context | (chain & key_valid) | eye


class PEagleHead(Eagle3Head):
    """EAGLE-3's head with P-EAGLE's placeholders ``mask_hidden`` [A*H] and ``mask_embed`` [H]
    (the module docstring has the math); saved as the ``peagle`` drafter kind."""

    kind: ClassVar[str] = "peagle"
    config_type: ClassVar[type[Eagle3Config]] = PEagleConfig
    config: PEagleConfig

    def __init__(self, config: PEagleConfig) -> None:
        super().__init__(config)
        width = len(config.aux_hidden_state_layer_ids) * config.hidden_size
        # Random, not zero: a zero feature would sit on the RMSNorm's singular point.
        self.mask_hidden = nn.Parameter(torch.randn(width))
        self.mask_embed = nn.Parameter(torch.randn(config.hidden_size) * 0.02)

    def embed(self, embedding: nn.Module, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., H]
        """The target's embeddings of ``ids``, with ``mask_embed`` for ``mask_token_id``."""
        return self.with_mask_embedding(ids, embedding(ids))

    def with_mask_embedding(
        self,
        ids: torch.Tensor,  # [...]
        embeds: torch.Tensor,  # [..., H] the target's embeddings of ids
    ) -> torch.Tensor:  # [..., H]
        """``embeds`` with ``mask_embed`` wherever ``ids`` is the mask token."""
        is_mask = (ids == self.config.mask_token_id)[..., None]
        return torch.where(is_mask, self.mask_embed.to(embeds.dtype), embeds)

    def mask_inputs(
        self, batch: int, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fused features, embeddings [B, R, H]
        """The inputs of ``rows`` mask rows: ``fc(mask_hidden)`` and ``mask_embed``."""
        fused = self.fuse(self.mask_hidden)
        shape = (batch, rows, self.config.hidden_size)
        return fused.expand(shape), self.mask_embed.expand(shape)

    def parallel(
        self,
        aux_hidden: torch.Tensor,  # [B, T, A*H] target features at each position t
        next_embeds: torch.Tensor,  # [B, T, H] embedding of token t+1 at index t
        attention_mask: torch.Tensor,  # [B, T] 1 for real tokens
        anchors: Sequence[torch.Tensor],  # per mask depth k = 2..N: [B, M_k] anchor positions
        anchor_valid: Sequence[torch.Tensor],  # per mask depth: [B, M_k] bool
    ) -> list[torch.Tensor]:  # [B, T, V_draft], then [B, M_k, V_draft] per mask depth
        """Every depth in one pass (training): the committed rows at all T positions and mask
        rows at the given anchors, under :func:`parallel_visibility`.

        Depth 1's logits at t predict ``x_{t+2}``, depth k's at anchor t predict
        ``x_{t+1+k}``, exactly what :class:`PEagleDrafter` drafts after committing t. A mask
        row needs its chain's shallower rows, so each depth's anchors must lie among the
        previous depth's (COD sampling, ``draftsmith.train.objectives.peagle``, keeps them nested).
        """
        batch, length = attention_mask.shape
        valid = attention_mask.bool()
        base = positions_from_mask(attention_mask)  # [B, T]
        hidden, embeds = [self.fuse(aux_hidden)], [next_embeds]
        arange = torch.arange(length, device=valid.device).expand(batch, -1)
        positions, anchor_of, depth_of = [base], [arange], [0]
        valid_of, widths = [valid], [length]
        for k, (index, keep) in enumerate(zip(anchors, anchor_valid, strict=True), start=1):
            mask_hidden, mask_embeds = self.mask_inputs(batch, index.shape[1])
            hidden.append(mask_hidden)
            embeds.append(mask_embeds)
            positions.append(base.gather(1, index.to(valid.device)) + k)
            anchor_of.append(index)
            depth_of.append(k)
            valid_of.append(keep)
            widths.append(index.shape[1])
        depth = torch.cat(
            [torch.full((w,), d, dtype=torch.long) for w, d in zip(widths, depth_of, strict=True)]
        ).to(valid.device)
        anchor = torch.cat([a.to(valid.device) for a in anchor_of], dim=1)
        visible = parallel_visibility(depth, anchor, torch.cat(valid_of, dim=1))
        prenorm, _ = self.forward(
            torch.cat(hidden, 1), torch.cat(embeds, 1), torch.cat(positions, 1), None, visible
        )
        return list(self.compute_logits(prenorm).split(widths, dim=1))


class PEagleDrafter(Eagle3Drafter):
    """Runs a :class:`PEagleHead` next to a Hugging Face target: chains drafted in one pass.

    The committed entries live in the head's KV cache as for EAGLE-3 (:class:`Eagle3Drafter`,
    whose continuous batching and hybrid support this inherits). Trees are not drafted: a
    mask row never sees a drafted token, so siblings would share one distribution.
    """

    kind: ClassVar[str] = "peagle"
    supports_trees: ClassVar[bool] = False
    supports_sampled_trees: ClassVar[bool] = False

    head: PEagleHead

    def __init__(self, head: PEagleHead, target: nn.Module) -> None:
        super().__init__(head, target)
        embedding = self._embed
        self._embed = lambda ids: self.head.embed(embedding, ids)
        self.lookahead = head.config.num_depths  # the width the mask rows are prepared for
        self._ahead: torch.Tensor | None = None  # [B, R, V_draft] logits of mask rows 2..R+1
        self._ahead_prenorm: torch.Tensor | None = None  # [B, R, H] those rows before the output
        # fc(mask_hidden) [1, 1, H] and the fused weights it was computed with: a constant of
        # the weights, so a round does not stream fc's weight again to recompute it.
        self._fused_mask: tuple[object, torch.Tensor] | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path, target: nn.Module) -> PEagleDrafter:
        """Load a native ``peagle`` folder for ``target``."""
        depth = target.config.num_hidden_layers
        return cls(PEagleHead.from_pretrained(path, target_num_hidden_layers=depth), target)

    propose_tree = Drafter.propose_tree
    propose_sampled_tree = Drafter.propose_sampled_tree
    commit_tree = Drafter.commit_tree

    @torch.no_grad()
    def propose(
        self, num_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> DraftProposal:
        """Draw draft j from q_j for j = 1..N at once (argmax when greedy)."""
        empty = self._empty_round(num_tokens)
        if empty is not None:
            return empty
        state = self._read_state()
        self.lookahead = num_tokens
        logits = state.logits[:, None]  # [B, 1, V_draft]
        rows = num_tokens - 1
        if rows:
            ahead = self._ahead
            if ahead is None or ahead.shape[1] < rows:
                ahead = self._mask_pass(rows)
            logits = torch.cat((logits, ahead[:, :rows]), dim=1)  # [B, N, V_draft]
        draft_ids, q = select_tokens(logits, sampling, generator)
        state.drafts = self.lean.to_target_ids(draft_ids)
        probs = None if q is None else self.lean.to_target_probs(q)
        return DraftProposal(tokens=state.drafts, probs=probs)

    # -- continuous batching ----------------------------------------------------------------
    def select_rows(self, rows: torch.Tensor) -> None:
        self._read_state()  # the mask rows follow each row's newest entry
        super().select_rows(rows)
        if self._ahead is not None:
            self._ahead = self._ahead[rows.to(self._ahead.device, torch.long)]

    def merge(self, other: Drafter) -> None:
        if isinstance(other, PEagleDrafter):  # each side's mask rows follow its newest entry
            self._read_state()
            other._read_state()
        mine, theirs = self._ahead, getattr(other, "_ahead", None)
        super().merge(other)
        same = mine is not None and theirs is not None and mine.shape[1] == theirs.shape[1]
        self._ahead = torch.cat((mine, theirs)) if same else None  # else the next propose runs

    # -- internals ------------------------------------------------------------------------
    def _committed_pass(
        self,
        fused: torch.Tensor,  # [B, W, H]
        embeds: torch.Tensor,  # [B, W, H]
        positions: torch.Tensor,  # [B, W]
        cache: PreallocatedStack,
        visible: torch.Tensor | None,  # [B, W, S + W] bool, or None: every slot
        seen: torch.Tensor,  # [B, S + W] bool: the committed entries once this block is in
        next_pos: torch.Tensor,  # [B] position of the next entry after this block
    ) -> torch.Tensor:  # [B, W, H] pre-norm outputs of the committed entries
        """The committed entries and the next round's mask rows in one block."""
        rows = self.lookahead - 1
        if rows < 1:
            self._ahead = self._ahead_prenorm = None
            return super()._committed_pass(fused, embeds, positions, cache, visible, seen, next_pos)
        batch, width = positions.shape
        if visible is None:
            visible = seen[:, None].expand(batch, width, -1)
        hidden, mask_embeds = self._mask_inputs(batch, rows)
        block = torch.cat(
            (visible, visible.new_zeros(batch, width, rows)), dim=2
        )  # committed rows never see mask rows
        prenorm = self.lean.step(
            torch.cat((fused, hidden), 1),
            torch.cat((embeds, mask_embeds), 1),
            torch.cat((positions, self._mask_positions(next_pos, rows)), 1),
            cache,
            torch.cat((block, self._mask_visibility(seen, rows)), 1),
        )
        cache.crop(-rows)
        self._ahead_prenorm = prenorm[:, width:]  # projected with the first position's output
        return prenorm[:, :width]

    def _first_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, V_draft]
        """Depth 1's logits and the mask rows' (kept for the next ``propose``) in one product:
        the draft vocabulary's weight is streamed once per round, not twice."""
        ahead, self._ahead_prenorm = self._ahead_prenorm, None
        if ahead is None:
            return super()._first_logits(hidden)
        logits = self.lean.draft_logits(torch.cat((hidden[:, None], ahead), 1))  # [B, 1 + R, V]
        self._ahead = logits[:, 1:]
        return logits[:, 0]

    def _mask_pass(self, rows: int) -> torch.Tensor:  # [B, R, V_draft]
        """Mask rows 2..rows+1 alone, after the committed cache (a wider round than prepared)."""
        state = self._require_state()
        batch = state.valid.shape[0]
        hidden, embeds = self._mask_inputs(batch, rows)
        prenorm = self.lean.step(
            hidden,
            embeds,
            self._mask_positions(state.next_pos, rows),
            state.cache,
            self._mask_visibility(state.valid, rows),
        )
        state.cache.crop(-rows)
        return self.lean.draft_logits(prenorm)

    def _mask_inputs(self, batch: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        weights = self.lean.weights()  # rebuilt whenever a head parameter changes in place
        if self._fused_mask is None or self._fused_mask[0] is not weights:
            self._fused_mask = (weights, self.lean.fuse(self.head.mask_hidden[None, None]))
        fused = self._fused_mask[1]  # [1, 1, H]
        shape = (batch, rows, fused.shape[-1])
        return fused.expand(shape), self.head.mask_embed.to(fused.dtype).expand(shape)

    @staticmethod
    def _mask_positions(next_pos: torch.Tensor, rows: int) -> torch.Tensor:  # [B] -> [B, R]
        return next_pos[:, None] + torch.arange(rows, device=next_pos.device)

    @staticmethod
    def _mask_visibility(seen: torch.Tensor, rows: int) -> torch.Tensor:  # -> [B, R, S + R]
        """Mask rows see the valid committed entries and their own chain's earlier rows."""
        chain = torch.ones(rows, rows, dtype=torch.bool, device=seen.device).tril()
        batch = seen.shape[0]
        return torch.cat(
            (seen[:, None].expand(batch, rows, -1), chain.expand(batch, rows, rows)), dim=2
        )


def load_runtime_drafter(path: str | Path | None, target: nn.Module) -> PEagleDrafter:
    """Registry entry (``draftsmith.decode.drafters.registry``): a P-EAGLE folder as a runtime drafter."""
    if path is None:
        raise ValueError("the peagle drafter needs a folder: pass --drafter PATH")
    return PEagleDrafter.from_pretrained(path, target)
