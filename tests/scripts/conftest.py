"""Fixtures of the script tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from draftsmith.train.target.demo import build_demo_target


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny demo target trained for 20 steps, built once per test module."""
    folder = tmp_path_factory.mktemp("t") / "tiny"
    return build_demo_target(
        folder, preset="tiny", max_steps=20, progress_bar=False, verbose=False, dtype="float32"
    )
