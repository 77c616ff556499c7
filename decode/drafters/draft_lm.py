"""A small causal LM that shares the target's tokenizer and drafts autoregressively.

Leviathan et al. 2023: the draft samples ``d_1 .. d_N`` from its own (transformed) distribution
``q``, one forward pass per token, over its own KV cache. After verification its cache keeps the
accepted drafts; what it has not read yet (the token emitted after them, and ``d_N`` when every
draft was accepted) is fed at the start of the next proposal.
"""

from __future__ import annotations

import torch

from decode.drafters.base import Drafter, DraftProposal, TargetPass
from decode.kv_cache import CachedSequence
from decode.lean_decoder import LeanDecoder
from decode.output_head import OutputHead
from decode.sampling import SamplingConfig, select_tokens


class DraftModelDrafter(Drafter):
    """Drafts with a Hugging Face causal LM (``AutoModelForCausalLM``)."""

    kind = "draft_lm"
    supports_external_drafts = True

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval()
        self._head = OutputHead.for_model(self.model)
        # The draft's own forward may differ from the model's by float rounding: exactness only
        # needs the q it reports, which is the q it sampled from.
        self._decoder = LeanDecoder.for_model(self.model) if self._head is not None else None
        self._sequence: CachedSequence | None = None
        self._unread: torch.Tensor | None = None  # [B, W] tokens the draft has not read
        self._unread_valid: torch.Tensor | None = None  # [B, W] bool
        self._last_drafts: torch.Tensor | None = None  # [B, N] the tokens the round verifies
        self._replaced: torch.Tensor | None = None  # [B] bool rows drafted by another proposer
        self._own_width = 0  # tokens this drafter proposed (and read all but the last of)

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def prefill(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor,  # [B, T]
        target_pass: TargetPass,
        pending: torch.Tensor,  # [B]
    ) -> None:
        device = input_ids.device
        self._sequence = CachedSequence(
            self.model, input_ids.shape[0], device, self._head, self._decoder
        )
        with torch.inference_mode():
            self._sequence.extend(input_ids, attention_mask.bool(), logits_to_keep=1)
        self._unread = pending[:, None]
        self._unread_valid = torch.ones_like(self._unread, dtype=torch.bool)

    @torch.inference_mode()
    def propose(
        self,
        num_tokens: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        sequence = self._require_state()
        self._own_width = num_tokens
        if num_tokens == 0:  # nothing read: the unread tokens wait for the next proposal
            self._last_drafts = self._unread.new_empty(self._unread.shape[0], 0)
            return DraftProposal(tokens=self._last_drafts, probs=None)
        logits = sequence.extend(self._unread, self._unread_valid, logits_to_keep=1).logits
        tokens, probs = [], []
        for step in range(num_tokens):
            token, token_probs = select_tokens(logits[:, -1], sampling, generator)
            tokens.append(token)
            probs.append(token_probs)
            if step + 1 < num_tokens:
                logits = sequence.extend(token[:, None], logits_to_keep=1).logits
        self._last_drafts = torch.stack(tokens, dim=1)
        stacked = None if sampling.greedy else torch.stack(probs, dim=1)
        return DraftProposal(tokens=self._last_drafts, probs=stacked)

    def replace_drafts(
        self,
        tokens: torch.Tensor,  # [B, W]
        replaced: torch.Tensor,  # [B] bool
    ) -> None:
        drafts = self._last_drafts
        if drafts.shape[1] and tokens.shape[1] != drafts.shape[1]:
            raise ValueError(
                f"replacement drafts have width {tokens.shape[1]}, the proposal {drafts.shape[1]}"
            )
        if drafts.shape[1]:
            self._last_drafts = torch.where(replaced[:, None], tokens, drafts)
            self._replaced = replaced
        else:  # a zero-width proposal: every row verifies the other proposer's tokens
            self._last_drafts = tokens
            self._replaced = torch.ones_like(replaced)

    def commit(
        self,
        num_accepted: torch.Tensor,  # [B]
        next_tokens: torch.Tensor,  # [B]
        target_pass: TargetPass,
    ) -> None:
        """Keep what the draft read of the accepted tokens; queue the rest to read next time.

        The draft read ``d_1 .. d_{N-1}`` of its own proposal; rows whose drafts were replaced
        (``replace_drafts``) read none of the verified ones. Unread: ``d_N`` when all N of a
        row's own drafts were accepted, a replaced row's accepted drafts, then the next token.
        """
        sequence = self._require_state()
        drafts = self._last_drafts  # [B, N] the verified tokens
        replaced, self._replaced = self._replaced, None
        num_drafts = drafts.shape[1]
        read_own = self._own_width > 0
        ones = torch.ones_like(next_tokens, dtype=torch.bool)[:, None]
        if not read_own:  # nothing was read this round: queue the accepted drafts too
            columns = torch.arange(num_drafts, device=drafts.device)[None, :]
            self._unread = torch.cat([self._unread, drafts, next_tokens[:, None]], dim=1)
            self._unread_valid = torch.cat(
                [self._unread_valid, columns < num_accepted[:, None], ones], dim=1
            )
            return
        if replaced is None:
            replaced = torch.zeros_like(next_tokens, dtype=torch.bool)
        # Own rows keep the accepted drafts among d_1 .. d_{N-1}; replaced rows keep none.
        keep = torch.where(replaced, 0, num_accepted.clamp(max=num_drafts - 1))
        sequence.rollback(num_drafts - 1, keep)
        columns = torch.arange(num_drafts, device=drafts.device)[None, :]
        first_unread = torch.where(replaced, 0, num_drafts - 1)[:, None]  # [B, 1]
        unread_valid = (columns >= first_unread) & (columns < num_accepted[:, None])
        if bool(unread_valid.any()):
            self._unread = torch.cat([drafts, next_tokens[:, None]], dim=1)
            self._unread_valid = torch.cat([unread_valid, ones], dim=1)
        else:
            self._unread = next_tokens[:, None]
            self._unread_valid = ones

    def _require_state(self) -> CachedSequence:
        if self._sequence is None:
            raise RuntimeError("DraftModelDrafter.propose called before prefill")
        return self._sequence
