"""Write trained heads in the folder layouts that vLLM and SGLang load.

EAGLE-3 (``LlamaForCausalLMEagle3``; vLLM ``llama_eagle3.py``, SGLang ``llama_eagle3.py``):
a Llama-style ``config.json`` with ``num_hidden_layers = 1``, ``vocab_size`` = the target's,
``draft_vocab_size`` and the aux layer ids, and ``model.safetensors`` with ``fc.weight``,
``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64 offsets: target_id = draft_id
+ d2t[draft_id]) and ``t2d`` (bool); no ``embed_tokens`` (both engines share the target's).
The two layouts differ only in where and how the aux layer ids are written:

* vLLM reads top-level ``eagle_aux_hidden_state_layer_ids`` and captures the *input* of those
  target layers, i.e. Hugging Face ``hidden_states[i]`` -- our convention, written as is;
* SGLang reads ``eagle_config["eagle_aux_hidden_state_layer_ids"]`` and captures the *output*
  of those layers (it adds one internally) -- written as ours minus one.

Medusa (vLLM ``MedusaModel``, ``vllm/transformers_utils/configs/medusa.py``): config fields
``num_heads``, ``num_hidden_layers``, ``hidden_size``, ``vocab_size``, ``truncated_vocab_size``,
``medusa_fc_bias`` and weights ``blocks.{i}.layers.{j}.weight/bias``, ``lm_heads.{i}.weight``.

Folders are written to a temporary sibling and renamed into place, so a crash never leaves a
half-written export behind.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from decode.atomic_io import atomic_folder
from decode.drafters.eagle import EAGLE3_ARCHITECTURE, Eagle3Head
from decode.drafters.medusa import MEDUSA_ARCHITECTURE, MedusaHeads

EngineFormat = Literal["vllm", "sglang"]
ENGINE_FORMATS: tuple[str, ...] = ("vllm", "sglang")


def eagle3_engine_config(head: Eagle3Head, fmt: EngineFormat, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` an engine expects for this head."""
    config = head.config
    out: dict[str, Any] = {
        "architectures": [EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.target_vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "target_num_hidden_layers": config.target_num_hidden_layers,  # ours; engines ignore it
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    ids = list(config.aux_hidden_state_layer_ids)
    if fmt == "vllm":
        out["eagle_aux_hidden_state_layer_ids"] = ids
    else:
        out["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],
            "use_aux_hidden_state": True,
        }
    return out


def export_eagle3(
    head: Eagle3Head,
    out_dir: str | Path,
    fmt: EngineFormat,
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``head`` as a vLLM or SGLang EAGLE-3 draft folder; returns the folder.

    ``dtype`` casts the floating-point weights (e.g. ``torch.bfloat16`` for serving); the
    vocabulary maps keep their integer/bool types.
    """
    if fmt not in ENGINE_FORMATS:
        raise ValueError(f"fmt must be one of {ENGINE_FORMATS}, got {fmt!r}")
    if len(head.config.aux_hidden_state_layer_ids) != 3:
        raise ValueError(
            "vLLM and SGLang build fc over exactly 3 target features, this head fuses "
            f"{len(head.config.aux_hidden_state_layer_ids)}: train with 3 aux_hidden_state_layer_ids"
        )
    if min(head.config.aux_hidden_state_layer_ids) < 1:
        raise ValueError(
            "engines capture hidden states from layer inputs 1..L-1; aux id 0 (the embeddings) "
            "cannot be exported: retrain with aux_hidden_state_layer_ids >= 1"
        )
    dtype = dtype or head.fc.weight.dtype
    tensors = {
        name: (tensor.to(dtype) if tensor.is_floating_point() else tensor)
        for name, tensor in head.state_dict().items()
    }
    config = eagle3_engine_config(head, fmt, dtype)
    return _write_folder(Path(out_dir), config, tensors, overwrite)


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
    return _write_folder(Path(out_dir), medusa_engine_config(heads, dtype), tensors, overwrite)


def _write_folder(
    out_dir: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], overwrite: bool
) -> Path:
    def write(folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
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
