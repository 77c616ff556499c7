"""Target, tokenizer and drafter from local folders, with the server's security defaults.

Loading goes through ``draftsmith.decode.loading``: weights from safetensors only (a folder holding only
pickled ``.bin`` weights is refused rather than unpickled), custom modelling code only when
``trust_remote_code`` is set, drafter folders checked (``draftsmith.decode.drafters.folder``). Nothing is
fetched from a hub: paths must be local folders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from draftsmith.decode import loading
from draftsmith.decode.cpu_threads import set_cpu_threads
from draftsmith.decode.drafters.base import Drafter
from draftsmith.decode.precision import announce, choose_dtype
from draftsmith.decode.serving.config import ServeConfig


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(loading.check_device(name))


def load_target(
    path: str | Path, dtype: str, device: torch.device, trust_remote_code: bool
) -> torch.nn.Module:
    """The target causal LM in eval mode on ``device``."""
    folder = loading.local_folder(path, "--target")
    return loading.load_causal_lm(
        folder, dtype, device=device, trust_remote_code=trust_remote_code, flag="--target"
    )


def load_tokenizer(path: str | Path, trust_remote_code: bool) -> Any:
    folder = loading.local_folder(path, "--tokenizer")
    return loading.load_tokenizer(folder, trust_remote_code, flag="--tokenizer")


def load_components(config: ServeConfig) -> tuple[torch.nn.Module, Any, Drafter]:
    """(target, tokenizer, drafter) as ``config`` names them."""
    target, drafter = load_models(config)
    tokenizer = load_tokenizer(config.tokenizer or config.target, config.trust_remote_code)
    return target, tokenizer, drafter


def load_models(config: ServeConfig) -> tuple[torch.nn.Module, Drafter]:
    """(target, drafter) as ``config`` names them, on its device, threads and dtype (what a
    decoder process loads: the tokenizer stays with the front end)."""
    from draftsmith.decode.drafters.hybrid import set_lookup_tokens
    from draftsmith.decode.drafters.registry import load_drafter

    set_cpu_threads(config.num_threads)
    device = resolve_device(config.device)
    choice = choose_dtype(config.dtype, device)
    announce(choice)
    target = load_target(config.target, choice.name, device, config.trust_remote_code)
    drafter = load_drafter(config.drafter, target, kind=config.drafter_kind)
    set_lookup_tokens(drafter, config.lookup_tokens, "--lookup-tokens")
    return target, drafter
