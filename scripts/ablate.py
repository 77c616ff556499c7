"""Ablate distillation recipes: a grid of overrides x seeds, each run trained, then measured.

    python scripts/ablate.py --grid loss=ce,fkl,rkl,jsd:0.5,tv,lk,nla \\
        data=corpus,regenerated,samples,onpolicy kind=draft_lm,eagle3 \\
        --seeds 0 1 2 --max-minutes 10 --output outputs/ablation
    python scripts/ablate.py --preset tiny --grid loss=tv,lk --seeds 0 1 --max-steps 5 \\
        --output outputs/ablation-tiny                 # a smoke run in about a minute

Every cell of the grid (the product of the ``--grid`` axes) is trained once per seed through
``draftsmith.train.distill.main`` (in this process; the grid logic is ``draftsmith.train.ablation.grid``), on the recipe of its drafter kind (``--preset``:
``configs/<preset>.yaml``, ``<preset>_eagle3.yaml``, ``<preset>_medusa.yaml``,
``<preset>_peagle.yaml``; ``--recipe KIND=PATH`` replaces one). Axes:

- ``loss``: a loss spec of ``draftsmith.train.losses`` (``ce``, ``fkl``, ``rkl``, ``jsd:0.5``, ``tv``,
  ``lk``, ``nla``, mixes such as ``0.5*fkl+0.5*tv``), the recipe's ``--loss``;
- ``kind``: the drafter kind (``draft_lm``, ``eagle3``, ``medusa``, ``peagle``), which picks
  the recipe (``kind=eagle3,peagle`` compares parallel drafting with EAGLE-3's chain at the
  same training budget);
- ``data``: where the training text comes from, joined with ``+`` to combine:
  ``corpus`` (the recipe's dataset, the embedded corpus), ``regenerated`` (the target's own
  responses to corpus prompts, written once per grid by ``scripts/regenerate_data.py`` into
  ``<output>/data/regenerated.jsonl``, or the file given by ``--regenerated``; the run gets
  ``--dataset <file>``), ``samples`` (``--train_source target_samples``: corpus prompts
  continued by the target as the recipe's ``--train_prompts``, ``--train_sequences`` and
  ``--train_temperatures`` say, as the recipe itself trains; regenerated at the start of each
  run, once per grid with ``--samples-seed`` and cached between runs), ``onpolicy``
  (``--on_policy_fraction``, default 0.5: that share of batches is continued by the drafter
  itself and scored by the target; only the ``draft_lm`` objective samples on-policy, and only
  a loss with a target term learns from it, so other kinds and a plain ``ce`` skip these cells
  and the JSON says why);
- any other recipe field (``loss_temperature=0.5,1``), passed as ``--<field> <value>``.

A run's held-out set comes from its own data (held-out prompts of that data continued by the
target), so compare the overlap across losses and kinds, and tau (always measured on the same
held-out corpus prompts, ``speed_eval_prompt_source``) across data sources too.

``--max-minutes`` is each run's time box (``--max_minutes``), ``--max-steps`` its step cap.
Each run's own summary gives the held-out overlap per draft position (``overlap@j``, the
expected acceptance of position j); its speed step (``draftsmith.train.speed_report`` over
``draftsmith.decode.measure.evaluate``) decodes ``--tau-prompts`` held-out prompts with the exported drafter
and measures tau (tokens per target pass) at each ``--temperatures`` (chains of
``--num-draft-tokens`` for every kind, so kinds compare alike).

Output (``--output``): ``ablation.json`` with every run, the per-cell mean, sample std, min
and max over seeds, and the gain of each cell over its baseline cell (``--baseline loss=ce``
by default when the grid has ``ce``; also ``data=corpus``), plus ``overlap.png`` and ``tau.png``
(means with min-max bars) and ``ablation.md``, the same summary as Markdown tables (one per
drafter kind, data sources as column groups, the gains in brackets). The JSON is rewritten
atomically after every run; rerunning the same command skips the runs it already holds and
continues an interrupted grid
(``--max-runs N`` stops on purpose after N new runs). Runs that fail are reported and retried
by the next invocation; a changed setting (recipe, time box, tau settings) refuses to mix
with the earlier runs instead of silently comparing unlike runs.

``--remeasure-tau 32 --output C`` runs no training: it decodes each finished run's drafter
again on 32 held-out prompts and keeps that tau beside the grid's (``tau_check``, with its
spread and gains), a steadier figure than the few prompts a grid affords per run.

``--merge A/ablation.json B/ablation.json --output C`` runs nothing: it folds grids of the same
settings that ran side by side (one per machine, or one per axis) into ``C/ablation.json``
and plots the union, so their cells compare with one another's baselines.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draftsmith.data.atomic_io import write_text_atomic
from draftsmith.decode.command_line import check_output_folder
from draftsmith.train.ablation.grid import (
    RECIPES,
    GridSettings,
    cells_of,
    check_baselines,
    check_run_counts,
    check_runs,
    default,
    grid_target,
    needs_regenerated,
    parse_grid,
    parse_pairs,
    recipes_for,
    remeasure_tau,
    run_grid,
)
from draftsmith.train.ablation.report import MARKDOWN_FILE, format_markdown, format_table
from draftsmith.train.ablation.results import RESULTS_FILE, merge_results

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from draftsmith.decode.measure.side_by_side import seed_value, temperature_value

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
        epilog="example: draftsmith-ablate --preset tiny --grid loss=tv,lk --seeds 0 1 "
        "--max-steps 5 --output outputs/ablation-tiny",
    )
    parser.add_argument(
        "--grid",
        nargs="+",
        default=["loss=ce,tv"],
        metavar="AXIS=V1,V2",
        help="axes of the grid: loss=..., data=corpus,regenerated,samples,onpolicy, "
        "kind=draft_lm,eagle3,medusa,peagle,dflash, or any recipe field",
    )
    parser.add_argument("--seeds", nargs="+", type=seed_value, default=[0, 1, 2])
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
    parser.add_argument(
        "--tau-prompts", type=int, default=default("tau_prompts"), help="held-out prompts decoded"
    )
    parser.add_argument(
        "--tau-new-tokens", type=int, default=default("tau_new_tokens"), help="tokens per prompt"
    )
    parser.add_argument(
        "--temperatures",
        nargs="+",
        type=temperature_value,
        default=list(default("temperatures")),
    )
    parser.add_argument(
        "--num-draft-tokens", type=int, default=default("num_draft_tokens"), help="chain length"
    )
    parser.add_argument("--on-policy-fraction", type=float, default=default("on_policy_fraction"))
    parser.add_argument(
        "--regenerated", type=Path, default=None, help="use this JSONL for data=regenerated"
    )
    parser.add_argument(
        "--samples-seed",
        type=seed_value,
        default=None,
        help="data=samples: continue the prompts with this seed in every run, so the target "
        "regenerates once per grid and the seeds vary the training alone (default: each run's "
        "seed, a regeneration per seed)",
    )
    parser.add_argument("--regen-prompts", type=int, default=default("regen_prompts"))
    parser.add_argument("--regen-prompt-tokens", type=int, default=default("regen_prompt_tokens"))
    parser.add_argument("--regen-new-tokens", type=int, default=default("regen_new_tokens"))
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
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--remeasure-tau",
        type=int,
        default=None,
        metavar="PROMPTS",
        help="run nothing: measure tau of the runs in --output again with this many prompts "
        "(kept beside the grid's own as tau_check)",
    )
    only.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        metavar="ABLATION_JSON",
        help="run nothing: fold these grids' results (same settings) into --output, then plot",
    )
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> GridSettings:
    return GridSettings(
        output=args.output,
        recipes=recipes_for(args.preset, parse_pairs(args.recipe, "--recipe")),
        target=args.target,
        max_minutes=args.max_minutes,
        max_steps=args.max_steps,
        overrides=parse_pairs(args.set, "--set"),
        tau_prompts=args.tau_prompts,
        tau_new_tokens=args.tau_new_tokens,
        temperatures=tuple(args.temperatures),
        num_draft_tokens=args.num_draft_tokens,
        on_policy_fraction=args.on_policy_fraction,
        regenerated=args.regenerated,
        samples_seed=args.samples_seed,
        regen_prompts=args.regen_prompts,
        regen_prompt_tokens=args.regen_prompt_tokens,
        regen_new_tokens=args.regen_new_tokens,
    )


def prepare_regenerated(settings: GridSettings, target: str, max_files: int | None) -> Path:
    """The grid's regenerated data: the given file, else written once by
    ``scripts/regenerate_data.py`` (corpus prompts answered by the target) and then reused."""
    path = settings.regenerated_file
    if settings.regenerated is not None:
        if not path.is_file():
            raise FileNotFoundError(
                f"--regenerated {path}: no such file; write one with "
                "scripts/regenerate_data.py or drop the flag to let the grid write it"
            )
        return path
    if path.is_file():
        print(f"regenerated data: reusing {path}")
        return path
    command = [
        sys.executable,
        str(REPO / "scripts" / "regenerate_data.py"),
        "--target", target,
        "--prompts", "stdlib",
        "--num-prompts", str(settings.regen_prompts),
        "--prompt-tokens", str(settings.regen_prompt_tokens),
        "--max-new-tokens", str(settings.regen_new_tokens),
        "--output", str(path),
        "--seed", "0",
    ]  # fmt: skip
    if max_files is not None:
        command += ["--max-files", str(max_files)]
    print("regenerated data: " + " ".join(command[1:]), flush=True)
    try:
        subprocess.run(command, check=True, cwd=REPO)
    except subprocess.CalledProcessError as error:
        raise ValueError(
            f"scripts/regenerate_data.py stopped with exit status {error.returncode} (its error "
            "is printed above); fix what it names, or pass a file with --regenerated"
        ) from None
    return path


# --------------------------------------------------------------------------- plots


def plot_results(
    cells: list[dict[str, Any]], output: Path, tau_prompts: int | None = None
) -> list[Path]:
    """``overlap.png`` (per draft position, one panel per kind) and ``tau.png`` (per
    temperature, cells grouped by kind): means with min-max bars over seeds; ``tau_prompts``,
    the grid's held-out prompts per run, labels the tau axis.

    In the overlap panels a cell's colour follows its first varying axis besides ``kind`` (the
    loss, say) and its marker the second (the data), so one loss reads alike across data and
    kinds. Where cells were measured again with more prompts (``tau_check``), ``tau.png`` draws
    that measurement as the bar and the grid's few-prompt tau as a hollow marker beside it.
    """
    from draftsmith.decode.measure.plots import _pyplot, _save

    if not cells:
        return []
    plt = _pyplot()
    kinds = sorted({c["cell"].get("kind", "") for c in cells})
    style = _cell_styles(cells)
    figure, axes = plt.subplots(
        1, len(kinds), figsize=(5.5 * len(kinds), 4.6), squeeze=False, sharey=True
    )
    for ax, kind in zip(axes[0], kinds, strict=True):
        chosen = [c for c in cells if c["cell"].get("kind", "") == kind]
        for offset, entry in enumerate(chosen):
            stats = entry["overlap"]
            x = [j + 1 + 0.03 * (offset - len(chosen) / 2) for j in range(len(stats))]
            mean = [s["mean"] for s in stats]
            low = [s["mean"] - s["min"] for s in stats]
            high = [s["max"] - s["mean"] for s in stats]
            color, marker = style[entry["key"]]
            label = _label(entry["cell"], drop=("kind",))
            ax.errorbar(
                x, mean, yerr=[low, high], marker=marker, color=color, capsize=3, label=label
            )
        positions = max((len(c["overlap"]) for c in chosen), default=1)
        ax.set_xticks(range(1, positions + 1))
        ax.set_xlim(0.5, positions + 0.5)
        ax.set_xlabel("draft position j")
        ax.set_title(kind or "held-out overlap")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2 if len(chosen) > 8 else 1)
    axes[0][0].set_ylabel("held-out overlap (mean, min-max over seeds)")
    paths = [_save(figure, output / "overlap.png")]

    temperatures = sorted({t for c in cells for t in c["tau"]}, key=float)
    if temperatures:
        figure, axes = plt.subplots(
            1,
            len(temperatures),
            figsize=(5.5 * len(temperatures), 0.32 * len(cells) + 1.8),
            squeeze=False,
            sharey=True,
        )
        kinds_first = sorted(cells, key=lambda c: kinds.index(c["cell"].get("kind", "")))
        names = [_label(c["cell"]) for c in kinds_first]
        checked = {c["tau_check"]["prompts"] for c in cells if "tau_check" in c}
        for ax, t in zip(axes[0], temperatures, strict=True):
            for i, entry in enumerate(kinds_first):
                grid_stats = entry["tau"].get(t)
                check = entry.get("tau_check", {}).get("tau", {}).get(t)
                bar = check or grid_stats
                if bar is None:
                    continue
                err = [[bar["mean"] - bar["min"]], [bar["max"] - bar["mean"]]]
                color = "#a5b8e0" if checked and not check else "#4472c4"
                ax.barh(i, bar["mean"], xerr=err, capsize=3, color=color, alpha=0.9)
                if check and grid_stats:
                    ax.plot(grid_stats["mean"], i, marker="o", mfc="none", color="black", ms=5)
            ax.set_yticks(range(len(cells)), names, fontsize=7)
            ax.axvline(1.0, color="black", linewidth=0.8)
            counts = sorted(checked) if checked else [tau_prompts] if tau_prompts else []
            what = f"{'/'.join(map(str, counts))} prompts" if counts else "the grid's prompts"
            ax.set_xlabel(f"tau at T={t}, {what} (mean, min-max over seeds)")
            ax.grid(alpha=0.3, axis="x")
        if checked:
            figure.suptitle(
                "dark bars: measured again with more prompts (circles: the grid's few-prompt "
                "tau of the same runs); pale bars: the grid's tau only",
                fontsize=8,
            )
        axes[0][0].invert_yaxis()
        paths.append(_save(figure, output / "tau.png"))
    return paths


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _cell_styles(cells: list[dict[str, Any]]) -> dict[str, tuple[Any, str]]:
    """A colour per value of the first varying axis besides ``kind``, a marker per value of
    the second; keyed by cell key."""
    from draftsmith.decode.measure.plots import _pyplot

    varying = [
        axis
        for axis in cells[0]["cell"]
        if axis != "kind" and len({c["cell"].get(axis) for c in cells}) > 1
    ]

    def values(axis: str | None) -> list[str]:
        return [] if axis is None else list(dict.fromkeys(c["cell"].get(axis) for c in cells))

    colour_axis = varying[0] if varying else None
    marker_axis = varying[1] if len(varying) > 1 else None
    colours, markers = values(colour_axis), values(marker_axis)
    palette = _pyplot().get_cmap("tab10" if len(colours or cells) <= 10 else "tab20")
    styles = {}
    for index, entry in enumerate(cells):
        colour = colours.index(entry["cell"].get(colour_axis)) if colour_axis else index
        marker = markers.index(entry["cell"].get(marker_axis)) if marker_axis else 0
        styles[entry["key"]] = (palette(colour % palette.N), MARKERS[marker % len(MARKERS)])
    return styles


def _label(cell: dict[str, str], drop: Sequence[str] = ()) -> str:
    return ", ".join(f"{k}={v}" for k, v in cell.items() if k not in drop) or "recipe"


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run (or continue) the grid, plot it and print the table; return the results."""
    from draftsmith.train.config import read_recipe

    args = parse_args(argv)
    grid = parse_grid(args.grid)
    settings = settings_from(args)
    check_output_folder(settings.output, "--output")
    baselines = None if args.baseline is None else parse_pairs(args.baseline, "--baseline")
    if args.merge:
        results = merge_results(settings.output / RESULTS_FILE, args.merge, baselines)
        print(f"[ablate] merged {len(results['added'])} runs into {results['path']}")
        report(results, settings.output)
        return results
    if args.remeasure_tau is not None:
        results = remeasure_tau(settings.output / RESULTS_FILE, args.remeasure_tau, _log)
        report(results, settings.output)
        return results
    cells = cells_of(grid)
    # Everything a run would refuse is refused now, before the first run (or the data) starts.
    check_run_counts(args.seeds, args.max_runs)
    if baselines is not None:
        check_baselines(baselines, cells, settings.output / RESULTS_FILE)
    check_runs(cells, args.seeds[0], settings)
    if needs_regenerated(cells):
        kinds = sorted({cell.get("kind", "draft_lm") for cell in cells})
        max_files = read_recipe(settings.recipes[kinds[0]]).get("max_files")
        prepare_regenerated(settings, grid_target(settings, kinds), max_files)
    results = run_grid(
        grid,
        args.seeds,
        settings,
        baselines,
        args.max_runs,
        log=_log,
    )
    if results["stopped"]:
        print(
            f"[ablate] stopped after {results['new_runs']} new runs (--max-runs); rerun to continue"
        )
    report(results, settings.output)
    return results


def _log(line: str) -> None:
    print(line, flush=True)


def report(results: dict[str, Any], output: Path) -> None:
    """Plot the cells and print their table, the skipped and failed cells and the files."""
    plots = plot_results(results["cells"], output, results["settings"].get("tau_prompts"))
    print(format_table(results["cells"]))
    tables = output / MARKDOWN_FILE
    write_text_atomic(tables, format_markdown(results))
    for key, reason in results["skipped"].items():
        print(f"[ablate] skipped {key}: {reason}")
    for key, error in results["failed"].items():
        print(f"[ablate] FAILED {key}: {error} (rerun to retry)")
    print(
        f"[ablate] {len(results['runs'])} runs in {results['path']}; plots: "
        + ", ".join(str(p) for p in plots)
        + f"; Markdown tables: {tables}"
    )


if __name__ == "__main__":
    # Before torch loads OpenMP: idle threads sleep at once only where ranks share the cores.
    from draftsmith.decode.cpu_threads import default_openmp_wait_policy

    default_openmp_wait_policy()
    from draftsmith.decode.command_line import run_command

    outcome = run_command(main)
    sys.exit(1 if outcome.get("failed") else 0)
