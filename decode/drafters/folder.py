"""The on-disk drafter folder shared by the head drafters (docs/interfaces.md).

Native folders hold ``drafter.json`` (the kind), ``config.json`` and ``model.safetensors``;
the loaders also accept an inference engine's export, recognised by ``architectures``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1


def save_native_folder(
    folder: str | Path, kind: str, config: dict[str, Any], module: torch.nn.Module
) -> None:
    """Write ``drafter.json``, ``config.json`` and ``model.safetensors`` for ``module``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    marker = {"kind": kind, "format_version": FORMAT_VERSION}
    (folder / "drafter.json").write_text(json.dumps(marker, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    save_file(weights, str(folder / "model.safetensors"))


def read_folder(
    folder: str | Path, kind: str, engine_architecture: str
) -> tuple[dict[str, Any], bool, dict[str, torch.Tensor]]:
    """``(config.json, is_native, weights)`` of a native ``kind`` folder or an engine export."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a drafter folder")
    raw = json.loads(config_path.read_text())
    marker = folder / "drafter.json"
    if marker.is_file():
        found = json.loads(marker.read_text()).get("kind")
        if found != kind:
            raise ValueError(f"{folder} holds a {found!r} drafter, not {kind!r}")
        native = True
    elif engine_architecture in raw.get("architectures", []):
        native = False
    else:
        raise ValueError(
            f"{folder} is neither a native {kind} folder (drafter.json) nor an export with "
            f"architectures [{engine_architecture!r}]"
        )
    weights_path = folder / "model.safetensors"
    if not weights_path.is_file():
        raise FileNotFoundError(f"{folder} has no model.safetensors")
    return raw, native, load_file(str(weights_path))
