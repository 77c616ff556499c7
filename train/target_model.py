"""Finding and loading the frozen target: a demo preset, a local folder or a hub id.

Loading itself is ``decode.loading``'s (safetensors only; remote code only with
``--trust_remote_code``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from decode import loading
from train.config import DEMO_TARGET_PRESETS

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class TargetRef(str):
    """A resolved ``--target``: a preset name, an existing folder, or a hub id."""

    kind: str

    def __new__(cls, value: str, kind: str) -> TargetRef:
        ref = super().__new__(cls, value)
        ref.kind = kind
        return ref


def resolve_target(spec: str) -> TargetRef:
    """Classify ``--target`` without loading anything; raise if it cannot be a model."""
    if spec in DEMO_TARGET_PRESETS:
        return TargetRef(spec, "preset")
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"--target {spec}: {path} has no config.json, so it is not a model folder; "
                "pass a folder saved with save_pretrained, a hub id, or one of "
                f"{', '.join(DEMO_TARGET_PRESETS)}"
            )
        return TargetRef(str(path), "folder")
    if _HUB_ID.match(spec) and not spec.startswith((".", "/", "~")):
        return TargetRef(spec, "hub")
    raise FileNotFoundError(
        f"--target {spec}: no such folder; pass an existing model folder, a hub id (org/name), "
        f"or one of the demo targets {', '.join(DEMO_TARGET_PRESETS)}"
    )


def target_location(ref: TargetRef, allow_build: bool = True) -> tuple[str, str]:
    """``(where to load from, display name)``; builds a missing demo target when allowed."""
    if ref.kind == "preset":
        from train.demo_target import build_demo_target, default_target_path, is_complete

        folder = default_target_path(str(ref))
        if not is_complete(folder) and not allow_build:
            raise FileNotFoundError(
                f"--target {ref}: the demo target is not built yet ({folder}) and a "
                "multi-process run cannot build it; build it once first with "
                f"`python scripts/build_demo_target.py --preset {ref}`"
            )
        location = str(build_demo_target(preset=str(ref)))
        return location, f"demo target '{ref}' ({location})"
    return str(ref), str(ref)


def load_tokenizer(location: str, trust_remote_code: bool = False) -> Any:
    """The target's tokenizer; one without a pad token gets eos as pad."""
    tokenizer = loading.load_tokenizer(location, trust_remote_code, flag="--target")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(location: str, dtype: str = "float32", trust_remote_code: bool = False) -> Any:
    """The frozen target in eval mode, without gradients."""
    return loading.load_causal_lm(
        location, dtype, trust_remote_code=trust_remote_code, frozen=True, flag="--target"
    )


def load_target(
    ref: TargetRef, dtype: str = "float32", trust_remote_code: bool = False
) -> tuple[Any, Any, str]:
    """``(model, tokenizer, name)`` in one call (scripts); see the functions above."""
    location, name = target_location(ref)
    tokenizer = load_tokenizer(location, trust_remote_code)
    return load_model(location, dtype, trust_remote_code), tokenizer, name
