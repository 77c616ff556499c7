"""The explicit registry of drafter kinds, and loading a drafter folder by its declared kind.

The kind comes from ``drafter.json`` (written by training) or from the architecture of a
vLLM/SGLang export; it is never guessed from a path name (docs/interfaces.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import torch
from draftsmith.decode.drafters.base import Drafter
from draftsmith.decode.drafters.folder import DRAFTER_FILE, read_drafter_marker
from draftsmith.decode.loading import LoadError, check_model_finite, read_json_object

# kind -> "module:function" building a runtime Drafter from (path, target); imported lazily so
# that loading one kind never imports the others.
DRAFTER_LOADERS: dict[str, str] = {
    "draft_lm": "draftsmith.decode.drafters.registry:load_draft_lm",
    "ngram": "draftsmith.decode.drafters.registry:load_ngram",
    "none": "draftsmith.decode.drafters.registry:load_no_drafter",
    "medusa": "draftsmith.decode.drafters.medusa:load_runtime_drafter",
    "eagle3": "draftsmith.decode.drafters.eagle.drafter:load_runtime_drafter",
    "peagle": "draftsmith.decode.drafters.eagle.peagle:load_runtime_drafter",
    "dflash": "draftsmith.decode.drafters.dflash.drafter:load_runtime_drafter",
    "hybrid": "draftsmith.decode.drafters.registry:load_hybrid",
}

# Architectures written by other engines' export formats.
# z-lab's and vLLM's DFlash name and speculators' (draftsmith.decode.drafters.dflash.head's
# DFLASH_ENGINE_ARCHITECTURES), spelled out so that detecting a kind imports no drafter module
# (tests/decode/test_dflash.py keeps them equal).
_EXPORT_ARCHITECTURES = {
    "LlamaForCausalLMEagle3": "eagle3",
    "MedusaModel": "medusa",
    "DFlashDraftModel": "dflash",
    "DFlashSpeculator": "dflash",
}


def detect_drafter_kind(path: str | Path) -> str:
    """The kind declared by a drafter folder (``drafter.json``, else its export architecture)."""
    folder = Path(path)
    if folder.is_file():
        raise ValueError(
            f"drafter path {folder} is a file, not a drafter folder: pass the folder that holds "
            "it (train/distill.py writes drafter.json, config.json and model.safetensors there)"
        )
    if not folder.is_dir():
        raise FileNotFoundError(
            f"drafter folder {folder} does not exist: pass the folder written by "
            "train/distill.py (or --drafter-kind ngram, which needs none)"
        )
    marker = folder / DRAFTER_FILE
    if marker.is_symlink() or marker.exists():  # present, but perhaps not a readable file
        if not marker.is_file():
            raise LoadError(
                f"{marker} is not a readable file (a folder, or a link to nothing): it declares "
                "the drafter's kind; restore the file train/distill.py wrote, or export again"
            )
        kind = read_drafter_marker(folder)["kind"]
        _check_kind(kind)
        return kind
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"{folder} has neither {DRAFTER_FILE} nor config.json: not a drafter")
    raw = read_json_object(config, "pass a drafter folder written by train/distill.py")
    for architecture in raw.get("architectures") or []:
        if architecture in _EXPORT_ARCHITECTURES:
            return _EXPORT_ARCHITECTURES[architecture]
    return "draft_lm"


def load_drafter(
    path: str | Path | None,
    target: torch.nn.Module,
    kind: str | None = None,
) -> Drafter:
    """Build the runtime drafter stored at ``path`` for ``target`` (same device and dtype)."""
    if kind is None:
        if path is None:
            raise ValueError("give a drafter folder, or kind='ngram' for prompt lookup")
        kind = detect_drafter_kind(path)
    _check_kind(kind)
    module_name, function_name = DRAFTER_LOADERS[kind].split(":")
    loader: Callable[..., Drafter] = getattr(importlib.import_module(module_name), function_name)
    drafter = loader(path, target)
    drafter.check_compatible(target)
    return drafter


def load_draft_lm(path: str | Path | None, target: torch.nn.Module) -> Drafter:
    """A draft causal LM from a Hugging Face folder, safetensors only, no remote code; with its
    pruned draft vocabulary when the folder has one (``draftsmith.decode.drafters.draft_lm``)."""
    from draftsmith.decode.drafters.draft_lm import DraftModelDrafter, load_draft_model

    if path is None:
        raise ValueError("the draft_lm drafter needs a folder: pass --drafter PATH")
    model, vocab_map = load_draft_model(path, target.dtype, flag="--drafter")
    check_model_finite(model, f"--drafter {path}", "retrain it with a lower learning rate")
    return DraftModelDrafter(model.to(next(target.parameters()).device), vocab_map)


def load_ngram(path: str | Path | None, target: torch.nn.Module) -> Drafter:
    """Prompt lookup needs no weights; ``path`` is ignored."""
    from draftsmith.decode.drafters.ngram import NgramDrafter

    return NgramDrafter(vocab_size=target.get_output_embeddings().weight.shape[0])


def load_no_drafter(path: str | Path | None, target: torch.nn.Module) -> Drafter:
    """Plain decoding through the speculative decoder (the benchmark's control); no weights."""
    from draftsmith.decode.drafters.none import NoDrafter

    return NoDrafter(vocab_size=target.get_output_embeddings().weight.shape[0])


def load_hybrid(path: str | Path | None, target: torch.nn.Module) -> Drafter:
    """Prompt lookup plus the learned drafter (draft_lm, eagle3 or peagle) stored at ``path``."""
    from draftsmith.decode.drafters.hybrid import HybridDrafter

    if path is None:
        raise ValueError(
            "the hybrid drafter pairs prompt lookup with a trained drafter: pass --drafter PATH "
            "(a draft_lm, eagle3 or peagle folder)"
        )
    learned_kind = detect_drafter_kind(path)
    if learned_kind == "hybrid":
        raise ValueError(f"{path} declares kind 'hybrid': point --drafter at the learned drafter")
    return HybridDrafter(load_drafter(path, target, kind=learned_kind))


def _check_kind(kind: str) -> None:
    if kind not in DRAFTER_LOADERS:
        raise ValueError(
            f"unknown drafter kind {kind!r}: choose one of {', '.join(sorted(DRAFTER_LOADERS))}"
        )
