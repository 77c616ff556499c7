"""scripts/parallel_ceiling.py on a tiny trained target: the caps it prints are probabilities
bounded by the chain's, written as JSON; bad settings are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_helpers import load_script


def test_the_caps_of_a_tiny_target_are_written_and_bounded(tmp_path: Path, target: Path) -> None:
    script = load_script("parallel_ceiling")
    out = tmp_path / "caps.json"
    argv = ["--target", str(target), "--dtype", "float32", "--num-prompts", "2",
            "--new-tokens", "6", "--contexts-per-prompt", "2", "--depths", "3",
            "--top-k", "4", "--beam", "8", "--output", str(out)]  # fmt: skip
    result = script.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    depths = result["depths"]
    assert [d["depth"] for d in depths] == [1, 2, 3] and result["contexts"] >= 2
    for d in depths[1:]:
        assert 0.0 < d["mixture"] <= d["ceiling"] + 1e-9 <= 1.0 + 1e-9
        assert 0.0 < d["coverage"] <= 1.0 + 1e-9
    assert 1.0 < result["tau_cap"][3] <= 4.0  # a chain of 3 drafts reaches at most 4


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--depths", "1"], "--depths must be >= 2"), (["--beam", "0"], "--beam must be >= 1")],
)
def test_bad_settings_are_refused_by_name(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        load_script("parallel_ceiling").parse_args(flags)
    assert message in capsys.readouterr().err


def test_bad_output_and_seed_are_refused_before_measuring(tmp_path: Path, capsys) -> None:
    """An --output folder or one under a file fails at once, not after the measurement."""
    script = load_script("parallel_ceiling")
    with pytest.raises(ValueError, match=r"--output .* is a folder"):
        script.main(["--target", str(tmp_path / "none"), "--output", str(tmp_path)])
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        script.main(["--target", str(tmp_path / "none"), "--output", str(tmp_path / "f" / "o")])
    with pytest.raises(SystemExit):
        script.parse_args(["--seed", str(2**70)])
    assert "--seed must be an integer in 0..2**63 - 1" in capsys.readouterr().err
