"""The ``draft_lm`` objective: a small causal LM distilled from a frozen target.

At every position t of a training sequence the drafter's next-token distribution
``q(. | x_<=t)`` is pulled towards the target's ``p(. | x_<=t)`` with the configured divergence
(``train.losses``: TV maximises the acceptance ``alpha = sum_x min(p, q)`` directly, KLs and
JSD are smoother surrogates; Zhou et al. 2024, DistillSpec). Only positions whose next token
counts (``loss_mask``; the generated part of regenerated or on-policy sequences) enter the loss.

Where the target's ``p`` comes from:

- online: the frozen target scores the batch in the same step;
- the offline cache: the batch carries the target's top-k log-probs and the rest mass
  (``data.cache``), expanded by ``data.cache.topk_to_probs``;
- on-policy (GKD, Agarwal et al. 2024): with probability ``on_policy_fraction`` a batch keeps
  only its first ``on_policy_prompt_tokens`` tokens, the drafter continues it by sampling, and
  the target scores the result online, so the drafter learns on the prefixes it produces.

Held-out metric: ``overlap@1``, the mean of ``sum_x min(p, q)`` over the held-out positions at
the decoding temperature, which is the expected acceptance rate of draft position 1
(Leviathan et al. 2023); ``greedy_match@1`` is the same at temperature 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from decode.sampling import SamplingConfig
from train.drafter_models import build_draft_lm, check_same_vocab, vocab_size_of
from train.generation import sample_continuations
from train.losses import Loss, TargetProbs, cross_entropy, overlap
from train.objectives import Batch, MetricSums, Objective
from train.objectives.causal_lm import next_token_targets

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from train.config import DistillConfig

DRAFTER_FORMAT_VERSION = 1


class DraftLMObjective(Objective):
    """Distil a causal-LM drafter (full or LoRA) from a frozen target."""

    kind: ClassVar[str] = "draft_lm"

    def __init__(
        self,
        drafter: torch.nn.Module,
        target: torch.nn.Module,
        loss: Loss,
        loss_temperature: float = 1.0,
        eval_temperature: float = 1.0,
        on_policy_fraction: float = 0.0,
        on_policy_prompt_tokens: int = 32,
        on_policy_temperature: float = 1.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_same_vocab(drafter, target)
        self.drafter = drafter
        self.target = target.eval().requires_grad_(False)
        self.loss = loss
        self.loss_temperature = loss_temperature
        self.eval_temperature = eval_temperature
        self.on_policy_fraction = on_policy_fraction
        self.on_policy_prompt_tokens = on_policy_prompt_tokens
        self.on_policy_sampling = SamplingConfig(temperature=on_policy_temperature)
        self.vocab_size = vocab_size_of(target)
        self.seed = seed
        # Which batches go on-policy (CPU coin) and what the drafter samples (on the device):
        # both seeded and checkpointed, so a resumed run replays the same batches.
        self.coin = torch.Generator().manual_seed(seed)
        self.sampler = torch.Generator().manual_seed(seed + 1)

    @classmethod
    def from_config(
        cls,
        config: DistillConfig,
        target: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        loss: Loss,
    ) -> DraftLMObjective:
        drafter = build_draft_lm(config.drafter, target, config.optim.seed)
        return cls(
            drafter,
            target,
            loss,
            loss_temperature=config.loss.loss_temperature,
            eval_temperature=config.loss.eval_temperature,
            on_policy_fraction=config.data.on_policy_fraction,
            on_policy_prompt_tokens=config.data.on_policy_prompt_tokens,
            on_policy_temperature=config.data.on_policy_temperature,
            seed=config.optim.seed,
        )

    # ------------------------------------------------------------------ loop protocol

    def trainable_module(self) -> torch.nn.Module:
        return self.drafter

    def bind(self, module: torch.nn.Module, accelerator: Any) -> None:
        super().bind(module, accelerator)
        self.target.to(accelerator.device)
        self.sampler = torch.Generator(accelerator.device)
        self.sampler.manual_seed(self.seed + 1 + accelerator.process_index)

    def compute_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        metrics: dict[str, float] = {}
        if self.on_policy_fraction > 0:
            draw = torch.rand((), generator=self.coin).item()
            on_policy = draw < self.on_policy_fraction
            metrics["on_policy"] = float(on_policy)
            if on_policy:
                batch = self.on_policy_batch(batch)
        draft_logits = self._draft_logits(batch)  # [B, T-1, V]
        labels, weights = next_token_targets(batch)  # [B, T-1]
        mask = weights > 0
        target = self._target(batch) if self.loss.needs_target else None
        parts = self.loss.parts(draft_logits, target, mask, self.loss_temperature, labels=labels)
        loss = self.loss.combine(parts)
        for key, value in parts.items():
            metrics[f"loss_{key}"] = float(value.detach())
        if target is not None:
            alpha = overlap(draft_logits.detach(), target, mask, self.loss_temperature)
            metrics["overlap"] = float(alpha.sum() / mask.sum().clamp_min(1))
        return loss, metrics

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> MetricSums:
        draft_logits = self._draft_logits(batch)  # [B, T-1, V]
        labels, weights = next_token_targets(batch)
        mask = weights > 0
        count = float(mask.sum())
        if count == 0:
            return {}
        target = self._target(batch)
        sampled = overlap(draft_logits, target, mask, self.eval_temperature)
        greedy = overlap(draft_logits, target, mask, 0.0)
        loss = self.loss(draft_logits, target, mask, self.loss_temperature, labels=labels)
        nll = cross_entropy(draft_logits, labels, mask)
        return {
            "overlap@1": (float(sampled.sum()), count),
            "greedy_match@1": (float(greedy.sum()), count),
            "loss": (float(loss) * count, count),
            "draft_nll": (float(nll) * count, count),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"coin": self.coin.get_state(), "sampler": self.sampler.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coin.set_state(state["coin"])
        self.sampler.set_state(state["sampler"])

    # ------------------------------------------------------------------ export

    def save_drafter(
        self,
        folder: Path,
        tokenizer: PreTrainedTokenizerBase | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """A normal HF causal-LM folder (LoRA merged) plus ``drafter.json``."""
        model = self.unwrapped_module
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if hasattr(model, "merge_and_unload"):  # peft: fold the LoRA deltas into the weights
            import copy

            from train.distributed import whole_peft_copy

            # The gathered state when given: under FSDP the local model holds shards only.
            whole = (
                copy.deepcopy(model) if state_dict is None else whole_peft_copy(model, state_dict)
            )
            whole.merge_and_unload().save_pretrained(folder)
        else:
            model.save_pretrained(folder, state_dict=state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        meta = {
            "kind": self.kind,
            "format_version": DRAFTER_FORMAT_VERSION,
            "vocab_size": self.vocab_size,
        }
        (folder / "drafter.json").write_text(json.dumps(meta, indent=2) + "\n")

    def describe(self) -> dict[str, Any]:
        """Architecture facts for the model card."""
        model = self.unwrapped_module
        config = getattr(model, "config", None)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return {
            "architecture": getattr(config, "architectures", None) or type(model).__name__,
            "num_hidden_layers": getattr(config, "num_hidden_layers", None),
            "hidden_size": getattr(config, "hidden_size", None),
            "parameters": sum(p.numel() for p in model.parameters()),
            "trainable_parameters": trainable,
            "lora": hasattr(model, "merge_and_unload"),
        }

    # ------------------------------------------------------------------ internals

    def on_policy_batch(self, batch: Batch) -> Batch:
        """Keep each row's prompt, let the drafter continue it, mark the continuation.

        Rows with fewer real tokens than the prompt length plus one are left as they were.
        """
        prompt = self.on_policy_prompt_tokens
        input_ids, attention = batch["input_ids"], batch["attention_mask"]  # [B, T]
        length = input_ids.shape[1]
        continued = sample_continuations(
            self.unwrapped_module,
            input_ids[:, :prompt],
            torch.ones_like(input_ids[:, :prompt]),
            length - prompt,
            self.on_policy_sampling,
            self.sampler,
        )
        usable = attention[:, : prompt + 1].all(-1)  # [B]
        new_ids = torch.cat([input_ids[:, :prompt], continued.tokens], dim=1)
        new_mask = torch.zeros_like(attention)
        new_mask[:, prompt:] = continued.valid.long()
        new_attention = torch.ones_like(attention)
        pick = usable[:, None]
        return {
            "input_ids": torch.where(pick, new_ids, input_ids),
            "attention_mask": torch.where(pick, new_attention, attention),
            "loss_mask": torch.where(pick, new_mask, batch.get("loss_mask", attention)),
        }

    def _draft_logits(self, batch: Batch) -> torch.Tensor:  # [B, T-1, V]
        outputs = self.module(
            input_ids=batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            use_cache=False,
        )
        return outputs.logits[:, :-1]

    @torch.no_grad()
    def _target(self, batch: Batch) -> torch.Tensor | TargetProbs:  # [B, T-1, V]
        if "topk_ids" in batch:
            from data.cache import topk_to_probs

            probs = topk_to_probs(
                batch["topk_ids"][:, :-1],
                batch["topk_logprobs"][:, :-1],
                batch["rest_logmass"][:, :-1],
                self.vocab_size,
            )
            return TargetProbs(probs)
        outputs = self.target(
            input_ids=batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            use_cache=False,
        )
        return outputs.logits[:, :-1]
