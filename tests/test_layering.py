"""The import direction of the layers (docs/architecture.md), and no module that shadows an installed package.

``accelerate launch train/distill.py`` puts ``train/`` first on ``sys.path``, so a
``train/datasets.py`` would replace the real ``datasets`` for the whole run.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINING_ONLY = {"accelerate", "peft", "wandb"}


def _imported_top_levels(package: str) -> dict[str, set[str]]:
    """Top-level module names each file of ``package`` imports (absolute imports only)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("data", {"decode", "train"} | TRAINING_ONLY),
        ("decode", {"train"} | TRAINING_ONLY),
    ],
)
def test_import_direction(package: str, forbidden: set[str]) -> None:
    offenders = {
        path: sorted(names & forbidden)
        for path, names in _imported_top_levels(package).items()
        if names & forbidden
    }
    assert not offenders, f"{package}/ must not import {sorted(forbidden)}: {offenders}"


def test_scripts_are_thin_over_packages() -> None:
    for path, names in _imported_top_levels("scripts").items():
        assert not names & {"tests"}, f"{path} imports test code"


@pytest.mark.parametrize("package", ["train", "decode", "data"])
def test_no_module_shadows_an_installed_package(package: str) -> None:
    shadowing = []
    for path in (ROOT / package).rglob("*.py"):
        name = path.stem
        if name == "__init__" or path.parent != ROOT / package:
            continue
        known = name in sys.stdlib_module_names or importlib.util.find_spec(name) is not None
        if known and name not in {package}:
            spec = importlib.util.find_spec(name)
            origin = getattr(spec, "origin", "") or ""
            if not origin.startswith(str(ROOT)):
                shadowing.append(f"{package}/{name}.py shadows {name}")
    assert not shadowing, shadowing
