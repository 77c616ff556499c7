"""Loading models, tokenizers and weight files: one dtype table, safetensors only, checked.

The one place where the target and draft causal LMs, their tokenizers and the drafters'
weight and JSON files are read (evaluation, the server and training all come here):

- weights load from safetensors only (``use_safetensors=True``): a folder holding only pickled
  ``.bin`` weights is refused rather than unpickled, since unpickling can run code;
- custom modelling code runs only when the caller passes ``trust_remote_code=True`` (the
  operator's own flag for a target); drafters never run it;
- a file that does not parse, a safetensors file that is corrupt and weights that are NaN or
  infinite raise an error naming the file and the fix (``LoadError``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from draftsmith.decode.precision import choose_dtype


class LoadError(ValueError):
    """A model, tokenizer or drafter file that cannot be used as it is."""


def resolve_dtype(name: str | torch.dtype, device: torch.device | str | None = None) -> torch.dtype:
    """A dtype name -> torch dtype; ``"auto"`` is ``draftsmith.decode.precision.choose_dtype``'s decision
    for ``device`` (bfloat16 where it has bfloat16 kernels, float32 elsewhere)."""
    if isinstance(name, torch.dtype):
        return name
    return choose_dtype(name, device or "cpu").dtype


def check_device(name: str) -> str:
    """``name`` when torch knows it and this machine has it; ``ValueError`` naming ``--device``
    and the fix otherwise (checked before any model is loaded)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(
            f"--device {name!r} is not a device torch knows; pass cpu or cuda (cuda:0, ...)"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this machine has no CUDA device; pass --device cpu")
    count = torch.cuda.device_count()
    if device.type == "cuda" and device.index is not None and device.index >= count:
        raise ValueError(f"--device {name}: this machine has {count} CUDA device(s); pass one")
    return name


def load_causal_lm(
    location: str | Path,
    dtype: str | torch.dtype = "float32",
    *,
    device: torch.device | str | None = None,
    trust_remote_code: bool = False,
    frozen: bool = True,
    flag: str = "--target",
) -> Any:
    """A Hugging Face causal LM from a folder (or a cached hub id), safetensors weights only.

    ``frozen`` returns it in eval mode without gradients (targets, inference drafters);
    otherwise as loaded (a draft LM to train). ``flag`` names the option in error messages.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(location),
            dtype=resolve_dtype(dtype, device),
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as error:
        safetensors_hint = (
            " (it holds only pickled .bin weights, which are never loaded: convert them with "
            "save_pretrained(..., safe_serialization=True))"
            if _only_pickled_weights(location)
            else ""
        )
        message = (
            f"{flag} {location}: could not load a causal LM{safetensors_hint} "
            f"({type(error).__name__}: {error}); pass a folder saved with save_pretrained "
            "(config.json and model.safetensors), or a hub id already in the local cache "
            "(HF_HUB_OFFLINE=1 allows only the cache)"
        )
        # A missing file stays an OSError (FileNotFoundError); bad content is a LoadError.
        raise (FileNotFoundError if isinstance(error, OSError) else LoadError)(message) from error
    if device is not None:
        model = model.to(device)
    if frozen:
        model = model.eval().requires_grad_(False)
    return model


def load_tokenizer(
    location: str | Path, trust_remote_code: bool = False, flag: str = "--target"
) -> Any:
    """The tokenizer saved with a model (a folder or a cached hub id)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(location), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        message = (
            f"{flag} {location}: could not load its tokenizer ({type(error).__name__}: {error}); "
            "pass the folder the model was saved in (tokenizer.json, tokenizer_config.json), or "
            "a hub id already in the local cache (HF_HUB_OFFLINE=1 allows only the cache)"
        )
        raise (FileNotFoundError if isinstance(error, OSError) else LoadError)(message) from error


def local_folder(path: str | Path, flag: str) -> Path:
    """``path`` as an existing local folder, or ``FileNotFoundError`` naming ``flag``."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{flag} {path}: no such folder; pass a local Hugging Face model folder (build one "
            "with scripts/build_demo_target.py or save_pretrained)"
        )
    return folder


def read_json_object(file: str | Path, fix: str) -> dict[str, Any]:
    """A JSON object from ``file``; anything else raises ``LoadError`` naming it and ``fix``."""
    file = Path(file)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise LoadError(f"{file} is not valid JSON ({error}); {fix}") from error
    if not isinstance(data, dict):
        raise LoadError(f"{file} holds a JSON {type(data).__name__}, not an object; {fix}")
    return data


def load_safetensors(file: str | Path, fix: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (CPU), checked finite; ``LoadError`` naming the file."""
    from safetensors.torch import load_file

    file = Path(file)
    if not file.is_file():
        raise LoadError(f"{file} does not exist; {fix}")
    try:
        tensors = load_file(str(file))
    except Exception as error:  # safetensors raises its own error type (no common base)
        raise LoadError(
            f"{file} is not a readable safetensors file ({type(error).__name__}: {error}); the "
            f"file is corrupt or truncated: {fix}"
        ) from error
    check_finite(tensors.items(), str(file), fix)
    return tensors


def check_finite(named: Any, source: str, fix: str) -> None:
    """Raise ``LoadError`` naming the first floating tensor of ``named`` holding NaN or inf."""
    for name, tensor in named:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise LoadError(
                f"{source}: weight {name} holds {bad} NaN or infinite value(s) of "
                f"{tensor.numel()}; such a model cannot draft: {fix}"
            )


def check_model_finite(model: torch.nn.Module, source: str, fix: str) -> None:
    """``check_finite`` over a module's parameters and buffers."""
    check_finite([*model.named_parameters(), *model.named_buffers()], source, fix)


def _only_pickled_weights(location: str | Path) -> bool:
    folder = Path(location)
    if not folder.is_dir():
        return False
    pickled = any(folder.glob("*.bin")) or any(folder.glob("*.pt"))
    return pickled and not any(folder.glob("*.safetensors"))
