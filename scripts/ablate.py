"""Ablate distillation recipes: a grid of overrides x seeds, each run trained, then measured.

    python scripts/ablate.py --grid loss=ce,fkl,rkl,jsd:0.5,tv,lk,nla \\
        data=corpus,regenerated,onpolicy kind=draft_lm,eagle3 \\
        --seeds 0 1 2 --max-minutes 10 --output outputs/ablation
    python scripts/ablate.py --preset tiny --grid loss=tv,lk --seeds 0 1 --max-steps 5 \\
        --output outputs/ablation-tiny                 # a smoke run in about a minute

Every cell of the grid (the product of the ``--grid`` axes) is trained once per seed through
``train.distill.main`` (in this process), on the recipe of its drafter kind (``--preset``:
``configs/<preset>.yaml``, ``<preset>_eagle3.yaml``, ``<preset>_medusa.yaml``; ``--recipe
KIND=PATH`` replaces one). Axes:

- ``loss``: a loss spec of ``train.losses`` (``ce``, ``fkl``, ``rkl``, ``jsd:0.5``, ``tv``,
  ``lk``, ``nla``, mixes such as ``0.5*fkl+0.5*tv``), the recipe's ``--loss``;
- ``kind``: the drafter kind (``draft_lm``, ``eagle3``, ``medusa``), which picks the recipe;
- ``data``: where the training text comes from, joined with ``+`` to combine:
  ``corpus`` (the recipe's dataset, the embedded corpus), ``regenerated`` (the target's own
  responses to corpus prompts, written once per grid by ``scripts/regenerate_data.py`` into
  ``<output>/data/regenerated.jsonl``, or the file given by ``--regenerated``; the run gets
  ``--dataset <file>``), ``onpolicy`` (``--on_policy_fraction``, default 0.5: that share of
  batches is continued by the drafter itself and scored by the target; only the ``draft_lm``
  objective samples on-policy, and only a loss with a target term learns from it, so other
  kinds and a plain ``ce`` skip these cells and the JSON says why);
- any other recipe field (``loss_temperature=0.5,1``), passed as ``--<field> <value>``.

A run's held-out set comes from its own data (held-out prompts of that data continued by the
target), so compare the overlap across losses and kinds, and tau (always measured on the same
held-out corpus prompts, ``speed_eval_prompt_source``) across data sources too.

``--max-minutes`` is each run's time box (``--max_minutes``), ``--max-steps`` its step cap.
Each run's own summary gives the held-out overlap per draft position (``overlap@j``, the
expected acceptance of position j); its speed step (``train.speed_report`` over
``decode.evaluate``) decodes ``--tau-prompts`` held-out prompts with the exported drafter
and measures tau (tokens per target pass) at each ``--temperatures`` (chains of
``--num-draft-tokens`` for every kind, so kinds compare alike).

Output (``--output``): ``ablation.json`` with every run, the per-cell mean, sample std, min
and max over seeds, and the gain of each cell over its baseline cell (``--baseline loss=ce``
by default when the grid has ``ce``; also ``data=corpus``), plus ``overlap.png`` and ``tau.png``
(means with min-max bars). The JSON is rewritten atomically after every run; rerunning the
same command skips the runs it already holds and continues an interrupted grid
(``--max-runs N`` stops on purpose after N new runs). Runs that fail are reported and retried
by the next invocation; a changed setting (recipe, time box, tau settings) refuses to mix
with the earlier runs instead of silently comparing unlike runs.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS_FILE = "ablation.json"
FORMAT_VERSION = 1

# preset -> drafter kind -> recipe; the grid's "kind" axis picks one.
RECIPES: dict[str, dict[str, str]] = {
    preset: {
        "draft_lm": f"configs/{preset}.yaml",
        "eagle3": f"configs/{preset}_eagle3.yaml",
        "medusa": f"configs/{preset}_medusa.yaml",
    }
    for preset in ("demo", "bench", "tiny")
}
DATA_SOURCES = ("corpus", "regenerated", "onpolicy")
ON_POLICY_KINDS = ("draft_lm",)  # objectives that sample their own continuations
# Fields the tool sets itself; the grid names them through its own axes.
RESERVED = {
    "drafter_kind": "kind",
    "dataset": "data=regenerated (or --recipe)",
    "on_policy_fraction": "data=onpolicy and --on-policy-fraction",
    "seed": "--seeds",
    "output_dir": "--output",
}


class Skip(Exception):
    """A cell that cannot run (e.g. on-policy data for a kind that does not sample)."""


# --------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--grid",
        nargs="+",
        default=["loss=ce,tv"],
        metavar="AXIS=V1,V2",
        help="axes of the grid: loss=..., data=corpus,regenerated,onpolicy, "
        "kind=draft_lm,eagle3,medusa, or any recipe field",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--preset", default="demo", choices=sorted(RECIPES))
    parser.add_argument(
        "--recipe", action="append", default=[], metavar="KIND=PATH", help="recipe of one kind"
    )
    parser.add_argument("--target", default=None, help="override every recipe's --target")
    parser.add_argument("--max-minutes", type=float, default=None, help="time box of each run")
    parser.add_argument("--max-steps", type=int, default=None, help="step cap of each run")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a recipe override applied to every run (the grid's axes win over it)",
    )
    parser.add_argument("--tau-prompts", type=int, default=8, help="held-out prompts decoded")
    parser.add_argument("--tau-new-tokens", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="chain length")
    parser.add_argument("--on-policy-fraction", type=float, default=0.5)
    parser.add_argument(
        "--regenerated", type=Path, default=None, help="use this JSONL for data=regenerated"
    )
    parser.add_argument("--regen-prompts", type=int, default=1000, help="prompts regenerated")
    parser.add_argument("--regen-prompt-tokens", type=int, default=32)
    parser.add_argument("--regen-new-tokens", type=int, default=192)
    parser.add_argument(
        "--baseline",
        action="append",
        default=None,
        metavar="AXIS=VALUE",
        help="cells are compared with the cell that has this value (default: loss=ce, "
        "data=corpus where the grid has them)",
    )
    parser.add_argument("--output", type=Path, default=Path("outputs/ablation"))
    parser.add_argument("--max-runs", type=int, default=None, help="stop after N new runs")
    args = parser.parse_args(argv)
    for name in ("tau_prompts", "tau_new_tokens", "num_draft_tokens", "regen_prompts"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_runs is not None and args.max_runs < 1:
        raise ValueError(f"--max-runs must be >= 1, got {args.max_runs}")
    if not 0.0 < args.on_policy_fraction <= 1.0:
        raise ValueError(f"--on-policy-fraction must lie in (0, 1], got {args.on_policy_fraction}")
    if len(set(args.seeds)) != len(args.seeds):
        raise ValueError(f"--seeds repeats a seed: {args.seeds}")
    return args


def parse_grid(items: Sequence[str]) -> dict[str, list[str]]:
    """``["loss=ce,tv", "kind=draft_lm"]`` -> ``{"loss": ["ce", "tv"], "kind": ["draft_lm"]}``."""
    from train.config import SECTIONS

    fields = {f for cls in SECTIONS.values() for f in cls.__dataclass_fields__}
    grid: dict[str, list[str]] = {}
    for item in items:
        axis, sep, values = item.partition("=")
        axis = axis.strip()
        parsed = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not axis or not parsed:
            raise ValueError(f"--grid {item!r}: write AXIS=V1,V2 (e.g. loss=ce,tv)")
        if axis in grid:
            raise ValueError(f"--grid names axis {axis!r} twice; give all its values at once")
        if axis in RESERVED:
            raise ValueError(f"--grid {axis}: set through {RESERVED[axis]}, not as a grid axis")
        if axis not in ("loss", "kind", "data") and axis not in fields:
            raise ValueError(
                f"--grid {axis}: unknown axis; use loss, data, kind or a recipe field "
                "(see python train/distill.py --help)"
            )
        if len(set(parsed)) != len(parsed):
            raise ValueError(f"--grid {item!r} repeats a value")
        if axis == "data":
            for value in parsed:
                bad = [part for part in value.split("+") if part not in DATA_SOURCES]
                if bad:
                    raise ValueError(
                        f"--grid data={value}: unknown source(s) {bad}; use "
                        f"{', '.join(DATA_SOURCES)}, or several joined with '+'"
                    )
        grid[axis] = parsed
    return grid


def parse_pairs(items: Iterable[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} {item!r}: write KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


# --------------------------------------------------------------------------- the grid


def cells_of(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    """The product of the axes, in the order given (the last axis varies fastest)."""
    return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]


def cell_key(cell: dict[str, str]) -> str:
    return ",".join(f"{axis}={value}" for axis, value in cell.items())


def run_key(cell: dict[str, str], seed: int) -> str:
    return f"{cell_key(cell)},seed={seed}"


def run_folder(output: Path, key: str) -> Path:
    """A file-system-safe folder per run: a readable slug plus a short hash of the key."""
    slug = re.sub(r"[^A-Za-z0-9._=-]+", "_", key.replace(",", "__"))[:80]
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    return output / "runs" / f"{slug}-{digest}"


def recipes_of(args: argparse.Namespace) -> dict[str, Path]:
    recipes = {kind: REPO / path for kind, path in RECIPES[args.preset].items()}
    for kind, path in parse_pairs(args.recipe, "--recipe").items():
        recipes[kind] = Path(path)
    return recipes


def run_argv(
    cell: dict[str, str],
    seed: int,
    args: argparse.Namespace,
    recipes: dict[str, Path],
    run_dir: Path,
    regenerated: Path | None,
) -> list[str]:
    """The ``train/distill.py`` flags of one run; raises :class:`Skip` for impossible cells."""
    kind = cell.get("kind", "draft_lm")
    if kind not in recipes:
        raise ValueError(
            f"no recipe for drafter kind {kind!r}: pass --recipe {kind}=PATH "
            f"(known: {', '.join(sorted(recipes))})"
        )
    recipe = recipes[kind]
    if not recipe.is_file():
        raise FileNotFoundError(f"recipe {recipe} of kind {kind!r} does not exist: pass --recipe")
    argv = ["--config", str(recipe), "--drafter_kind", kind, "--output_dir", str(run_dir)]
    argv += ["--overwrite_output_dir", "true", "--seed", str(seed), "--report_to", "none"]
    argv += ["--progress_bar", "false"]
    if args.target is not None:
        argv += ["--target", args.target]
    if args.max_minutes is not None:
        argv += ["--max_minutes", str(args.max_minutes)]
    if args.max_steps is not None:
        argv += ["--max_steps", str(args.max_steps)]
    argv += ["--speed_eval_prompts", str(args.tau_prompts)]
    argv += ["--speed_eval_new_tokens", str(args.tau_new_tokens)]
    argv += ["--speed_eval_draft_tokens", str(args.num_draft_tokens)]
    argv += ["--speed_eval_tree_total_tokens", "0"]  # chains: every kind drafts alike
    argv += ["--speed_eval_temperatures", *(f"{t:g}" for t in args.temperatures)]
    for field, value in parse_pairs(args.set, "--set").items():
        argv += [f"--{field}", value]
    sources = cell.get("data", "corpus").split("+")
    if "regenerated" in sources:
        assert regenerated is not None
        argv += ["--dataset", str(regenerated)]
    if "onpolicy" in sources:
        if kind not in ON_POLICY_KINDS:
            raise Skip(
                f"data=onpolicy: the {kind} objective does not sample on-policy continuations "
                f"(only {', '.join(ON_POLICY_KINDS)} does)"
            )
        _check_on_policy_loss(cell.get("loss"), recipe)
        argv += ["--on_policy_fraction", str(args.on_policy_fraction)]
    else:
        argv += ["--on_policy_fraction", "0"]
    for axis, value in cell.items():
        if axis == "loss":
            argv += ["--loss", value]
        elif axis not in ("kind", "data"):
            argv += [f"--{axis}", value]
    return argv


def _check_on_policy_loss(loss: str | None, recipe: Path) -> None:
    """On-policy batches carry the drafter's own samples: hard labels there teach nothing."""
    from train.config import read_recipe
    from train.losses import build_loss

    spec = loss if loss is not None else read_recipe(recipe).get("loss", "tv")
    if not build_loss(spec).needs_target:
        raise Skip(
            f"data=onpolicy with loss={spec}: on-policy batches are the drafter's own samples, "
            "and a loss without a target term would train it on its own guesses"
        )


def settings_of(args: argparse.Namespace, recipes: dict[str, Path]) -> dict[str, Any]:
    """What makes runs comparable; a resumed grid must have the same."""
    return {
        "recipes": {kind: str(path) for kind, path in sorted(recipes.items())},
        "target": args.target,
        "max_minutes": args.max_minutes,
        "max_steps": args.max_steps,
        "set": parse_pairs(args.set, "--set"),
        "tau_prompts": args.tau_prompts,
        "tau_new_tokens": args.tau_new_tokens,
        "temperatures": [float(t) for t in args.temperatures],
        "num_draft_tokens": args.num_draft_tokens,
        "on_policy_fraction": args.on_policy_fraction,
        "regenerated": _regeneration_settings(args),
    }


# --------------------------------------------------------------------------- regenerated data


def _regeneration_settings(args: argparse.Namespace) -> dict[str, Any]:
    if args.regenerated is not None:
        return {"file": str(args.regenerated)}
    return {
        "file": str(args.output / "data" / "regenerated.jsonl"),
        "prompts": args.regen_prompts,
        "prompt_tokens": args.regen_prompt_tokens,
        "new_tokens": args.regen_new_tokens,
    }


def grid_target(args: argparse.Namespace, recipes: dict[str, Path], kinds: Iterable[str]) -> str:
    """The one target of the grid (``--target``, else the recipes' common one)."""
    if args.target is not None:
        return args.target
    from train.config import read_recipe

    targets = {read_recipe(recipes[kind]).get("target", "demo") for kind in kinds}
    if len(targets) != 1:
        raise ValueError(
            f"the recipes of this grid name different targets {sorted(targets)}: pass --target"
        )
    return targets.pop()


def prepare_regenerated(args: argparse.Namespace, target: str, max_files: int | None) -> Path:
    """The regenerated data of the grid: ``--regenerated``, else written once and reused."""
    if args.regenerated is not None:
        if not args.regenerated.is_file():
            raise FileNotFoundError(
                f"--regenerated {args.regenerated}: no such file; write one with "
                "scripts/regenerate_data.py or drop the flag to let the grid write it"
            )
        return args.regenerated
    path = args.output / "data" / "regenerated.jsonl"
    if path.is_file():
        print(f"regenerated data: reusing {path}")
        return path
    command = [
        sys.executable,
        str(REPO / "scripts" / "regenerate_data.py"),
        "--target", target,
        "--prompts", "stdlib",
        "--num-prompts", str(args.regen_prompts),
        "--prompt-tokens", str(args.regen_prompt_tokens),
        "--max-new-tokens", str(args.regen_new_tokens),
        "--output", str(path),
        "--seed", "0",
    ]  # fmt: skip
    if max_files is not None:
        command += ["--max-files", str(max_files)]
    print("regenerated data: " + " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True, cwd=REPO)
    return path


# --------------------------------------------------------------------------- one run


def train_and_measure(argv: list[str]) -> dict[str, Any]:
    """One run through ``train.distill.main``; its summary reduced to what the grid compares."""
    from train.distill import main as distill_main

    summary = distill_main(argv)
    held_out = summary["held_out"]
    speed = summary.get("speed") or {}
    return {
        "overlap": _per_position(held_out, "overlap@"),
        "greedy_match": _per_position(held_out, "greedy_match@"),
        "held_out": held_out,
        "tau": {t: r["tau"] for t, r in speed.items()},
        "predicted_tau": {t: r["predicted_tau"] for t, r in speed.items()},
        "speedup": {t: r["speedup"] for t, r in speed.items()},
        "steps": summary["steps"],
        "stop_reason": summary["stop_reason"],
        "minutes": summary["minutes"],
        "tokens_seen": summary["tokens_seen"],
        "data": summary["data"],
        "eval_description": summary["eval_description"],
    }


def _per_position(held_out: dict[str, float], prefix: str) -> list[float]:
    keys = [k for k in held_out if k.startswith(prefix) and k[len(prefix) :].isdigit()]
    return [held_out[k] for k in sorted(keys, key=lambda k: int(k[len(prefix) :]))]


# --------------------------------------------------------------------------- aggregation


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min, max and count."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": n}


def summarize(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell: overlap and greedy match per position and tau per temperature over seeds."""
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
        temperatures = set.intersection(*(set(r["tau"]) for r in records))
        entry["tau"] = {
            t: spread([r["tau"][t] for r in records]) for t in sorted(temperatures, key=float)
        }
        cells.append(entry)
    return cells


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


def load_results(path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The results written so far (empty for a new grid); refuses other settings."""
    if not path.is_file():
        return {"format_version": FORMAT_VERSION, "settings": settings, "runs": {}}
    results = json.loads(path.read_text())
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
    from data.atomic_io import write_json_atomic

    results["cells"] = compare_with_baselines(summarize(results["runs"]), baselines)
    results["baselines"] = baselines
    results["skipped"] = skipped
    results["failed"] = failed  # not in "runs": the next invocation retries them
    write_json_atomic(path, results)


# --------------------------------------------------------------------------- plots


def plot_results(cells: list[dict[str, Any]], output: Path) -> list[Path]:
    """``overlap.png`` (per draft position, one panel per kind) and ``tau.png`` (per
    temperature): means with min-max bars over seeds, seeds as dots."""
    from decode.plots import _pyplot, _save

    if not cells:
        return []
    plt = _pyplot()
    kinds = sorted({c["cell"].get("kind", "") for c in cells})
    figure, axes = plt.subplots(
        1, len(kinds), figsize=(5.5 * len(kinds), 4.2), squeeze=False, sharey=True
    )
    for ax, kind in zip(axes[0], kinds, strict=True):
        chosen = [c for c in cells if c["cell"].get("kind", "") == kind]
        for offset, entry in enumerate(chosen):
            stats = entry["overlap"]
            x = [j + 1 + 0.04 * (offset - len(chosen) / 2) for j in range(len(stats))]
            mean = [s["mean"] for s in stats]
            low = [s["mean"] - s["min"] for s in stats]
            high = [s["max"] - s["mean"] for s in stats]
            label = _label(entry["cell"], drop=("kind",))
            ax.errorbar(x, mean, yerr=[low, high], marker="o", capsize=3, label=label)
        ax.set_xlabel("draft position j")
        ax.set_title(kind or "held-out overlap")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("held-out overlap (mean, min-max over seeds)")
    paths = [_save(figure, output / "overlap.png")]

    temperatures = sorted({t for c in cells for t in c["tau"]}, key=float)
    if temperatures:
        figure, axes = plt.subplots(
            1,
            len(temperatures),
            figsize=(5.5 * len(temperatures), 0.42 * len(cells) + 1.6),
            squeeze=False,
            sharey=True,
        )
        names = [_label(c["cell"]) for c in cells]
        for ax, t in zip(axes[0], temperatures, strict=True):
            rows = [(i, c["tau"][t]) for i, c in enumerate(cells) if t in c["tau"]]
            ys = [i for i, _ in rows]
            means = [s["mean"] for _, s in rows]
            err = [[s["mean"] - s["min"] for _, s in rows], [s["max"] - s["mean"] for _, s in rows]]
            ax.barh(ys, means, xerr=err, capsize=3, color="#4472c4", alpha=0.85)
            ax.set_yticks(range(len(cells)), names, fontsize=7)
            ax.axvline(1.0, color="black", linewidth=0.8)
            ax.set_xlabel(f"tau at T={t} (mean, min-max over seeds)")
            ax.grid(alpha=0.3, axis="x")
        axes[0][0].invert_yaxis()
        paths.append(_save(figure, output / "tau.png"))
    return paths


def _label(cell: dict[str, str], drop: Sequence[str] = ()) -> str:
    return ", ".join(f"{k}={v}" for k, v in cell.items() if k not in drop) or "recipe"


# --------------------------------------------------------------------------- report


def format_table(cells: list[dict[str, Any]]) -> str:
    """One line per cell: overlap@1 and tau per temperature, mean +- std [min, max]."""
    temperatures = sorted({t for c in cells for t in c["tau"]}, key=float)
    lines = []
    for entry in cells:
        parts = [f"{entry['key']:<44} n={len(entry['seeds'])}"]
        if entry["overlap"]:
            parts.append(f"overlap@1 {_fmt(entry['overlap'][0])}")
        for t in temperatures:
            if t in entry["tau"]:
                parts.append(f"tau(T={t}) {_fmt(entry['tau'][t])}")
        for name, gain in entry.get("gain", {}).items():
            text = " ".join(f"T={t} {g:+.1%}" for t, g in gain["tau"].items())
            parts.append(f"vs {name}: {text}")
        lines.append("  ".join(parts))
    return "\n".join(lines)


def _fmt(stats: dict[str, float]) -> str:
    return f"{stats['mean']:.3f}+-{stats['std']:.3f} [{stats['min']:.3f}, {stats['max']:.3f}]"


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run (or continue) the grid; return the results dict written to ``ablation.json``."""
    args = parse_args(argv)
    grid = parse_grid(args.grid)
    recipes = recipes_of(args)
    cells = cells_of(grid)
    baselines = (
        parse_pairs(args.baseline, "--baseline")
        if args.baseline is not None
        else default_baselines(grid)
    )
    settings = settings_of(args, recipes)
    path = args.output / RESULTS_FILE
    results = load_results(path, settings)
    runs: dict[str, dict[str, Any]] = results["runs"]

    regenerated = None
    if any("regenerated" in c.get("data", "").split("+") for c in cells):
        kinds = {c.get("kind", "draft_lm") for c in cells}
        target = grid_target(args, recipes, kinds)
        from train.config import read_recipe

        max_files = read_recipe(recipes[sorted(kinds)[0]]).get("max_files")
        regenerated = prepare_regenerated(args, target, max_files)

    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    new_runs = 0
    stopped = False
    total = len(cells) * len(args.seeds)
    for seed in args.seeds:  # all cells of a seed first: early partial grids are comparable
        for cell in cells:
            key = run_key(cell, seed)
            if key in runs:
                print(f"[ablate] {key}: done already, skipped")
                continue
            if args.max_runs is not None and new_runs >= args.max_runs:
                stopped = True
                break
            run_dir = run_folder(args.output, key)
            try:
                run_args = run_argv(cell, seed, args, recipes, run_dir, regenerated)
            except Skip as reason:
                skipped[cell_key(cell)] = str(reason)
                continue
            print(f"[ablate] run {len(runs) + 1}/{total}: {key}", flush=True)
            start = time.perf_counter()
            try:
                measured = train_and_measure(run_args)
            except Exception as error:  # one bad cell must not lose the grid
                traceback.print_exc()
                failed[key] = f"{type(error).__name__}: {error}"
                continue
            runs[key] = {
                "key": key,
                "cell": cell,
                "seed": seed,
                "run_dir": str(run_dir),
                "argv": run_args,
                "wall_minutes": (time.perf_counter() - start) / 60,
                **measured,
            }
            new_runs += 1
            save_results(path, results, baselines, skipped, failed)
        if stopped:
            break
    save_results(path, results, baselines, skipped, failed)
    plots = plot_results(results["cells"], args.output)
    print(format_table(results["cells"]))
    for key, reason in skipped.items():
        print(f"[ablate] skipped {key}: {reason}")
    for key, error in failed.items():
        print(f"[ablate] FAILED {key}: {error} (rerun to retry)")
    if stopped:
        print(f"[ablate] stopped after {new_runs} new runs (--max-runs); rerun to continue")
    print(f"[ablate] {len(runs)} runs in {path}; plots: {', '.join(str(p) for p in plots)}")
    return results


if __name__ == "__main__":
    # libgomp busy-waiting collapses throughput on shared cores; set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        outcome = main()
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    sys.exit(1 if outcome.get("failed") else 0)
