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


def test_new_tokens_past_the_context_are_refused_before_sampling(target: Path) -> None:
    """10**12 new tokens once allocated their padding up front (an 8 TB request)."""
    script = load_script("parallel_ceiling")
    argv = ["--target", str(target), "--dtype", "float32", "--num-prompts", "1",
            "--new-tokens", str(10**12)]  # fmt: skip
    with pytest.raises(ValueError, match=r"--new-tokens 1000000000000: the longest prompt"):
        script.main(argv)


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
    for seed in (str(2**70), "-1", str(2**32)):
        with pytest.raises(SystemExit) as exit_info:
            script.parse_args(["--seed", seed])
        assert exit_info.value.code == 2
        assert "argument --seed: must be an integer in 0..4294967295" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(["--prompts", ""])
    assert exit_info.value.code == 2 and "--prompts is empty" in capsys.readouterr().err


def test_bad_targets_and_prompts_are_refused_before_the_target_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import draftsmith.train.target.model

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the target loaded before the bad input was refused")

    monkeypatch.setattr(draftsmith.train.target.model, "load_target", refuse)
    script = load_script("parallel_ceiling")
    (tmp_path / "empty.jsonl").write_text("")
    for argv, error, message in (
        (["--target", str(tmp_path / "none")], FileNotFoundError, "no such folder"),
        (["--target", str(tmp_path)], FileNotFoundError, "has no config.json"),
        (["--prompts", str(tmp_path / "missing.txt")], FileNotFoundError, "does not exist"),
        (["--prompts", str(tmp_path)], ValueError, "is a folder"),
        (["--prompts", str(tmp_path / "empty.jsonl")], ValueError, "holds no records"),
    ):
        with pytest.raises(error, match=message):
            script.main(["--target", "tiny", *argv])
