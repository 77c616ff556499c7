"""The ``dflash`` objective: a DFlash block drafter trained against a frozen target
(docs/theory.md §9).

DFlash (Chen et al. 2026, arXiv 2602.06036) trains what it decodes
(``draftsmith.decode.drafters.dflash.head``): for each sequence it samples anchors ``a`` and
runs the blocks ``[x_a, m, ..., m]`` of all of them in one pass, each block seeing the fused
target features at positions < a and, without a causal mask, its own rows. Row j of the block
at a guesses ``x_{a+j}``; the target's law for that token is its next-token distribution at
``a + j - 1``. In the terms of :class:`draftsmith.train.objectives.heads.HeadObjective`, draft
output k = j - 1 at position t = a - 1 is compared with the target at ``t + 1 + k``, so the
shared alignment, losses (TV, LK, the KLs, CE and their mixes), held-out metrics, target outputs
(online or the offline cache), pruned vocabulary and saving all apply unchanged.

Position weights decay as in the DFlash paper, ``w_j = exp(-(j - 1) / gamma)``
(``dflash_loss_decay`` = gamma): early positions, which every accepted run passes through,
matter most. Anchors: ``dflash_num_anchors`` per sequence, drawn uniformly without replacement
among the positions whose first guessed token is trained (the objective's own seeded generator,
checkpointed with the run); held-out evaluation takes that many anchors evenly spaced, the same
for every run, so ``overlap@j`` is comparable across runs and with EAGLE-3's.

DSpark (arXiv 2607.05147) options: the Markov head (``markov_rank``) is trained with the
teacher-forced previous token; the confidence head (``confidence_head``) with a binary
cross-entropy towards each position's acceptance ``sum_x min(p_j, q_j)`` at the decoding
temperature (a soft label; detached), weighted by ``confidence_weight`` (DSpark: 1.0 beside
0.1 CE + 0.9 TV).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from draftsmith.decode.drafters.dflash.head import DFlashHead
from draftsmith.train.export.dflash import DFLASH_FORMATS
from draftsmith.train.losses import Loss
from draftsmith.train.objectives import Batch
from draftsmith.train.objectives.eagle3 import (
    Eagle3Objective,
    rarest_token,
    recipe_eagle3_settings,
    recipe_head,
)
from draftsmith.train.objectives.heads import SampledRows, future_mask, overlap_at

if TYPE_CHECKING:
    from draftsmith.train.config import DistillConfig
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def decay_weights(positions: int, gamma: float) -> tuple[float, ...]:
    """DFlash's position weights ``exp(-(j - 1) / gamma)``, j = 1..positions."""
    if not gamma > 0:
        raise ValueError(f"--dflash_loss_decay must be > 0, got {gamma}")
    return tuple(math.exp(-j / gamma) for j in range(positions))


def sample_anchors(
    candidates: torch.Tensor,  # [B, T] bool: positions a whose block trains x_{a+1}
    count: int,
    generator: torch.Generator | None,  # None: evenly spaced (evaluation)
) -> tuple[torch.Tensor, torch.Tensor]:  # anchors [B, M] int64, valid [B, M] bool
    """Up to ``count`` anchors per row among its candidates (module docstring); slots past a
    row's candidates are padding (``valid`` False, anchor 1)."""
    batch = candidates.shape[0]
    available = candidates.sum(1)  # [B]
    take = int(min(count, int(available.max()) if batch else 0)) or 1
    if generator is None:
        # The i-th of `take` evenly spaced ranks among each row's candidates.
        rank = candidates.long().cumsum(1) - 1  # [B, T]
        wanted = (torch.arange(take, device=candidates.device)[None] * available[:, None]) // take
        hit = candidates[:, None, :] & (rank[:, None, :] == wanted[:, :, None])  # [B, M, T]
        anchors = hit.float().argmax(-1)
    else:
        keys = torch.rand(candidates.shape, generator=generator).to(candidates.device)
        keys = torch.where(candidates, keys, torch.full_like(keys, 2.0))
        anchors = keys.topk(take, dim=1, largest=False).indices.sort(dim=1).values
    valid = torch.arange(take, device=candidates.device)[None] < available[:, None]
    anchors = torch.where(valid, anchors, torch.ones_like(anchors))
    return anchors, valid


class BlockTrainer(torch.nn.Module):
    """The trainable module: a :class:`DFlashHead` whose ``forward`` runs the sampled blocks
    (through ``forward`` so that accelerate's wrappers see it)."""

    def __init__(self, head: DFlashHead, embed: torch.nn.Module) -> None:
        super().__init__()
        self.head = head
        self._embed = [embed]  # the frozen target's embedding, not a submodule of this one

    def forward(
        self,
        aux_hidden: torch.Tensor,  # [B, T, A*H]
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor,  # [B, T]
        anchors: torch.Tensor,  # [B, M]
        anchor_valid: torch.Tensor,  # [B, M]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [B, M, B-1, Vd], [B, M, B-1]
        return self.head.blocks(
            aux_hidden, input_ids, self._embed[0], attention_mask, anchors, anchor_valid
        )


class DFlashObjective(Eagle3Objective):
    """Train a :class:`DFlashHead` on a frozen target; see the module docstring."""

    kind: ClassVar[str] = "dflash"
    head: DFlashHead

    def __init__(
        self,
        head: DFlashHead,
        target: torch.nn.Module,
        loss: Loss,
        *,
        num_anchors: int = 16,
        loss_decay: float = 7.0,
        confidence_weight: float = 1.0,
        choose_mask_token: bool = True,
        seed: int = 0,
        **settings: Any,
    ) -> None:
        if settings.get("align_topk"):
            raise ValueError(
                "--align_topk does not apply to dflash (a block's positions are drafted in one "
                "pass, not as a chain); leave it at 0"
            )
        if num_anchors < 1:
            raise ValueError(f"--dflash_num_anchors must be >= 1, got {num_anchors}")
        if confidence_weight < 0:
            raise ValueError(f"--confidence_weight must be >= 0, got {confidence_weight}")
        positions = head.config.draft_tokens
        settings["unroll_steps"] = positions
        settings["step_weights"] = decay_weights(positions, loss_decay)
        bad = [f for f in settings.get("export_formats") or () if f not in DFLASH_FORMATS]
        if bad:
            raise ValueError(
                f"--export_format {','.join(bad)}: a dflash drafter exports as "
                f"{' or '.join(DFLASH_FORMATS)} (vLLM's qwen3_dflash and speculators' dflash "
                "layouts)"
            )
        if settings.get("export_formats") and (
            head.config.markov_rank or head.config.confidence_head
        ):
            raise ValueError(
                "--export_format: vLLM's and speculators' DFlash layouts have no DSpark Markov "
                "or confidence head; drop --markov_rank/--confidence_head or the export"
            )
        super().__init__(head, target, loss, **settings)
        self.blocks = BlockTrainer(head, target.get_input_embeddings())
        self.num_anchors = num_anchors
        self.loss_decay = loss_decay
        self.confidence_weight = confidence_weight
        self.choose_mask_token = choose_mask_token
        self.seed = seed
        self.anchor_generator = torch.Generator().manual_seed(seed)
        self._confidence: torch.Tensor | None = None  # [B, M, B-1] of the last forward

    @classmethod
    def from_config(
        cls,
        config: DistillConfig,
        target: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        loss: Loss,
    ) -> DFlashObjective:
        drafter = config.drafter
        head = recipe_head(
            config,
            target,
            DFlashHead,
            block_size=drafter.dflash_block_size,
            mask_token_id=drafter.mask_token_id,
            markov_rank=drafter.markov_rank,
            confidence_head=drafter.confidence_head,
        )
        return cls(
            head,
            target,
            loss,
            num_anchors=config.loss.dflash_num_anchors,
            loss_decay=config.loss.dflash_loss_decay,
            confidence_weight=config.loss.confidence_weight,
            choose_mask_token=drafter.mask_token_id is None,
            seed=config.optim.seed,
            **recipe_eagle3_settings(config),
        )

    # ------------------------------------------------------------------ data hooks

    def prepare(self, train_rows: Sequence[dict[str, Any]]) -> None:
        """EAGLE-3's draft vocabulary, then the mask token: the rarest token of the rows (ties
        to the highest id) unless the recipe named one. Its embedding is the target's row."""
        super().prepare(train_rows)
        if not self.choose_mask_token:
            return
        vocab = self.head.config.target_vocab_size
        self.head.config.mask_token_id = rarest_token(train_rows, vocab)

    def trainable_module(self) -> torch.nn.Module:
        return self.blocks

    def bind(self, module: torch.nn.Module, accelerator: Any) -> None:
        super().bind(module, accelerator)
        self.anchor_generator.manual_seed(self.seed + accelerator.process_index)

    def state_dict(self) -> dict[str, Any]:
        return {"anchors": self.anchor_generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.anchor_generator.set_state(state["anchors"])

    # ------------------------------------------------------------------ DFlash's own parts

    def _draft_logits(self, batch: Batch, features: torch.Tensor) -> list[SampledRows]:
        """Block row j at anchor a as draft output j - 1 at position a - 1 (module docstring)."""
        input_ids = batch["input_ids"]  # [B, T]
        length = input_ids.shape[1]
        attention = batch.get("attention_mask")
        if attention is None:
            attention = torch.ones_like(input_ids)
        trained = future_mask(batch, 2)  # [B, T - 2]: x_{t+2} trained, t = a - 1
        candidates = F.pad(trained, (1, length - trained.shape[1] - 1))  # [B, T] by anchor a
        generator = self.anchor_generator if self.module.training else None
        anchors, valid = sample_anchors(candidates, self.num_anchors, generator)
        dtype = self.trained_head.fc.weight.dtype
        logits, confidence = self.module(features.to(dtype), input_ids, attention, anchors, valid)
        self._confidence = confidence
        return [SampledRows(logits[:, :, j], anchors - 1, valid) for j in range(logits.shape[2])]

    def _auxiliary_loss(
        self, batch: Batch, drafts: Sequence[SampledRows], target: torch.Tensor
    ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The confidence head's BCE towards each position's acceptance (module docstring)."""
        confidence, self._confidence = self._confidence, None
        if confidence is None or self.confidence_weight == 0:
            return None, {}
        terms, counts = [], []
        for k, (_, draft, target_k, mask, _) in enumerate(self._aligned(batch, drafts, target)):
            if not bool(mask.any()):
                continue
            with torch.no_grad():
                accept = overlap_at(
                    self._to_target_logits(draft.detach()), target_k, mask, self.eval_temperature
                )
            logit = confidence[:, :, k].float()
            bce = F.binary_cross_entropy_with_logits(logit, accept.float(), reduction="none")
            terms.append((bce * mask).sum())
            counts.append(mask.sum())
        if not terms:
            return None, {}
        value = torch.stack(terms).sum() / torch.stack(counts).sum()
        return self.confidence_weight * value, {"confidence_bce": float(value.detach())}

    def _architecture(self) -> dict[str, Any]:
        config = self.trained_head.config
        return {
            **super()._architecture(),
            "architecture": "DFlash block drafter (z-lab DFlashDraftModel / vLLM qwen3_dflash "
            "weight names)"
            + (", DSpark Markov head" if config.markov_rank else "")
            + (", DSpark confidence head" if config.confidence_head else ""),
            "num_hidden_layers": config.num_hidden_layers,
            "block_size": config.block_size,
            "mask_token_id": config.mask_token_id,
            "markov_rank": config.markov_rank,
            "confidence_head": config.confidence_head,
            "num_anchors": self.num_anchors,
            "loss_decay": self.loss_decay,
            "confidence_weight": self.confidence_weight,
        }

    def _export(self, drafter: torch.nn.Module, folder: Path, fmt: str) -> None:
        """vLLM's ``qwen3_dflash`` or the speculators ``dflash`` layout, which names the target
        as its verifier (``draftsmith.train.export.dflash``)."""
        from draftsmith.train.export.dflash import export_dflash

        export_dflash(drafter, folder, fmt, overwrite=True, **self._verifier())
