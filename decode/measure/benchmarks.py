"""Acceptance per benchmark, reported the way SpecForge and speculators report it.

A user who brings MT-Bench, GSM8K and HumanEval prompt files (``draftsmith.data.benchmarks`` reads their
published shapes) gets one evaluation per file and one line per benchmark. SpecForge's benchmark
scripts print each benchmark's *accept length*: the mean number of tokens one target forward
pass emits (accepted drafts plus the target's own token); speculators' evaluations print vLLM's
*mean acceptance length*, ``1 + accepted / drafts``, and the acceptance rate per draft position.
For chains both equal draftsmith's ``tau`` (docs/theory.md §5), and the per-position rates are
``alpha_j``, so the line shows the figure either project's users compare:

    benchmark   prompts  accept length  alpha per position       speedup
    mtbench          80          3.21   0.81 0.63 0.49 0.37        2.31x
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from draftsmith.decode.measure.prompts import file_prompts


def run_benchmarks(
    files: dict[str, str],
    num_prompts: int,
    encode: Any,  # prompt -> [1, T] token ids (draftsmith.decode.measure.side_by_side.encode_prompt with a tokenizer)
    evaluate: Any,  # list of [1, T] prompts -> the report of draftsmith.decode.measure.evaluate.evaluate_drafter
    system_prompt: str | None = None,
) -> dict[str, Any]:
    """One evaluation per benchmark file, its questions opened by ``system_prompt``; returns
    ``{"benchmarks": {name: report}, ...}`` with ``accept_length`` (= tau) in each report and
    their mean over benchmarks."""
    reports: dict[str, dict[str, Any]] = {}
    for name, path in files.items():
        prompts: list[torch.Tensor] = [
            encode(p) for p in file_prompts(path, num_prompts, system_prompt)
        ]
        report = evaluate(prompts)
        reports[name] = {
            "file": path,
            "num_prompts": len(prompts),
            "accept_length": report["tau"],
            **report,
        }
    lengths = [r["accept_length"] for r in reports.values()]
    return {
        "benchmarks": reports,
        "accept_length_mean": sum(lengths) / len(lengths) if lengths else 0.0,
    }


def format_benchmarks(result: dict[str, Any]) -> str:
    """The per-benchmark table (accept length, alpha per position, speedup over plain)."""
    lines = [f"{'benchmark':<12}{'prompts':>8}{'accept length':>15}  {'alpha per position':<28}"
             f"{'speedup':>8}"]  # fmt: skip
    for name, report in result["benchmarks"].items():
        alphas = " ".join(f"{a:.2f}" for a in report["alpha_per_position"])
        lines.append(
            f"{name:<12}{report['num_prompts']:>8}{report['accept_length']:>15.2f}  "
            f"{alphas:<28}{report['speedup']:>7.2f}x"
        )
    lines.append(f"{'mean':<12}{'':>8}{result['accept_length_mean']:>15.2f}")
    return "\n".join(lines)


def parse_benchmark_flags(values: list[str] | None) -> dict[str, str]:
    """``--benchmark NAME=FILE`` flags (or a bare FILE, named by its stem) -> {name: file}."""
    benchmarks: dict[str, str] = {}
    for value in values or []:
        name, _, file = value.rpartition("=")
        name = name or Path(file).stem
        if not file:
            raise ValueError(f"--benchmark {value!r}: give NAME=FILE, e.g. mtbench=question.jsonl")
        if name in benchmarks:
            raise ValueError(f"--benchmark {name} is given twice; name each file once")
        benchmarks[name] = file
    return benchmarks
