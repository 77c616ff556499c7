"""The ``medusa`` objective: K Medusa heads trained on a frozen target's last hidden state.

Medusa (Cai et al., 2024) puts K extra heads on the target's final (post-norm) hidden state
``h_t``, the one whose LM head predicts ``x_{t+1}``; head i (0-based) guesses ``x_{t+2+i}``
(``draftsmith.decode.drafters.medusa``). Medusa-1 keeps the backbone frozen and distils each head towards
the target's own distribution for that token, its next-token law at position ``t+1+i``:

    L = sum_i w_i * D_i / sum_i w_i,   D_i = mean over kept t of D(p(. | x_<=t+1+i), q_i(. | t))

with any divergence D of ``draftsmith.train.losses`` and head weights ``w_i`` (the paper uses ``0.8^i``).
A position t counts for head i when ``x_t`` and ``x_{t+2+i}`` are real tokens and
``loss_mask[t+2+i]`` is set. The heads start as copies of the target's LM head on zero residual
blocks (``MedusaHeads.from_target``), so every head starts as the target's next-token head.

The target's hidden state and distributions come online (the frozen target runs under
``no_grad`` with ``output_hidden_states=True``) or from the offline cache (hidden state index
``num_hidden_layers``, the post-norm state, and the top-k log-probabilities). Unlike EAGLE-3
the heads never see their own guesses, so no unrolling is needed: head i's input is the same
at training and inference.

Held-out metrics per head (draft position j = i + 1): ``overlap@j`` (the mean of
``sum_x min(p, q_i)`` at the decoding temperature, the expected acceptance of draft position j
given the earlier ones), ``greedy_match@j`` (the same at temperature 0), ``loss@j``, ``loss``.

Everything but the heads (the target's outputs, alignment, the loss and evaluation loops,
saving and export) is the shared :class:`draftsmith.train.objectives.heads.HeadObjective`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from draftsmith.decode.drafters.medusa import MedusaHeads
from draftsmith.train.losses import Loss
from draftsmith.train.objectives import Batch
from draftsmith.train.objectives.heads import (
    HeadObjective,
    parse_export_formats,
    position_weights,
    recipe_head_settings,
    recipe_position_weights,
)

if TYPE_CHECKING:
    from draftsmith.train.config import DistillConfig
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class SpanHeads(torch.nn.Module):
    """The trainable module: :class:`MedusaHeads` run, per head, only where it is trained.

    Head i is evaluated on positions ``0 .. T-3-i`` (the ones whose token ``t+2+i`` exists),
    so no full ``[B, T, K, V]`` tensor is built and sliced: its backward would allocate that
    much zeros per head.
    """

    def __init__(self, heads: MedusaHeads) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:  # [B, T, H] -> K x [B, S_i, V]
        length = hidden.shape[1]
        out = []
        for i, (block, lm_head) in enumerate(
            zip(self.heads.blocks, self.heads.lm_heads, strict=True)
        ):
            span = length - 2 - i
            if span < 1:
                break
            out.append(lm_head(block(hidden[:, :span])))
        return out


class MedusaObjective(HeadObjective):
    """Train :class:`MedusaHeads` on a frozen target; see the module docstring for the math."""

    kind: ClassVar[str] = "medusa"
    drafter_attribute: ClassVar[str] = "heads"

    def __init__(
        self,
        heads: MedusaHeads,
        target: torch.nn.Module,
        loss: Loss,
        *,
        head_weights: Sequence[float] | None = None,
        align_topk: int = 0,
        loss_temperature: float = 1.0,
        eval_temperature: float = 1.0,
        export_formats: Sequence[str] | str | None = (),
    ) -> None:
        output = target.get_output_embeddings().weight
        if tuple(output.shape) != (heads.config.vocab_size, heads.config.hidden_size):
            raise ValueError(
                f"the Medusa heads map width {heads.config.hidden_size} to "
                f"{heads.config.vocab_size} tokens but the target's LM head is "
                f"{tuple(output.shape[::-1])}: build them with MedusaHeads.from_target(target)"
            )
        for fmt in set(parse_export_formats(export_formats)) - {"vllm"}:
            raise ValueError(
                f"--export_format {fmt}: {fmt} has no Medusa layout; export medusa heads "
                "with --export_format vllm"
            )
        super().__init__(
            target,
            loss,
            position_weights(heads.config.num_heads, head_weights),
            align_topk=align_topk,
            loss_temperature=loss_temperature,
            eval_temperature=eval_temperature,
            export_formats=export_formats,
        )
        self.heads = heads
        self.span_heads = SpanHeads(heads)
        self.num_target_layers = int(target.config.num_hidden_layers)

    @classmethod
    def from_config(
        cls,
        config: DistillConfig,
        target: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        loss: Loss,
    ) -> MedusaObjective:
        num_heads = config.drafter.medusa_num_heads
        heads = MedusaHeads.from_target(target, num_heads, config.drafter.medusa_num_layers)
        heads.float()  # trained in float32 whatever the target's dtype; cast on export/load
        return cls(
            heads,
            target,
            loss,
            head_weights=recipe_position_weights(config, num_heads),
            **recipe_head_settings(config),
        )

    @property
    def head_weights(self) -> tuple[float, ...]:
        """Loss weight of each head (``0.8^i`` by default)."""
        return self.weights

    @property
    def trained_heads(self) -> MedusaHeads:
        """The heads being trained (unwrapped from DDP/compile wrappers)."""
        return self.trained_drafter

    def target_cache_hidden_layers(self) -> list[int]:
        """The offline cache keeps the last (post-norm) hidden state, index ``num_layers``."""
        return [self.num_target_layers]

    def trainable_module(self) -> torch.nn.Module:
        return self.span_heads

    # ------------------------------------------------------------------ Medusa's own parts

    def _features(self, by_layer: dict[int, torch.Tensor]) -> torch.Tensor:  # [B, T, H]
        """The target's last hidden state, in the heads' dtype."""
        dtype = self.trained_heads.lm_heads[0].weight.dtype
        return by_layer[self.num_target_layers].to(dtype)

    def _draft_logits(self, batch: Batch, features: torch.Tensor) -> list[torch.Tensor]:
        return self.module(features)  # K x [B, T-2-i, V]

    def _architecture(self) -> dict[str, Any]:
        config = self.trained_heads.config
        return {
            "architecture": "Medusa heads (vLLM MedusaModel weight layout)",
            "num_heads": config.num_heads,
            "num_layers": config.num_layers,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "head_weights": [round(w, 6) for w in self.head_weights],
        }

    def _export(self, drafter: torch.nn.Module, folder: Path, fmt: str) -> None:
        """vLLM's layout (``draftsmith.train.export.formats.export_medusa``); sglang is refused up front."""
        from draftsmith.train.export.formats import export_medusa

        export_medusa(drafter, folder, overwrite=True)
