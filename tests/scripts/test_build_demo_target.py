"""scripts/build_demo_target.py: builds or reuses, prints metrics and decoded generations."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from script_helpers import load_script


def _load_script() -> ModuleType:
    return load_script("build_demo_target", "build_demo_target_script")


def test_cli_builds_then_reuses_and_shows_generations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _load_script()
    folder = tmp_path / "tiny"
    argv = [
        "--preset",
        "tiny",
        "--output-dir",
        str(folder),
        "--max-steps",
        "5",
        "--new-tokens",
        "6",
    ]
    assert script.main(argv) == 0
    first = capsys.readouterr().out
    assert "test_loss" in first and "tokens_per_s" in first
    assert "--- greedy ---" in first and "--- sampled (T=0.8) ---" in first
    assert (folder / "model.safetensors").is_file()
    assert script.main(argv) == 0
    second = capsys.readouterr().out
    assert "reusing" in second
    # Greedy decoding from the same folder is deterministic; so is the seeded sample.
    assert (
        first.split("demo target saved")[1].split("--- greedy ---")[1]
        == second.split("--- greedy ---")[1]
    )


def test_cli_rejects_unknown_options() -> None:
    script = _load_script()
    with pytest.raises(SystemExit):
        script.parse_args(["--presets", "tiny"])
