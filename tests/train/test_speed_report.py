"""After training, the run measures its drafter end to end: report.json, plots, summary table."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.decode.measure.machine import describe_machine
from draftsmith.train.distill import main


def test_distill_measures_the_exported_drafter(tiny_argv, tmp_path: Path, capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def parse(self, text):\nclass Reader(object):\n")
    out = tmp_path / "run"
    summary = main(
        tiny_argv(
            out,
            "--max_steps",
            "4",
            "--speed_eval_prompts",
            "2",
            "--speed_eval_prompt_source",
            str(prompts),
            "--speed_eval_new_tokens",
            "12",
            "--speed_eval_temperatures",
            "0",
            "1",
            "--speed_eval_repeats",
            "2",
            "--speed_eval_adaptive",
            "true",
            "--speed_eval_adaptive_draft_tokens",
            "6",
        )
    )
    report = json.loads((out / "report.json").read_text())
    assert set(report["by_temperature"]) == {"0", "1"}
    greedy = report["by_temperature"]["0"]
    assert greedy["greedy_equal_to_baseline"] == 2  # exact: same tokens as plain decoding
    assert greedy["num_prompts"] == 2 and 1.0 <= greedy["tau"] <= 5.0
    assert report["repeats"] == greedy["repeats"] == 2  # each prompt timed by its faster pass
    # Adaptive chains pick each round's length in 0..6, the drafter's and the hybrid's alike.
    assert greedy["adaptive"] and greedy["num_draft_tokens"] == 6
    assert report["hybrid"]["0"]["adaptive"] and report["hybrid"]["1"]["num_draft_tokens"] == 6
    assert report["held_out_overlap"] == [summary["held_out"]["overlap@1"]]
    assert summary["speed"]["0"]["speedup"] == greedy["speedup"]
    # Against draftsmith's own plain decoding too, which is exact as well.
    assert greedy["draftsmith_plain_greedy_equal_to_baseline"] == 2
    assert summary["speed"]["0"]["speedup_over_draftsmith_plain"] > 0
    # The hybrid of prompt lookup and the new drafter, and the out-of-distribution prompts.
    assert report["hybrid"]["0"]["greedy_equal_to_baseline"] == 2
    assert report["hybrid"]["0"]["drafter_usage"]["learned_rows"] > 0
    assert report["ood"]["prompts"] == "ood"
    assert report["ood"]["0"]["drafter"]["greedy_equal_to_baseline"] == 2
    for png in ("acceptance.png", "speedup.png"):
        assert (out / png).stat().st_size > 1000
    held = json.loads((out / "drafter" / "eval_results.json").read_text())
    assert held["overlap@1"] == summary["held_out"]["overlap@1"]
    printed = capsys.readouterr().out
    assert "held-out overlap per position" in printed
    assert f"machine: {describe_machine(report['machine'])}" in printed  # figures name it
    assert summary["machine"]["cpu_kernels"] == report["machine"]["cpu_kernels"]
    card = (out / "drafter" / "README.md").read_text()
    assert f"- machine: {describe_machine(summary['machine'])}" in card
