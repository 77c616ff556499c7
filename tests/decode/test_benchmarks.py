"""Benchmark prompt files in their published shapes (MT-Bench, GSM8K, HumanEval) and the
acceptance length per benchmark that draftsmith.decode.measure.evaluate prints, as SpecForge and speculators do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from draftsmith.data.benchmarks import load_benchmark_prompts
from draftsmith.decode.measure import evaluate
from draftsmith.decode.measure.benchmarks import format_benchmarks, parse_benchmark_flags

MTBENCH = [
    {"question_id": 81, "category": "writing",
     "turns": ["Compose a travel blog post about Hawaii.", "Rewrite it starting with A."]},
    {"question_id": 82, "category": "math", "turns": ["What is 3 * 7?", "And 4 * 7?"]},
    {"question_id": 83, "category": "coding", "turns": ["Write a loop.", "Now in C."]},
]  # fmt: skip
GSM8K = [
    {"question": "Tom has 3 apples and buys 2 more. How many?", "answer": "3 + 2 = 5\n#### 5"},
    {"question": "A box holds 4 pens. How many in 3 boxes?", "answer": "4 * 3 = 12\n#### 12"},
]
HUMANEVAL = [
    {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n",
     "canonical_solution": "    return a + b\n", "test": "assert add(1, 2) == 3",
     "entry_point": "add"},
    {"task_id": "HumanEval/1", "prompt": "def neg(x):\n", "canonical_solution": "    return -x\n",
     "test": "assert neg(1) == -1", "entry_point": "neg"},
]  # fmt: skip


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_each_shape_becomes_one_turn_chat_prompts(tmp_path: Path) -> None:
    mt = load_benchmark_prompts(_write(tmp_path / "question.jsonl", MTBENCH))
    assert mt[1] == [{"role": "user", "content": "What is 3 * 7?"}]  # the first turn only
    assert len(mt) == 3 and len(load_benchmark_prompts(tmp_path / "question.jsonl", 2)) == 2
    gsm = load_benchmark_prompts(_write(tmp_path / "test.jsonl", GSM8K))
    assert gsm[0] == [{"role": "user", "content": GSM8K[0]["question"]}]
    he = load_benchmark_prompts(_write(tmp_path / "HumanEval.jsonl", HUMANEVAL))
    assert he[1] == [{"role": "user", "content": "def neg(x):\n"}]
    plain = load_benchmark_prompts(_write(tmp_path / "p.jsonl", [{"prompt": "def f():"}]))
    assert plain == ["def f():"]  # other files: draftsmith.decode.measure.prompts' usual records


def test_bad_benchmark_files_and_flags_are_refused(tmp_path: Path) -> None:
    mixed = _write(tmp_path / "mixed.jsonl", [MTBENCH[0], GSM8K[0]])
    with pytest.raises(ValueError, match=r"mixed\.jsonl:2: not a mtbench record"):
        load_benchmark_prompts(mixed)
    empty = _write(tmp_path / "empty.jsonl", [{**MTBENCH[0], "turns": []}])
    with pytest.raises(ValueError, match="'turns' must be a non-empty list"):
        load_benchmark_prompts(empty)
    assert parse_benchmark_flags(["mtbench=a.jsonl", "b/HumanEval.jsonl"]) == {
        "mtbench": "a.jsonl",
        "HumanEval": "b/HumanEval.jsonl",
    }
    with pytest.raises(ValueError, match="given twice"):
        parse_benchmark_flags(["x=a.jsonl", "x=b.jsonl"])


def test_evaluate_prints_the_accept_length_of_each_benchmark(
    tiny_pair_dirs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target_dir, draft_dir = tiny_pair_dirs
    files = {
        "mtbench": _write(tmp_path / "question.jsonl", MTBENCH),
        "gsm8k": _write(tmp_path / "test.jsonl", GSM8K),
        "humaneval": _write(tmp_path / "HumanEval.jsonl", HUMANEVAL),
    }
    out = tmp_path / "report.json"
    argv = ["--target", str(target_dir), "--drafter", str(draft_dir), "--num-prompts", "2",
            "--max-new-tokens", "10", "--num-draft-tokens", "3", "--no-peer", "--plain-also", "",
            "--json", str(out)]  # fmt: skip
    for name, path in files.items():
        argv += ["--benchmark", f"{name}={path}"]
    evaluate.main(argv)
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert list(report["benchmarks"]) == ["mtbench", "gsm8k", "humaneval"]
    lengths = []
    for name, bench in report["benchmarks"].items():
        assert bench["num_prompts"] == 2
        assert bench["greedy_equal_to_baseline"] == 2  # exact decoding on every benchmark
        # Accept length as SpecForge prints it: tokens per target forward = 1 + mean accepted.
        assert bench["accept_length"] == bench["tau"]
        assert 1.0 <= bench["accept_length"] <= 4.0
        row = next(line for line in printed.splitlines() if line.startswith(name))
        assert f"{bench['accept_length']:.2f}" in row
        lengths.append(bench["accept_length"])
    assert report["accept_length_mean"] == pytest.approx(sum(lengths) / 3)
    assert format_benchmarks(report).splitlines()[0].split()[:3] == [
        "benchmark",
        "prompts",
        "accept",
    ]


def test_a_draft_that_is_the_target_accepts_everything_on_every_benchmark(
    tiny_pair_dirs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Self-drafting in float32 accepts every draft: accept length k + 1 = 4.00 per benchmark
    (13 new tokens = the prefill's token + 3 rounds of 3 drafts and a bonus)."""
    target_dir, _ = tiny_pair_dirs
    argv = ["--target", str(target_dir), "--drafter", str(target_dir), "--drafter-kind",
            "draft_lm", "--dtype", "float32", "--num-prompts", "2", "--max-new-tokens", "13",
            "--num-draft-tokens", "3", "--no-peer", "--plain-also", "",
            "--benchmark", f"mtbench={_write(tmp_path / 'question.jsonl', MTBENCH)}",
            "--benchmark", f"humaneval={_write(tmp_path / 'HumanEval.jsonl', HUMANEVAL)}"]  # fmt: skip
    report = evaluate.main(argv)
    assert [b["accept_length"] for b in report["benchmarks"].values()] == [4.0, 4.0]
    assert [b["alpha_per_position"] for b in report["benchmarks"].values()] == [[1.0] * 3] * 2
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    mtbench = next(row for row in rows if row and row[0] == "mtbench")
    assert mtbench[:6] == ["mtbench", "2", "4.00", "1.00", "1.00", "1.00"]
