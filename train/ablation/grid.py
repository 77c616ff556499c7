"""Ablation grids of distillation recipes: cells x seeds, trained and measured, one results file.

A grid is the product of axes of recipe overrides (:func:`parse_grid`): ``loss`` (a spec of
``draftsmith.train.losses``), ``kind`` (the drafter kind, which picks its recipe), ``data`` (``corpus``,
``regenerated``, ``samples``, ``onpolicy``, joined with ``+``) and any other recipe field. Every cell runs
once per seed through ``draftsmith.train.distill.main`` (:func:`run_argv` gives its flags, the
``data`` sources mapped to the recipe keys ``--dataset`` and ``--on_policy_fraction``), and the
run's own summary gives what the grid compares (:func:`train_and_measure`): the held-out
overlap per draft position, ``overlap@j`` (the expected acceptance ``alpha_j`` of
docs/theory.md §5), and tau, the tokens per target pass that the speed step measures with the
decoder (``draftsmith.train.speed_report`` over ``draftsmith.decode.measure.evaluate``) at each decoding temperature.

:func:`run_grid` keeps every run in one JSON (``ablation.json``, ``draftsmith.train.ablation.results``:
the per-cell spread over seeds and the gains over baseline cells such as ``loss=ce``),
rewritten atomically after each run. Rerun on the same file, it skips the runs already there, so
an interrupted grid continues where it stopped; runs made with other settings
(:meth:`GridSettings.fingerprint`) are refused rather than mixed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.decode.command_line import check_positive_finite
from draftsmith.decode.defaults import NUM_DRAFT_TOKENS
from draftsmith.decode.measure.machine import machine_record
from draftsmith.train.ablation.results import (
    RESULTS_FILE,
    TIMED_MEASURES,
    cell_key,
    default_baselines,
    load_results,
    read_results,
    run_key,
    save_results,
)
from draftsmith.train.config import SECTIONS, read_recipe

REPO = Path(__file__).resolve().parents[2]

# preset -> drafter kind -> recipe; the grid's "kind" axis picks one.
# The demo preset's configs/demo.yaml is the main job (an EAGLE-3 head), so its draft LM has
# its own recipe.
RECIPES: dict[str, dict[str, str]] = {
    preset: {
        "draft_lm": f"configs/{preset}_draft_lm.yaml"
        if preset == "demo"
        else f"configs/{preset}.yaml",
        "eagle3": f"configs/{preset}_eagle3.yaml",
        "medusa": f"configs/{preset}_medusa.yaml",
        "peagle": f"configs/{preset}_peagle.yaml",
        "dflash": f"configs/{preset}_dflash.yaml",
    }
    for preset in ("demo", "bench", "tiny")
}
DATA_SOURCES = ("corpus", "regenerated", "samples", "onpolicy")
# Sources that name the training text; at most one per cell (on-policy mixes into any).
TEXT_SOURCES = ("corpus", "regenerated", "samples")
ON_POLICY_KINDS = ("draft_lm",)  # objectives that sample their own continuations
# Fields the tool sets itself; the grid names them through its own axes.
RESERVED = {
    "drafter_kind": "kind",
    "dataset": "data=regenerated (or --recipe)",
    "train_source": "data=samples (the target's own text) or data=corpus",
    "on_policy_fraction": "data=onpolicy and --on-policy-fraction",
    "seed": "--seeds",
    "train_samples_seed": "--samples-seed",
    "output_dir": "--output",
}


# What measure_tau records per temperature besides tau, kept in each run's entry.
DECODE_MEASURES = ("alpha", *TIMED_MEASURES, "num_draft_tokens", "dtype")


class Skip(Exception):
    """A cell that cannot run (e.g. on-policy data for a kind that does not sample)."""


@dataclass
class GridSettings:
    """Everything but the grid and the seeds: where results go and how each run is made."""

    output: Path
    recipes: dict[str, Path]  # drafter kind -> recipe (see recipes_for)
    target: str | None = None  # overrides every recipe's --target
    max_minutes: float | None = None  # each run's time box
    max_steps: int | None = None  # each run's step cap
    overrides: dict[str, str] = field(default_factory=dict)  # recipe field -> value, every run
    tau_prompts: int = 8  # held-out prompts decoded to measure tau
    tau_new_tokens: int = 64  # tokens per prompt
    temperatures: tuple[float, ...] = (0.0, 1.0)
    num_draft_tokens: int = NUM_DRAFT_TOKENS  # chain length for every kind
    on_policy_fraction: float = 0.5  # data=onpolicy
    regenerated: Path | None = None  # data=regenerated: this JSONL (else written per grid)
    # data=samples: the seed of the target's continuations, shared by every run (so the grid
    # regenerates them once and its seeds vary the training alone); None: each run's own seed.
    samples_seed: int | None = None
    regen_prompts: int = 1000
    regen_prompt_tokens: int = 32
    # A prompt/response record is one training row (never packed with another), so prompt +
    # response fills the demo and bench recipes' 256-token block: fewer would leave each step with
    # fewer supervised tokens than a step of packed corpus text.
    regen_new_tokens: int = 224

    def __post_init__(self) -> None:
        least = {
            "tau_prompts": 1,
            "tau_new_tokens": 1,
            "num_draft_tokens": 1,
            "regen_prompts": 1,
            "regen_new_tokens": 1,
            "regen_prompt_tokens": 2,  # a corpus prompt is a packed block of >= 2 tokens
            "max_steps": 1,
        }
        for name, bound in least.items():
            value = getattr(self, name)
            if value is not None and value < bound:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {bound}, got {value}")
        if self.max_minutes is not None:
            unset = " (or left out for the recipes' own)"
            check_positive_finite(self.max_minutes, "--max-minutes", "minutes", unset)
        if not 0.0 < self.on_policy_fraction <= 1.0:
            raise ValueError(
                f"--on-policy-fraction must lie in (0, 1], got {self.on_policy_fraction}"
            )
        names = [f"{t:g}" for t in self.temperatures]  # how results key each temperature
        if len(set(names)) != len(names):
            raise ValueError(f"--temperatures repeats a temperature: {' '.join(names)}")
        for name in RESERVED:
            if name in self.overrides:
                raise ValueError(f"--set {name}: set through {RESERVED[name]}")
        unknown = sorted(set(self.overrides) - recipe_fields())
        if unknown:
            raise ValueError(
                f"--set {unknown[0]}: not a recipe field (see python train/distill.py --help)"
            )

    @property
    def regenerated_file(self) -> Path:
        """The JSONL of ``data=regenerated``: the given one, else ``<output>/data/``."""
        return self.regenerated or self.output / "data" / "regenerated.jsonl"

    def fingerprint(self) -> dict[str, Any]:
        """What makes runs comparable; a resumed grid must have the same (JSON types)."""
        out = dataclasses.asdict(self)
        del out["output"]
        # Recipes by content, and the grid's own data by its place in the output folder: a
        # grid resumes from another clone or after its folder moved, not after a recipe changed.
        out["recipes"] = {kind: recipe_digest(path) for kind, path in sorted(self.recipes.items())}
        out["temperatures"] = [float(t) for t in self.temperatures]
        if self.samples_seed is None:  # grids written before the setting existed
            del out["samples_seed"]
        out["regenerated"] = (
            "<output>/data/regenerated.jsonl"
            if self.regenerated is None
            else str(self.regenerated_file)
        )
        if self.regenerated is not None:  # a given file: how it was made is not ours
            for name in ("regen_prompts", "regen_prompt_tokens", "regen_new_tokens"):
                del out[name]
        return out


def recipe_digest(path: Path) -> str:
    """A short SHA-256 of the resolved recipe (inheritance applied), or ``missing: <path>``."""
    if not path.is_file():
        return f"missing: {path}"
    text = json.dumps(read_recipe(path), sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def default(name: str) -> Any:
    """The default of a :class:`GridSettings` field (the command line's defaults)."""
    spec = GridSettings.__dataclass_fields__[name]
    return (
        spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
    )


def recipes_for(preset: str, replaced: dict[str, str] | None = None) -> dict[str, Path]:
    """The recipes of ``preset`` per drafter kind, with ``replaced`` kinds pointing elsewhere."""
    if preset not in RECIPES:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(sorted(RECIPES))}")
    recipes = {kind: REPO / path for kind, path in RECIPES[preset].items()}
    for kind, path in (replaced or {}).items():
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"--recipe {kind}={path}: no such file; pass a recipe YAML (e.g. "
                f"{RECIPES[preset]['eagle3']})"
            )
        recipes[kind] = Path(path)
    return recipes


def recipe_fields() -> set[str]:
    """Every field a recipe sets (the flags of ``train/distill.py``)."""
    return {name for cls in SECTIONS.values() for name in cls.__dataclass_fields__}


# --------------------------------------------------------------------------- the grid


def parse_grid(items: Sequence[str]) -> dict[str, list[str]]:
    """``["loss=ce,tv", "kind=draft_lm"]`` -> ``{"loss": ["ce", "tv"], "kind": ["draft_lm"]}``."""
    fields = recipe_fields()
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
                parts = value.split("+")
                bad = [part for part in parts if part not in DATA_SOURCES]
                if bad:
                    raise ValueError(
                        f"--grid data={value}: unknown source(s) {bad}; use "
                        f"{', '.join(DATA_SOURCES)}, or several joined with '+'"
                    )
                if sum(part in TEXT_SOURCES for part in parts) > 1:
                    raise ValueError(
                        f"--grid data={value}: {', '.join(TEXT_SOURCES)} each name the training "
                        "text; join at most one of them with onpolicy"
                    )
        grid[axis] = parsed
    return grid


def parse_pairs(items: Iterable[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"{flag} {item!r}: write KEY=VALUE")
        if key in out:
            raise ValueError(f"{flag} names {key!r} twice; give it once")
        out[key] = value.strip()
    return out


def check_baselines(baselines: dict[str, str], cells: Iterable[dict[str, str]], path: Path) -> None:
    """``ValueError`` for a ``--baseline AXIS=VALUE`` that no cell takes, neither in this grid
    nor among the runs already in ``path`` (a grid may add runs to a file whose earlier cells
    hold its baseline): no gain would be computed against it."""
    known = list(cells)
    if path.is_file():
        known += [record["cell"] for record in read_results(path)["runs"].values()]
    for axis, value in baselines.items():
        values = sorted({cell[axis] for cell in known if axis in cell})
        where = f"this grid{' and the runs in ' + str(path) if path.is_file() else ''}"
        if not values:
            raise ValueError(
                f"--baseline {axis}={value}: no cell of {where} varies {axis!r}; name an axis "
                "of --grid"
            )
        if value not in values:
            raise ValueError(
                f"--baseline {axis}={value}: the cells of {where} take {axis} = "
                f"{', '.join(values)}; name one of them"
            )


def check_run_counts(seeds: Sequence[int], max_runs: int | None) -> None:
    """``ValueError`` for repeated seeds or a ``--max-runs`` below 1."""
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds repeats a seed: {list(seeds)}")
    if max_runs is not None and max_runs < 1:
        raise ValueError(f"--max-runs must be >= 1, got {max_runs}")


def check_runs(cells: Iterable[dict[str, str]], seed: int, settings: GridSettings) -> None:
    """Parse each cell's ``train/distill.py`` flags as its run will (recipe, ``--set``, the
    grid's values, the target's name, the loss, the kind), so that a bad value fails here,
    before the grid starts, not in every run after it has."""
    from draftsmith.train.config import parse_config
    from draftsmith.train.losses import build_loss
    from draftsmith.train.objectives import get_objective_class
    from draftsmith.train.target.model import resolve_target

    for cell in cells:
        try:
            argv = run_argv(cell, seed, settings, run_folder(settings.output, run_key(cell, seed)))
        except Skip:
            continue
        try:
            config = parse_config(argv)
            build_loss(config.loss.loss)
            get_objective_class(config.drafter.drafter_kind)
            resolve_target(config.target.target)
        except FileNotFoundError as error:
            raise FileNotFoundError(f"cell {cell_key(cell)}: {error}") from error
        except ValueError as error:
            raise ValueError(f"cell {cell_key(cell)}: {error}") from error


def cells_of(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    """The product of the axes, in the order given (the last axis varies fastest)."""
    return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]


def run_folder(output: Path, key: str) -> Path:
    """A file-system-safe folder per run: a readable slug plus a short hash of the key."""
    slug = re.sub(r"[^A-Za-z0-9._=-]+", "_", key.replace(",", "__"))[:80]
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    return output / "runs" / f"{slug}-{digest}"


def run_argv(
    cell: dict[str, str],
    seed: int,
    settings: GridSettings,
    run_dir: Path,
) -> list[str]:
    """The ``train/distill.py`` flags of one run; raises :class:`Skip` for impossible cells."""
    kind = cell.get("kind", "draft_lm")
    recipes = settings.recipes
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
    if settings.target is not None:
        argv += ["--target", settings.target]
    if settings.max_minutes is not None:
        argv += ["--max_minutes", str(settings.max_minutes)]
    if settings.max_steps is not None:
        argv += ["--max_steps", str(settings.max_steps)]
    # The run's own speed step times baselines the grid does not compare; tau is measured
    # by measure_tau on the exported drafter instead.
    argv += ["--speed_eval_prompts", "0"]
    for name, value in settings.overrides.items():
        argv += [f"--{name}", value]
    sources = cell.get("data", "corpus").split("+")
    # The data axis names the training text: a recipe's own train_source (e.g. the main job's
    # target samples) would otherwise replace the corpus and the regenerated file alike.
    # ``samples``: corpus prompts continued by the target as the recipe's --train_prompts,
    # --train_sequences and --train_temperatures say, regenerated at the start of each run.
    argv += ["--train_source", "target_samples" if "samples" in sources else "data"]
    if "samples" in sources and settings.samples_seed is not None:
        argv += ["--train_samples_seed", str(settings.samples_seed)]
    if "regenerated" in sources:
        argv += ["--dataset", str(settings.regenerated_file)]
    if "onpolicy" in sources:
        if kind not in ON_POLICY_KINDS:
            raise Skip(
                f"data=onpolicy: the {kind} objective does not sample on-policy continuations "
                f"(only {', '.join(ON_POLICY_KINDS)} does)"
            )
        _check_on_policy_loss(cell.get("loss"), recipe)
        argv += ["--on_policy_fraction", str(settings.on_policy_fraction)]
    else:
        argv += ["--on_policy_fraction", "0"]
    for axis, value in cell.items():
        if axis == "loss":
            argv += ["--loss", value]
        elif axis not in ("kind", "data"):
            argv += [f"--{axis}", value]
    return argv


def short_budget(measured: dict[str, Any], settings: GridSettings) -> str | None:
    """A warning when a run with a step cap stopped on a time box first: the recipe's own
    ``max_minutes`` still binds unless ``--max-minutes`` replaces it, and a slow or shared
    machine then gives the cells of one grid different budgets."""
    if settings.max_steps is None or measured.get("stop_reason") != "max_minutes":
        return None
    return (
        f"warning: stopped on its time box after {measured.get('steps')} of "
        f"{settings.max_steps} steps, so the grid's budgets differ; pass --max-minutes "
        "above any run's length to make the step cap the budget"
    )


def _check_on_policy_loss(loss: str | None, recipe: Path) -> None:
    """On-policy batches carry the drafter's own samples: hard labels there teach nothing."""
    from draftsmith.train.losses import build_loss  # torch: imported when first needed

    spec = loss if loss is not None else read_recipe(recipe).get("loss", "tv")
    if not build_loss(spec).needs_target:
        raise Skip(
            f"data=onpolicy with loss={spec}: on-policy batches are the drafter's own samples, "
            "and a loss without a target term would train it on its own guesses"
        )


def grid_target(settings: GridSettings, kinds: Iterable[str]) -> str:
    """The one target of the grid (``--target``, else the recipes' common one)."""
    if settings.target is not None:
        return settings.target
    targets = {read_recipe(settings.recipes[kind]).get("target", "demo") for kind in kinds}
    if len(targets) != 1:
        raise ValueError(
            f"the recipes of this grid name different targets {sorted(targets)}: pass --target"
        )
    return targets.pop()


# --------------------------------------------------------------------------- one run


def train_and_measure(
    argv: list[str], settings: GridSettings | None = None, drafter_dir: Path | None = None
) -> dict[str, Any]:
    """One run through ``draftsmith.train.distill.main``; its summary reduced to what the grid compares.

    With ``settings`` and ``drafter_dir`` tau comes from :func:`measure_tau` on the exported
    drafter; without, from the run's own speed step (``summary["speed"]``).
    """
    from draftsmith.train.distill import main as distill_main

    summary = distill_main(argv)
    held_out = summary["held_out"]
    if settings is not None and drafter_dir is not None:
        source = read_recipe(Path(argv[argv.index("--config") + 1])).get(
            "speed_eval_prompt_source", "demo"
        )
        speed = measure_tau(summary["target_path"], drafter_dir, source, settings)
    else:
        # The held-out prompts' rows are keyed by temperature ("0", "1"); other rows the speed
        # step may add (another prompt set, another drafter) are not this run's measurement.
        speed = {t: r for t, r in (summary.get("speed") or {}).items() if _is_number(t)}
    return {
        "overlap": _per_position(held_out, "overlap@"),
        "greedy_match": _per_position(held_out, "greedy_match@"),
        "held_out": held_out,
        "tau": {t: r["tau"] for t, r in speed.items()},
        "predicted_tau": {t: r["predicted_tau"] for t, r in speed.items()},
        "speedup": {t: r["speedup"] for t, r in speed.items() if "speedup" in r},
        **{key: {t: r[key] for t, r in speed.items() if key in r} for key in DECODE_MEASURES},
        "steps": summary["steps"],
        "stop_reason": summary["stop_reason"],
        "minutes": summary["minutes"],
        "tokens_seen": summary["tokens_seen"],
        "data": summary["data"],
        "eval_description": summary["eval_description"],
        "machine": summary["machine"],  # where it trained and decoded (its figures' context)
    }


def measure_tau(
    target_path: str | Path, drafter_dir: Path, prompt_source: str, settings: GridSettings
) -> dict[str, dict[str, float]]:
    """Tau and predicted tau of the exported drafter at each of ``settings.temperatures``,
    with the acceptance per draft position (``alpha``), a round's parts (``draft_ms_per_round``,
    what P-EAGLE's one pass and a DFlash block save over EAGLE-3's chain;
    ``verify_ms_per_round``, the target's pass over the round's w + 1 rows; ``plain_step_ms``,
    one plain target step, the unit of docs/theory.md §5's cost model) and tokens/s, the
    drafter's and draftsmith's plain decoding's (no drafter, the target's dtype) interleaved per
    prompt, with their ratio ``speedup_over_plain``. The target decodes in the dtype the
    main job's speed step chooses on this machine (``choose_dtype("auto")``: bfloat16 where the
    CPU has its kernels), recorded as ``dtype``.

    Chains of ``settings.num_draft_tokens`` for every chain kind and a DFlash block's whole
    B - 1 drafts (``round_drafts``), ``settings.tau_prompts`` held-out
    prompts of ``settings.tau_new_tokens`` tokens, the decoder seeded once per temperature.
    HF's ``generate`` is not timed (tau = tokens per target pass, docs/theory.md §5); compare
    speeds between cells run on the same machine under the same load only.
    """
    from draftsmith.decode.drafters.none import NoDrafter
    from draftsmith.decode.drafters.registry import load_drafter
    from draftsmith.decode.measure.evaluate import load_target
    from draftsmith.decode.measure.prompts import load_eval_prompts
    from draftsmith.decode.measure.side_by_side import (
        EvalSettings,
        encode_prompt,
        measure_side_by_side,
        speculative_method,
    )
    from draftsmith.decode.precision import choose_dtype

    dtype = choose_dtype("auto").name  # the main job's decoding dtype on this machine
    target, tokenizer = load_target(str(target_path), dtype=dtype)
    drafter = load_drafter(drafter_dir, target)
    prompts = [
        encode_prompt(tokenizer, p) for p in load_eval_prompts(prompt_source, settings.tau_prompts)
    ]
    drafts = round_drafts(drafter, settings.num_draft_tokens)
    out: dict[str, dict[str, float]] = {}
    for temperature in settings.temperatures:
        decode_settings = EvalSettings(
            num_draft_tokens=drafts,
            max_new_tokens=settings.tau_new_tokens,
            temperature=temperature,
        )
        methods = {
            "drafter": speculative_method(target, drafter, decode_settings),
            "plain": speculative_method(target, NoDrafter(drafter.vocab_size), decode_settings),
        }
        result = measure_side_by_side(target, methods, prompts, warmup=False)
        stats, plain = result["drafter"].stats, result["plain"].stats
        out[f"{temperature:g}"] = {
            "tau": stats.tau,
            "predicted_tau": stats.predicted_tau,
            "alpha": stats.alpha_per_position,
            "draft_ms_per_round": stats.draft_ms_per_round,
            "verify_ms_per_round": stats.verify_ms_per_pass,
            "plain_step_ms": plain.verify_ms_per_pass,
            "tokens_per_s": result["drafter"].tokens_per_s,
            "plain_tokens_per_s": result["plain"].tokens_per_s,
            "speedup_over_plain": result["drafter"].tokens_per_s / result["plain"].tokens_per_s,
            "num_draft_tokens": drafts,
            "dtype": dtype,
        }
    return out


def round_drafts(drafter, chain: int) -> int:
    """Drafts per round a grid's run is measured with: a DFlash block verifies its whole
    block (B - 1, so that a grid over ``dflash_block_size`` compares blocks, as the benchmark's
    default does), every other kind a chain of ``chain``."""
    return drafter.max_draft_tokens if drafter.kind == "dflash" else chain


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _per_position(held_out: dict[str, float], prefix: str) -> list[float]:
    keys = [k for k in held_out if k.startswith(prefix) and k[len(prefix) :].isdigit()]
    return [held_out[k] for k in sorted(keys, key=lambda k: int(k[len(prefix) :]))]


def remeasure_tau(path: Path, prompts: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure tau again for every run in ``path`` with ``prompts`` held-out prompts, kept
    beside the grid's own as ``tau_check`` (same tokens per prompt, temperatures and chains).

    The grid's tau comes from few prompts to keep runs short, and every run decodes the same
    ones, so a prompt that suits one loss biases all its seeds alike; more prompts after the
    fact show whether a difference is the drafter's. Resumes: runs already measured with
    ``prompts`` are skipped, and the file is rewritten after each run.
    """
    if prompts < 1:
        raise ValueError(f"--remeasure-tau must be >= 1, got {prompts}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; run the grid first (or pass its --output)")
    results = read_results(path)
    grid = results["settings"]
    settings = GridSettings(
        output=path.parent,
        recipes={},
        tau_prompts=prompts,
        tau_new_tokens=grid["tau_new_tokens"],
        temperatures=tuple(grid["temperatures"]),
        num_draft_tokens=grid["num_draft_tokens"],
    )
    for key, record in results["runs"].items():
        if record.get("tau_check", {}).get("prompts") == prompts:
            continue
        run_dir = Path(record["run_dir"])
        summary_file = run_dir / "summary.json"
        if not summary_file.is_file() or not (run_dir / "drafter").is_dir():
            raise FileNotFoundError(
                f"run {key}: {run_dir} lacks summary.json or drafter/ (moved or deleted?)"
            )
        from draftsmith.decode.loading import read_json_object

        summary = read_json_object(summary_file, f"run {key} again (delete {run_dir})")
        recipe = Path(record["argv"][record["argv"].index("--config") + 1])
        source = read_recipe(recipe).get("speed_eval_prompt_source", "demo")
        log(f"[ablate] tau with {prompts} prompts: {key}")
        measured = measure_tau(summary["target_path"], run_dir / "drafter", source, settings)
        record["tau_check"] = {
            "prompts": prompts,
            "tau": {t: r["tau"] for t, r in measured.items()},
            "machine": machine_record(),
        }
        save_results(
            path,
            results,
            results.get("baselines", {}),
            results.get("skipped", {}),
            results.get("failed", {}),
        )
    return {**results, "path": str(path)}


# --------------------------------------------------------------------------- the grid runner


def needs_regenerated(cells: Iterable[dict[str, str]]) -> bool:
    return any("regenerated" in cell.get("data", "").split("+") for cell in cells)


def run_grid(
    grid: dict[str, list[str]],
    seeds: Sequence[int],
    settings: GridSettings,
    baselines: dict[str, str] | None = None,
    max_runs: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run (or continue) the grid; return the results written to ``<output>/ablation.json``.

    Seeds are the outer loop, so a partial grid has whole seeds to compare. ``max_runs``
    stops after that many new runs (``results["stopped"]``). A run that raises is logged and
    left out of ``runs`` (``results["failed"]``), so the next call retries it.
    """
    check_run_counts(seeds, max_runs)
    cells = cells_of(grid)
    if needs_regenerated(cells) and not settings.regenerated_file.is_file():
        raise FileNotFoundError(
            f"data=regenerated needs {settings.regenerated_file}: write it with "
            "scripts/regenerate_data.py (scripts/ablate.py does so once per grid)"
        )
    baselines = default_baselines(grid) if baselines is None else baselines
    path = settings.output / RESULTS_FILE
    results = load_results(path, settings.fingerprint())
    runs: dict[str, dict[str, Any]] = results["runs"]
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    new_runs = 0
    stopped = False
    total = len(cells) * len(seeds)
    position = 0  # this grid's run being started, among its cells x seeds
    for seed in seeds:
        for cell in cells:
            position += 1
            key = run_key(cell, seed)
            run_dir = run_folder(settings.output, key)
            try:
                run_args = run_argv(cell, seed, settings, run_dir)
            except Skip as reason:
                skipped[cell_key(cell)] = str(reason)
                continue
            if key in runs:
                log(f"[ablate] {key}: done already, skipped")
                continue
            if max_runs is not None and new_runs >= max_runs:
                stopped = True
                break
            log(f"[ablate] run {position}/{total}: {key}")
            start = time.perf_counter()
            try:
                measured = train_and_measure(run_args, settings, run_dir / "drafter")
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
            if budget_note := short_budget(measured, settings):
                log(f"[ablate] {key}: {budget_note}")
            save_results(path, results, baselines, skipped, failed)
        if stopped:
            break
    save_results(path, results, baselines, skipped, failed)
    return {**results, "stopped": stopped, "new_runs": new_runs, "path": str(path)}
