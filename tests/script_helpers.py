"""Shared by the script tests: a script of scripts/ loaded from its file, as `python` runs it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str, module_name: str | None = None) -> ModuleType:
    """``scripts/<name>.py`` as a fresh module (``module_name``, default ``name``)."""
    spec = importlib.util.spec_from_file_location(
        module_name or name, REPO / "scripts" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
