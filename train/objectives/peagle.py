"""The ``peagle`` objective: a P-EAGLE head trained on all its depths in one pass
(docs/theory.md §8).

P-EAGLE (Hui et al. 2026; the ``peagle`` model of vllm-project/speculators) drafts depth 1
from EAGLE-3's ordinary row and depths 2..N from mask rows that see the committed context and
their own chain only (``draftsmith.decode.drafters.eagle.peagle``). Training runs what decoding runs: one
forward over the sequence's committed rows (all T positions, depth 1) and, for depth k >= 2,
a mask row at each sampled anchor t, at position ``t + k - 1``, under the P-EAGLE attention
mask (:func:`draftsmith.decode.drafters.eagle.peagle.parallel_visibility`). Depth k's logits at anchor t guess
``x_{t+1+k}`` against the target's law at ``t+k``, so the losses, their weights ``w_k``, the
target's outputs (online or from the offline cache), the pruned vocabulary, saving and the
held-out metrics are EAGLE-3's (:class:`draftsmith.train.objectives.eagle3.Eagle3Objective`,
:class:`draftsmith.train.objectives.heads.HeadObjective`); ``unroll_steps`` is the depth count N.

Conditional drop-token (COD) sampling bounds the memory of the deeper depths (the speculators
``down_sample_ratio`` / ``down_sample_ratio_min``). With ``r = cod_ratio`` and
``f = cod_min_ratio``, depth k >= 2 keeps about ``n_k * max(r^(k-1), f)`` anchors of a row,
``n_k`` being the row's positions whose depth-k token is trained, drawn uniformly without
replacement among the anchors kept at depth k - 1 (nested, because a mask row attends to its
chain's shallower rows). A step then runs ``T * (1 + sum_k max(r^(k-1), f))`` rows instead of
``N * T`` (2.5 T instead of 4 T at N = 4, r = 0.7, f = 0.2). Each depth's loss is the mean over
its kept anchors, an unbiased estimate of the full-sequence mean. Held-out evaluation (the
module in eval mode) keeps every anchor, so ``overlap@j`` means what it means for EAGLE-3.
The draws come from the objective's own seeded generator, checkpointed with the run.

The mask token's id (``mask_token_id``, the placeholder the exported ``embed_tokens`` row
carries) is the rarest token of the training rows unless the recipe names one; its embedding
starts from the target's row of that token and is trained with the head.
GRIFFIN's ``align_topk`` is refused: the chains of the sampled anchors are not positional.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from draftsmith.decode.drafters.eagle.peagle import PEagleHead
from draftsmith.train.losses import Loss
from draftsmith.train.objectives import Batch
from draftsmith.train.objectives.eagle3 import (
    Eagle3Objective,
    rarest_token,
    recipe_eagle3_settings,
    recipe_head,
)
from draftsmith.train.objectives.heads import SampledRows, future_mask

if TYPE_CHECKING:
    from draftsmith.train.config import DistillConfig
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def cod_anchors(
    candidates: Sequence[torch.Tensor],  # per depth k = 2..N: [B, T] bool, depth k trained at t
    real: torch.Tensor,  # [B, T] bool: real tokens (the depth-1 rows)
    ratio: float,
    min_ratio: float,
    generator: torch.Generator | None,  # None: keep every candidate (evaluation)
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # anchors, valid: [B, M_k] per depth
    """Conditional drop-token sampling of the anchors of depths 2..N (module docstring).

    Depth k keeps ``floor(n_k * max(ratio^(k-1), min_ratio))`` anchors of each row (``n_k``
    its candidates), drawn without replacement from its candidates that depth k - 1 kept;
    fewer when that pool is smaller. Slots past a row's count are padding (``valid`` False).
    """
    members = real
    anchors, valids = [], []
    for k, candidate in enumerate(candidates, start=1):
        pool = members & candidate  # [B, T]
        if generator is None:
            wanted = pool.sum(1)
            keys = (~pool).float()  # pool first, in position order (a stable sort)
        else:
            share = max(ratio**k, min_ratio)
            wanted = (candidate.sum(1).double() * share).floor().long()
            keys = torch.rand(pool.shape, generator=generator).to(pool.device)
            keys = torch.where(pool, keys, 2.0)  # outside the pool: after every member
        count = int(wanted.max()) if wanted.numel() else 0
        index = keys.argsort(dim=1, stable=True)[:, :count]  # [B, M]
        slot = torch.arange(count, device=pool.device)
        valid = (slot < wanted[:, None]) & pool.gather(1, index)
        members = torch.zeros_like(pool).scatter(1, index, valid)
        anchors.append(index)
        valids.append(valid)
    return anchors, valids


def rows_per_position(ratio: float, min_ratio: float, depths: int) -> float:
    """Head rows a COD step runs per sequence position: ``1 + sum_k max(ratio^(k-1),
    min_ratio)`` over depths k = 2..N (N rows without sampling)."""
    return 1 + math.fsum(max(ratio**k, min_ratio) for k in range(1, depths))


class ParallelHead(torch.nn.Module):
    """The trainable module: a :class:`PEagleHead` whose ``forward`` is the one-pass P-EAGLE
    forward (run through ``forward`` so that accelerate's wrappers see it)."""

    def __init__(self, head: PEagleHead) -> None:
        super().__init__()
        self.head = head

    def forward(
        self,
        aux_hidden: torch.Tensor,  # [B, T, A*H]
        next_ids: torch.Tensor,  # [B, T] token t+1 at index t
        next_embeds: torch.Tensor,  # [B, T, H] the target's embeddings of next_ids
        attention_mask: torch.Tensor,  # [B, T]
        anchors: list[torch.Tensor],  # per depth 2..N: [B, M_k]
        anchor_valid: list[torch.Tensor],  # per depth 2..N: [B, M_k] bool
    ) -> list[torch.Tensor]:  # [B, T, V_draft], then [B, M_k, V_draft] per depth
        embeds = self.head.with_mask_embedding(next_ids, next_embeds)
        return self.head.parallel(aux_hidden, embeds, attention_mask, anchors, anchor_valid)


class PEagleObjective(Eagle3Objective):
    """Train a :class:`PEagleHead` on a frozen target; see the module docstring."""

    kind: ClassVar[str] = "peagle"
    head: PEagleHead

    def __init__(
        self,
        head: PEagleHead,
        target: torch.nn.Module,
        loss: Loss,
        *,
        cod_ratio: float = 0.7,
        cod_min_ratio: float = 0.2,
        choose_mask_token: bool = True,
        seed: int = 0,
        **settings: Any,
    ) -> None:
        if settings.get("align_topk"):
            raise ValueError(
                "--align_topk does not apply to peagle (its sampled chains are not positional); "
                "leave it at 0"
            )
        bad = [f for f in settings.get("export_formats") or () if f != "speculators"]
        if bad:
            raise ValueError(
                f"--export_format {','.join(bad)}: vLLM serves P-EAGLE from the speculators "
                "layout only; use --export_format speculators"
            )
        if not 0.0 < cod_ratio <= 1.0 or not 0.0 <= cod_min_ratio <= 1.0:
            raise ValueError(
                f"--cod_ratio must lie in (0, 1] and --cod_min_ratio in [0, 1], got "
                f"{cod_ratio} and {cod_min_ratio}"
            )
        super().__init__(head, target, loss, **settings)
        if self.unroll_steps != head.config.num_depths:
            raise ValueError(
                f"the head drafts {head.config.num_depths} depths but unroll_steps is "
                f"{self.unroll_steps}: build it with num_depths=unroll_steps"
            )
        self.parallel = ParallelHead(head)
        self.cod_ratio, self.cod_min_ratio = cod_ratio, cod_min_ratio
        self.choose_mask_token = choose_mask_token
        self.seed = seed
        self.cod = torch.Generator().manual_seed(seed)
        if self.init_from_target:
            self._copy_mask_embedding()

    @classmethod
    def from_config(
        cls,
        config: DistillConfig,
        target: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        loss: Loss,
    ) -> PEagleObjective:
        mask_id = config.drafter.mask_token_id
        head = recipe_head(
            config,
            target,
            PEagleHead,
            num_depths=config.loss.unroll_steps,
            mask_token_id=mask_id,
        )
        return cls(
            head,
            target,
            loss,
            cod_ratio=config.loss.cod_ratio,
            cod_min_ratio=config.loss.cod_min_ratio,
            choose_mask_token=mask_id is None,
            seed=config.optim.seed,
            **recipe_eagle3_settings(config),
        )

    # ------------------------------------------------------------------ data hooks

    def prepare(self, train_rows: Sequence[dict[str, Any]]) -> None:
        """EAGLE-3's draft vocabulary, then the mask token: the rarest token of the rows (ties
        to the highest id) unless the recipe named one."""
        super().prepare(train_rows)
        if not self.choose_mask_token:
            return
        vocab = self.head.config.target_vocab_size
        self.head.config.mask_token_id = rarest_token(train_rows, vocab)
        if self.init_from_target:
            self._copy_mask_embedding()

    def trainable_module(self) -> torch.nn.Module:
        return self.parallel

    def bind(self, module: torch.nn.Module, accelerator: Any) -> None:
        super().bind(module, accelerator)
        self.cod.manual_seed(self.seed + accelerator.process_index)

    def state_dict(self) -> dict[str, Any]:
        return {"cod": self.cod.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cod.set_state(state["cod"])

    # ------------------------------------------------------------------ P-EAGLE's own parts

    def _draft_logits(
        self, batch: Batch, features: torch.Tensor
    ) -> list[torch.Tensor | SampledRows]:
        """Depth 1 at every position, depths 2..N at COD-sampled anchors (all in eval mode)."""
        input_ids = batch["input_ids"]  # [B, T]
        length = input_ids.shape[1]
        attention = batch.get("attention_mask")
        if attention is None:
            attention = torch.ones_like(input_ids)
        candidates = []
        for k in range(1, self.unroll_steps):  # depth k + 1 guesses x_{t+2+k}
            trained = future_mask(batch, 2 + k)  # [B, T - 2 - k]
            candidates.append(F.pad(trained, (0, length - trained.shape[1])))
        generator = self.cod if self.module.training else None
        anchors, valid = cod_anchors(
            candidates, attention.bool(), self.cod_ratio, self.cod_min_ratio, generator
        )
        dtype = self.trained_head.fc.weight.dtype
        next_ids = torch.cat((input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])), dim=1)
        with torch.no_grad():
            next_embeds = self.target.get_input_embeddings()(next_ids)
        logits = self.module(
            features.to(dtype), next_ids, next_embeds.to(dtype), attention, anchors, valid
        )
        return [
            logits[0],
            *(SampledRows(d, a, v) for d, a, v in zip(logits[1:], anchors, valid, strict=True)),
        ]

    def _architecture(self) -> dict[str, Any]:
        config = self.trained_head.config
        rows = rows_per_position(self.cod_ratio, self.cod_min_ratio, config.num_depths)
        return {
            **super()._architecture(),
            "architecture": "P-EAGLE head (EAGLE-3 layer, all depths in one pass; speculators "
            "peagle layout)",
            "num_depths": config.num_depths,
            "mask_token_id": config.mask_token_id,
            "cod_ratio": self.cod_ratio,
            "cod_min_ratio": self.cod_min_ratio,
            "training_rows_per_position": round(rows, 4),
        }

    def _export(self, drafter: torch.nn.Module, folder: Path, fmt: str) -> None:
        """The speculators ``peagle`` layout vLLM serves (``draftsmith.train.export.formats``)."""
        from draftsmith.train.export.formats import export_peagle

        embeddings = self.target.get_input_embeddings().weight
        export_peagle(drafter, embeddings, folder, overwrite=True, **self._verifier())

    @torch.no_grad()
    def _copy_mask_embedding(self) -> None:
        """Start the mask embedding from the target's row of the mask token."""
        weight = self.target.get_input_embeddings().weight
        row = weight[self.head.config.mask_token_id]
        self.head.mask_embed.copy_(row.to(self.head.mask_embed))
