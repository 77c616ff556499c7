"""``python -m draftsmith.decode.measure.evaluate``: one run, three methods, the documented JSON."""

from __future__ import annotations

import json

import pytest
from draftsmith.decode.measure import evaluate
from draftsmith.decode.measure.machine import cpu_kernels

REQUIRED_KEYS = {
    "tau",
    "alpha_per_position",
    "predicted_tau",
    "tokens_per_s_baseline",
    "tokens_per_s_speculative",
    "speedup",
    "target_forward_ms",
    "draft_step_ms",
    "peer",
}


@pytest.mark.parametrize("kind", ["draft_lm", "ngram"])
def test_evaluate_writes_report(tiny_pair_dirs, tmp_path, kind: str) -> None:
    target_dir, draft_dir = tiny_pair_dirs
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nclass Point:\nfor i in range(10):\n")
    out = tmp_path / "report.json"
    argv = [
        "--target",
        str(target_dir),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "12",
        "--num-draft-tokens",
        "3",
        "--json",
        str(out),
        "--drafter-kind",
        kind,
        "--dtype",  # exact greedy equality is float32's; bf16 agrees up to near-ties (test_bfloat16)
        "float32",
    ]
    if kind == "draft_lm":
        argv += ["--drafter", str(draft_dir)]
    evaluate.main(argv)
    report = json.loads(out.read_text())
    assert report.keys() >= REQUIRED_KEYS
    assert report["num_prompts"] == 3
    assert report["greedy_equal_to_baseline"] == 3  # greedy output equals plain decoding
    assert 1 <= len(report["alpha_per_position"]) <= 3  # n-gram rounds can be narrower
    assert 1.0 <= report["tau"] <= 4.0
    assert report["peer"]["name"] == {"draft_lm": "hf_assisted", "ngram": "hf_prompt_lookup"}[kind]
    assert report["peer"]["tokens_per_s"] > 0
    assert report["machine"]["cpu_kernels"] == cpu_kernels()  # the figures name their machine
    assert evaluate.format_table(report).startswith("machine: ")


def test_lookup_tokens_widens_the_hybrids_copies_and_needs_the_hybrid(
    tiny_pair_dirs, tmp_path
) -> None:
    target_dir, draft_dir = tiny_pair_dirs
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a = 1\na = 1\na = 1\na = 1\n")  # text that repeats: lookup copies
    out = tmp_path / "report.json"
    common = ["--target", str(target_dir), "--prompts", str(prompts), "--num-draft-tokens", "2"]
    evaluate.main(
        [
            *common,
            *("--drafter", str(draft_dir), "--drafter-kind", "hybrid", "--lookup-tokens", "5"),
            *("--max-new-tokens", "24", "--dtype", "float32", "--json", str(out)),
        ]
    )
    report = json.loads(out.read_text())
    assert report["greedy_equal_to_baseline"] == report["num_prompts"]
    assert 2 <= len(report["alpha_per_position"]) <= 5  # copies past N = 2, never past 5
    with pytest.raises(SystemExit):  # refused before any model is loaded
        evaluate.main([*common, "--drafter-kind", "ngram", "--lookup-tokens", "5"])


def test_mismatched_tokenizer_is_refused(tiny_pair_dirs, tmp_path) -> None:
    from tiny_models import tiny_tokenizer

    target_dir, draft_dir = tiny_pair_dirs
    other = tmp_path / "other_draft"
    other.mkdir()
    for name in draft_dir.iterdir():
        (other / name.name).write_bytes(name.read_bytes())
    tiny_tokenizer(vocab_size=280).save_pretrained(other)
    with pytest.raises(ValueError, match="different tokenizer"):
        evaluate.main(
            [
                "--target",
                str(target_dir),
                "--drafter",
                str(other),
                "--prompts",
                "demo",
                "--num-prompts",
                "1",
            ]
        )


def test_missing_target_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="build the demo target"):
        evaluate.main(["--target", str(tmp_path / "nope"), "--drafter-kind", "ngram"])


def test_bad_prompt_files_and_counts_are_one_line_errors(tiny_pair_dirs, tmp_path) -> None:
    """The command line ends a bad input in one ``error:`` line and exit status 2."""
    import subprocess
    import sys
    from pathlib import Path

    target_dir, _ = tiny_pair_dirs
    binary = tmp_path / "prompts.txt"
    binary.write_bytes(b"\x00\xff\xfe binary \x80\n")
    with pytest.raises(ValueError, match=r"prompts\.txt is not UTF-8 text"):
        evaluate.main(
            ["--target", str(target_dir), "--drafter-kind", "ngram", "--prompts", str(binary)]
        )
    with pytest.raises(SystemExit):
        evaluate.main(
            ["--target", str(target_dir), "--drafter-kind", "ngram", "--num-prompts", "-1"]
        )
    repo = Path(__file__).resolve().parents[2]
    for argv, expected in (
        (["--prompts", str(binary)], "is not UTF-8 text"),
        (["--prompts", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
        (["--repeats", "two"], "argument --repeats: must be an integer >= 1, got 'two'"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "draftsmith.decode.measure.evaluate", "--target", str(target_dir),
             "--drafter-kind", "ngram", *argv],
            cwd=repo, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and expected in result.stderr


def test_contradictions_and_outputs_are_refused_before_loading(tiny_pair_dirs, tmp_path) -> None:
    """Checked before any model loads: a --json folder or a parent that is a file, an unknown
    or absent device, a folder for a kind that takes none, tree flags without --tree."""
    target_dir, draft_dir = tiny_pair_dirs
    missing = ["--target", str(tmp_path / "no-target"), "--drafter-kind", "ngram"]
    with pytest.raises(ValueError, match="is a folder; pass a file path"):
        evaluate.main([*missing, "--json", str(tmp_path)])
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        evaluate.main([*missing, "--json", str(tmp_path / "f" / "r.json")])
    with pytest.raises(ValueError, match="not a device torch knows"):
        evaluate.main([*missing, "--device", "tpu"])
    with pytest.raises(ValueError, match="is a folder; pass a file in it"):
        evaluate.main([*missing, "--prompts", str(tmp_path)])
    with pytest.raises(ValueError, match="is a file, not a model folder"):
        evaluate.main(["--target", str(tmp_path / "f"), "--drafter-kind", "ngram"])
    for argv in (
        [*missing, "--drafter", str(draft_dir)],  # ngram takes no folder
        ["--target", str(target_dir)],  # no drafter at all
        [*missing, "--tree-top-k", "9"],
        [*missing, "--tree-when-sampling"],
        [*missing, "--temperature", "nan"],
        [*missing, "--top-p", "0"],
        [*missing, "--max-new-tokens", "0"],
        [*missing, "--num-draft-tokens", "-1"],
        [*missing, "--seed", str(2**70)],
    ):
        with pytest.raises(SystemExit) as exit_info:
            evaluate.main(argv)
        assert exit_info.value.code == 2, argv


def test_max_new_tokens_past_the_context_is_refused(tiny_pair_dirs, tmp_path) -> None:
    """Instead of decoding past max_position_embeddings for hours."""
    target_dir, _ = tiny_pair_dirs
    prompts = tmp_path / "p.txt"
    prompts.write_text("def add(a, b):\n")
    with pytest.raises(ValueError, match="passes the target's context of 512 tokens"):
        evaluate.main(
            ["--target", str(target_dir), "--drafter-kind", "ngram", "--prompts", str(prompts),
             "--max-new-tokens", "100000000", "--plain-also", ""]
        )  # fmt: skip
