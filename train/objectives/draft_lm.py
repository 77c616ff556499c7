"""The ``draft_lm`` objective: a small causal LM distilled from a frozen target.

At every position t of a training sequence the drafter's next-token distribution
``q(. | x_<=t)`` is pulled towards the target's ``p(. | x_<=t)`` with the configured divergence
(``draftsmith.train.losses``: TV maximises the acceptance ``alpha = sum_x min(p, q)`` directly, KLs and
JSD are smoother surrogates; Zhou et al. 2024, DistillSpec). Only positions whose next token
counts (``loss_mask``; the generated part of regenerated or on-policy sequences) enter the loss.

Where the target's ``p`` comes from:

- online: the frozen target scores the batch in the same step;
- the offline cache: the batch carries the target's top-k log-probs and the rest mass
  (``draftsmith.data.cache``), expanded by ``draftsmith.data.cache.topk_to_probs``;
- on-policy (GKD, Agarwal et al. 2024): with probability ``on_policy_fraction`` a batch keeps
  only its first ``on_policy_prompt_tokens`` tokens, the drafter continues it by sampling, and
  the target scores the result online, so the drafter learns on the prefixes it produces.

Held-out metric: ``overlap@1``, the mean of ``sum_x min(p, q)`` over the held-out positions at
the decoding temperature, which is the expected acceptance rate of draft position 1
(Leviathan et al. 2023); ``greedy_match@1`` is the same at temperature 0.

Pruned draft vocabulary (``--draft_vocab_size``, as EAGLE-3's; Li et al. 2025): the drafter's
output layer keeps ``V_draft`` rows, one per draft token, so its step on CPU reads a
``V_draft / V`` share of the output matrix. :meth:`DraftLMObjective.prepare` picks the most
frequent training labels (``draftsmith.train.objectives.eagle3.count_tokens`` and
``draftsmith.decode.drafters.eagle.head.build_vocab_maps``, as EAGLE-3 does) and takes the rows of those tokens
from the drafter's initial full head (the target's rows when ``drafter_init`` copies its head).
The loss compares ``q`` [V_draft] with the target's distribution restricted to the draft
vocabulary and renormalised (the target's logits, or the cache's log-probs expanded in log
space by ``draftsmith.train.objectives.heads.cached_target_logprobs``, indexed at the draft tokens; the
losses' ``log_softmax`` renormalises); a ``ce`` term drops labels outside the draft vocabulary.
Held-out overlap is measured in the *target* vocabulary with ``q`` placed there (zero
elsewhere), which is what speculative sampling accepts; ``label_in_draft_vocab`` is the share
of held-out labels the draft can propose at all, ``draftable_mass`` the target's probability
on the draft vocabulary at the decoding temperature (the cap on ``overlap@1``). The exported
folder keeps the head and the maps apart from the Hugging Face weights
(:meth:`DraftLMObjective.save_drafter`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from draftsmith.decode.drafters.draft_lm import DRAFT_VOCAB_FILE
from draftsmith.decode.drafters.eagle.head import build_vocab_maps
from draftsmith.decode.drafters.vocab_map import (
    VocabMap,
    to_draft_ids,
    to_target_ids,
    to_target_logits,
)
from draftsmith.decode.sampling import SamplingConfig
from draftsmith.train.drafter_models import (
    build_draft_lm,
    check_same_vocab,
    prune_output_head,
    vocab_size_of,
)
from draftsmith.train.generation import sample_continuations
from draftsmith.train.losses import Loss, TargetProbs, cross_entropy, draftable_mass, overlap
from draftsmith.train.objectives import Batch, MetricSums, Objective
from draftsmith.train.objectives.causal_lm import next_token_logits, next_token_targets
from draftsmith.train.objectives.eagle3 import count_tokens
from draftsmith.train.objectives.heads import cached_target_logprobs

if TYPE_CHECKING:
    from draftsmith.train.config import DistillConfig
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

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
        draft_vocab_size: int | None = None,
        loss_chunk_size: int = 0,
    ) -> None:
        super().__init__()
        check_same_vocab(drafter, target)
        vocab = vocab_size_of(target)
        if draft_vocab_size is not None and not 0 <= draft_vocab_size <= vocab:
            raise ValueError(
                f"--draft_vocab_size must lie in [1, {vocab}] (0 or unset: the whole vocabulary), "
                f"got {draft_vocab_size}"
            )
        # None: the whole vocabulary. Otherwise the output layer's rows stand for the target ids
        # draft_to_target [V_draft] (the first V_draft tokens until prepare chooses them).
        self.draft_vocab_size = (
            draft_vocab_size if draft_vocab_size not in (None, 0, vocab) else None
        )
        self.draft_to_target: torch.Tensor | None = None
        self.vocab_coverage: float | None = None
        self._head_source: torch.Tensor | None = None  # [V, H] the initial full output layer
        if self.draft_vocab_size is not None:
            self._head_source = drafter.get_output_embeddings().weight.detach().clone()
            self.draft_to_target = torch.arange(self.draft_vocab_size)
            prune_output_head(drafter, self.draft_to_target, self._head_source)
            check_same_vocab(drafter, target, self.draft_vocab_size)
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
        self.loss_chunk_size = loss_chunk_size  # 0: the whole batch's logits at once
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
            draft_vocab_size=config.drafter.draft_vocab_size,
            loss_chunk_size=config.loss.loss_chunk_size,
        )

    # ------------------------------------------------------------------ data hooks

    def prepare(self, train_rows: Sequence[dict[str, Any]]) -> None:
        """Choose the draft vocabulary from the training labels' frequencies (as EAGLE-3).

        With the full vocabulary this does nothing. Otherwise the ``draft_vocab_size`` most
        frequent label tokens become the draft vocabulary (:func:`build_vocab_maps`) and the
        output layer is rebuilt from the initial full head's rows of those tokens.
        """
        if self.draft_vocab_size is None:
            self.vocab_coverage = 1.0
            return
        counts = count_tokens(train_rows, self.vocab_size)  # [V]
        total = int(counts.sum())
        if total == 0:
            raise ValueError(
                "the training rows hold no label token to choose a draft vocabulary from: "
                "check loss_mask, or drop --draft_vocab_size to keep the full vocabulary"
            )
        d2t, t2d = build_vocab_maps(counts, self.draft_vocab_size)
        self.draft_to_target = VocabMap.from_maps(d2t, t2d).draft_to_target
        self.vocab_coverage = float(counts[t2d].sum()) / total
        prune_output_head(self.drafter, self.draft_to_target, self._head_source)

    # ------------------------------------------------------------------ loop protocol

    def trainable_module(self) -> torch.nn.Module:
        return self.drafter

    def bind(self, module: torch.nn.Module, accelerator: Any) -> None:
        super().bind(module, accelerator)
        self.target.to(accelerator.device)
        if self.draft_to_target is not None:
            self.draft_to_target = self.draft_to_target.to(accelerator.device)
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
        if self.loss_chunk_size:
            return self._chunked_loss(batch, metrics)
        draft_logits = self._draft_logits(batch)  # [B, T-1, V_draft]
        labels, weights = next_token_targets(batch)  # [B, T-1]
        labels, mask = self._loss_labels(labels, weights > 0)
        target = self._restrict(self._target(batch)) if self.loss.needs_target else None
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
        draft_logits = self._draft_logits(batch)  # [B, T-1, V_draft]
        labels, weights = next_token_targets(batch)
        mask = weights > 0
        count = float(mask.sum())
        if count == 0:
            return {}
        target = self._target(batch)  # [B, T-1, V]
        # Acceptance is measured in the target vocabulary: q is 0 outside the draft vocabulary.
        draft_full = to_target_logits(draft_logits, self.draft_to_target, self.vocab_size)
        sampled = overlap(draft_full, target, mask, self.eval_temperature)
        greedy = overlap(draft_full, target, mask, 0.0)
        out: MetricSums = {
            "overlap@1": (float(sampled.sum()), count),
            "greedy_match@1": (float(greedy.sum()), count),
        }
        if draft_logits.shape[-1] < draft_full.shape[-1]:  # a pruned draft vocabulary
            mass = draftable_mass(draft_full, target, mask, self.eval_temperature)
            out["draftable_mass"] = (float(mass.sum()), count)
        draft_labels, in_vocab = self._draft_labels(labels, mask)
        loss_mask = in_vocab if self.loss.needs_labels else mask
        kept = float(loss_mask.sum())
        if kept > 0:
            loss = self.loss(
                draft_logits,
                self._restrict(target),
                loss_mask,
                self.loss_temperature,
                labels=draft_labels,
            )
            out["loss"] = (float(loss) * kept, kept)
        if bool(in_vocab.any()):  # over labels the draft can propose (all without pruning)
            nll = cross_entropy(draft_logits, draft_labels, in_vocab)
            out["draft_nll"] = (float(nll) * float(in_vocab.sum()), float(in_vocab.sum()))
        if self.draft_to_target is not None:
            out["label_in_draft_vocab"] = (float(in_vocab.sum()), count)
        return out

    def state_dict(self) -> dict[str, Any]:
        state = {"coin": self.coin.get_state(), "sampler": self.sampler.get_state()}
        if self.draft_to_target is not None:
            state["draft_to_target"] = self.draft_to_target.cpu()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("draft_to_target")
        ours = None if self.draft_to_target is None else self.draft_to_target.cpu()
        if (saved is None) != (ours is None) or (
            ours is not None and not torch.equal(torch.as_tensor(saved), ours)
        ):
            raise ValueError(
                "the checkpoint's draft vocabulary differs from the one this run chose from its "
                "training data: resume with the same data and --draft_vocab_size, or start anew"
            )
        self.coin.set_state(state["coin"])
        self.sampler.set_state(state["sampler"])

    # ------------------------------------------------------------------ export

    def save_drafter(
        self,
        folder: Path,
        tokenizer: PreTrainedTokenizerBase | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """A normal HF causal-LM folder (LoRA merged) plus ``drafter.json``.

        With a pruned draft vocabulary the folder stays a normal HF folder whose
        ``config.json`` keeps the target's ``vocab_size`` (the input embedding reads every
        token) and whose ``model.safetensors`` holds every weight but ``lm_head.weight``; that
        layer ([V_draft, H]) and EAGLE-3's maps ``d2t`` [V_draft] and ``t2d`` [V] go to
        ``draft_vocab.safetensors``, which ``draftsmith.decode.drafters.draft_lm.load_draft_model`` reads.
        """
        model = self.unwrapped_module
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if hasattr(model, "merge_and_unload"):  # peft: fold the LoRA deltas into the weights
            import copy

            from draftsmith.train.distributed import whole_peft_copy

            # The gathered state when given: under FSDP the local model holds shards only.
            whole = (
                copy.deepcopy(model) if state_dict is None else whole_peft_copy(model, state_dict)
            )
            model, state_dict = whole.merge_and_unload(), None
        elif state_dict is not None:
            from draftsmith.train.distributed import without_tied_copies

            state_dict = without_tied_copies(model, state_dict)
        if self.draft_to_target is None:
            model.save_pretrained(folder, state_dict=state_dict)
        else:
            self._save_pruned(model, folder, state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        meta: dict[str, Any] = {
            "kind": self.kind,
            "format_version": DRAFTER_FORMAT_VERSION,
            "vocab_size": self.vocab_size,
        }
        if self.draft_to_target is not None:
            meta["draft_vocab_size"] = self.draft_vocab_size
            meta["draft_vocab_file"] = DRAFT_VOCAB_FILE
        (folder / "drafter.json").write_text(json.dumps(meta, indent=2) + "\n")

    def _save_pruned(
        self,
        model: torch.nn.Module,
        folder: Path,
        state_dict: dict[str, torch.Tensor] | None,
    ) -> None:
        """The HF folder without the output layer, and ``draft_vocab.safetensors``."""
        from safetensors.torch import save_file

        weights = dict(model.state_dict() if state_dict is None else state_dict)
        head = weights.pop("lm_head.weight", None)
        if head is None:
            raise ValueError(
                "the draft LM's state has no lm_head.weight to store as the pruned head: "
                "--draft_vocab_size needs a Llama-like model whose output layer is lm_head"
            )
        model.config.tie_word_embeddings = False
        model.save_pretrained(folder, state_dict=weights)
        d2t, t2d = VocabMap(self.draft_to_target.cpu(), self.vocab_size).maps()
        tensors = {
            "lm_head.weight": head.detach().contiguous().cpu(),
            "d2t": d2t.contiguous(),
            "t2d": t2d.contiguous(),
        }
        save_file(tensors, str(folder / DRAFT_VOCAB_FILE))

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
            "draft_vocab_size": self.draft_vocab_size or self.vocab_size,
            "target_vocab_size": self.vocab_size,
            "draft_vocab_coverage": self.vocab_coverage,
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
        sampled = to_target_ids(continued.tokens, self.draft_to_target)  # draft ids -> target ids
        new_ids = torch.cat([input_ids[:, :prompt], sampled], dim=1)
        new_mask = torch.zeros_like(attention)
        new_mask[:, prompt:] = continued.valid.long()
        new_attention = torch.ones_like(attention)
        pick = usable[:, None]
        return {
            "input_ids": torch.where(pick, new_ids, input_ids),
            "attention_mask": torch.where(pick, new_attention, attention),
            "loss_mask": torch.where(pick, new_mask, batch.get("loss_mask", attention)),
        }

    def _draft_labels(
        self, labels: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, T-1] draft ids, [B, T-1] bool
        """Labels in draft ids (0 where pruned) and the mask of those in the draft vocabulary."""
        if self.draft_to_target is None:
            return labels, mask
        draft = to_draft_ids(labels, self.draft_to_target, self.vocab_size)
        return draft.clamp_min(0), mask & (draft >= 0)

    def _loss_labels(
        self, labels: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Labels and mask for the loss: a ``ce`` term drops labels outside the draft vocabulary
        (as EAGLE-3's objective does); divergences keep every position."""
        draft_labels, in_vocab = self._draft_labels(labels, mask)
        return draft_labels, (in_vocab if self.loss.needs_labels else mask)

    def _chunked_loss(
        self, batch: Batch, metrics: dict[str, float]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss with both output heads applied ``loss_chunk_size`` positions at a time
        (``draftsmith.train.loss_chunks``): no [B, T, V] logits of either model exist; same gradients."""
        from draftsmith.train.loss_chunks import chunked_loss_parts

        labels, weights = next_token_targets(batch)  # [B, T-1]
        labels, mask = self._loss_labels(labels, weights > 0)
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}
        # logits_to_keep=1: the model's own head runs on one position; the chunks run it on all.
        draft = self.module(**inputs, output_hidden_states=True, use_cache=False, logits_to_keep=1)
        hidden = draft.hidden_states[-1][:, :-1]  # [B, T-1, H] after the final norm
        parts = chunked_loss_parts(
            self.loss,
            hidden,
            self.unwrapped_module.get_output_embeddings(),
            self._target_rows(batch),
            mask,
            self.loss_temperature,
            labels=labels,
            chunk=self.loss_chunk_size,
        )
        for key, value in parts.items():
            metrics[f"loss_{key}"] = float(value.detach())
        return self.loss.combine(parts), metrics

    @torch.no_grad()
    def _target_rows(self, batch: Batch) -> Any:  # flat positions [n] -> target rows [n, V_draft]
        """The target at flat positions of [B, T-1], restricted to the draft vocabulary: the
        cache's rows expanded per chunk, or the target's head applied to its final hidden
        states per chunk."""
        if "topk_ids" in batch:
            fields = [batch[name][:, :-1] for name in ("topk_ids", "topk_logprobs", "rest_logmass")]
            flat = [field.reshape(-1, *field.shape[2:]) for field in fields]

            def cached(index: torch.Tensor) -> Any:
                rows = cached_target_logprobs(*(f[index] for f in flat), self.vocab_size)
                return self._restrict(rows)

            return cached
        outputs = self.target(
            **{"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")},
            output_hidden_states=True,
            use_cache=False,
            logits_to_keep=1,
        )
        hidden = outputs.hidden_states[-1][:, :-1]
        hidden = hidden.reshape(-1, hidden.shape[-1])  # [B * (T-1), H]
        head = self.target.get_output_embeddings()
        return lambda index: self._restrict(head(hidden[index]))

    def _restrict(self, target: torch.Tensor | TargetProbs) -> torch.Tensor | TargetProbs:
        """The target's logits (or log-probs) at the draft tokens [..., V_draft]; the losses'
        ``log_softmax`` renormalises them over the draft vocabulary."""
        if self.draft_to_target is None:
            return target
        return target[..., self.draft_to_target]

    def _draft_logits(self, batch: Batch) -> torch.Tensor:  # [B, T-1, V_draft]
        return next_token_logits(self.module, batch)

    @torch.no_grad()
    def _target(self, batch: Batch) -> torch.Tensor | TargetProbs:  # [B, T-1, V]
        if "topk_ids" in batch and self.draft_to_target is not None:
            # Log space keeps a tiny rest mass, so no row loses all its mass when restricted.
            return cached_target_logprobs(
                batch["topk_ids"][:, :-1],
                batch["topk_logprobs"][:, :-1],
                batch["rest_logmass"][:, :-1],
                self.vocab_size,
            )
        if "topk_ids" in batch:
            from draftsmith.data.cache import topk_to_probs

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
