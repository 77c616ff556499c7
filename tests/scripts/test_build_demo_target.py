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


def test_hostile_flags_are_refused_by_name_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A time box that is no finite positive number, counts below 1, seeds out of range, more
    new tokens than the target's context, an empty prompt and output folders that cannot be
    made: exit 2 at once (the budget used to fail only after the corpus and tokenizer)."""
    script = _load_script()
    (tmp_path / "afile").write_text("x")
    base = ["--preset", "tiny", "--output-dir", str(tmp_path / "t")]
    for flags, message in (
        (["--max-minutes", "nan"], "--max-minutes must be a finite number of minutes > 0"),
        (["--max-minutes", "inf"], "--max-minutes must be a finite number of minutes > 0"),
        (["--max-minutes", "0"], "--max-minutes must be a finite number of minutes > 0"),
        (["--max-minutes", "-1"], "--max-minutes must be a finite number of minutes > 0"),
        (["--max-steps", "0"], "argument --max-steps: must be an integer >= 1, got 0"),
        (["--seed", "-1"], "argument --seed: must be an integer in 0..4294967295"),
        (["--seed", str(2**70)], "argument --seed: must be an integer in 0..4294967295"),
        (["--new-tokens", "0"], "argument --new-tokens: must be an integer >= 1"),
        (["--new-tokens", "100000"], "passes the tiny target's context of 2048 tokens"),
        (["--prompt", ""], "--prompt is empty"),
        (["--preset", "banana"], "argument --preset: invalid choice: 'banana'"),
        (["--output-dir", str(tmp_path / "afile")], "afile is a file; pass a folder"),
        (["--output-dir", str(tmp_path / "afile" / "t")], "afile is a file, not a folder"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            script.parse_args([*base, *flags])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, flags
    for threads in ("0", "-1", "100000"):
        with pytest.raises(ValueError, match=f"--threads {threads}: give a thread count"):
            script.main([*base, "--threads", threads])
    assert not (tmp_path / "t").exists()


def test_a_damaged_build_is_named_with_the_fix(tmp_path: Path) -> None:
    from draftsmith.train.target.demo import MARKER, METRICS_FILE

    folder = tmp_path / "t"
    folder.mkdir()
    (folder / MARKER).write_text("tiny\n")
    (folder / METRICS_FILE).write_text("{")
    with pytest.raises(ValueError, match=r"metrics\.json is not valid JSON .* \(--force\)"):
        _load_script().main(["--preset", "tiny", "--output-dir", str(folder)])
