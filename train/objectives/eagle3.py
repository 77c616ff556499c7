"""The ``eagle3`` objective: an EAGLE-3 head trained against a frozen target (training-time test).

EAGLE-3 (Li et al., 2025) drafts from the target's own features: at position t the head fuses
three of the target's hidden states ``g_t = fc(cat(h^low_t, h^mid_t, h^high_t))`` with the
target's embedding of the next token ``x_{t+1}`` and predicts ``x_{t+2}``
(``draftsmith.decode.drafters.eagle.head``). At inference the head then feeds on its own outputs for the
following draft positions, so training unrolls it the same way ("training-time test",
:meth:`Eagle3Head.unroll`): step k (0-based) at position t reads its own step-(k-1) output and
the token ``x_{t+1+k}``, and its distribution ``q_k(. | t)`` guesses ``x_{t+2+k}``. The target's
distribution for that token is its next-token law at position ``t+1+k``, ``p(. | x_<=t+1+k)``.
With the configured divergence D (``draftsmith.train.losses``: TV maximises acceptance directly, KLs and
JSD are smoother surrogates) and per-step weights ``w_k`` (EAGLE-3 uses ``0.8^k``) the loss is

    L = sum_k w_k * D_k / sum_k w_k,   D_k = mean over kept t of D(p(. | x_<=t+1+k), q_k(. | t))

A position t counts for step k when ``x_t`` and ``x_{t+2+k}`` are real tokens and
``loss_mask[t+2+k]`` is set (the token is one the drafter should predict).

Pruned draft vocabulary: with ``draft_vocab_size < V`` the head's LM head covers the most
frequent tokens of the training data (:meth:`Eagle3Objective.prepare` counts them before the
first step and installs EAGLE-3's ``d2t``/``t2d`` maps). The loss then compares ``q`` with the
target's distribution restricted to the draft vocabulary and renormalised, as EAGLE-3 does;
held-out overlap is measured in the *target* vocabulary (``q`` scattered back, zero outside the
draft vocabulary), which is what speculative sampling accepts.

Where the target's features and distributions come from:

- online: the frozen target runs on the batch under ``no_grad`` with
  ``output_hidden_states=True``;
- the offline cache (``draftsmith.data.cache``): the batch carries the cached hidden states of the head's
  aux layers (``hidden_states`` [B, L_cache, T, H], layer ids from
  :meth:`Eagle3Objective.target_cache_hidden_layers`) and the top-k log-probabilities, expanded
  in log space by :func:`draftsmith.train.objectives.heads.cached_target_logprobs`.

Held-out metrics per draft position j = k + 1: ``overlap@j``, the mean of
``sum_x min(p(x), q_k(x))`` at the decoding temperature, the expected acceptance rate of draft
position j given that the earlier ones were accepted (Leviathan et al. 2023; the ``alpha_j`` of
docs/theory.md §5); ``greedy_match@j``, the same at temperature 0; ``loss@j`` and ``loss``.

The loss and evaluation loops, the target's outputs (online or cached), the alignment of step
k with the target at ``t+1+k``, saving and export are shared with the ``medusa`` objective
(:class:`draftsmith.train.objectives.heads.HeadObjective`); this module holds what is EAGLE-3's own: the
fusion of three hidden states, the unrolling, and the pruned draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from draftsmith.decode.drafters.eagle.config import VARIANT_FLAGS
from draftsmith.decode.drafters.eagle.head import Eagle3Config, Eagle3Head, build_vocab_maps
from draftsmith.train.losses import Loss
from draftsmith.train.objectives import Batch
from draftsmith.train.objectives.heads import (
    HeadObjective,
    position_weights,
    recipe_head_settings,
    recipe_position_weights,
)

if TYPE_CHECKING:
    from draftsmith.train.config import DistillConfig
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def count_tokens(rows: Iterable[dict[str, Any]], vocab_size: int) -> torch.Tensor:  # [V] int64
    """How often each token is a training label (``loss_mask`` set, all tokens without one)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for index, row in enumerate(rows):
        ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
        mask = row.get("loss_mask")
        if mask is not None:
            ids = ids[torch.as_tensor(mask).bool()]
        if ids.numel() == 0:
            continue
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(
                f"training row {index} holds token ids outside [0, {vocab_size}): the data was "
                "tokenised with another tokenizer than the target's"
            )
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def rarest_token(rows: Iterable[dict[str, Any]], vocab_size: int) -> int:
    """The token id that occurs least often in the rows' ``input_ids`` (ties to the highest
    id): the placeholder of P-EAGLE's and DFlash's mask rows unless a recipe names one."""
    counts = count_tokens(({"input_ids": row["input_ids"]} for row in rows), vocab_size)
    return int((counts * (vocab_size + 1) - torch.arange(vocab_size)).argmin())


def recipe_head(
    config: DistillConfig,
    target: PreTrainedModel,
    head_type: type[Eagle3Head] = Eagle3Head,
    **extra,
) -> Eagle3Head:
    """The head a recipe describes for ``target`` (``extra``: config fields of a subclass),
    initialised from the recipe's seed alone."""
    drafter = config.drafter
    overrides: dict[str, Any] = dict(extra)
    if drafter.draft_vocab_size is not None:
        overrides["draft_vocab_size"] = drafter.draft_vocab_size
    if drafter.aux_hidden_state_layer_ids:
        overrides["aux_hidden_state_layer_ids"] = tuple(drafter.aux_hidden_state_layer_ids)
    if drafter.drafter_intermediate_size is not None:
        overrides["intermediate_size"] = drafter.drafter_intermediate_size
    overrides["num_hidden_layers"] = drafter.drafter_num_layers
    # EAGLE-3.1's and speculators' layer variants, set only when chosen (the config
    # refuses them for kinds without the EAGLE-3 layer)
    overrides.update({flag: True for flag in VARIANT_FLAGS if getattr(drafter, flag)})
    head_config = head_type.config_type.for_target(target.config, **overrides)
    # nn.Module initialises from the global RNG: fork it so that only the seed matters.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.optim.seed)
        return head_type(head_config)


def recipe_eagle3_settings(config: DistillConfig) -> dict[str, Any]:
    """The keywords :class:`Eagle3Objective` (and P-EAGLE's) takes from a recipe."""
    return {
        "unroll_steps": config.loss.unroll_steps,
        "step_weights": recipe_position_weights(config, config.loss.unroll_steps),
        "init_from_target": config.drafter.drafter_init != "random",
        "freeze_lm_head": config.drafter.freeze_embeddings,
        **recipe_head_settings(config),
    }


class UnrolledHead(torch.nn.Module):
    """The trainable module: an :class:`Eagle3Head` whose ``forward`` is training-time test.

    Running the unroll through ``forward`` lets accelerate's wrappers (DDP, autocast) see it.
    """

    def __init__(self, head: Eagle3Head, steps: int) -> None:
        super().__init__()
        self.head = head
        self.steps = steps

    def forward(
        self,
        aux_hidden: torch.Tensor,  # [B, T, A*H]
        next_embeds: torch.Tensor,  # [B, T, H]
        attention_mask: torch.Tensor,  # [B, T]
    ) -> list[torch.Tensor]:  # `steps` tensors [B, T, V_draft]
        return self.head.unroll(aux_hidden, next_embeds, attention_mask, self.steps)


class Eagle3Objective(HeadObjective):
    """Train an :class:`Eagle3Head` on a frozen target; see the module docstring for the math."""

    kind: ClassVar[str] = "eagle3"
    drafter_attribute: ClassVar[str] = "head"

    def __init__(
        self,
        head: Eagle3Head,
        target: torch.nn.Module,
        loss: Loss,
        *,
        unroll_steps: int = 4,
        step_weights: Sequence[float] | None = None,
        align_topk: int = 0,
        loss_temperature: float = 1.0,
        eval_temperature: float = 1.0,
        export_formats: Sequence[str] | str | None = (),
        init_from_target: bool = True,
        freeze_lm_head: bool = False,
    ) -> None:
        if unroll_steps < 1:
            raise ValueError(f"--unroll_steps must be >= 1, got {unroll_steps}")
        _check_head_fits(head.config, target)
        super().__init__(
            target,
            loss,
            position_weights(unroll_steps, step_weights),
            align_topk=align_topk,
            loss_temperature=loss_temperature,
            eval_temperature=eval_temperature,
            export_formats=export_formats,
        )
        if "sglang" in self.export_formats:  # refused now, not after training at export
            from draftsmith.train.export.formats import engine_aux_ids

            engine_aux_ids(head, "sglang")
        self.head = head
        self.unrolled = UnrolledHead(head, unroll_steps)
        self.unroll_steps = unroll_steps
        self.init_from_target = init_from_target
        self.vocab_coverage: float | None = None
        if init_from_target:
            self._copy_target_output_layer()
        if freeze_lm_head:
            self.head.lm_head.requires_grad_(False)
        # Cached hidden states: one copy per distinct layer id, in ascending order.
        self._cache_layers = sorted(set(head.config.aux_hidden_state_layer_ids))

    @classmethod
    def from_config(
        cls,
        config: DistillConfig,
        target: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        loss: Loss,
    ) -> Eagle3Objective:
        return cls(recipe_head(config, target), target, loss, **recipe_eagle3_settings(config))

    @property
    def step_weights(self) -> tuple[float, ...]:
        """Loss weight of each unrolled step (``0.8^k`` by default)."""
        return self.weights

    @property
    def trained_head(self) -> Eagle3Head:
        """The head being trained (unwrapped from DDP/compile wrappers)."""
        return self.trained_drafter

    # ------------------------------------------------------------------ data hooks

    def prepare(self, train_rows: Sequence[dict[str, Any]]) -> None:
        """Choose the draft vocabulary from the training labels' frequencies (EAGLE-3).

        With the full vocabulary this does nothing. Otherwise the ``draft_vocab_size`` most
        frequent tokens get draft ids (:func:`build_vocab_maps`) and, when initialising from the
        target, the head's LM head is re-copied from the target's rows of those tokens.
        """
        config = self.head.config
        if config.draft_vocab_size == config.target_vocab_size:
            self.vocab_coverage = 1.0
            return
        counts = count_tokens(train_rows, config.target_vocab_size)
        total = int(counts.sum())
        if total == 0:
            raise ValueError(
                "the training rows hold no label token to choose a draft vocabulary from: "
                "check loss_mask, or drop --draft_vocab_size to keep the full vocabulary"
            )
        d2t, t2d = build_vocab_maps(counts, config.draft_vocab_size)
        self.head.set_vocab_maps(d2t.to(self.head.d2t.device), t2d.to(self.head.t2d.device))
        self.vocab_coverage = float(counts[t2d].sum()) / total
        if self.init_from_target:
            self._copy_target_output_layer()

    def target_cache_hidden_layers(self) -> list[int]:
        """The hidden-state ids the offline cache must keep (the head's aux layers, deduplicated)."""
        return list(self._cache_layers)

    def trainable_module(self) -> torch.nn.Module:
        return self.unrolled

    # ------------------------------------------------------------------ EAGLE-3's own parts

    def _features(self, by_layer: dict[int, torch.Tensor]) -> torch.Tensor:  # [B, T, A*H]
        """The fused layer's input: the aux hidden states concatenated in the head's order."""
        ids = self.trained_head.config.aux_hidden_state_layer_ids
        return torch.cat([by_layer[i] for i in ids], dim=-1)

    def _draft_logits(self, batch: Batch, features: torch.Tensor) -> list[torch.Tensor]:
        return self._unroll(batch, features)

    def _unroll(self, batch: Batch, aux: torch.Tensor) -> list[torch.Tensor]:
        """The head's logits [B, T, V_draft] at each of the ``unroll_steps`` steps."""
        input_ids = batch["input_ids"]  # [B, T]
        dtype = self.trained_head.fc.weight.dtype
        with torch.no_grad():
            embeds = self.target.get_input_embeddings()(input_ids[:, 1:])  # [B, T-1, H]
            next_embeds = torch.cat((embeds, torch.zeros_like(embeds[:, :1])), dim=1)
        attention = batch.get("attention_mask")
        if attention is None:
            attention = torch.ones_like(input_ids)
        return self.module(aux.to(dtype), next_embeds.to(dtype), attention)

    def _to_draft_vocab(self, target: torch.Tensor) -> torch.Tensor:  # [..., V] -> [..., Vd]
        return self.trained_head.to_draft_vocab(target)

    def _to_target_logits(self, draft: torch.Tensor) -> torch.Tensor:  # [..., Vd] -> [..., V]
        return self.trained_head.to_target_logits(draft)

    def _draft_labels(
        self, labels: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Hard labels in draft ids for a ``ce`` term; labels outside the draft vocabulary drop."""
        if not self.loss.needs_labels:
            return None, mask
        head = self.trained_head
        config = head.config
        if config.draft_vocab_size == config.target_vocab_size:
            return labels, mask
        to_draft = torch.full(
            (config.target_vocab_size,), -1, dtype=torch.long, device=labels.device
        )
        to_draft[head.draft_to_target_ids] = torch.arange(
            config.draft_vocab_size, device=labels.device
        )
        draft_labels = to_draft[labels]
        keep = mask & (draft_labels >= 0)
        return draft_labels.clamp_min(0), keep

    def _architecture(self) -> dict[str, Any]:
        config = self.trained_head.config
        return {
            "architecture": "EAGLE-3 head (LlamaForCausalLMEagle3 weight layout)",
            "hidden_size": config.hidden_size,
            "aux_hidden_state_layer_ids": list(config.aux_hidden_state_layer_ids),
            "draft_vocab_size": config.draft_vocab_size,
            "target_vocab_size": config.target_vocab_size,
            "draft_vocab_coverage": self.vocab_coverage,
            "rope": {  # one choice everywhere: docs/guides/real-targets.md
                "rope_type": "default",
                "rope_theta": config.rope_theta,
                "rope_scaling": None,
                "max_position_embeddings": config.max_position_embeddings,
                "target_rope": getattr(self.target.config, "rope_parameters", None),
                "target_max_position_embeddings": getattr(
                    self.target.config, "max_position_embeddings", None
                ),
            },
            "unroll_steps": self.unroll_steps,
            "step_weights": [round(w, 6) for w in self.step_weights],
        }

    def _export(self, drafter: torch.nn.Module, folder: Path, fmt: str) -> None:
        """vLLM, SGLang and speculators layouts (``draftsmith.train.export.formats.export_eagle3``); the
        speculators format names the target (its path or hub id) as the verifier."""
        from draftsmith.train.export.formats import export_eagle3

        export_eagle3(
            drafter,
            folder,
            fmt,
            overwrite=True,
            num_speculative_tokens=self.unroll_steps,  # the draft length it was trained for
            **self._verifier(),
        )

    def _verifier(self) -> dict[str, Any]:
        """The target as the speculators format names its verifier: path or hub id, and
        architectures."""
        target_config = self.target.config
        return {
            "verifier": str(getattr(target_config, "_name_or_path", "") or "<target>"),
            "verifier_architectures": getattr(target_config, "architectures", None)
            or ["LlamaForCausalLM"],
        }

    @torch.no_grad()
    def _copy_target_output_layer(self) -> None:
        """Start the head's final norm and LM head from the target's (draft-vocabulary rows)."""
        output = self.target.get_output_embeddings()
        if output is None or output.weight.shape[1] != self.head.config.hidden_size:
            return
        rows = output.weight[self.head.draft_to_target_ids.to(output.weight.device)]
        self.head.lm_head.weight.copy_(rows.to(self.head.lm_head.weight))
        norm = getattr(self.target.get_decoder(), "norm", None)
        weight = getattr(norm, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.shape == self.head.norm.weight.shape:
            self.head.norm.weight.copy_(weight.to(self.head.norm.weight))


def _check_head_fits(config: Eagle3Config, target: torch.nn.Module) -> None:
    target_config = target.config
    embed = target.get_input_embeddings().weight
    problems = []
    if embed.shape[1] != config.hidden_size:
        problems.append(f"hidden size {config.hidden_size} vs the target's {embed.shape[1]}")
    vocab = target.get_output_embeddings().weight.shape[0]
    if vocab != config.target_vocab_size:
        problems.append(f"target vocabulary {config.target_vocab_size} vs the target's {vocab}")
    if target_config.num_hidden_layers != config.target_num_hidden_layers:
        problems.append(
            f"{config.target_num_hidden_layers} target layers vs the target's "
            f"{target_config.num_hidden_layers}"
        )
    if problems:
        raise ValueError(
            "the EAGLE-3 head was built for another target (" + "; ".join(problems) + "): build "
            "it with Eagle3Config.for_target(target.config)"
        )
