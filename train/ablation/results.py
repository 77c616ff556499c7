"""The results file of an ablation grid: its runs, their per-cell spread over seeds and the
gains over baseline cells, written atomically, checked on reading, and merged across grids.

``ablation.json`` holds ``settings`` (the grid's fingerprint: runs made with other settings are
refused rather than mixed), ``runs`` (one record per cell and seed: the cell's axis values, the
seed, tau per decoding temperature, overlap and greedy agreement per draft position, the
machine), ``machine`` (:func:`machine_of`: the machine of every run) and the
derived ``cells`` (:func:`summarize`: mean, sample standard deviation, min and max over seeds)
with each cell's relative gain over its baseline cells (:func:`compare_with_baselines`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS_FILE = "ablation.json"
FORMAT_VERSION = 1
# A run's decoding measurements per temperature (``draftsmith.train.ablation.grid.measure_tau``)
# that a cell summarises over seeds; runs recorded before one existed simply lack it.
TIMED_MEASURES = (
    "draft_ms_per_round",
    "verify_ms_per_round",
    "plain_step_ms",
    "tokens_per_s",
    "plain_tokens_per_s",
    "speedup_over_plain",
)


# --------------------------------------------------------------------------- keys


def cell_key(cell: dict[str, str]) -> str:
    return ",".join(f"{axis}={value}" for axis, value in cell.items())


def run_key(cell: dict[str, str], seed: int) -> str:
    return f"{cell_key(cell)},seed={seed}"


# --------------------------------------------------------------------------- aggregation


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min, max and count."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": n}


def by_temperature(tables: Sequence[dict[str, float]]) -> dict[str, dict[str, float]]:
    """The ``spread`` of each temperature's values over runs (one table per run, keyed by
    temperature), for the temperatures every run measured, in increasing order."""
    shared = set.intersection(*(set(table) for table in tables))
    return {t: spread([table[t] for table in tables]) for t in sorted(shared, key=float)}


def summarize(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell: overlap and greedy match per position, tau per temperature, the steps trained,
    training tokens/s, the decoding's measurements per temperature (``TIMED_MEASURES``: a
    round's draft and verify time, a plain step, tokens/s and the speedup over plain
    decoding), the acceptance per draft position per temperature and, with a pruned draft
    vocabulary, the target's probability on it (``draftable_mass``), over seeds."""
    by_cell: dict[str, list[dict[str, Any]]] = {}
    for record in runs.values():
        by_cell.setdefault(cell_key(record["cell"]), []).append(record)
    cells = []
    for key, records in by_cell.items():
        records.sort(key=lambda r: r["seed"])
        entry: dict[str, Any] = {
            "key": key,
            "cell": records[0]["cell"],
            "seeds": [r["seed"] for r in records],
        }
        for metric in ("overlap", "greedy_match"):
            length = min(len(r[metric]) for r in records)
            entry[metric] = [spread([r[metric][j] for r in records]) for j in range(length)]
        steps = [r["steps"] for r in records if isinstance(r.get("steps"), int)]
        if len(steps) == len(records):  # what each run trained, its time box included
            entry["steps"] = spread(steps)
        speeds = [r["tokens_seen"] / (60 * r["minutes"]) for r in records if r.get("minutes")]
        if len(speeds) == len(records):  # training throughput, where every run recorded it
            entry["train_tokens_per_s"] = spread(speeds)
        masses = [r.get("held_out", {}).get("draftable_mass") for r in records]
        if all(m is not None for m in masses):  # a pruned draft vocabulary's cap on overlap
            entry["draftable_mass"] = spread(masses)
        entry["tau"] = by_temperature([r["tau"] for r in records])
        for metric in TIMED_MEASURES:  # the decoding measurement
            timed = by_temperature([r.get(metric) or {} for r in records])
            if timed:
                entry[metric] = timed
        alphas = [r.get("alpha") or {} for r in records]
        shared = set.intersection(*(set(a) for a in alphas))
        if shared:  # acceptance per draft position at each temperature, over seeds
            entry["alpha"] = {
                t: [
                    spread([a[t][j] for a in alphas]) for j in range(min(len(a[t]) for a in alphas))
                ]
                for t in sorted(shared, key=float)
            }
        checks = [r.get("tau_check") for r in records]
        if all(checks) and len({c["prompts"] for c in checks}) == 1:
            entry["tau_check"] = {
                "prompts": checks[0]["prompts"],
                "tau": by_temperature([c["tau"] for c in checks]),
            }
        cells.append(entry)
    return cells


def machine_of(runs: dict[str, dict[str, Any]]) -> dict[str, Any] | list[dict[str, Any]] | None:
    """The machine the grid's runs (and their ``tau_check`` re-measurements) ran on
    (``draftsmith.decode.measure.machine.machine_record``): one record, a list of the distinct
    ones when grids of several machines were merged, or None when no run names one."""
    seen: list[dict[str, Any]] = []
    for record in runs.values():
        for machine in (record.get("machine"), record.get("tau_check", {}).get("machine")):
            if machine and machine not in seen:
                seen.append(machine)
    if not seen:
        return None
    return seen[0] if len(seen) == 1 else seen


def compare_with_baselines(
    cells: list[dict[str, Any]], baselines: dict[str, str]
) -> list[dict[str, Any]]:
    """Relative gains (``mean / baseline mean - 1``) of each cell over its baseline cells.

    The baseline of a cell for ``axis=value`` is the cell equal to it on every other axis.
    """
    index = {cell_key(c["cell"]): c for c in cells}
    for entry in cells:
        gains: dict[str, Any] = {}
        for axis, value in baselines.items():
            if axis not in entry["cell"] or entry["cell"][axis] == value:
                continue
            base = index.get(cell_key({**entry["cell"], axis: value}))
            if base is None:
                continue
            gain: dict[str, Any] = {"baseline": base["key"], "tau": {}}
            for t, stats in entry["tau"].items():
                if t in base["tau"] and base["tau"][t]["mean"] > 0:
                    gain["tau"][t] = stats["mean"] / base["tau"][t]["mean"] - 1.0
            if "tau_check" in entry and "tau_check" in base:
                mine, theirs = entry["tau_check"]["tau"], base["tau_check"]["tau"]
                gain["tau_check"] = {
                    t: stats["mean"] / theirs[t]["mean"] - 1.0
                    for t, stats in mine.items()
                    if t in theirs and theirs[t]["mean"] > 0
                }
            if entry["overlap"] and base["overlap"] and base["overlap"][0]["mean"] > 0:
                gain["overlap@1"] = entry["overlap"][0]["mean"] / base["overlap"][0]["mean"] - 1
            gains[f"{axis}={value}"] = gain
        entry["gain"] = gains
    return cells


def default_baselines(grid: dict[str, list[str]]) -> dict[str, str]:
    out = {}
    for axis, value in (("loss", "ce"), ("data", "corpus")):
        if value in grid.get(axis, []):
            out[axis] = value
    return out


# --------------------------------------------------------------------------- results file


def read_results(path: Path) -> dict[str, Any]:
    """A results file, checked to be one this tool wrote (a clear error otherwise)."""
    try:
        results = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        message = f"{path} is not a results file ({error}); pass a grid's {RESULTS_FILE}"
        raise ValueError(message) from None

    def bad(problem: str) -> ValueError:
        return ValueError(f"{path} is not a results file of this tool: {problem}")

    if not isinstance(results, dict):
        raise bad("its top level is not an object")
    if results.get("format_version") != FORMAT_VERSION:
        raise bad(f"format_version {results.get('format_version')!r}, expected {FORMAT_VERSION}")
    if not isinstance(results.get("settings"), dict) or not isinstance(results.get("runs"), dict):
        raise bad('it lacks the "settings" and "runs" objects')
    for key, record in results["runs"].items():
        fields = {"cell": dict, "seed": int, "tau": dict, "overlap": list, "greedy_match": list}
        if not isinstance(record, dict) or any(
            not isinstance(record.get(name), kind) for name, kind in fields.items()
        ):
            raise bad(f"run {key!r} lacks one of {', '.join(fields)}")
        if not all(isinstance(v, str) for v in record["cell"].values()):
            raise bad(f"run {key!r}: a cell maps axes to string values")
    return results


def load_results(path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The results written so far (empty for a new grid); refuses other settings."""
    if not path.is_file():
        return {"format_version": FORMAT_VERSION, "settings": settings, "runs": {}}
    results = read_results(path)
    if results.get("settings") != settings:
        changed = sorted(
            k
            for k in set(settings) | set(results.get("settings", {}))
            if settings.get(k) != results.get("settings", {}).get(k)
        )
        raise ValueError(
            f"{path} holds runs made with other settings ({', '.join(changed)}): rerun with "
            "the same settings to continue that grid, or pass another --output"
        )
    return results


def save_results(
    path: Path,
    results: dict[str, Any],
    baselines: dict[str, str],
    skipped: dict[str, str],
    failed: dict[str, str],
) -> None:
    """Recompute the per-cell summary and write everything atomically (a crash mid-write
    leaves the previous file)."""
    from draftsmith.data.atomic_io import write_json_atomic

    machine = machine_of(results["runs"])
    if machine is not None:  # else a record made before runs named theirs keeps its own
        results["machine"] = machine
    results["cells"] = compare_with_baselines(summarize(results["runs"]), baselines)
    results["baselines"] = baselines
    results["skipped"] = skipped
    results["failed"] = failed  # not in "runs": the next invocation retries them
    write_json_atomic(path, results)


def merge_results(
    path: Path, sources: Sequence[Path], baselines: dict[str, str] | None = None
) -> dict[str, Any]:
    """Fold the runs of other grids' results files into ``path`` (grids of one settings run
    side by side, e.g. one per machine), re-keyed to the axis order of the runs already there.

    Refuses files made with other settings or other axes; a run both files hold keeps the one
    in ``path``. Returns the merged results with ``added`` (keys of the runs taken over).
    """
    results = read_results(path) if path.is_file() else None
    runs: dict[str, dict[str, Any]] = {} if results is None else results["runs"]
    axes = next((list(record["cell"]) for record in runs.values()), None)
    added: list[str] = []
    for source in sources:
        if not source.is_file():
            raise FileNotFoundError(f"--merge {source}: no such file; pass a grid's {RESULTS_FILE}")
        if results is None:
            results = {**read_results(source), "runs": {}}
            runs = results["runs"]
        other = load_results(source, results["settings"])
        for record in other["runs"].values():
            cell = record["cell"]
            axes = list(cell) if axes is None else axes
            if set(cell) != set(axes):
                raise ValueError(
                    f"--merge {source}: its runs vary {', '.join(cell)} and the merged runs "
                    f"{', '.join(axes)}; merge grids over the same axes"
                )
            ordered = {axis: cell[axis] for axis in axes}
            key = run_key(ordered, record["seed"])
            if key not in runs:
                runs[key] = {**record, "key": key, "cell": ordered}
                added.append(key)
    if results is None:
        raise ValueError("--merge: no results to merge")
    results["runs"] = runs
    grid = {axis: sorted({r["cell"][axis] for r in runs.values()}) for axis in axes or []}
    baselines = default_baselines(grid) if baselines is None else baselines
    save_results(path, results, baselines, results.get("skipped", {}), results.get("failed", {}))
    return {**results, "path": str(path), "added": added}
