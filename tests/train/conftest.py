"""A tiny demo target built once per session, and argv helpers for train/distill.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY_RECIPE = REPO / "configs" / "tiny.yaml"


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The "tiny" demo target (2 x 64, vocab 512), 60 steps: peaked enough to imitate."""
    from draftsmith.train.target.demo import build_demo_target

    folder = tmp_path_factory.mktemp("targets") / "tiny"
    return build_demo_target(
        folder, preset="tiny", max_steps=60, progress_bar=False, verbose=False, dtype="float32"
    )


@pytest.fixture
def tiny_argv(tiny_target: Path) -> Callable[..., list[str]]:
    """``tiny_argv(output_dir, *flags)``: the tiny recipe against the session's tiny target."""

    def build(output_dir: Path, *extra: str) -> list[str]:
        return [
            "--config",
            str(TINY_RECIPE),
            "--target",
            str(tiny_target),
            "--output_dir",
            str(output_dir),
            *extra,
        ]

    return build
