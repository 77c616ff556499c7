"""A small causal LM that shares the target's tokenizer and drafts autoregressively.

Leviathan et al. 2023: the draft samples ``d_1 .. d_N`` from its own (transformed) distribution
``q``, one forward pass per token, over its own KV cache. After verification its cache keeps the
accepted drafts; what it has not read yet (the token emitted after them, and ``d_N`` when every
draft was accepted) is fed at the start of the next proposal.

Pruned draft vocabulary (as EAGLE-3's, Li et al. 2025): a draft LM trained with
``--draft_vocab_size`` has an output layer of ``V_draft`` rows (the most frequent training
labels) while its embedding still reads every target token. Its logits, sampling and greedy
choice stay in the draft vocabulary (the output projection, which dominates a small model's step
on CPU, shrinks by ``V / V_draft``); only the chosen ids are mapped to target ids, and the
reported ``q`` is the draft-vocabulary distribution placed in the target vocabulary with zeros
elsewhere (``draftsmith.decode.drafters.vocab_map``), the law the tokens were drawn from, so verification
stays exact. The folder stores that head and the maps beside a normal Hugging Face model
(:func:`load_draft_model`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from draftsmith.decode.drafters.base import Drafter, DraftProposal, TargetPass
from draftsmith.decode.drafters.vocab_map import VocabMap, to_target_ids, to_target_probs
from draftsmith.decode.forward.cached_sequence import CachedSequence, pad_front
from draftsmith.decode.forward.lean_decoder import LeanDecoder
from draftsmith.decode.forward.output_head import DRAFT_LOGITS_DTYPE, OutputHead
from draftsmith.decode.forward.projection import draft_layer_layout, draft_vocab_layout
from draftsmith.decode.sampling import SamplingConfig, select_tokens

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
"""A pruned draft LM's output layer and vocabulary maps: ``lm_head.weight`` [V_draft, H],
``d2t`` [V_draft] int64 (``target_id = draft_id + d2t[draft_id]``) and ``t2d`` [V] bool."""


class DraftModelDrafter(Drafter):
    """Drafts with a Hugging Face causal LM (``AutoModelForCausalLM``)."""

    kind = "draft_lm"
    supports_external_drafts = True

    def __init__(self, model: torch.nn.Module, vocab_map: VocabMap | None = None) -> None:
        """``vocab_map``: the pruned draft vocabulary of ``model``'s output layer (its rows are
        the draft ids); ``None`` when the model predicts over the whole vocabulary."""
        self.model = model.eval()
        rows = model.get_output_embeddings().weight.shape[0]
        if vocab_map is not None and rows != vocab_map.draft_vocab_size:
            raise ValueError(
                f"the draft LM's output layer has {rows} rows but its draft vocabulary "
                f"{vocab_map.draft_vocab_size} tokens: load it with load_draft_model"
            )
        device = model.get_output_embeddings().weight.device
        self.vocab_map = None if vocab_map is None else vocab_map.to(device)
        self._head = OutputHead.for_model(self.model, DRAFT_LOGITS_DTYPE, draft_vocab_layout)
        # The draft's own forward may differ from the model's by float rounding: exactness only
        # needs the q it reports, which is the q it sampled from.
        self._decoder = (
            LeanDecoder.for_model(self.model, draft_layer_layout)
            if self._head is not None
            else None
        )
        self._sequence: CachedSequence | None = None
        self._unread: torch.Tensor | None = None  # [B, W] tokens the draft has not read
        self._unread_valid: torch.Tensor | None = None  # [B, W] bool
        self._last_drafts: torch.Tensor | None = None  # [B, N] the tokens the round verifies
        self._replaced: torch.Tensor | None = None  # [B] bool rows drafted by another proposer
        self._own_width = 0  # tokens this drafter proposed (and read all but the last of)

    @property
    def vocab_size(self) -> int:
        """The target vocabulary the drafts and ``q`` are expressed in."""
        if self.vocab_map is not None:
            return self.vocab_map.target_vocab_size
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
        ids = None if self.vocab_map is None else self.vocab_map.draft_to_target  # [V_draft]
        logits = sequence.extend(self._unread, self._unread_valid, logits_to_keep=1).logits
        tokens, probs = [], []
        for step in range(num_tokens):
            # [B] draft ids and [B, V_draft] probabilities, mapped to the target's vocabulary
            draft_token, token_probs = select_tokens(logits[:, -1], sampling, generator)
            token = to_target_ids(draft_token, ids)  # [B]
            tokens.append(token)
            probs.append(token_probs)
            if step + 1 < num_tokens:
                logits = sequence.extend(token[:, None], logits_to_keep=1).logits
        self._last_drafts = torch.stack(tokens, dim=1)
        stacked = None
        if not sampling.greedy:  # [B, N, V] the law each draft was drawn from
            stacked = to_target_probs(torch.stack(probs, dim=1), ids, self.vocab_size)
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

    def select_rows(self, rows: torch.Tensor) -> None:
        sequence = self._require_state()
        rows = rows.to(self._unread.device, torch.long)
        sequence.select_rows(rows)
        self._unread, self._unread_valid = self._unread[rows], self._unread_valid[rows]
        self._last_drafts = self._replaced = None

    def merge(self, other: Drafter) -> None:
        """Append ``other``'s rows: both caches (``CachedSequence.merge``) and the unread tokens,
        padded in front with invalid columns (the last column stays each row's newest)."""
        if not isinstance(other, DraftModelDrafter) or other.model is not self.model:
            raise TypeError("only a spawn of this draft LM drafter can be merged into it")
        sequence = self._require_state()
        sequence.merge(other._require_state())
        width = max(self._unread.shape[1], other._unread.shape[1])
        self._unread = torch.cat([pad_front(self._unread, width), pad_front(other._unread, width)])
        self._unread_valid = torch.cat(
            [pad_front(self._unread_valid, width), pad_front(other._unread_valid, width)]
        )
        self._last_drafts = self._replaced = None

    def _require_state(self) -> CachedSequence:
        if self._sequence is None:
            raise RuntimeError("DraftModelDrafter.propose called before prefill")
        return self._sequence


def load_draft_model(
    path: str | Path, dtype: str | torch.dtype = "float32", flag: str = "--drafter"
) -> tuple[torch.nn.Module, VocabMap | None]:
    """A draft LM folder: the model (frozen, CPU) and its pruned vocabulary map, if any.

    A pruned folder (``draft_vocab.safetensors`` present) is a normal Hugging Face causal-LM
    folder whose ``config.vocab_size`` is the target's (the embedding reads every target token)
    and whose ``model.safetensors`` holds every weight but ``lm_head.weight``; the output layer
    of ``V_draft`` rows and the maps are read from :data:`DRAFT_VOCAB_FILE` and replace the
    head that ``from_pretrained`` leaves freshly initialised. Shapes and maps are checked.
    """
    from draftsmith.decode.loading import LoadError, load_causal_lm, load_safetensors

    folder = Path(path)
    pruned = (folder / DRAFT_VOCAB_FILE).is_file()
    with _quiet_transformers() if pruned else contextlib.nullcontext():
        model = load_causal_lm(path, dtype, trust_remote_code=False, flag=flag)
    if not pruned:
        return model, None
    fix = "re-export the drafter with train/distill.py"
    tensors = load_safetensors(folder / DRAFT_VOCAB_FILE, fix)
    missing = sorted({"lm_head.weight", "d2t", "t2d"} - set(tensors))
    if missing:
        raise LoadError(f"{folder / DRAFT_VOCAB_FILE} lacks {missing}; {fix}")
    try:
        vocab_map = VocabMap.from_maps(
            tensors["d2t"], tensors["t2d"], str(folder / DRAFT_VOCAB_FILE)
        )
    except ValueError as error:
        raise LoadError(f"{error}; {fix}") from error
    weight = tensors["lm_head.weight"]  # [V_draft, H]
    embed = model.get_input_embeddings().weight  # [V, H]
    expected = (vocab_map.draft_vocab_size, embed.shape[1])
    if tuple(weight.shape) != expected or vocab_map.target_vocab_size != embed.shape[0]:
        raise LoadError(
            f"{folder / DRAFT_VOCAB_FILE}: lm_head.weight {tuple(weight.shape)} and t2d "
            f"[{vocab_map.target_vocab_size}] do not fit the model (head {expected}, "
            f"vocabulary {embed.shape[0]}); {fix}"
        )
    _check_marker(folder, vocab_map.draft_vocab_size)
    head = torch.nn.Linear(embed.shape[1], weight.shape[0], bias=False, dtype=embed.dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
    model.set_output_embeddings(head.requires_grad_(False))
    model.config.tie_word_embeddings = False
    return model, vocab_map


def _check_marker(folder: Path, draft_vocab_size: int) -> None:
    """``drafter.json``'s ``draft_vocab_size``, when recorded, agrees with the stored head."""
    marker = folder / "drafter.json"
    if not marker.is_file():
        return
    from draftsmith.decode.loading import LoadError, read_json_object

    recorded = read_json_object(marker, "re-export the drafter").get("draft_vocab_size")
    if recorded is not None and recorded != draft_vocab_size:
        raise LoadError(
            f"{marker} records draft_vocab_size {recorded!r} but {DRAFT_VOCAB_FILE} holds "
            f"{draft_vocab_size} tokens; re-export the drafter with train/distill.py"
        )


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide the load report of a pruned folder (its ``lm_head.weight`` is stored apart)."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)
