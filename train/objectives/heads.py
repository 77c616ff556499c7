"""The shared base of head objectives: drafters that read a frozen target's hidden states.

EAGLE-3 (``draftsmith.train.objectives.eagle3``) and Medusa (``draftsmith.train.objectives.medusa``) both put a small
trainable module on the target's hidden states and predict draft positions j = k + 1 =
1..N: at position t, output k guesses ``x_{t+2+k}``, whose law under the target is its
next-token distribution at position ``t+1+k``, ``p(. | x_<=t+1+k)``. With the configured
divergence D (``draftsmith.train.losses``) and per-position weights ``w_k`` (``0.8^k`` in both papers)

    L = sum_k w_k * D_k / sum_k w_k,   D_k = mean over kept t of D(p(. | x_<=t+1+k), q_k(. | t))

A position t counts for output k when ``x_t`` and ``x_{t+2+k}`` are real tokens and
``loss_mask[t+2+k]`` is set (:func:`future_mask`). With ``align_topk = K > 0`` (GRIFFIN's
token-alignable training, Hu et al. 2025) it counts only where the chain from t would reach
output k: at every earlier output i < k, the token the chain continues with, ``x_{t+2+i}``,
lies in the drafter's top K (:func:`in_top_k`). Positions whose earlier drafts were already
rejected at decoding never ask output k for a token, so they no longer pull it towards contexts
it is never used in. ``D_k`` then sums over the reached positions and divides by all of output
k's positions: each position weighs ``1[chain from t reaches k]``, the indicator form of the
factor ``prod_{i<k} alpha_i(t)`` that the expected accepted length ``sum_k prod_{i<=k}
alpha_i`` (docs/theory.md §5) puts on ``alpha_k(t)``, so a term grows with the share of chains
that reach it. (GRIFFIN's own normalization, a mean over the reached positions alone, gives a
term over a handful of positions the full weight ``w_k`` while a drafter trains from scratch,
and lost tau on the demo target: docs/guides/ablation.md.) The held-out metrics
stay unmasked, comparable with and without it.

Everything but the module itself is shared and lives here: where the target's features and
distributions come from (online, or the offline cache of ``draftsmith.data.cache``), the alignment of
output k with the target at ``t+1+k``, the loss and evaluation loops, saving, engine export and
the model-card facts. A kind supplies only what is truly its own (:class:`HeadObjective`'s
abstract methods): which hidden states it reads and how it fuses them, how it produces its N
outputs (EAGLE-3 unrolls itself, "training-time test"; Medusa runs independent heads), and, for
EAGLE-3, the map between its pruned draft vocabulary and the target's.

Held-out metrics per draft position j: ``overlap@j``, the mean of ``sum_x min(p(x), q(x))`` at
the decoding temperature in the *target* vocabulary, the expected acceptance rate of draft
position j given the earlier ones accepted (Leviathan et al. 2023; the ``alpha_j`` of
docs/theory.md §5); ``greedy_match@j``, the same at temperature 0; ``loss@j`` and ``loss``.
With a pruned draft vocabulary, ``draftable_mass``: the target's probability on the draft
vocabulary at the decoding temperature, the most any ``overlap@j`` can reach
(``draftsmith.train.losses.draftable_mass``).

References: Li et al., EAGLE-3, 2025; Cai et al., Medusa, 2024; Hu et al., GRIFFIN: Effective
Token Alignment for Faster Speculative Decoding, 2025 (arXiv 2502.11018).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from draftsmith.train.config import (
    EXPORT_FORMATS,
    HIDDEN_STATE_NOISE_SHAPES,
    parse_export_formats,
)
from draftsmith.train.losses import Loss, draftable_mass, overlap
from draftsmith.train.objectives import Batch, MetricSums, Objective

if TYPE_CHECKING:
    from draftsmith.train.config import DistillConfig
    from transformers import PreTrainedTokenizerBase


Aligned = tuple[float, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""Per draft position: weight, draft logits [B, S, Vd], target [B, S, V], mask and labels [B, S]."""


@dataclass
class SampledRows:
    """A draft output computed at some positions only (P-EAGLE's COD sampling): ``logits``
    [B, M, Vd] at positions ``anchors`` [B, M]; slots with ``valid`` False are padding."""

    logits: torch.Tensor  # [B, M, V_draft]
    anchors: torch.Tensor  # [B, M] int64 positions t
    valid: torch.Tensor  # [B, M] bool


# --------------------------------------------------------------------------- shared helpers


def position_weights(
    num_positions: int, weights: Sequence[float] | None = None, decay: float = 0.8
) -> tuple[float, ...]:
    """Loss weights of draft positions 1..N: ``weights`` as given, else ``decay^(j-1)``.

    EAGLE-3 weighs its unrolled steps by ``0.8^k`` and Medusa its heads by ``0.8^i`` (Cai et al.
    2024): later positions are reached less often, so they matter less to acceptance.
    """
    if num_positions < 1:
        raise ValueError(f"the number of draft positions must be >= 1, got {num_positions}")
    if weights is None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"--position_weight_decay must lie in (0, 1], got {decay}")
        return tuple(decay**j for j in range(num_positions))
    values = tuple(float(w) for w in weights)
    if len(values) != num_positions:
        raise ValueError(
            f"--position_weights gives {len(values)} weights for {num_positions} draft positions "
            "(unroll_steps for eagle3, medusa_num_heads for medusa): give one per position"
        )
    if any(not math.isfinite(w) or w < 0 for w in values) or sum(values) <= 0:
        raise ValueError(
            f"--position_weights must be finite, >= 0 and not all 0, got {list(values)}"
        )
    return values


def recipe_position_weights(config: DistillConfig, num_positions: int) -> tuple[float, ...]:
    """:func:`position_weights` of ``num_positions`` draft positions from the recipe's loss
    section (``position_weights``, else ``position_weight_decay``)."""
    return position_weights(
        num_positions, config.loss.position_weights, config.loss.position_weight_decay
    )


def in_top_k(
    logits: torch.Tensor,  # [B, S, V] draft logits in the target vocabulary (-inf: not draftable)
    tokens: torch.Tensor,  # [B, S] target ids
    k: int,
) -> torch.Tensor:  # [B, S] bool
    """Whether ``tokens`` lies among the ``k`` largest ``logits`` (ties count; a token with
    logit -inf, outside a pruned draft vocabulary, never does)."""
    kth = logits.topk(min(k, logits.shape[-1]), dim=-1).values[..., -1]  # [B, S]
    chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, S]
    return (chosen >= kth) & torch.isfinite(chosen)


def recipe_head_settings(config: DistillConfig) -> dict[str, Any]:
    """The recipe's settings every :class:`HeadObjective` takes as keywords: the loss and
    evaluation temperatures, the chain masking and the export formats."""
    return {
        "align_topk": config.loss.align_topk,
        "loss_temperature": config.loss.loss_temperature,
        "eval_temperature": config.loss.eval_temperature,
        "export_formats": parse_export_formats(config.output.export_format),
    }


def future_mask(batch: Batch, ahead: int) -> torch.Tensor:  # [B, T - ahead] bool
    """Positions t whose prediction of ``x_{t+ahead}`` is trained on.

    True where ``x_t`` and ``x_{t+ahead}`` are real tokens (``attention_mask``) and
    ``loss_mask[t+ahead]`` is set. ``ahead = 2 + k`` for draft output k.
    """
    input_ids = batch["input_ids"]  # [B, T]
    if ahead < 1:
        raise ValueError(f"ahead must be >= 1, got {ahead}")
    length = input_ids.shape[1]
    if length <= ahead:
        return torch.zeros(input_ids.shape[0], 0, dtype=torch.bool, device=input_ids.device)
    attention = batch.get("attention_mask")
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention is None else attention.bool()
    mask = real[:, :-ahead] & real[:, ahead:]
    if "loss_mask" in batch:
        mask = mask & batch["loss_mask"][:, ahead:].bool()
    return mask


def cached_target_logprobs(
    topk_ids: torch.Tensor,  # [B, T, k] int
    topk_logprobs: torch.Tensor,  # [B, T, k]
    rest_logmass: torch.Tensor,  # [B, T]
    vocab_size: int,
) -> torch.Tensor:  # [B, T, V] float32 log-probabilities
    """The offline cache's distribution (``draftsmith.data.cache.topk_to_probs``) in log space.

    ``log p(x) = topk_logprobs[j]`` at ``x = topk_ids[j]``, else ``rest_logmass - log(V - k)``
    (the rest mass spread uniformly). Staying in log space keeps a tiny rest mass non-zero,
    so restricting ``p`` to a pruned draft vocabulary never leaves a row without mass; the
    losses renormalise with ``log_softmax``.
    """
    k = topk_ids.shape[-1]
    if k > vocab_size:
        raise ValueError(
            f"the cache keeps k = {k} log-probs per token but the vocabulary is {vocab_size}"
        )
    if k == vocab_size:
        fill = torch.full_like(rest_logmass, -math.inf, dtype=torch.float32)
    else:
        fill = rest_logmass.float() - math.log(vocab_size - k)
    out = fill[..., None].expand(*fill.shape, vocab_size).clone()
    out.scatter_(-1, topk_ids.long(), topk_logprobs.float())
    return out


def overlap_at(
    draft_logits: torch.Tensor,  # [B, S, V]
    target_logits: torch.Tensor,  # [B, S, V]
    mask: torch.Tensor,  # [B, S] bool
    temperature: float,
) -> torch.Tensor:  # [B, S]
    """``draftsmith.train.losses.overlap`` with both sides in a common dtype (e.g. a float32 head on a
    float64 or bfloat16 target)."""
    dtype = torch.promote_types(draft_logits.dtype, target_logits.dtype)
    return overlap(draft_logits.to(dtype), target_logits.to(dtype), mask, temperature)


# --------------------------------------------------------------------------- the base


class HeadObjective(Objective):
    """Train a head drafter on a frozen target; see the module docstring for the math.

    Subclasses set ``kind`` and implement :meth:`trainable_module` (a wrapper whose one child
    attribute named ``drafter_attribute`` is the drafter saved on export),
    :meth:`target_cache_hidden_layers`, :meth:`_features`, :meth:`_draft_logits`,
    :meth:`_architecture` and :meth:`_export`; EAGLE-3 also overrides the vocabulary hooks.
    """

    drafter_attribute: str = "head"

    def __init__(
        self,
        target: torch.nn.Module,
        loss: Loss,
        weights: Sequence[float],
        *,
        align_topk: int = 0,
        loss_temperature: float = 1.0,
        eval_temperature: float = 1.0,
        export_formats: Sequence[str] | str | None = (),
    ) -> None:
        super().__init__()
        if isinstance(align_topk, bool) or not isinstance(align_topk, int) or align_topk < 0:
            raise ValueError(f"--align_topk must be an integer >= 0 (0: off), got {align_topk!r}")
        self.target = target.eval().requires_grad_(False)
        self.loss = loss
        self.weights = tuple(weights)
        self.align_topk = align_topk
        self.loss_temperature = loss_temperature
        self.eval_temperature = eval_temperature
        self.export_formats = parse_export_formats(export_formats)
        self.target_vocab_size = int(target.get_output_embeddings().weight.shape[0])

    # ------------------------------------------------------------------ what a kind supplies

    @abstractmethod
    def target_cache_hidden_layers(self) -> list[int]:
        """The ``output_hidden_states`` indices the drafter reads (ascending, deduplicated)."""

    @abstractmethod
    def _features(self, by_layer: dict[int, torch.Tensor]) -> torch.Tensor:
        """The drafter's input from the hidden states it reads, ``layer id -> [B, T, H]``."""

    @abstractmethod
    def _draft_logits(
        self, batch: Batch, features: torch.Tensor
    ) -> Sequence[torch.Tensor | SampledRows]:
        """Draft logits per position k, ``[B, S_k, V_draft]`` with ``S_k >= T - 2 - k`` (or
        :class:`SampledRows` at some positions), run through ``self.module``."""

    @abstractmethod
    def _architecture(self) -> dict[str, Any]:
        """The kind's own architecture facts for the model card (:meth:`describe`)."""

    @abstractmethod
    def _export(self, drafter: torch.nn.Module, folder: Path, fmt: str) -> None:
        """Write ``drafter`` in an engine's layout (``fmt`` from :data:`EXPORT_FORMATS`)."""

    def _to_draft_vocab(self, target: torch.Tensor) -> torch.Tensor:  # [..., V] -> [..., Vd]
        """The target's logits restricted to the draft vocabulary (all of it by default)."""
        return target

    def _to_target_logits(self, draft: torch.Tensor) -> torch.Tensor:  # [..., Vd] -> [..., V]
        """Draft logits in the target vocabulary, where acceptance is measured."""
        return draft

    def _draft_labels(
        self, labels: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Hard labels in draft ids for a ``ce`` term, and the mask of those that exist."""
        return (labels if self.loss.needs_labels else None), mask

    # ------------------------------------------------------------------ loop protocol

    @property
    def trained_drafter(self) -> torch.nn.Module:
        """The drafter being trained, unwrapped from DDP/compile wrappers."""
        return getattr(self.unwrapped_module, self.drafter_attribute)

    def bind(self, module: torch.nn.Module, accelerator: Any) -> None:
        super().bind(module, accelerator)
        self.target.to(accelerator.device)

    def compute_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        features, target = self._target_outputs(batch)
        features = self._noisy(features)  # training only: evaluate reads them clean
        drafts = self._draft_logits(batch, features)
        auxiliary, metrics = self._auxiliary_loss(batch, drafts, target)
        if self.loss.needs_target:  # into the draft vocabulary once: each position reads a slice
            target = self._to_draft_vocab(target)
        total: torch.Tensor | None = None
        used = 0.0
        reached: torch.Tensor | None = None  # [B, S_k] bool: the chain from t reaches output k
        for k, (weight, draft, target_k, mask, labels) in enumerate(
            self._aligned(batch, drafts, target)
        ):
            chain_tokens = labels  # [B, S_k] target ids the chain continues with
            labels, mask = self._draft_labels(labels, mask)
            share = 1.0  # the share of output k's positions whose chain reaches it
            if self.align_topk:
                counted = float(mask.sum())
                if reached is not None:
                    reached = reached[:, : mask.shape[1]]
                    mask = mask & reached
                    share = float(mask.sum()) / counted if counted else 0.0
                    metrics[f"reached@{k + 1}"] = share
                with torch.no_grad():
                    hit = in_top_k(self._to_target_logits(draft), chain_tokens, self.align_topk)
                reached = hit if reached is None else reached & hit
                if counted and not bool(mask.any()):  # no chain reaches k: its term is 0
                    used += weight
                    continue
            if not bool(mask.any()):
                continue
            target_draft = target_k if self.loss.needs_target else None
            parts = self.loss.parts(draft, target_draft, mask, self.loss_temperature, labels=labels)
            value = self.loss.combine(parts)
            term = weight * share * value  # share * mean over reached = sum over reached / all
            total = term if total is None else total + term
            used += weight
            metrics[f"loss@{k + 1}"] = float(value.detach())
            if "tv" in parts:  # the overlap is free with a TV term (a full pass over V is not)
                metrics[f"overlap@{k + 1}"] = 1.0 - float(parts["tv"].detach())
        if total is None:  # no position of this batch reaches any draft position: a zero step
            if drafts:
                return sum(_logits_of(draft).sum() for draft in drafts) * 0.0, metrics
            return sum(p.sum() for p in self.module.parameters()) * 0.0, metrics
        if auxiliary is not None:
            return total / used + auxiliary, metrics
        return total / used, metrics

    def _auxiliary_loss(
        self,
        batch: Batch,
        drafts: Sequence[torch.Tensor | SampledRows],
        target: torch.Tensor,  # [B, T, V] the target's logits or log-probs, full vocabulary
    ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """A term a kind adds to the distillation loss (DSpark's confidence head), and its
        metrics; None by default."""
        del batch, drafts, target
        return None, {}

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> MetricSums:
        features, target = self._target_outputs(batch)
        drafts = self._draft_logits(batch, features)
        out: MetricSums = {}
        weighted_loss = weighted_count = 0.0
        for k, (weight, draft, target_k, mask, labels) in enumerate(
            self._aligned(batch, drafts, target)
        ):
            count = float(mask.sum())
            if count == 0:
                continue
            draft_full = self._to_target_logits(draft)
            sampled = overlap_at(draft_full, target_k, mask, self.eval_temperature)
            greedy = overlap_at(draft_full, target_k, mask, 0.0)
            out[f"overlap@{k + 1}"] = (float(sampled.sum()), count)
            out[f"greedy_match@{k + 1}"] = (float(greedy.sum()), count)
            if k == 0 and draft.shape[-1] < draft_full.shape[-1]:  # a pruned draft vocabulary
                mass = draftable_mass(draft_full, target_k, mask, self.eval_temperature)
                out["draftable_mass"] = (float(mass.sum()), count)
            draft_labels, loss_mask = self._draft_labels(labels, mask)
            if not bool(loss_mask.any()):
                continue
            target_draft = self._to_draft_vocab(target_k) if self.loss.needs_target else None
            value = float(
                self.loss(
                    draft, target_draft, loss_mask, self.loss_temperature, labels=draft_labels
                )
            )
            kept = float(loss_mask.sum())
            out[f"loss@{k + 1}"] = (value * kept, kept)
            weighted_loss += weight * value * kept
            weighted_count += weight * kept
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
        """The native folder (the drafter's ``save_pretrained``) plus ``<folder>/<format>/``.

        ``state_dict`` (the gathered trainable state, keys ``<drafter_attribute>.*``) replaces
        the local weights when given (FSDP/DeepSpeed shard them). The tokenizer is the
        target's and is not stored.
        """
        drafter = self.trained_drafter
        if state_dict is not None:
            prefix = f"{self.drafter_attribute}."
            drafter = type(drafter)(drafter.config)
            drafter.load_state_dict({k.removeprefix(prefix): v for k, v in state_dict.items()})
        folder = Path(folder)
        drafter.save_pretrained(folder)
        for fmt in self.export_formats:
            self._export(drafter, folder / fmt, fmt)

    def describe(self) -> dict[str, Any]:
        """Architecture facts for the model card."""
        drafter = self.trained_drafter
        return {
            **self._architecture(),
            "parameters": sum(p.numel() for p in drafter.parameters()),
            "trainable_parameters": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
            "exports": list(self.export_formats),
            "align_topk": self.align_topk,
        }

    # ------------------------------------------------------------------ hidden-state noise

    hidden_state_noise: float = 0.0
    hidden_state_noise_shape: str = "uniform"
    _noise_seed: int = 0
    _noise_generator: torch.Generator | None = None

    def set_hidden_state_noise(self, scale: float, shape: str = "uniform", seed: int = 0) -> None:
        """Add noise of scale ``scale`` to the target's hidden states the head reads, in
        training only, as speculators' EAGLE-3 recipe does to its dataset's hidden states:
        ``h + s * u`` with ``u ~ U(-1, 1)`` (``uniform``) or ``u ~ N(0, 1)`` (``gaussian``),
        drawn from a generator seeded with ``seed``, so a run is reproducible. The head then
        learns to draft from features a little off the target's own, as its own drafts (and
        another precision's target) give it at decoding time."""
        if scale < 0 or shape not in HIDDEN_STATE_NOISE_SHAPES:
            raise ValueError(
                f"hidden-state noise needs a scale >= 0 and uniform or gaussian, got {scale}, {shape!r}"
            )
        self.hidden_state_noise, self.hidden_state_noise_shape = float(scale), shape
        self._noise_seed, self._noise_generator = seed, None

    def _noisy(self, features: torch.Tensor) -> torch.Tensor:  # [B, T, F] -> [B, T, F]
        """``features`` plus the configured noise (unchanged, no draw, when it is off)."""
        if not self.hidden_state_noise:
            return features
        if self._noise_generator is None or self._noise_generator.device != features.device:
            self._noise_generator = torch.Generator(features.device).manual_seed(self._noise_seed)
        generator = self._noise_generator
        if self.hidden_state_noise_shape == "gaussian":
            draw = torch.randn(features.shape, generator=generator, device=features.device)
        else:
            draw = torch.rand(features.shape, generator=generator, device=features.device) * 2 - 1
        return features + (self.hidden_state_noise * draw).to(features.dtype)

    # ------------------------------------------------------------------ shared internals

    @torch.no_grad()
    def _target_outputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's input features and the target's logits or log-probs [B, T, V].

        Online, the frozen target runs on the batch with ``output_hidden_states=True``; from
        the offline cache, the batch carries the hidden states of
        :meth:`target_cache_hidden_layers` (``hidden_states`` [B, L_cache, T, H]) and the top-k
        log-probabilities, expanded in log space by :func:`cached_target_logprobs`.
        """
        layers = self.target_cache_hidden_layers()
        if "topk_ids" in batch:
            if "hidden_states" not in batch:
                raise ValueError(
                    "the batch comes from an offline target cache without hidden states: the "
                    f"{self.kind} drafter reads the target's hidden states {layers}; rebuild the "
                    "cache or use --target_outputs online"
                )
            cached = batch["hidden_states"]  # [B, L_cache, T, H]
            if cached.shape[1] != len(layers):
                raise ValueError(
                    f"the cached hidden states hold {cached.shape[1]} layers but the {self.kind} "
                    f"drafter reads layers {layers}: delete the cache folder to rebuild it"
                )
            by_layer = {layer: cached[:, j] for j, layer in enumerate(layers)}
            target = cached_target_logprobs(
                batch["topk_ids"],
                batch["topk_logprobs"],
                batch["rest_logmass"],
                self.target_vocab_size,
            )
        else:
            outputs = self.target(
                input_ids=batch["input_ids"],
                attention_mask=batch.get("attention_mask"),
                output_hidden_states=True,
                use_cache=False,
            )
            hidden = outputs.hidden_states
            if max(layers) >= len(hidden):
                raise ValueError(
                    f"the target returned {len(hidden)} hidden states but the {self.kind} drafter "
                    f"reads index {max(layers)}: check its layer ids against the target's depth"
                )
            by_layer = {layer: hidden[layer] for layer in layers}
            target = outputs.logits
        return self._features(by_layer), target

    def _aligned(
        self, batch: Batch, drafts: Sequence[torch.Tensor | SampledRows], target: torch.Tensor
    ) -> Iterable[Aligned]:
        """Per draft output k: weight, logits [B, S, Vd], target [B, S, V], mask, labels [B, S].

        ``S = T - 2 - k``: output k at position t predicts ``x_{t+2+k}`` against the target's
        distribution at ``t+1+k``. Outputs that no position reaches are skipped. An output
        given as :class:`SampledRows` is compared at its anchors only (``S = M``).
        """
        input_ids = batch["input_ids"]
        length = input_ids.shape[1]
        for k, (weight, logits) in enumerate(zip(self.weights, drafts, strict=False)):
            span = length - 2 - k
            if span < 1:
                break
            target_k = target[:, 1 + k : 1 + k + span]
            mask, labels = future_mask(batch, 2 + k), input_ids[:, 2 + k :]
            if isinstance(logits, SampledRows):
                index = logits.anchors.clamp(max=span - 1)  # [B, M]
                rows = torch.arange(index.shape[0], device=index.device)[:, None]
                keep = logits.valid & (logits.anchors < span)
                target_k, labels = target_k[rows, index], labels[rows, index]
                mask = mask[rows, index] & keep
                yield weight, logits.logits, target_k, mask, labels
            else:
                yield weight, logits[:, :span], target_k, mask, labels


def _logits_of(draft: torch.Tensor | SampledRows) -> torch.Tensor:
    return draft.logits if isinstance(draft, SampledRows) else draft


__all__ = [
    "EXPORT_FORMATS",
    "HeadObjective",
    "SampledRows",
    "cached_target_logprobs",
    "future_mask",
    "in_top_k",
    "overlap_at",
    "parse_export_formats",
    "position_weights",
    "recipe_head_settings",
    "recipe_position_weights",
]
