"""The EAGLE-3 runtime drafter: an :class:`Eagle3Head` next to a Hugging Face target.

Chains draft one head step per token; EAGLE-2 dynamic trees (Li et al. 2024) expand the most
likely children by cumulative draft log-probability. Committed entries (target feature, next
token) stay in the head's own KV cache; drafted entries are dropped after each proposal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from decode.drafters.base import Drafter, DraftProposal, TargetPass, TreeSpec
from decode.drafters.eagle import Eagle3Head, block_visibility, positions_from_mask
from decode.sampling import SamplingConfig, select_tokens
from decode.tree import Frontier, TreeProposal, TreeVerification, build_dynamic_tree


@dataclass
class _DrafterState:
    keys: torch.Tensor  # [B, KV, S, D] committed entries (padding and holes marked in `valid`)
    values: torch.Tensor  # [B, KV, S, D]
    valid: torch.Tensor  # [B, S] bool
    hidden: torch.Tensor  # [B, H] pre-norm output of each row's last committed entry
    logits: torch.Tensor  # [B, V_target] draft logits for the token after the pending one
    next_pos: torch.Tensor  # [B] position of the next entry (the pending token's pair)
    drafts: torch.Tensor | None = None  # [B, N] the last chain proposal, until committed


class Eagle3Drafter(Drafter):
    """Runs an :class:`Eagle3Head` next to a Hugging Face target (chain and dynamic trees).

    The drafter keeps its own KV cache of committed entries (f_t, x_{t+1}): ``prefill`` reads
    the prompt's target features, ``commit`` the verify pass's features of the accepted tokens
    and the pending one. Drafted entries are temporary and dropped after each proposal. Rows
    advance independently; rejected or padded entries stay in memory as masked holes and are
    compacted when they outnumber the live ones. The head is moved to the target's embedding
    device and dtype.
    """

    kind: ClassVar[str] = "eagle3"
    needs_hidden_states: ClassVar[bool] = True
    supports_trees: ClassVar[bool] = True

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
        self._embed = embed
        self._state: _DrafterState | None = None
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
        valid = attention_mask.bool()
        if not valid[:, -1].all():
            raise ValueError("prompts must be left-padded: every row's last column must be real")
        next_ids = torch.cat((input_ids[:, 1:], pending[:, None]), dim=1)
        positions = positions_from_mask(attention_mask)
        fused = self.head.fuse(self.head.gather_aux(hidden_states))
        visible = block_visibility(None, valid)
        prenorm, (keys, values) = self.head(fused, self._embed(next_ids), positions, None, visible)
        last = prenorm[:, -1]
        self._state = _DrafterState(
            keys=keys,
            values=values,
            valid=valid,
            hidden=last,
            logits=self._target_logits(last),
            next_pos=positions[:, -1] + 1,
        )

    @torch.no_grad()
    def propose(
        self, num_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> DraftProposal:
        """Draft ``num_tokens`` tokens per row autoregressively (argmax or sampled)."""
        state = self._require_state()
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_tokens == 0:  # a round without drafts; commit still reads its features
            state.drafts = state.logits.new_empty(state.logits.shape[0], 0, dtype=torch.long)
            return DraftProposal(tokens=state.drafts, probs=None)
        keys, values, valid = state.keys, state.values, state.valid
        logits, hidden = state.logits, state.hidden
        tokens, probs = [], []
        for step in range(num_tokens):
            token, q = select_tokens(logits, sampling, generator)
            tokens.append(token)
            probs.append(q)
            if step == num_tokens - 1:
                break
            block_valid = torch.ones_like(token, dtype=torch.bool)[:, None]
            prenorm, (key, value) = self.head(
                hidden[:, None],
                self._embed(token)[:, None],
                (state.next_pos + step)[:, None],
                (keys, values),
                block_visibility(valid, block_valid),
            )
            keys, values = torch.cat((keys, key), 2), torch.cat((values, value), 2)
            valid = torch.cat((valid, block_valid), 1)
            hidden = prenorm[:, 0]
            logits = self._target_logits(hidden)
        state.drafts = torch.stack(tokens, dim=1)
        return DraftProposal(
            tokens=state.drafts, probs=None if sampling.greedy else torch.stack(probs, dim=1)
        )

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

    # -- trees ----------------------------------------------------------------------------
    @torch.no_grad()
    def propose_tree(self, spec: TreeSpec, depth: int) -> TreeProposal:
        """EAGLE-2 dynamic tree from the head's own log-probabilities (deterministic children).

        Verify it with :func:`decode.tree.verify_tree_greedy` / ``verify_tree_stochastic`` over
        the target's pass on ``tree.input_ids(pending)``, then call :meth:`commit_tree`.
        """
        state = self._require_state()
        top_k = spec.top_k
        # Near the end of generation the depth shrinks; keep as many nodes as still fit.
        total_tokens = min(spec.total_tokens, top_k + (depth - 1) * top_k * top_k)
        if top_k > self.head.config.draft_vocab_size:
            raise ValueError(
                f"top_k={top_k} exceeds the draft vocabulary ({self.head.config.draft_vocab_size})"
            )
        batch = state.hidden.shape[0]
        keys, values = state.keys, state.values
        committed = state.valid
        outputs = state.hidden[:, None].expand(batch, top_k, -1)  # parents' outputs
        seen = torch.zeros(batch, top_k, 0, dtype=torch.bool, device=committed.device)

        def expand(frontier: Frontier) -> torch.Tensor:  # [B, K, V] log-probs of children
            nonlocal keys, values, outputs, seen
            slots = frontier.parent_slots.clamp(min=0)
            hidden_in = outputs.gather(1, slots[..., None].expand(-1, -1, outputs.shape[-1]))
            ancestors = seen.gather(1, slots[..., None].expand(-1, -1, seen.shape[-1]))
            own = torch.eye(top_k, dtype=torch.bool, device=seen.device).expand(batch, -1, -1)
            seen = torch.cat((ancestors, own), dim=-1)
            visible = torch.cat((committed[:, None].expand(-1, top_k, -1), seen), dim=-1)
            positions = (state.next_pos + frontier.step)[:, None].expand(-1, top_k)
            prenorm, (key, value) = self.head(
                hidden_in, self._embed(frontier.tokens), positions, (keys, values), visible
            )
            keys, values = torch.cat((keys, key), 2), torch.cat((values, value), 2)
            outputs = prenorm
            return torch.log_softmax(self._target_logits(prenorm).float(), dim=-1)

        root = torch.log_softmax(state.logits.float(), dim=-1)
        state.drafts = None
        return build_dynamic_tree(root, expand, top_k=top_k, depth=depth, total_tokens=total_tokens)

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

    # -- internals ------------------------------------------------------------------------
    def _require_state(self) -> _DrafterState:
        if self._state is None:
            raise RuntimeError("the drafter has no batch: call prefill() first")
        return self._state

    def _target_logits(self, prenorm: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V_t]
        return self.head.to_target_logits(self.head.compute_logits(prenorm))

    def _append_committed(
        self,
        drafts: torch.Tensor,  # [B, D] drafted tokens; the first num_accepted are accepted
        num_accepted: torch.Tensor,  # [B]
        next_tokens: torch.Tensor,  # [B]
        hidden_states: Sequence[torch.Tensor],  # each [B, D + 1, H]: [pending, d_1 .. d_D]
    ) -> None:
        """Add entries (f_pending, d_1), ..., (f_{d_n}, next) per row; the rest are holes."""
        state = self._require_state()
        width = drafts.shape[1] + 1
        cols = torch.arange(width, device=drafts.device)
        padded = torch.cat((drafts, next_tokens[:, None]), dim=1)
        tokens = torch.where(cols < num_accepted[:, None], padded, next_tokens[:, None])
        block_valid = cols <= num_accepted[:, None]
        positions = state.next_pos[:, None] + cols
        fused = self.head.fuse(self.head.gather_aux(hidden_states))
        prenorm, (key, value) = self.head(
            fused,
            self._embed(tokens),
            positions,
            (state.keys, state.values),
            block_visibility(state.valid, block_valid),
        )
        rows = torch.arange(drafts.shape[0], device=drafts.device)
        state.keys = torch.cat((state.keys, key), 2)
        state.values = torch.cat((state.values, value), 2)
        state.valid = torch.cat((state.valid, block_valid), 1)
        state.hidden = prenorm[rows, num_accepted]
        state.logits = self._target_logits(state.hidden)
        state.next_pos = state.next_pos + num_accepted + 1
        state.drafts = None
        live = int(state.valid.sum(1).max())
        if state.valid.shape[1] > 2 * live:  # amortised: each compaction halves the cache
            self._compact(live)

    def _compact(self, live: int) -> None:
        """Drop holes: keep each row's valid entries in order, right-aligned in ``live`` slots."""
        state = self._require_state()
        order = torch.sort(state.valid.long(), dim=1, stable=True).indices[:, -live:]
        index = order[:, None, :, None].expand(-1, state.keys.shape[1], -1, state.keys.shape[-1])
        state.keys = state.keys.gather(2, index)
        state.values = state.values.gather(2, index)
        state.valid = state.valid.gather(1, order)


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
    """Registry entry (``decode.drafters.registry``): an EAGLE-3 folder as a runtime drafter."""
    if path is None:
        raise ValueError("the eagle3 drafter needs a folder: pass --drafter PATH")
    return Eagle3Drafter.from_pretrained(path, target)
