"""The on-disk drafter folder shared by the head drafters (docs/interfaces.md).

Native folders hold ``drafter.json`` (the kind and ``format_version``), ``config.json`` and
``model.safetensors``; the loaders also accept an inference engine's export, recognised by
``architectures``. A drafter folder may come from someone else, so everything read from it is
checked (``draftsmith.decode.loading``): malformed JSON, a missing ``kind``, a ``format_version`` newer
than this code reads, a corrupt safetensors file and NaN or infinite weights are errors naming
the file and the fix. So are a config field of the wrong type (``"hidden_size": "32"``), a size
that is not positive, a size larger than every dimension of the folder's own weights (a
hostile ``"hidden_size": 10000000`` would otherwise allocate terabytes before the shapes are
compared) and weights that are not floating point.
"""

from __future__ import annotations

import json
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

import torch
from draftsmith.decode.loading import LoadError, load_safetensors, read_json_object
from draftsmith.decode.yaml_values import describe_type, describe_value, typed_value
from safetensors.torch import save_file

FORMAT_VERSION = 1
"""The newest ``drafter.json`` format this code reads (and the one it writes)."""
DRAFTER_FILE = "drafter.json"
PROVENANCE_FILE = "provenance.json"
"""Where a trained folder keeps its training record (``draftsmith.train.provenance``)."""
_REEXPORT = "re-export the drafter with train/distill.py or use a folder written by it"
_SIZE_KEYS = (
    "hidden_size",
    "vocab_size",
    "intermediate_size",
    "num_heads",
    "num_layers",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "target_vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "truncated_vocab_size",
    "num_depths",
)
"""config.json keys that size the module built before its weights are compared: a dimension
of some weight, or a count of modules (at most the number of tensors)."""


ConfigT = TypeVar("ConfigT")


def config_from_fields(cls: type[ConfigT], values: dict[str, Any]) -> ConfigT:
    """``cls(**values)`` for a dataclass config read from a folder, refusing unknown keys,
    values of another type than the field's and numbers that are not positive (except ids)."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"unknown {cls.__name__} fields {unknown}; expected a subset of {sorted(known)}"
        )
    hints = typing.get_type_hints(cls)
    checked = {
        name: _checked_field(cls, name, hints[name], value) for name, value in values.items()
    }
    return cls(**checked)


def _checked_field(cls: type, name: str, hint: Any, value: Any) -> Any:
    """``value`` of config field ``name`` if it has the field's type (ints widened to float)
    and, unless it is a list, is positive (non-negative for an id or a field the class names in
    ``ZERO_ALLOWED``, where 0 means off); else ``LoadError``."""
    ok, converted = typed_value(value, hint)
    if not ok:
        raise LoadError(
            f"config.json: {cls.__name__}.{name} must be {describe_type(hint)}, got "
            f"{describe_value(value)}; {_REEXPORT}"
        )
    number = isinstance(converted, (int, float)) and not isinstance(converted, bool)
    zero_allowed = name.endswith("_id") or name in getattr(cls, "ZERO_ALLOWED", ())
    if number and (converted < 0 if zero_allowed else converted <= 0):
        raise LoadError(
            f"config.json: {cls.__name__}.{name} must be positive, got {converted!r}; {_REEXPORT}"
        )
    return converted


def trained_config(folder: str | Path) -> dict[str, Any] | None:
    """The resolved training config of ``folder``'s ``provenance.json`` (section -> field ->
    value), or None when the folder has no such record."""
    file = Path(folder) / PROVENANCE_FILE
    if not file.is_file():
        return None
    config = read_json_object(file, "restore the provenance.json train/distill.py wrote").get(
        "config"
    )
    return config if isinstance(config, dict) else None


def read_drafter_marker(folder: str | Path) -> dict[str, Any]:
    """``drafter.json`` of ``folder``, checked: a string ``kind`` and a readable version."""
    file = Path(folder) / DRAFTER_FILE
    marker = read_json_object(
        file, f'it must be an object such as {{"kind": "draft_lm"}}; {_REEXPORT}'
    )
    kind = marker.get("kind")
    if not isinstance(kind, str) or not kind:
        raise LoadError(
            f"{file} declares no drafter kind (a 'kind' string such as \"draft_lm\", "
            f'"eagle3" or "medusa"); add it, or {_REEXPORT}'
        )
    version = marker.get("format_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise LoadError(f"{file}: format_version must be a positive integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise LoadError(
            f"{file}: format_version {version} is newer than this draftsmith reads "
            f"({FORMAT_VERSION}); upgrade draftsmith, or {_REEXPORT}"
        )
    return marker


def save_native_folder(
    folder: str | Path, kind: str, config: dict[str, Any], module: torch.nn.Module
) -> None:
    """Write ``drafter.json``, ``config.json`` and ``model.safetensors`` for ``module``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    marker = {"kind": kind, "format_version": FORMAT_VERSION}
    (folder / DRAFTER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    save_file(weights, str(folder / "model.safetensors"))


def read_folder(
    folder: str | Path, kind: str, engine_architecture: str | tuple[str, ...]
) -> tuple[dict[str, Any], bool, dict[str, torch.Tensor]]:
    """``(config.json, is_native, weights)`` of a native ``kind`` folder or an engine export
    (``architectures`` naming ``engine_architecture``, or one of several)."""
    accepted = (
        (engine_architecture,) if isinstance(engine_architecture, str) else engine_architecture
    )
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a drafter folder")
    raw = read_json_object(config_path, _REEXPORT)
    if (folder / DRAFTER_FILE).is_file():
        found = read_drafter_marker(folder)["kind"]
        if found != kind:
            raise ValueError(f"{folder} holds a {found!r} drafter, not {kind!r}")
        native = True
    elif set(accepted) & set(raw.get("architectures") or []):
        native = False
    else:
        raise ValueError(
            f"{folder} is neither a native {kind} folder (drafter.json) nor an export with "
            f"architectures {' or '.join(f'[{a!r}]' for a in accepted)}"
        )
    weights_path = folder / "model.safetensors"
    if not weights_path.is_file():
        raise FileNotFoundError(f"{folder} has no model.safetensors")
    weights = load_safetensors(weights_path, _REEXPORT)
    check_weights_fit_config(raw, weights, config_path)
    return raw, native, weights


def check_weights_fit_config(
    raw: dict[str, Any], weights: dict[str, torch.Tensor], config_path: Path
) -> None:
    """Refuse parameters that are not floating point, and sizes in ``config.json`` that no
    weight holds (checked before the module those sizes describe is built)."""
    for name, tensor in weights.items():
        if name.endswith((".weight", ".bias")) and not tensor.is_floating_point():
            raise LoadError(
                f"{config_path.parent / 'model.safetensors'}: weight {name} has dtype "
                f"{str(tensor.dtype).removeprefix('torch.')}, not a floating-point dtype; "
                f"{_REEXPORT}"
            )
    bound = max([len(weights), *(max(t.shape, default=1) for t in weights.values())])
    for key in _SIZE_KEYS:
        value = raw.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > bound:
            raise LoadError(
                f"{config_path}: {key} {value} is larger than every dimension of the weights in "
                f"model.safetensors (at most {bound}), so the config does not describe them; "
                f"{_REEXPORT}"
            )
