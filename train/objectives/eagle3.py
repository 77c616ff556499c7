"""The ``eagle3`` objective: an EAGLE-3 head trained against a frozen target (training-time test).

EAGLE-3 (Li et al., 2025) drafts from the target's own features: at position t the head fuses
three of the target's hidden states ``g_t = fc(cat(h^low_t, h^mid_t, h^high_t))`` with the
target's embedding of the next token ``x_{t+1}`` and predicts ``x_{t+2}``
(``decode.drafters.eagle``). At inference the head then feeds on its own outputs for the
following draft positions, so training unrolls it the same way ("training-time test",
:meth:`Eagle3Head.unroll`): step k (0-based) at position t reads its own step-(k-1) output and
the token ``x_{t+1+k}``, and its distribution ``q_k(. | t)`` guesses ``x_{t+2+k}``. The target's
distribution for that token is its next-token law at position ``t+1+k``, ``p(. | x_<=t+1+k)``.
With the configured divergence D (``train.losses``: TV maximises acceptance directly, KLs and
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
- the offline cache (``data.cache``): the batch carries the cached hidden states of the head's
  aux layers (``hidden_states`` [B, L_cache, T, H], layer ids from
  :meth:`Eagle3Objective.target_cache_hidden_layers`) and the top-k log-probabilities, expanded
  in log space by :func:`cached_target_logprobs`.

Held-out metrics per draft position j = k + 1: ``overlap@j``, the mean of
``sum_x min(p(x), q_k(x))`` at the decoding temperature, the expected acceptance rate of draft
position j given that the earlier ones were accepted (Leviathan et al. 2023; the ``alpha_j`` of
docs/theory.md §5); ``greedy_match@j``, the same at temperature 0; ``loss@j`` and ``loss``.

The helpers :func:`position_weights`, :func:`future_mask` and :func:`cached_target_logprobs`
are shared with the ``medusa`` objective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from decode.drafters.eagle import Eagle3Config, Eagle3Head, build_vocab_maps
from train.losses import Loss, build_loss, overlap
from train.objectives import Batch, MetricSums, Objective

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from train.config import DistillConfig

EXPORT_FORMATS = ("vllm", "sglang")


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


def future_mask(batch: Batch, ahead: int) -> torch.Tensor:  # [B, T - ahead] bool
    """Positions t whose prediction of ``x_{t+ahead}`` is trained on.

    True where ``x_t`` and ``x_{t+ahead}`` are real tokens (``attention_mask``) and
    ``loss_mask[t+ahead]`` is set. ``ahead = 2 + k`` for EAGLE-3 step k and Medusa head k.
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
    """The offline cache's distribution (``data.cache.topk_to_probs``) in log space.

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


def parse_export_formats(value: str | None) -> tuple[str, ...]:
    """``--export_format`` (``vllm``, ``sglang``, ``vllm,sglang`` or unset) as a tuple."""
    if value is None or not value.strip() or value.strip() == "none":
        return ()
    formats = tuple(part.strip() for part in value.split(",") if part.strip())
    bad = [fmt for fmt in formats if fmt not in EXPORT_FORMATS]
    if bad:
        raise ValueError(
            f"--export_format {value!r}: unknown format(s) {bad}; use "
            f"{', '.join(EXPORT_FORMATS)} or a comma list of them"
        )
    return tuple(dict.fromkeys(formats))


def overlap_at(
    draft_logits: torch.Tensor,  # [B, S, V]
    target_logits: torch.Tensor,  # [B, S, V]
    mask: torch.Tensor,  # [B, S] bool
    temperature: float,
) -> torch.Tensor:  # [B, S]
    """``train.losses.overlap`` with both sides in a common dtype (e.g. a float32 head on a
    float64 or bfloat16 target)."""
    dtype = torch.promote_types(draft_logits.dtype, target_logits.dtype)
    return overlap(draft_logits.to(dtype), target_logits.to(dtype), mask, temperature)


def combine_parts(loss: Loss, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """``sum_i weight_i * term_i`` of a loss mix, from :meth:`Loss.parts`."""
    first, *rest = loss.spec.terms
    total = first.weight * parts[first.key]
    for term in rest:
        total = total + term.weight * parts[term.key]
    return total


# --------------------------------------------------------------------------- the objective


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


class Eagle3Objective(Objective):
    """Train an :class:`Eagle3Head` on a frozen target; see the module docstring for the math."""

    kind: ClassVar[str] = "eagle3"

    def __init__(
        self,
        head: Eagle3Head,
        target: torch.nn.Module,
        loss: Loss,
        *,
        unroll_steps: int = 4,
        step_weights: Sequence[float] | None = None,
        loss_temperature: float = 1.0,
        eval_temperature: float = 1.0,
        export_formats: Sequence[str] = (),
        init_from_target: bool = True,
        freeze_lm_head: bool = False,
    ) -> None:
        super().__init__()
        if unroll_steps < 1:
            raise ValueError(f"--unroll_steps must be >= 1, got {unroll_steps}")
        _check_head_fits(head.config, target)
        self.head = head
        self.unrolled = UnrolledHead(head, unroll_steps)
        self.target = target.eval().requires_grad_(False)
        self.loss = loss
        self.unroll_steps = unroll_steps
        self.step_weights = position_weights(unroll_steps, step_weights)
        self.loss_temperature = loss_temperature
        self.eval_temperature = eval_temperature
        self.export_formats = parse_export_formats(",".join(export_formats))
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
    ) -> Eagle3Objective:
        drafter = config.drafter
        overrides: dict[str, Any] = {}
        if drafter.draft_vocab_size is not None:
            overrides["draft_vocab_size"] = drafter.draft_vocab_size
        if drafter.aux_hidden_state_layer_ids:
            overrides["aux_hidden_state_layer_ids"] = tuple(drafter.aux_hidden_state_layer_ids)
        head_config = Eagle3Config.for_target(target.config, **overrides)
        # nn.Module initialises from the global RNG: fork it so that only the seed matters.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.optim.seed)
            head = Eagle3Head(head_config)
        return cls(
            head,
            target,
            build_loss(config.loss.loss),
            unroll_steps=config.loss.unroll_steps,
            step_weights=position_weights(
                config.loss.unroll_steps,
                config.loss.position_weights,
                config.loss.position_weight_decay,
            ),
            loss_temperature=config.loss.loss_temperature,
            eval_temperature=config.loss.eval_temperature,
            export_formats=parse_export_formats(config.output.export_format),
            init_from_target=drafter.drafter_init != "random",
            freeze_lm_head=drafter.freeze_embeddings,
        )

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

    # ------------------------------------------------------------------ loop protocol

    def trainable_module(self) -> torch.nn.Module:
        return self.unrolled

    @property
    def trained_head(self) -> Eagle3Head:
        """The head being trained (unwrapped from DDP/compile wrappers)."""
        return self.unwrapped_module.head

    def bind(self, module: torch.nn.Module, accelerator: Any) -> None:
        super().bind(module, accelerator)
        self.target.to(accelerator.device)

    def compute_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        aux, target = self._target_outputs(batch)
        steps = self._unroll(batch, aux)
        head = self.trained_head
        total: torch.Tensor | None = None
        used = 0.0
        metrics: dict[str, float] = {}
        for k, (weight, draft, target_k, mask, labels) in enumerate(
            self._aligned(batch, steps, target)
        ):
            labels, mask = self._draft_labels(head, labels, mask)
            if not bool(mask.any()):
                continue
            target_draft = head.to_draft_vocab(target_k) if self.loss.needs_target else None
            parts = self.loss.parts(draft, target_draft, mask, self.loss_temperature, labels=labels)
            value = combine_parts(self.loss, parts)
            total = weight * value if total is None else total + weight * value
            used += weight
            metrics[f"loss@{k + 1}"] = float(value.detach())
            if "tv" in parts:  # the overlap is free with a TV term (a full pass over V is not)
                metrics[f"overlap@{k + 1}"] = 1.0 - float(parts["tv"].detach())
        if total is None:  # no position of this batch reaches any draft step: a zero step
            return sum(step.sum() for step in steps) * 0.0, metrics
        return total / used, metrics

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> MetricSums:
        aux, target = self._target_outputs(batch)
        steps = self._unroll(batch, aux)
        head = self.trained_head
        out: MetricSums = {}
        weighted_loss = weighted_count = 0.0
        for k, (weight, draft, target_k, mask, labels) in enumerate(
            self._aligned(batch, steps, target)
        ):
            count = float(mask.sum())
            if count == 0:
                continue
            draft_full = head.to_target_logits(draft)
            sampled = overlap_at(draft_full, target_k, mask, self.eval_temperature)
            greedy = overlap_at(draft_full, target_k, mask, 0.0)
            out[f"overlap@{k + 1}"] = (float(sampled.sum()), count)
            out[f"greedy_match@{k + 1}"] = (float(greedy.sum()), count)
            draft_labels, loss_mask = self._draft_labels(head, labels, mask)
            if bool(loss_mask.any()):
                target_draft = head.to_draft_vocab(target_k) if self.loss.needs_target else None
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
        """The native folder (``Eagle3Head.save_pretrained``) plus any engine exports.

        Engine layouts (``--export_format vllm,sglang``) go to ``<folder>/<format>/``
        (``train.export_formats.export_eagle3``); the tokenizer is the target's, not stored.
        ``state_dict`` (the gathered trainable state, keys ``head.*``) replaces the local
        weights when given (FSDP/DeepSpeed shard them).
        """
        from train.export_formats import export_eagle3

        head = self.trained_head
        if state_dict is not None:
            head = Eagle3Head(head.config)
            head.load_state_dict({k.removeprefix("head."): v for k, v in state_dict.items()})
        folder = Path(folder)
        head.save_pretrained(folder)
        for fmt in self.export_formats:
            export_eagle3(head, folder / fmt, fmt, overwrite=True)

    def describe(self) -> dict[str, Any]:
        """Architecture facts for the model card."""
        head = self.trained_head
        config = head.config
        return {
            "architecture": "EAGLE-3 head (LlamaForCausalLMEagle3 weight layout)",
            "hidden_size": config.hidden_size,
            "aux_hidden_state_layer_ids": list(config.aux_hidden_state_layer_ids),
            "draft_vocab_size": config.draft_vocab_size,
            "target_vocab_size": config.target_vocab_size,
            "draft_vocab_coverage": self.vocab_coverage,
            "unroll_steps": self.unroll_steps,
            "step_weights": [round(w, 6) for w in self.step_weights],
            "parameters": sum(p.numel() for p in head.parameters()),
            "trainable_parameters": sum(p.numel() for p in head.parameters() if p.requires_grad),
            "exports": list(self.export_formats),
        }

    # ------------------------------------------------------------------ internals

    @torch.no_grad()
    def _target_outputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused-layer inputs [B, T, A*H] and target logits or log-probs [B, T, V]."""
        head = self.trained_head
        ids = head.config.aux_hidden_state_layer_ids
        if "topk_ids" in batch:
            if "hidden_states" not in batch:
                raise ValueError(
                    "the batch comes from an offline target cache without hidden states: EAGLE-3 "
                    "needs them; rebuild the cache (the eagle3 objective asks for layers "
                    f"{self._cache_layers}) or use --target_outputs online"
                )
            cached = batch["hidden_states"]  # [B, L_cache, T, H]
            if cached.shape[1] != len(self._cache_layers):
                raise ValueError(
                    f"the cached hidden states hold {cached.shape[1]} layers but the head reads "
                    f"{self._cache_layers}: delete the cache folder to rebuild it"
                )
            aux = torch.cat([cached[:, self._cache_layers.index(i)] for i in ids], dim=-1)
            target = cached_target_logprobs(
                batch["topk_ids"],
                batch["topk_logprobs"],
                batch["rest_logmass"],
                head.config.target_vocab_size,
            )
            return aux, target
        outputs = self.target(
            input_ids=batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            output_hidden_states=True,
            use_cache=False,
        )
        return head.gather_aux(outputs.hidden_states), outputs.logits

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

    def _aligned(
        self, batch: Batch, steps: list[torch.Tensor], target: torch.Tensor
    ) -> Iterable[tuple[float, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per step k: weight, draft logits [B, S, Vd], target [B, S, V], mask and labels [B, S].

        ``S = T - 2 - k``: step k at position t predicts ``x_{t+2+k}`` against the target's
        distribution at ``t+1+k``. Steps that no position reaches are skipped.
        """
        input_ids = batch["input_ids"]
        length = input_ids.shape[1]
        for k, (weight, logits) in enumerate(zip(self.step_weights, steps, strict=True)):
            span = length - 2 - k
            if span < 1:
                break
            yield (
                weight,
                logits[:, :span],
                target[:, 1 + k : 1 + k + span],
                future_mask(batch, 2 + k),
                input_ids[:, 2 + k :],
            )

    def _draft_labels(
        self, head: Eagle3Head, labels: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Hard labels in draft ids for a ``ce`` term; labels outside the draft vocabulary drop."""
        if not self.loss.needs_labels:
            return None, mask
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
