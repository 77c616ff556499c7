"""Rewrite the results sections of the README and the guides from the saved JSON.

    draftsmith-report                                   # rewrite every marked section
    draftsmith-report --check                           # exit 1 if any differs (tests run it)
    draftsmith-report --main-job outputs/distill-demo   # take a new main-job run (the README's)
    draftsmith-report --main-job outputs/distill-demo --into main_job_amd.json  # the AMD record
    draftsmith-report --main-job outputs/distill-demo --into main_job_avx2.json  # AVX2 only

A section is the text between ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->`` in
README.md or a file of docs/ or docs/guides/; ``SECTIONS`` says which function writes each one
from which record under docs/results/ (``RECORDS``). The tables are written from what the tools saved: the main
job's ``summary.json`` (copied to ``docs/results/main_job.json``, or the record ``--into``
names, by ``--main-job``), the
benchmark's ``--json`` file and the ablation tool's ``ablation.json`` files (their Markdown is
``draftsmith.train.ablation.report``'s own). ``--check`` also lists

- result figures (a number followed by ``x``, ``%``, ``ms``, ``tokens/s``, a tau, a spread, a
  table cell holding a measurement) typed outside the marked sections, so every figure has a
  source record. Code blocks (``bash``, ``python``, ``yaml``, ``json``), text between
  ``<!-- quoted -->`` and ``<!-- /quoted -->`` (figures quoted from a published source the
  text names), between ``<!-- projection -->`` and ``<!-- /projection -->`` (a projection the
  text labels so) and the worked examples of ``ARITHMETIC`` are exempt;
- records under docs/results/ that name no ``machine`` (the machine a figure was measured on,
  ``draftsmith.decode.measure.machine``), and files there that no document cites.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from draftsmith.decode.measure.machine import describe_machine
from draftsmith.decode.measure.side_by_side import UNREPRODUCED_TIMING
from draftsmith.decode.measure.tables import markdown_table
from draftsmith.scripts.compare_policies import policy_windows_table
from draftsmith.scripts.load_sweep import sweep_ratio_table, sweep_table
from draftsmith.scripts.profile_serve import round_parts_table

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path("docs/results")
MAIN_JOB = RESULTS / "main_job.json"
BENCH_DEMO = RESULTS / "bench_demo.json"
BENCH_NO_AMX = RESULTS / "bench_no_amx" / "bench.json"
BENCH_AMD = RESULTS / "bench_amd" / "bench.json"
MAIN_JOB_AMD = RESULTS / "main_job_amd.json"
MAIN_JOB_AVX2 = RESULTS / "main_job_avx2.json"  # the AVX2-only AMD EPYC's (float32)
SERVING_SWEEP = RESULTS / "serving_sweep.json"  # draftsmith-load-test --sweep --json
BENCH_DFLASH_AVX2 = RESULTS / "bench_dflash_avx2" / "bench.json"
# Seed 0's EAGLE-3 and DSpark heads of the DSpark grid in one benchmark (the bf16 AMD EPYC)
BENCH_DSPARK_AMD = RESULTS / "bench_dspark_amd" / "bench.json"
ABLATION_DFLASH_AVX2 = RESULTS / "ablation_dflash_avx2" / "ablation.json"  # B and L of a block
# EAGLE-3, P-EAGLE and DFlash at the main job's budget, three seeds (the bf16 AMD EPYC)
ABLATION_KINDS_AMD = RESULTS / "ablation_kinds_amd" / "ablation.json"
# The same grid's DFlash cell with 48 anchors per sequence instead of 16, one seed
ABLATION_DFLASH_ANCHORS_AMD = RESULTS / "ablation_dflash_anchors_amd" / "ablation.json"
SERVING_SWEEP_AMD = RESULTS / "serving_sweep_amd.json"  # the bf16 AMD EPYC, with vLLM
SWEEP_RIVALS = {"vLLM": ("vllm", "vllm+head"), "ours": ("always", "plain")}
"""The serving goals' comparisons: load-aware drafting against the faster of vLLM's two
servers, and against the better of drafting always and never."""
# The hybrid (the EAGLE-3 head with prompt lookup) served beside the head alone, plain, and vLLM
SERVING_SWEEP_HYBRID = RESULTS / "serving_sweep_hybrid.json"  # the AVX2-only EPYC (float32)
HYBRID_RIVALS = {"vLLM": SWEEP_RIVALS["vLLM"], "ours": ("load-aware", "plain")}
"""The hybrid server against the faster of vLLM's two, and against the better of our head alone
(load-aware) and plain decoding."""
# DFlash with and without DSpark's Markov head (48 anchors) beside EAGLE-3, three seeds
ABLATION_DSPARK_AMD = RESULTS / "ablation_dspark_amd" / "ablation.json"
# Where a served round's time goes, at 1 and 8 clients (scripts/profile_serve.py --json)
SERVING_ROUNDS_AMD = RESULTS / "serving_rounds_amd.json"
SERVING_ROUNDS_AVX2 = RESULTS / "serving_rounds_avx2.json"  # the same on the AVX2-only EPYC
# The draft policies in interleaved windows without HTTP (scripts/compare_policies.py --json)
POLICY_WINDOWS_AVX2 = RESULTS / "policy_windows_avx2.json"
ABLATION_PEAGLE_NO_AMX = RESULTS / "ablation_peagle_no_amx" / "ablation.json"
ABLATION_PEAGLE_AMD = RESULTS / "ablation_peagle_amd" / "ablation.json"
ABLATION_VOCAB_NO_AMX = RESULTS / "ablation_vocab_no_amx" / "ablation.json"
ABLATION_VOCAB_NO_AMX_8MIN = RESULTS / "ablation_vocab_no_amx_8min" / "ablation.json"
ABLATION_CACHE_NO_AMX = RESULTS / "ablation_cache_no_amx" / "ablation.json"
ABLATION_CACHE256_NO_AMX = RESULTS / "ablation_cache256_no_amx" / "ablation.json"
ABLATION_SCHEDULE_NO_AMX = RESULTS / "ablation_schedule_no_amx" / "ablation.json"
ABLATION_STEPS_AMX = RESULTS / "ablation_steps_amx" / "ablation.json"
ABLATION_PEAGLE_450_AMX = RESULTS / "ablation_peagle_450_amx" / "ablation.json"
ABLATION_PEAGLE_LAYERS_450_AMX = RESULTS / "ablation_peagle_layers_450_amx" / "ablation.json"
RECORDS = (
    MAIN_JOB,
    MAIN_JOB_AMD,
    MAIN_JOB_AVX2,
    BENCH_DEMO,
    BENCH_NO_AMX,
    BENCH_AMD,
    BENCH_DFLASH_AVX2,
    BENCH_DSPARK_AMD,
    ABLATION_DFLASH_AVX2,
    ABLATION_KINDS_AMD,
    ABLATION_DFLASH_ANCHORS_AMD,
    ABLATION_DSPARK_AMD,
    SERVING_SWEEP,
    SERVING_SWEEP_HYBRID,
    SERVING_SWEEP_AMD,
    SERVING_ROUNDS_AMD,
    SERVING_ROUNDS_AVX2,
    POLICY_WINDOWS_AVX2,
    ABLATION_PEAGLE_NO_AMX,
    ABLATION_PEAGLE_AMD,
    ABLATION_VOCAB_NO_AMX,
    ABLATION_VOCAB_NO_AMX_8MIN,
    ABLATION_CACHE_NO_AMX,
    ABLATION_CACHE256_NO_AMX,
    ABLATION_SCHEDULE_NO_AMX,
    ABLATION_STEPS_AMX,
    ABLATION_PEAGLE_450_AMX,
    ABLATION_PEAGLE_LAYERS_450_AMX,
)
"""The records the sections read: cited by the documents through their sections."""
DOCUMENTS = ("README.md", "docs/*.md", "docs/guides/*.md")
HEADLINE = (
    "plain (HF generate)",
    "HF prompt lookup",
    "draftsmith plain (no drafter)",
    "draftsmith plain, float32",
    "draftsmith EAGLE-3 chain",
    "draftsmith EAGLE-3 chain (adaptive N)",
)
"""Benchmark rows the README's table always shows (the references and the kind the main job
trains, at the fixed and at the adaptive length), beside each temperature's best draftsmith
method and best trained drafter; a saved benchmark must hold all of them."""

MARKER = re.compile(r"(<!-- report:([\w-]+) -->\n)(.*?)(<!-- /report:\2 -->)", re.DOTALL)
FIGURE = re.compile(
    r"(?<![\w.])\d+(\.\d+)?x\b"  # a speedup or a ratio: 1.54x, 3x (not a shape: 8 x 512)
    r"|\d\s?%"  # a share or a gain
    r"|\d ± \d"  # a spread over seeds
    r"|\btau (of |= |was |at )?\d+\.\d"  # a tau
    r"|\d\.\d+ tau\b"
    r"|\d\s?(ms|milliseconds?|microseconds?|µs)\b"  # a time
    r"|\d\s?tok(ens)?/s\b"  # a throughput
    r"|^\|.*\|\s*[+-]?\d+\.\d+\s*x?\s*\|"  # a table cell holding a measured figure
)
"""A result figure: these belong inside marked sections only."""
EXEMPT = re.compile(
    r"<!-- (quoted|projection) -->\n.*?<!-- /\1 -->"
    r"|^```(bash|python|yaml|json)\n.*?^```",
    re.DOTALL | re.MULTILINE,
)
"""Where the figure check does not look: figures quoted from a published source the text
names, a projection the text labels so, and code."""
ARITHMETIC: tuple[str, ...] = ()
"""Worked arithmetic the documents may type (each one exactly as written): an example of a
formula, not a measurement. ``check`` fails on an entry no document holds any more."""


# --------------------------------------------------------------------------- small formats


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _read(path: Path) -> dict[str, Any]:
    """The record at ``path`` (under the repository, or absolute); ``ValueError`` naming it
    when it is not a JSON object."""
    from draftsmith.decode.loading import read_json_object

    fix = "restore it from git (git checkout -- FILE) or rewrite it with the tool that wrote it"
    return read_json_object(REPO / path, fix)


# --------------------------------------------------------------------------- the main job


def _main_job_rows(summary: dict[str, Any]) -> list[tuple[str, str, str, dict[str, Any]]]:
    """``(prompts, method, temperature, figures)`` per measured row of the run's speed step."""
    kind = summary["drafter_kind"]
    rows = []
    for key, figures in summary["speed"].items():
        *prefix, temperature = key.split(" ")
        prompts = "ood" if prefix[:1] == ["ood"] else "held-out"
        method = "hybrid" if "hybrid" in prefix else f"{kind} chain"
        if figures.get("adaptive"):  # recorded since the speed step could adapt its length
            method += f", adaptive N <= {figures['num_draft_tokens']}"
        rows.append((prompts, method, temperature, figures))
    return sorted(rows, key=lambda r: (r[0] == "ood", float(r[2]), r[1].startswith("hybrid")))


def main_job_table(summary: dict[str, Any]) -> str:
    """The main job's speed step: each method and prompt set at each temperature."""
    rows = [
        [
            prompts,
            method,
            temperature,
            _x(r["speedup_over_draftsmith_plain"]),
            _x(r.get("speedup_over_fastest_plain")),  # absent from runs before it existed
            _x(r["speedup"]),
            _f(r["tau"]),
            _f(r.get("distinct_4gram_share")),
            _f(r["draft_cost_ratio"]),
            _f(r.get("verify_cost_ratio")),
        ]
        for prompts, method, temperature, r in _main_job_rows(summary)
    ]
    header = [
        "prompts",
        "method",
        "T",
        "vs ours",
        "vs fastest plain",
        "vs HF",
        "tau",
        "4-grams",
        "draft/target step",
        "verify/target step",
    ]
    return "\n".join(markdown_table(header, rows))


def main_job_run(summary: dict[str, Any]) -> str:
    """One paragraph: the run's length and its drafter's held-out figures per position."""
    held = summary["held_out"]
    per_position = [
        " / ".join(_f(held[k]) for k in sorted((k for k in held if k.startswith(p)), key=_position))
        for p in ("overlap@", "greedy_match@")
    ]
    minutes = summary.get("minutes")  # absent from results transcribed by hand
    length = f" in {minutes:.1f} min" if minutes is not None else ""
    peak = summary.get("peak_rss_bytes")  # recorded since the run measured it
    length += f" (peak memory of the process {peak / 1e9:.1f} GB)" if peak else ""
    mass = held.get("draftable_mass")  # pruned draft vocabularies, recorded since it existed
    cap = (
        f" (the target's probability on the draft vocabulary, which caps each overlap: {_f(mass)})"
        if mass is not None
        else ""
    )
    return (
        f"The run: a `{summary['drafter_kind']}` drafter, loss `{summary['loss']}`, "
        f"{summary['steps']} steps ({summary['stop_reason']}){length} on "
        f"{summary['train_sequences']:,} training sequences; held-out overlap per draft "
        f"position {per_position[0]}{cap}, greedy agreement {per_position[1]}."
        f"{_trained_in(summary)}"
    )


def _trained_in(summary: dict[str, Any]) -> str:
    """The run's training dtype and why (``draftsmith.decode.precision``), where the summary records it."""
    if "dtype" not in summary:
        return ""
    reason = summary.get("dtype_reason")
    return (
        f" Trained in {summary['dtype']}" + (f" ({reason})." if reason else ".") + _machine(summary)
    )


def _machine(record: dict[str, Any]) -> str:
    """`` Machine: ...``: the machine (or, for merged ablation grids, the machines) a record
    names; ``check`` refuses a record under docs/results/ without one."""
    machine = record.get("machine")
    if not machine:
        return ""
    machines = machine if isinstance(machine, list) else [machine]  # merged grids: several
    return f" Machine: {'; '.join(describe_machine(m) for m in machines)}."


def _position(key: str) -> int:
    return int(key.rpartition("@")[2])


# --------------------------------------------------------------------------- the benchmark


def _by_method(bench: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """method -> temperature -> row, methods in the order the benchmark ran them."""
    methods: dict[str, dict[str, dict[str, Any]]] = {}
    for temperature, rows in bench["by_temperature"].items():
        for row in rows:
            methods.setdefault(row["method"], {})[temperature] = row
    return methods


SPEEDUPS = (
    "vs ours: over draftsmith's own plain decoding in the run's dtype (no drafter, the "
    "control); vs fastest plain: over draftsmith's fastest plain decoding in any dtype; vs HF: "
    "over HF `generate`; 4-grams: the share of distinct 4-grams of the output (1 = no "
    "repetition; greedy text that repeats itself inflates T=0 figures)."
)


def _setting(bench: dict[str, Any], prompts: str = "held-out") -> str:
    return (
        f"Benchmark on target `{Path(bench['target']).name}`: {bench['num_prompts']} {prompts} "
        f"prompts x {bench['max_new_tokens']} tokens, batch 1, N = {bench['num_draft_tokens']} "
        f"draft tokens{_adaptive_clause(bench)}, interleaved per prompt{_repeats_clause(bench)}."
        + _machine(bench)
    )


def _adaptive_clause(bench: dict[str, Any]) -> str:
    """How far the adaptive rows may draft, where the record says (runs since the flag)."""
    most = bench.get("adaptive_draft_tokens")
    return (
        f" (adaptive rows: 0..{most} per round)"
        if most is not None and most != bench["num_draft_tokens"]
        else ""
    )


def _repeats_clause(bench: dict[str, Any]) -> str:
    """How the benchmark timed each prompt when it ran the prompts more than once (records
    before ``unreproduced_timing`` kept a non-reproducing method's first pass)."""
    repeats = bench.get("repeats", 1)
    if repeats <= 1:
        return ""
    clause = f"; {repeats} passes, each prompt of each method timed by its fastest pass of the same tokens"
    if bench.get("unreproduced_timing") == UNREPRODUCED_TIMING:
        return clause + (
            " (a method whose passes decoded other tokens, the adaptive and hybrid rows when "
            "sampling, is timed on the prompt's quietest pass, the one in which the methods that "
            "reproduced took the least time together)"
        )
    return clause + (
        " (a pass that decoded other tokens is not timed: rows whose policy adapts to "
        "measured times, the adaptive and hybrid ones, often keep their first pass when sampling)"
    )


def bench_table(bench: dict[str, Any], prompts: str = "held-out") -> str:
    """Every method of a benchmark run: tokens/s, both speedups, tau, draft cost per T."""
    temperatures = list(bench["by_temperature"])
    header = ["method"]
    for t in temperatures:
        header += [
            f"T={t} tok/s",
            f"T={t} vs ours",
            f"T={t} vs fastest plain",
            f"T={t} vs HF",
            f"T={t} tau",
            f"T={t} GPU projection",
        ]
    header.append(f"draft/target step (T={temperatures[-1]})")
    rows = []
    for method, by_t in _by_method(bench).items():
        row = [method]
        for t in temperatures:
            r = by_t.get(t)
            row += (
                [
                    _f(r["tokens_per_s"], 1),
                    _x(r["speedup_over_draftsmith_plain"]),
                    _x(r.get("speedup_over_fastest_plain", r["speedup_over_draftsmith_plain"])),
                    _x(r["speedup"]),
                    _f(r["tau"]),
                    _x(r["gpu_projected_speedup"]) if r.get("gpu_projected_speedup") else "-",
                ]
                if r
                else ["-"] * 6
            )
        last = by_t.get(temperatures[-1])
        row.append(_f(last["draft_cost_ratio"] if last else None))
        rows.append(row)
    best = [
        f"- T={t}: best draftsmith method ({b['draftsmith']}) {_x(b['ratio'])} the best HF one "
        f"({b['hf']}) and {_x(b['over_draftsmith_plain'])} draftsmith plain; best trained "
        f"drafter ({b['trained']}) {_x(b['trained_over_draftsmith_plain'])} draftsmith plain."
        for t, b in bench["best_against_hf"].items()
    ]
    return "\n".join(
        [f"{_setting(bench, prompts)} {SPEEDUPS}", "", *markdown_table(header, rows), "", *best]
    )


def cost_model(bench: dict[str, Any], method: str = "draftsmith EAGLE-3 chain") -> str:
    """docs/theory.md §5's speedup model filled in with one benchmark row's measured parts."""
    lines = []
    for t, rows in bench["by_temperature"].items():
        r = next((row for row in rows if row["method"] == method), None)
        if r is None or r["draft_step_ms"] is None:
            continue
        n, tau = bench["num_draft_tokens"], r["tau"]
        t_t, t_v, t_d = r["target_step_ms"], r["verify_pass_ms"], r["draft_step_ms"]
        model = tau * t_t / (n * t_d + t_v)
        free = tau * t_t / t_v
        lines.append(
            f"    T={t}: speedup = tau * T_t / (N * T_d + T_v) = {tau:.2f} * {t_t:.2f} / "
            f"({n} * {t_d:.2f} + {t_v:.2f}) = {model:.2f}  (measured "
            f"{r['speedup_over_draftsmith_plain']:.2f}; a free drafter: {free:.2f})"
        )
    return f"{method}, times in ms:\n\n" + "\n".join(lines)


BLOCK_ROWS = (
    "draftsmith plain (no drafter)",
    "draftsmith EAGLE-3 chain",
    "draftsmith DFlash block",
)
"""The rows that compare the block drafter with the chain on one run."""
BLOCK_ROWS_ADAPTIVE = (
    *BLOCK_ROWS,
    "draftsmith EAGLE-3 chain (adaptive N)",
    "draftsmith DFlash block (adaptive N)",
    "draftsmith hybrid: lookup + EAGLE-3",
    "draftsmith hybrid: lookup + DFlash",
)
"""The same, with each drafter's adaptive length and its hybrid with prompt lookup."""


def block_drafter_table(bench: dict[str, Any], methods: tuple[str, ...] = BLOCK_ROWS) -> str:
    """The DFlash block beside the EAGLE-3 chain (the benchmark rows ``methods``), per prompt
    set and temperature: tokens/s and the ratio over plain decoding, tau, the round's parts (a
    round drafts N tokens at T_d each, then verifies in T_v; both in ms and in target steps
    T_t) and the acceptance per position (of position j given the ones before it accepted)."""
    header = ["prompts", "T", "method", "tokens/s", "vs plain", "tau", "N", "draft ms (steps)"]
    header += ["verify ms (steps)", "acceptance per position"]
    rows = []
    for prompts, record in bench["prompt_sets"].items():
        for t, by_method in record["by_temperature"].items():
            for r in by_method:
                if r["method"] not in methods:
                    continue
                alpha = r["alpha_per_position"] or []
                n, t_t = len(alpha), r["target_step_ms"]
                draft = n * r["draft_step_ms"] if r["draft_step_ms"] is not None else None
                rows.append(
                    [
                        prompts,
                        t,
                        r["method"],
                        _f(r["tokens_per_s"], 1),
                        _x(r["speedup_over_draftsmith_plain"]),
                        _f(r["tau"]),
                        str(n or "-"),
                        "-" if draft is None else f"{draft:.1f} ({draft / t_t:.2f})",
                        f"{r['verify_pass_ms']:.1f} ({r['verify_pass_ms'] / t_t:.2f})",
                        " ".join(f"{a:.2f}" for a in alpha) or "-",
                    ]
                )
    setting = _setting(bench, "held-out (demo) and out-of-distribution (ood)")
    note = "Each row drafts its own N per round (a DFlash block: B - 1)."
    return "\n".join([f"{setting} {note}", "", *markdown_table(header, rows)])


CHAIN_COST_MODELS = ("draftsmith EAGLE-3 chain", "draftsmith P-EAGLE chain")
"""The benchmark rows whose cost model a results section shows by default."""


def cost_models(bench: dict[str, Any], methods: tuple[str, ...] = CHAIN_COST_MODELS) -> str:
    """``cost_model`` of each of ``methods`` the benchmark has, one block each."""
    present = _by_method(bench)
    return "\n\n".join(cost_model(bench, method) for method in methods if method in present)


# --------------------------------------------------------------------------- the README's table


def headline_table(bench: dict[str, Any], summary: dict[str, Any]) -> str:
    """The benchmark's reference and best rows beside the main job's own, on held-out prompts."""
    methods = _by_method(bench)
    missing = [name for name in HEADLINE if name not in methods]
    if missing:
        raise ValueError(f"the benchmark JSON has no rows {missing}: update report.HEADLINE")
    best = bench["best_against_hf"].values()
    wanted = {*HEADLINE, *(b[k] for b in best for k in ("draftsmith", "trained"))}
    temperatures = list(bench["by_temperature"])
    columns = ("vs fastest plain", "vs HF", "tau", "4-grams")
    header = ["run", "method"] + [f"T={t} {c}" for t in temperatures for c in columns]
    rows = []
    for method, by_t in methods.items():
        if method in wanted:
            rows.append(["benchmark", method, *_speed_tau(by_t, temperatures)])
    job: dict[str, dict[str, dict[str, Any]]] = {}
    for prompts, method, temperature, figures in _main_job_rows(summary):
        job.setdefault(f"{method} ({prompts} prompts)", {})[temperature] = figures
    for method, by_t in job.items():
        rows.append(["main job", method, *_speed_tau(by_t, temperatures)])
    caption = (
        f"{_setting(bench)} Main job: its own speed step at the end of training (held-out "
        f"prompts, and `ood`: installed third-party code the target never saw). {SPEEDUPS}"
    )
    return "\n".join([caption, "", *markdown_table(header, rows)])


KEY_ROWS = (
    *HEADLINE,
    "draftsmith P-EAGLE chain",
    "draftsmith hybrid: lookup + EAGLE-3",
    "draftsmith EAGLE-3 tree",
    "draftsmith EAGLE-3 tree (sampled)",
)
"""The rows a machine's short benchmark table keeps (those the record has), beside each
temperature's best draftsmith method."""


def key_rows_table(bench: dict[str, Any]) -> str:
    """``bench_table``'s setting and a short table: the references, the chains, the hybrid
    and the tree of ``KEY_ROWS``, and each temperature's best draftsmith method."""
    best = {b["draftsmith"] for b in bench["best_against_hf"].values()}
    temperatures = list(bench["by_temperature"])
    columns = ("vs fastest plain", "vs HF", "tau", "4-grams")
    header = ["method"] + [f"T={t} {c}" for t in temperatures for c in columns]
    rows = [
        [method, *_speed_tau(by_t, temperatures)]
        for method, by_t in _by_method(bench).items()
        if method in KEY_ROWS or method in best
    ]
    return "\n".join([f"{_setting(bench)} {SPEEDUPS}", "", *markdown_table(header, rows)])


def _speed_tau(by_t: dict[str, dict[str, Any]], temperatures: list[str]) -> list[str]:
    cells = []
    for t in temperatures:
        r = by_t.get(t)
        cells += (
            [
                _x(r.get("speedup_over_fastest_plain", r["speedup_over_draftsmith_plain"])),
                _x(r["speedup"]),
                _f(r["tau"]),
                _f(r["distinct_4gram_share"]) if "distinct_4gram_share" in r else "-",
            ]
            if r
            else ["-"] * 4
        )
    return cells


# --------------------------------------------------------------------------- machines, greedy ties


def _kernels(machine: dict[str, Any]) -> str:
    kernels = machine.get("cpu_kernels") or []
    amx = " (no AMX)" if "AVX512-BF16" in kernels and "AMX" not in kernels else ""
    return (" + ".join(kernels) or "none detected") + amx


def machines_table(records: tuple[Path, ...] = RECORDS) -> str:
    """Every machine the records name, with its kernels and the records measured there."""
    machines: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for path in records:
        named = _read(path)["machine"]
        for machine in named if isinstance(named, list) else [named]:
            key = json.dumps({k: machine.get(k) for k in ("cpu", "cpu_kernels")}, sort_keys=True)
            machines.setdefault(key, (machine, []))[1].append(f"`{path.relative_to(RESULTS)}`")
    rows = [
        [
            str(machine.get("accelerator") or machine.get("cpu")),
            _kernels(machine),
            str(machine.get("logical_cpus")),
            str(machine.get("torch")),
            ", ".join(names),
        ]
        for machine, names in machines.values()
    ]
    header = ["machine", "CPU kernels", "logical CPUs", "torch", "records (docs/results/)"]
    return "\n".join(markdown_table(header, rows))


GREEDY_RECORDS = (BENCH_DEMO, BENCH_NO_AMX, BENCH_AMD)
"""The benchmark records whose greedy agreement the benchmarks guide shows."""


def greedy_agreement_table(records: tuple[Path, ...] = GREEDY_RECORDS) -> str:
    """Per benchmark record, the prompts at T = 0 whose greedy output equals plain HF
    ``generate``'s in the record's dtype, token for token (docs/theory.md §7), for the rows of
    ``KEY_ROWS`` but HF ``generate`` itself."""
    methods = [m for m in KEY_ROWS if m != "plain (HF generate)" and "sampled" not in m]
    rows = []
    for path in records:
        bench = _read(path)
        greedy = {row["method"]: row for row in bench["by_temperature"].get("0", [])}
        rows.append(
            [
                f"{bench['machine']['cpu']} ({_kernels(bench['machine'])}), {bench['dtype']}",
                *(
                    f"{greedy[m]['greedy_equal_to_plain']}/{bench['num_prompts']}"
                    if m in greedy
                    else "-"
                    for m in methods
                ),
            ]
        )
    return "\n".join(markdown_table(["record", *methods], rows))


CHAIN, PARALLEL = "draftsmith EAGLE-3 chain", "draftsmith P-EAGLE chain"


def chains_by_machine(records: tuple[Path, ...] = GREEDY_RECORDS) -> str:
    """The EAGLE-3 and P-EAGLE chains of each benchmark record over draftsmith's plain
    decoding, per temperature, and P-EAGLE's speed as a share of the chain's."""
    temperatures = ("0", "1")
    header = ["machine", "dtype"]
    header += [f"T={t} EAGLE-3 chain" for t in temperatures]
    header += [f"T={t} P-EAGLE chain" for t in temperatures]
    header += [f"T={t} P-EAGLE / EAGLE-3" for t in temperatures]
    rows = []
    for path in records:
        bench = _read(path)
        methods = _by_method(bench)
        speed = {
            (m, t): methods.get(m, {}).get(t, {}).get("speedup_over_fastest_plain")
            for m in (CHAIN, PARALLEL)
            for t in temperatures
        }
        ratio = [
            _f(speed[PARALLEL, t] / speed[CHAIN, t])
            if speed[PARALLEL, t] and speed[CHAIN, t]
            else "-"
            for t in temperatures
        ]
        rows.append(
            [
                f"{bench['machine']['cpu']} ({_kernels(bench['machine'])})",
                bench["dtype"],
                *(_x(speed[CHAIN, t]) for t in temperatures),
                *(_x(speed[PARALLEL, t]) for t in temperatures),
                *ratio,
            ]
        )
    intro = (
        "Each benchmark record's held-out prompts: speed over draftsmith's fastest plain "
        "decoding on the same machine (ratios within one run; the machines' plain speeds differ)."
    )
    return "\n".join([intro, "", *markdown_table(header, rows)])


# --------------------------------------------------------------------------- the ablation


def ablation_tables(path: Path) -> str:
    """The ablation tool's own Markdown of a results file."""
    from draftsmith.train.ablation.report import format_markdown
    from draftsmith.train.ablation.results import read_results

    results = read_results(REPO / path)
    return (_machine(results).strip() + "\n\n" + format_markdown(results)).rstrip("\n")


def block_grid_table(path: Path) -> str:
    """One row per DFlash run of a grid over the block's rows B and layers L: steps reached in
    the time box, held-out overlap at the first positions, and decoding alone on held-out
    prompts at each temperature (tau, the drafter's time per round, tokens/s)."""
    from draftsmith.train.ablation.report import temperatures_of
    from draftsmith.train.ablation.results import read_results, summarize

    results = read_results(REPO / path)
    runs = sorted(
        results["runs"].values(),
        key=lambda r: (int(r["cell"]["drafter_num_layers"]), int(r["cell"]["dflash_block_size"])),
    )
    temperatures = temperatures_of(summarize(results["runs"]))
    settings = results["settings"]
    header = ["B", "L", "drafts", "steps", "overlap@1", "overlap@2"]
    for t in temperatures:
        header += [f"tau T={t}", f"draft ms T={t}", f"tokens/s T={t}"]
    rows = []
    for run in runs:
        cells = [
            str(run["cell"]["dflash_block_size"]),
            str(run["cell"]["drafter_num_layers"]),
            str(run["num_draft_tokens"][temperatures[0]]),
            str(run["steps"]),
            f"{run['overlap'][0]:.3f}",
            f"{run['overlap'][1]:.3f}",
        ]
        for t in temperatures:
            cells += [
                f"{run['tau'][t]:.2f}",
                f"{run['draft_ms_per_round'][t]:.1f}",
                f"{run['tokens_per_s'][t]:.1f}",
            ]
        rows.append(cells)
    lines = markdown_table(header, rows)
    caption = (
        f"One seed a cell, each trained in a {settings['max_minutes']:g}-minute box on the "
        f"target's own continuations, then decoding {settings['tau_prompts']} held-out prompts x "
        f"{settings['tau_new_tokens']} tokens alone, verifying its whole block (B - 1 drafts)."
        + _machine(results)
    )
    return caption + "\n\n" + "\n".join(lines)


def depth_overlaps_table(path: Path) -> str:
    """One row per cell: the held-out overlap at every draft depth and tau, mean ± std."""
    from draftsmith.train.ablation.report import _mean_std, tau_source, temperatures_of
    from draftsmith.train.ablation.results import read_results, summarize

    results = read_results(REPO / path)
    cells = summarize(results["runs"])  # from the runs: every figure today's summary keeps
    source = tau_source(cells)
    temperatures = temperatures_of(cells)
    depths = max(len(entry["overlap"]) for entry in cells)
    with_mass = any("draftable_mass" in entry for entry in cells)
    header = ["cell", "seeds", *(f"overlap@{d + 1}" for d in range(depths))]
    header += ["draftable mass"] if with_mass else []
    header += [f"tau T={t}" for t in temperatures]
    with_speed = any("train_tokens_per_s" in entry for entry in cells)
    header += ["training tokens/s"] if with_speed else []
    steps = results["settings"].get("max_steps")
    timed_out = steps is None or any(  # a grid of step caps, or a time box ended some run
        entry.get("steps", {}).get("min", steps) != steps  # before its cap: how far each got
        for entry in cells
    )
    header += ["steps"] if timed_out else []
    rows = []
    for entry in cells:
        taus = entry[source]["tau"] if source == "tau_check" else entry["tau"]
        overlaps = [*entry["overlap"], *([None] * (depths - len(entry["overlap"])))]
        mass = [_mean_std(entry.get("draftable_mass"), 3)] if with_mass else []
        run_length = [_mean_std(entry.get("train_tokens_per_s"), 0)] if with_speed else []
        run_length += [_mean_std(entry.get("steps"), 0)] if timed_out else []
        rows.append(
            [
                entry["key"],
                str(len(entry["seeds"])),
                *(_mean_std(o, 3) for o in overlaps),
                *mass,
                *(_mean_std(taus.get(t), 2) for t in temperatures),
                *run_length,
            ]
        )
    minutes = results["settings"].get("max_minutes")
    if steps is None:  # max_steps was an axis: each cell names its own cap
        box = f", up to {minutes:g} minutes" if minutes is not None else ""
        budget = f"each cell's step cap{box} per run"
    elif timed_out:
        budget = f"up to {steps} steps or {minutes:g} minutes per run"
    else:
        budget = f"{steps} steps per run"
    mass_note = (
        " draftable mass: the target's held-out probability on the draft vocabulary, the most"
        " any overlap can reach (– where nothing is pruned);"
        if with_mass
        else ""
    )
    intro = (
        f"mean ± std over seeds; {budget}; overlap@k: held-out overlap of draft "
        f"depth k;{mass_note} tau: tokens per target pass on held-out prompts, "
        f"{_drafts_caption(results)}"
        + (
            "; training tokens/s: the run's own throughput (shared cores slow it)."
            if with_speed
            else "."
        )
    )
    return "\n".join([intro + _machine(results), "", *markdown_table(header, rows)])


def decoding_table(path: Path, ratios: Sequence[tuple[str, str]] | None = None) -> str:
    """One row per cell: tau, the round's parts (drafting and verifying, ms), decoding tokens/s
    and, where the grid timed plain decoding beside it, the speedup over it, at each
    temperature, mean ± std over seeds; then ratios of the means, one row per ``(cell,
    against)`` pair of cell keys in ``ratios`` (default: every other cell against the first,
    P-EAGLE or DFlash against EAGLE-3 in a ``kind`` grid)."""
    from draftsmith.train.ablation.report import _mean_std, temperatures_of
    from draftsmith.train.ablation.results import read_results, summarize

    results = read_results(REPO / path)
    cells = [
        entry
        for entry in summarize(results["runs"])
        if "draft_ms_per_round" in entry and "tokens_per_s" in entry
    ]
    if not cells:
        raise ValueError(f"{path}: no run recorded a decoding measurement")
    temperatures = temperatures_of(cells)
    measures = [m for m in DECODING_MEASURES if all(m[0] in entry for entry in cells)]
    header = ["cell", "seeds"]
    header += [f"{name} T={t}" for _, name, _ in measures for t in temperatures]
    rows = [
        [entry["key"], str(len(entry["seeds"]))]
        + [
            _mean_std(entry[metric].get(t), digits)
            for metric, _, digits in measures
            for t in temperatures
        ]
        for entry in cells
    ]
    by_key = {entry["key"]: entry for entry in cells}
    if ratios is None:
        ratios = [(entry["key"], cells[0]["key"]) for entry in cells[1:]]
    for pair in ratios:
        missing = [key for key in pair if key not in by_key]
        if missing:
            raise ValueError(f"{path}: no cell {missing[0]!r} to compare; cells: {list(by_key)}")
        entry, against = (by_key[key] for key in pair)
        rows.append(
            [f"{entry['key']} / {against['key']}", "–"]
            + [
                _ratio(entry[metric].get(t), against[metric].get(t))
                for metric, _, _ in measures
                for t in temperatures
            ]
        )
    named = {metric for metric, _, _ in measures}
    intro = (
        f"mean ± std over seeds; tau: tokens per target pass on held-out prompts, "
        f"{_drafts_caption(results)}; draft ms/round: the drafter's time per round"
        + (
            "; verify ms/round: the target's pass over the round's rows"
            if "verify_ms_per_round" in named
            else ""
        )
        + "; tokens/s: the speculative decoder's speed (one pass per prompt)"
        + (
            "; x plain: over draftsmith's plain decoding in the target's dtype, interleaved per prompt"
            if "speedup_over_plain" in named
            else ""
        )
        + "; the last rows divide one cell's means by another's."
    )
    return "\n".join([intro + _machine(results), "", *markdown_table(header, rows)])


DECODING_MEASURES = (
    ("tau", "tau", 2),
    ("draft_ms_per_round", "draft ms/round", 2),
    ("verify_ms_per_round", "verify ms/round", 2),
    ("tokens_per_s", "tokens/s", 0),
    ("speedup_over_plain", "x plain", 2),
)
"""A grid's decoding measurements that ``decoding_table`` shows, where every cell has them:
(summary key, column name, decimals)."""


def _drafts_caption(results: dict[str, Any]) -> str:
    """How many drafts a round of the grid's runs verified: chains of N, a DFlash block B - 1."""
    chain = results.get("settings", {}).get("num_draft_tokens", 4)
    kinds = {run["cell"].get("kind") for run in results["runs"].values()}
    block = " (a DFlash block: its B - 1)" if "dflash" in kinds else ""
    # Runs recorded before the grid named its decoding dtype decoded in float32 (its default).
    dtypes = sorted(
        {
            d
            for run in results["runs"].values()
            for d in (run.get("dtype") or {"": "float32"}).values()
        }
    )
    return f"chains of {chain}{block}, the target decoding in {' and '.join(dtypes)}"


_DFLASH_48 = "kind=dflash,data=samples,markov_rank=0,dflash_num_anchors=48"
_DSPARK_48 = "kind=dflash,data=samples,markov_rank=64,dflash_num_anchors=48"
_DSPARK_48_CONFIDENCE = _DSPARK_48 + ",confidence_head=true"
DSPARK_RATIOS = (
    (_DSPARK_48, _DFLASH_48),
    (_DSPARK_48, "kind=eagle3,data=samples"),
    (_DFLASH_48, "kind=eagle3,data=samples"),
    (_DSPARK_48_CONFIDENCE, _DSPARK_48),
    (_DSPARK_48_CONFIDENCE, "kind=eagle3,data=samples"),
)
"""The DSpark grid's comparisons: the Markov head against plain DFlash (DSpark's paper
claims +18.4% accepted length), each block against the EAGLE-3 chain, and the confidence
head (the verify width from the drafter's own outputs) against the block without it."""

MAIN_JOB_GOALS = {"0": 2.6, "1": 2.0}
"""The speedups over plain decoding the main job aims for on held-out prompts, by
temperature: what ``kinds_cost_model`` prices each drafter's acceptance against."""


def kinds_cost_model(path: Path) -> str:
    """One row per cell and temperature, seed means: a round's parts in target steps (a plain
    step ``T_step`` is the unit), tau, the speedup docs/theory.md §5 predicts from them,
    ``tau * T_step / (T_draft + T_verify)``, beside the measured one, the speedup with drafting
    free (``tau * T_step / T_verify``: the limit a deeper target of the same width approaches,
    its step growing while the drafter's round does not) and the tau the main job's goal at
    that temperature (``MAIN_JOB_GOALS``) needs at these costs."""
    from draftsmith.train.ablation.results import read_results, summarize

    results = read_results(REPO / path)
    parts = ("plain_step_ms", "draft_ms_per_round", "verify_ms_per_round", "speedup_over_plain")
    cells = [entry for entry in summarize(results["runs"]) if all(m in entry for m in parts)]
    if not cells:
        raise ValueError(f"{path}: no run timed a plain step beside its rounds")
    header = ["cell", "T", "seeds", "T_step ms", "T_draft (steps)", "T_verify (steps)", "tau"]
    header += [
        "predicted x plain",
        "measured x plain",
        "x plain, drafting free",
        "goal: tau needed",
    ]
    rows = []
    for entry in cells:
        for t, step_stats in entry["plain_step_ms"].items():
            step = step_stats["mean"]
            draft = entry["draft_ms_per_round"][t]["mean"] / step
            verify = entry["verify_ms_per_round"][t]["mean"] / step
            tau = entry["tau"][t]["mean"]
            goal = MAIN_JOB_GOALS.get(t)
            rows.append(
                [
                    entry["key"],
                    t,
                    str(len(entry["seeds"])),
                    f"{step:.2f}",
                    f"{draft:.2f}",
                    f"{verify:.2f}",
                    f"{tau:.2f}",
                    _x(tau / (draft + verify)),
                    _x(entry["speedup_over_plain"][t]["mean"]),
                    _x(tau / verify),
                    "-" if goal is None else f"{goal:.1f}x: {goal * (draft + verify):.2f}",
                ]
            )
    intro = (
        "Seed means of the grid's decoding: a round's drafting and verifying in plain target "
        "steps (T_step), the speedup the cost model predicts from them, tau x T_step / "
        "(T_draft + T_verify), beside the measured one, the speedup with drafting free (tau x "
        "T_step / T_verify) and the tau the main job's goal at that temperature needs at these "
        "costs."
    )
    return "\n".join([intro + _machine(results), "", *markdown_table(header, rows)])


def acceptance_table(path: Path) -> str:
    """One row per cell and temperature: the acceptance rate at each draft position (of
    position j given the ones before it accepted), mean ± std over seeds, as decoded on the
    grid's held-out prompts: where a block's later positions fall off against a chain's."""
    from draftsmith.train.ablation.report import _mean_std
    from draftsmith.train.ablation.results import read_results, summarize

    results = read_results(REPO / path)
    cells = [entry for entry in summarize(results["runs"]) if "alpha" in entry]
    if not cells:
        raise ValueError(f"{path}: no run recorded the acceptance per position")
    width = max(len(by_t) for entry in cells for by_t in entry["alpha"].values())
    header = ["cell", "T", *(f"position {j + 1}" for j in range(width))]
    rows = []
    for entry in cells:
        for t, per_position in entry["alpha"].items():
            shown = [_mean_std(stats, 2) for stats in per_position]
            rows.append([entry["key"], t, *shown, *["–"] * (width - len(shown))])
    intro = (
        "mean ± std over seeds; acceptance at draft position j given the positions before it "
        f"were accepted, decoding held-out prompts, {_drafts_caption(results)}."
    )
    return "\n".join([intro + _machine(results), "", *markdown_table(header, rows)])


def _ratio(value: dict[str, float] | None, base: dict[str, float] | None) -> str:
    if value is None or base is None or not base["mean"]:
        return "–"
    return f"{value['mean'] / base['mean']:.2f}"


# --------------------------------------------------------------------------- sections

SECTIONS: dict[str, Callable[[], str]] = {
    "machines": machines_table,
    "greedy-agreement": greedy_agreement_table,
    "chains-by-machine": chains_by_machine,
    "headline": lambda: headline_table(_read(BENCH_DEMO), _read(MAIN_JOB)),
    "main-job-run": lambda: main_job_run(_read(MAIN_JOB)),
    "main-job": lambda: main_job_table(_read(MAIN_JOB)),
    "bench-demo": lambda: bench_table(_read(BENCH_DEMO)),
    "cost-model": lambda: cost_models(_read(BENCH_DEMO)),
    "bench-no-amx": lambda: key_rows_table(_read(BENCH_NO_AMX)),
    "cost-model-no-amx": lambda: cost_model(_read(BENCH_NO_AMX)),
    "main-job-amd-run": lambda: main_job_run(_read(MAIN_JOB_AMD)),
    "main-job-avx2": lambda: main_job_table(_read(MAIN_JOB_AVX2)),
    "main-job-avx2-run": lambda: main_job_run(_read(MAIN_JOB_AVX2)),
    "bench-amd": lambda: key_rows_table(_read(BENCH_AMD)),
    "cost-model-amd": lambda: cost_model(_read(BENCH_AMD)),
    "ablation-peagle-no-amx": lambda: ablation_tables(ABLATION_PEAGLE_NO_AMX),
    "ablation-peagle-amd": lambda: ablation_tables(ABLATION_PEAGLE_AMD),
    "ablation-peagle-amd-depths": lambda: depth_overlaps_table(ABLATION_PEAGLE_AMD),
    "ablation-vocab-no-amx": lambda: depth_overlaps_table(ABLATION_VOCAB_NO_AMX),
    "ablation-vocab-no-amx-8min": lambda: depth_overlaps_table(ABLATION_VOCAB_NO_AMX_8MIN),
    "ablation-cache-no-amx": lambda: depth_overlaps_table(ABLATION_CACHE_NO_AMX),
    "ablation-cache256-no-amx": lambda: depth_overlaps_table(ABLATION_CACHE256_NO_AMX),
    "ablation-schedule-no-amx": lambda: depth_overlaps_table(ABLATION_SCHEDULE_NO_AMX),
    "ablation-steps-amx": lambda: depth_overlaps_table(ABLATION_STEPS_AMX),
    "ablation-peagle-450-amx": lambda: depth_overlaps_table(ABLATION_PEAGLE_450_AMX),
    "ablation-peagle-450-amx-decoding": lambda: decoding_table(ABLATION_PEAGLE_450_AMX),
    "ablation-peagle-layers-450-amx": lambda: depth_overlaps_table(ABLATION_PEAGLE_LAYERS_450_AMX),
    "ablation-peagle-layers-450-amx-decoding": lambda: decoding_table(
        ABLATION_PEAGLE_LAYERS_450_AMX
    ),
    "serving-sweep": lambda: sweep_table(_read(SERVING_SWEEP)),
    "serving-sweep-ratios": lambda: sweep_ratio_table(
        _read(SERVING_SWEEP), "load-aware", SWEEP_RIVALS
    ),
    "bench-dflash-avx2": lambda: block_drafter_table(_read(BENCH_DFLASH_AVX2)),
    "ablation-dflash-avx2": lambda: block_grid_table(ABLATION_DFLASH_AVX2),
    "ablation-kinds-amd": lambda: depth_overlaps_table(ABLATION_KINDS_AMD),
    "ablation-kinds-amd-decoding": lambda: decoding_table(ABLATION_KINDS_AMD),
    "ablation-kinds-amd-acceptance": lambda: acceptance_table(ABLATION_KINDS_AMD),
    "ablation-kinds-amd-cost-model": lambda: kinds_cost_model(ABLATION_KINDS_AMD),
    "ablation-dflash-anchors-amd": lambda: (
        depth_overlaps_table(ABLATION_DFLASH_ANCHORS_AMD)
        + "\n\n"
        + decoding_table(ABLATION_DFLASH_ANCHORS_AMD)
    ),
    "ablation-dspark-amd": lambda: depth_overlaps_table(ABLATION_DSPARK_AMD),
    "ablation-dspark-amd-decoding": lambda: decoding_table(ABLATION_DSPARK_AMD, DSPARK_RATIOS),
    "ablation-dspark-amd-acceptance": lambda: acceptance_table(ABLATION_DSPARK_AMD),
    "ablation-dspark-amd-cost-model": lambda: kinds_cost_model(ABLATION_DSPARK_AMD),
    "bench-dspark-amd": lambda: block_drafter_table(_read(BENCH_DSPARK_AMD), BLOCK_ROWS_ADAPTIVE),
    "serving-sweep-amd": lambda: sweep_table(_read(SERVING_SWEEP_AMD)),
    "serving-sweep-amd-ratios": lambda: sweep_ratio_table(
        _read(SERVING_SWEEP_AMD), "load-aware", SWEEP_RIVALS
    ),
    "serving-sweep-hybrid": lambda: sweep_table(_read(SERVING_SWEEP_HYBRID)),
    "serving-sweep-hybrid-ratios": lambda: sweep_ratio_table(
        _read(SERVING_SWEEP_HYBRID), "hybrid", HYBRID_RIVALS
    ),
    "serving-rounds-amd": lambda: round_parts_table(_read(SERVING_ROUNDS_AMD)),
    "serving-rounds-avx2": lambda: round_parts_table(_read(SERVING_ROUNDS_AVX2)),
    "policy-windows-avx2": lambda: policy_windows_table(_read(POLICY_WINDOWS_AVX2)),
}
"""Section name -> the function that writes its text from docs/results/."""


def documents() -> list[Path]:
    return sorted(path for pattern in DOCUMENTS for path in REPO.glob(pattern))


def rewrite(text: str, cache: dict[str, str]) -> str:
    """``text`` with every marked section replaced by what its function writes."""

    def fill(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in SECTIONS:
            raise ValueError(f"no section {name!r}; known: {', '.join(SECTIONS)}")
        if name not in cache:
            cache[name] = SECTIONS[name]().rstrip("\n") + "\n"
        return match.group(1) + cache[name] + match.group(4)

    return MARKER.sub(fill, text)


def unmarked_figures(text: str) -> list[str]:
    """Lines holding a result figure outside every marked section, every exempt block and
    every worked example of ``ARITHMETIC``."""
    outside = EXEMPT.sub("", MARKER.sub("", text))
    for example in ARITHMETIC:
        outside = outside.replace(example, "")
    return [line.strip() for line in outside.splitlines() if FIGURE.search(line)]


def record_problems(texts: list[str]) -> list[str]:
    """Files under docs/results/ that name no machine (JSON records) or that no document
    cites: by a section reading it (``RECORDS``), by its path or by its folder's."""
    problems = []
    for path in sorted((REPO / RESULTS).rglob("*")):
        if not path.is_file():
            continue
        name = path.relative_to(REPO)
        under = path.relative_to(REPO / RESULTS).as_posix()
        if path.suffix == ".json" and not _read(path).get("machine"):
            problems.append(
                f"{name}: names no machine; add the `machine` of the computer it was measured "
                "on (draftsmith.decode.measure.machine.machine_record), or remove the record"
            )
        cited = name in RECORDS or any(
            f"results/{under}" in text or f"results/{path.parent.name}/" in text for text in texts
        )
        if not cited:
            problems.append(f"{name}: no document cites it; git rm it (history keeps it)")
    return problems


def check(paths: list[Path]) -> list[str]:
    """Problems: sections that differ from what the JSON says, figures typed outside them,
    arithmetic examples no document holds, records without a machine or a citation."""
    problems = []
    cache: dict[str, str] = {}
    texts = [path.read_text() for path in paths]
    problems += [
        f"report.ARITHMETIC: no document holds {example!r} any more; remove the entry"
        for example in ARITHMETIC
        if not any(example in text for text in texts)
    ]
    problems += record_problems(texts)
    for path in paths:
        text = path.read_text()
        name = path.relative_to(REPO)
        if rewrite(text, cache) != text:
            stale = [
                m.group(2) for m in MARKER.finditer(text) if rewrite(m.group(0), cache) != m[0]
            ]
            problems.append(f"{name}: sections {stale} differ from docs/results/ (run report.py)")
        problems += [
            f"{name}: a figure outside a report section: {line}" for line in unmarked_figures(text)
        ]
    return problems


NOT_A_NUMBER = re.compile(r"\b(nan|inf)\b")
"""A figure Python printed from NaN or infinity."""


def take_main_job(run_dir: Path, destination: Path = REPO / MAIN_JOB) -> None:
    """Copy a main-job run's ``summary.json`` to ``docs/results/main_job.json``, once its
    sections render from it: a record that does not would break every later report."""
    from draftsmith.decode.loading import read_json_object

    if not run_dir.is_dir():
        raise FileNotFoundError(
            f"--main-job {run_dir}: no such folder; pass a distill run folder (its --output_dir)"
        )
    summary = run_dir / "summary.json"
    if not summary.is_file():
        raise FileNotFoundError(f"{summary}: no summary.json (is it a distill run folder?)")
    fix = "pass the folder of a finished distill run (train/distill.py writes summary.json last)"
    record = read_json_object(summary, fix)
    if "speed" not in record:
        raise ValueError(f"{summary} has no speed step (the run had speed_eval_prompts 0)")
    try:
        text = main_job_table(record) + main_job_run(record)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(
            f"{summary} is not a run summary the report can read ({type(error).__name__}: "
            f"{error}); {fix}"
        ) from error
    if NOT_A_NUMBER.search(text):
        raise ValueError(f"{summary} holds NaN or infinite figures; {fix}")
    shutil.copyfile(summary, destination)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: draftsmith-report --main-job outputs/distill-demo",
    )
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    parser.add_argument(
        "--main-job", type=Path, default=None, help="a distill run folder to take results from"
    )
    parser.add_argument(
        "--into",
        choices=(MAIN_JOB.name, MAIN_JOB_AMD.name, MAIN_JOB_AVX2.name),
        default=MAIN_JOB.name,
        help="the record --main-job replaces: main_job.json (the AMX machine's, the README's "
        "headline and the benchmarks guide's main job), main_job_amd.json (the AMD EPYC's "
        "with AVX512-BF16) or main_job_avx2.json (the AVX2-only AMD EPYC's)",
    )
    args = parser.parse_args(argv)
    if args.check and args.main_job is not None:
        parser.error("--check changes nothing, so it takes no --main-job: drop one of them")
    if args.into != parser.get_default("into") and args.main_job is None:
        parser.error("--into names the record --main-job replaces: add --main-job, or drop it")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    paths = documents()
    if args.check:
        problems = check(paths)
        print("\n".join(problems) or f"{len(paths)} documents match docs/results/")
        return 1 if problems else 0
    if args.main_job is not None:
        take_main_job(args.main_job, REPO / RESULTS / args.into)
    cache: dict[str, str] = {}
    for path in paths:
        text = path.read_text()
        new = rewrite(text, cache)
        if new != text:
            path.write_text(new)
            print(f"rewrote {path.relative_to(REPO)}")
    for problem in check(paths):
        print(problem)
    return 0


if __name__ == "__main__":
    from draftsmith.decode.command_line import run_command

    sys.exit(run_command(main))
