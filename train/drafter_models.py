"""Building the ``draft_lm`` drafter: from a folder, or a thin copy of the target's architecture.

A draft LM must share the target's tokenizer, so the natural small draft is the target's own
architecture with fewer layers (and optionally narrower). Copying the target's input
embeddings, final norm and LM head gives it the target's token geometry from step 0 (as
EAGLE reuses the target's embedding and head, Li et al. 2024); ``target_layers`` also copies the
target's first layers, so a one-layer draft starts as the target's first block followed by its
head. LoRA (Hu et al. 2022, through peft) trains low-rank deltas only and is merged on export.

A pruned draft vocabulary (``--draft_vocab_size``, as EAGLE-3's; Li et al. 2025) replaces the
output layer by one of ``V_draft`` rows (:func:`prune_output_head`) while the input embedding
keeps every target token: the draft reads any token but predicts among the kept ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from draftsmith.train.config import DrafterConfig
    from transformers import PreTrainedModel


def vocab_size_of(model: torch.nn.Module) -> int:
    """Rows of the output embedding: the size of the space the model predicts over."""
    return int(model.get_output_embeddings().weight.shape[0])


def check_same_vocab(
    drafter: torch.nn.Module, target: torch.nn.Module, draft_vocab_size: int | None = None
) -> None:
    """A draft LM must read and predict over the target's token space (its output layer may
    cover a pruned draft vocabulary of ``draft_vocab_size`` tokens instead)."""
    target_vocab = vocab_size_of(target)
    read_vocab = int(drafter.get_input_embeddings().weight.shape[0])
    predicted = vocab_size_of(drafter)
    expected = target_vocab if draft_vocab_size is None else draft_vocab_size
    if read_vocab != target_vocab or predicted != expected:
        pruned = "" if draft_vocab_size is None else f" (its draft vocabulary {expected})"
        raise ValueError(
            f"the drafter reads {read_vocab} and predicts over {predicted} tokens but the target "
            f"over {target_vocab}{pruned}: a draft_lm must share the target's tokenizer; drop "
            "--drafter_path to build the draft from the target's config, or pick a drafter of "
            "the target's family"
        )


def build_draft_lm(config: DrafterConfig, target: PreTrainedModel, seed: int) -> torch.nn.Module:
    """The trainable draft LM described by ``config`` (a peft model when ``lora_rank > 0``).

    ``drafter_path`` loads through ``draftsmith.decode.loading`` (safetensors only, no remote code, NaN or
    infinite weights refused).
    """
    if config.drafter_path is not None:
        from draftsmith.decode.drafters.draft_lm import DRAFT_VOCAB_FILE
        from draftsmith.decode.loading import check_model_finite, load_causal_lm

        if (Path(config.drafter_path) / DRAFT_VOCAB_FILE).is_file():
            raise ValueError(
                f"--drafter_path {config.drafter_path} holds a draft LM with a pruned vocabulary "
                f"({DRAFT_VOCAB_FILE}); training continues only from a full-vocabulary causal "
                "LM: pass that folder (or drop --drafter_path), and choose the pruning with "
                "--draft_vocab_size"
            )
        drafter = load_causal_lm(
            config.drafter_path, torch.float32, frozen=False, flag="--drafter_path"
        )
        check_model_finite(
            drafter,
            f"--drafter_path {config.drafter_path}",
            "pass another folder, or drop --drafter_path to build the draft from the target",
        )
        check_same_vocab(drafter, target)
    else:
        drafter = _thin_copy(config, target, seed)
    if config.freeze_embeddings:
        drafter.get_input_embeddings().requires_grad_(False)
        drafter.get_output_embeddings().requires_grad_(False)
    if config.lora_rank > 0:
        drafter = _with_lora(drafter, config)
    return drafter


def prune_output_head(
    model: torch.nn.Module,
    draft_to_target: torch.Tensor,  # [V_draft] int64 target ids the output rows stand for
    source: torch.Tensor,  # [V, H] the full output layer the rows are taken from
) -> None:
    """Give ``model`` an output layer of the rows ``source[draft_to_target]`` (no bias).

    The new layer keeps the old one's ``requires_grad`` (frozen by ``--freeze_embeddings`` or by
    LoRA), and ``tie_word_embeddings`` is switched off so that saving and loading never tie the
    pruned head back to the full input embedding. A peft model is changed in its base model.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    old = base.get_output_embeddings()
    if type(old) is not torch.nn.Linear or old.bias is not None:
        raise ValueError(
            f"--draft_vocab_size prunes a plain linear output layer without bias, but this draft "
            f"LM's is {type(old).__name__}: drop --draft_vocab_size for this architecture"
        )
    rows = source.detach()[draft_to_target.to(source.device)]  # [V_draft, H]
    head = torch.nn.Linear(
        rows.shape[1], rows.shape[0], bias=False, dtype=old.weight.dtype, device=old.weight.device
    )
    with torch.no_grad():
        head.weight.copy_(rows)
    head.weight.requires_grad_(old.weight.requires_grad)
    base.set_output_embeddings(head)
    base.config.tie_word_embeddings = False
    text_config = base.config.get_text_config()
    if text_config is not base.config:
        text_config.tie_word_embeddings = False


def _thin_copy(config: DrafterConfig, target: PreTrainedModel, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    overrides = {"num_hidden_layers": config.drafter_num_layers}
    if config.drafter_hidden_size is not None:
        overrides["hidden_size"] = config.drafter_hidden_size
    if config.drafter_intermediate_size is not None:
        overrides["intermediate_size"] = config.drafter_intermediate_size
    if config.drafter_num_heads is not None:
        overrides["num_attention_heads"] = config.drafter_num_heads
        overrides["num_key_value_heads"] = config.drafter_num_heads
    values = target.config.to_dict()
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "head_dim" in values and (
        config.drafter_hidden_size is not None or config.drafter_num_heads is not None
    ):
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    for key in ("layer_types", "max_window_layers"):
        if isinstance(values.get(key), list):
            values[key] = values[key][: config.drafter_num_layers]
    draft_config = type(target.config).from_dict(values)
    draft_config.dtype = torch.float32
    # transformers initialises from the global RNG: fork it so only ``seed`` matters.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = AutoModelForCausalLM.from_config(draft_config, dtype=torch.float32)
    if config.drafter_init != "random":
        _copy_from_target(drafter, target, config.drafter_init, config.drafter_num_layers)
    return drafter


def _copy_from_target(
    drafter: torch.nn.Module, target: torch.nn.Module, init: str, num_layers: int
) -> None:
    target_hidden = target.get_input_embeddings().weight.shape[1]
    draft_hidden = drafter.get_input_embeddings().weight.shape[1]
    if draft_hidden != target_hidden:
        raise ValueError(
            f"--drafter_init {init} copies the target's embeddings, which needs the target's "
            f"hidden size {target_hidden}, but --drafter_hidden_size is {draft_hidden}; drop "
            "--drafter_hidden_size or use --drafter_init random"
        )
    with torch.no_grad():
        drafter.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
        draft_head, target_head = drafter.get_output_embeddings(), target.get_output_embeddings()
        if draft_head.weight.data_ptr() != drafter.get_input_embeddings().weight.data_ptr():
            draft_head.weight.copy_(target_head.weight)
        inner_draft, inner_target = _inner(drafter), _inner(target)
        if hasattr(inner_draft, "norm") and hasattr(inner_target, "norm"):
            inner_draft.norm.load_state_dict(inner_target.norm.state_dict())
        if init == "target_layers":
            if not (hasattr(inner_draft, "layers") and hasattr(inner_target, "layers")):
                raise ValueError(
                    "--drafter_init target_layers needs a Llama-like model (model.layers); use "
                    "--drafter_init embeddings"
                )
            if num_layers > len(inner_target.layers):
                raise ValueError(
                    f"--drafter_num_layers {num_layers} exceeds the target's "
                    f"{len(inner_target.layers)} layers; lower it or use --drafter_init embeddings"
                )
            for draft_layer, target_layer in zip(
                inner_draft.layers, inner_target.layers, strict=False
            ):
                draft_layer.load_state_dict(target_layer.state_dict())


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, getattr(model, "base_model_prefix", "model"), model)


def _with_lora(drafter: torch.nn.Module, config: DrafterConfig) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    modules: str | list[str] = config.lora_target_modules
    if modules != "all-linear":
        modules = [name.strip() for name in modules.split(",") if name.strip()]
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(drafter, lora)
