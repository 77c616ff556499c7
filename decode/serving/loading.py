"""Target, tokenizer and drafter from folders, with the server's security defaults.

Weights load from safetensors only (``use_safetensors=True``: a folder holding only pickled
``.bin`` weights is refused rather than unpickled) and custom modelling code runs only when
``trust_remote_code`` is set. Nothing is fetched from a hub: paths must be local folders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from decode.drafters.base import Drafter
from decode.serving.config import ServeConfig

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available here; use --device cpu")
    return device


def load_target(
    path: str | Path, dtype: str, device: torch.device, trust_remote_code: bool
) -> torch.nn.Module:
    """The target causal LM in eval mode on ``device``."""
    from transformers import AutoModelForCausalLM

    folder = _local_folder(path, "--target")
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        dtype="auto" if dtype == "auto" else _DTYPES[dtype],
        use_safetensors=True,
        trust_remote_code=trust_remote_code,
    )
    return model.to(device).eval()


def load_tokenizer(path: str | Path, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    folder = _local_folder(path, "--tokenizer")
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)


def load_components(config: ServeConfig) -> tuple[torch.nn.Module, Any, Drafter]:
    """(target, tokenizer, drafter) as ``config`` names them."""
    from decode.drafters.registry import load_drafter

    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    target = load_target(config.target, config.dtype, device, config.trust_remote_code)
    tokenizer = load_tokenizer(config.tokenizer or config.target, config.trust_remote_code)
    drafter = load_drafter(config.drafter, target, kind=config.drafter_kind)
    return target, tokenizer, drafter


def _local_folder(path: str | Path, flag: str) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{flag} {path}: no such folder; the server loads local Hugging Face folders only "
            "(build one with scripts/build_demo_target.py or save_pretrained)"
        )
    return folder
