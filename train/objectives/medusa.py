"""The ``medusa`` objective: K Medusa heads trained on a frozen target's last hidden state.

Medusa (Cai et al., 2024) puts K extra heads on the target's final (post-norm) hidden state
``h_t``, the one whose LM head predicts ``x_{t+1}``; head i (0-based) guesses ``x_{t+2+i}``
(``decode.drafters.medusa``). Medusa-1 keeps the backbone frozen and distils each head towards
the target's own distribution for that token, its next-token law at position ``t+1+i``:

    L = sum_i w_i * D_i / sum_i w_i,   D_i = mean over kept t of D(p(. | x_<=t+1+i), q_i(. | t))

with any divergence D of ``train.losses`` and head weights ``w_i`` (the paper uses ``0.8^i``).
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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from decode.drafters.medusa import MedusaHeads
from train.losses import Loss, build_loss
from train.objectives import Batch, MetricSums, Objective
from train.objectives.eagle3 import (
    cached_target_logprobs,
    combine_parts,
    future_mask,
    overlap_at,
    parse_export_formats,
    position_weights,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from train.config import DistillConfig


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


class MedusaObjective(Objective):
    """Train :class:`MedusaHeads` on a frozen target; see the module docstring for the math."""

    kind: ClassVar[str] = "medusa"

    def __init__(
        self,
        heads: MedusaHeads,
        target: torch.nn.Module,
        loss: Loss,
        *,
        head_weights: Sequence[float] | None = None,
        loss_temperature: float = 1.0,
        eval_temperature: float = 1.0,
        export_formats: Sequence[str] = (),
    ) -> None:
        super().__init__()
        output = target.get_output_embeddings().weight
        if tuple(output.shape) != (heads.config.vocab_size, heads.config.hidden_size):
            raise ValueError(
                f"the Medusa heads map width {heads.config.hidden_size} to "
                f"{heads.config.vocab_size} tokens but the target's LM head is "
                f"{tuple(output.shape[::-1])}: build them with MedusaHeads.from_target(target)"
            )
        formats = parse_export_formats(",".join(export_formats))
        if "sglang" in formats:
            raise ValueError(
                "--export_format sglang: SGLang loads no Medusa layout; export medusa heads "
                "with --export_format vllm"
            )
        self.heads = heads
        self.span_heads = SpanHeads(heads)
        self.target = target.eval().requires_grad_(False)
        self.loss = loss
        self.head_weights = position_weights(heads.config.num_heads, head_weights)
        self.loss_temperature = loss_temperature
        self.eval_temperature = eval_temperature
        self.export_formats = formats
        self.num_target_layers = int(target.config.num_hidden_layers)

    @classmethod
    def from_config(
        cls,
        config: DistillConfig,
        target: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
    ) -> MedusaObjective:
        num_heads = config.drafter.medusa_num_heads
        heads = MedusaHeads.from_target(target, num_heads, config.drafter.medusa_num_layers)
        heads.float()  # trained in float32 whatever the target's dtype; cast on export/load
        return cls(
            heads,
            target,
            build_loss(config.loss.loss),
            head_weights=position_weights(
                num_heads, config.loss.position_weights, config.loss.position_weight_decay
            ),
            loss_temperature=config.loss.loss_temperature,
            eval_temperature=config.loss.eval_temperature,
            export_formats=parse_export_formats(config.output.export_format),
        )

    # ------------------------------------------------------------------ data hooks

    def target_cache_hidden_layers(self) -> list[int]:
        """The offline cache keeps the last (post-norm) hidden state, index ``num_layers``."""
        return [self.num_target_layers]

    # ------------------------------------------------------------------ loop protocol

    def trainable_module(self) -> torch.nn.Module:
        return self.span_heads

    @property
    def trained_heads(self) -> MedusaHeads:
        """The heads being trained (unwrapped from DDP/compile wrappers)."""
        return self.unwrapped_module.heads

    def bind(self, module: torch.nn.Module, accelerator: Any) -> None:
        super().bind(module, accelerator)
        self.target.to(accelerator.device)

    def compute_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        hidden, target = self._target_outputs(batch)
        logits = self.module(hidden)  # K x [B, T-2-i, V]
        total: torch.Tensor | None = None
        used = 0.0
        metrics: dict[str, float] = {}
        for i, (weight, draft, target_i, mask, labels) in enumerate(
            self._aligned(batch, logits, target)
        ):
            if not bool(mask.any()):
                continue
            parts = self.loss.parts(
                draft,
                target_i if self.loss.needs_target else None,
                mask,
                self.loss_temperature,
                labels=labels,
            )
            value = combine_parts(self.loss, parts)
            total = weight * value if total is None else total + weight * value
            used += weight
            metrics[f"loss@{i + 1}"] = float(value.detach())
            if "tv" in parts:  # the overlap is free with a TV term (a full pass over V is not)
                metrics[f"overlap@{i + 1}"] = 1.0 - float(parts["tv"].detach())
        if total is None:  # no position of this batch reaches any head: a zero step
            return sum(p.sum() for p in self.module.parameters()) * 0.0, metrics
        return total / used, metrics

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> MetricSums:
        hidden, target = self._target_outputs(batch)
        logits = self.module(hidden)  # K x [B, T-2-i, V]
        out: MetricSums = {}
        weighted_loss = weighted_count = 0.0
        for i, (weight, draft, target_i, mask, labels) in enumerate(
            self._aligned(batch, logits, target)
        ):
            count = float(mask.sum())
            if count == 0:
                continue
            sampled = overlap_at(draft, target_i, mask, self.eval_temperature)
            greedy = overlap_at(draft, target_i, mask, 0.0)
            value = float(
                self.loss(
                    draft,
                    target_i if self.loss.needs_target else None,
                    mask,
                    self.loss_temperature,
                    labels=labels,
                )
            )
            out[f"overlap@{i + 1}"] = (float(sampled.sum()), count)
            out[f"greedy_match@{i + 1}"] = (float(greedy.sum()), count)
            out[f"loss@{i + 1}"] = (value * count, count)
            weighted_loss += weight * value * count
            weighted_count += weight * count
        if weighted_count > 0:
            out["loss"] = (weighted_loss, weighted_count)
        return out

    # ------------------------------------------------------------------ export

    def save_drafter(
        self,
        folder: Path,
        tokenizer: PreTrainedTokenizerBase | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """The native folder (``MedusaHeads.save_pretrained``) plus ``<folder>/vllm/`` if asked.

        ``state_dict`` (the gathered trainable state) replaces the local weights when given.
        """
        from train.export_formats import export_medusa

        heads = self.trained_heads
        if state_dict is not None:
            heads = MedusaHeads(heads.config)
            heads.load_state_dict({k.removeprefix("heads."): v for k, v in state_dict.items()})
        folder = Path(folder)
        heads.save_pretrained(folder)
        for _fmt in self.export_formats:  # only vllm: checked in __init__
            export_medusa(heads, folder / "vllm", overwrite=True)

    def describe(self) -> dict[str, Any]:
        """Architecture facts for the model card."""
        heads = self.trained_heads
        config = heads.config
        return {
            "architecture": "Medusa heads (vLLM MedusaModel weight layout)",
            "num_heads": config.num_heads,
            "num_layers": config.num_layers,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "head_weights": [round(w, 6) for w in self.head_weights],
            "parameters": sum(p.numel() for p in heads.parameters()),
            "trainable_parameters": sum(p.numel() for p in heads.parameters() if p.requires_grad),
            "exports": list(self.export_formats),
        }

    # ------------------------------------------------------------------ internals

    @torch.no_grad()
    def _target_outputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's last hidden state [B, T, H] and its logits or log-probs [B, T, V]."""
        dtype = self.trained_heads.lm_heads[0].weight.dtype
        if "topk_ids" in batch:
            if "hidden_states" not in batch:
                raise ValueError(
                    "the batch comes from an offline target cache without hidden states: Medusa "
                    f"needs the last one (index {self.num_target_layers}); rebuild the cache or "
                    "use --target_outputs online"
                )
            cached = batch["hidden_states"]  # [B, 1, T, H]
            if cached.shape[1] != 1:
                raise ValueError(
                    f"the cached hidden states hold {cached.shape[1]} layers, Medusa reads only "
                    "the last one: delete the cache folder to rebuild it"
                )
            target = cached_target_logprobs(
                batch["topk_ids"],
                batch["topk_logprobs"],
                batch["rest_logmass"],
                self.heads.config.vocab_size,
            )
            return cached[:, 0].to(dtype), target
        outputs = self.target(
            input_ids=batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            output_hidden_states=True,
            use_cache=False,
        )
        return outputs.hidden_states[-1].to(dtype), outputs.logits

    def _aligned(
        self, batch: Batch, logits: list[torch.Tensor], target: torch.Tensor
    ) -> Iterable[tuple[float, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per head i: weight, logits [B, S, V], target [B, S, V], mask and labels [B, S].

        ``S = T - 2 - i``: head i at position t predicts ``x_{t+2+i}`` against the target's
        distribution at ``t+1+i`` (``logits`` from :class:`SpanHeads`). Heads that no position
        reaches are skipped.
        """
        input_ids = batch["input_ids"]
        for i, (weight, draft) in enumerate(zip(self.head_weights, logits, strict=False)):
            span = draft.shape[1]
            yield (
                weight,
                draft,
                target[:, 1 + i : 1 + i + span],
                future_mask(batch, 2 + i),
                input_ids[:, 2 + i :],
            )
