"""Benchmark draftsmith against the Hugging Face methods on one target, in one run.

    python scripts/benchmark.py --target PATH [--draft-lm DIR] [--eagle3 DIR] [--medusa DIR]
        [--peagle DIR] --json OUT --plots DIR

On the same prompts, interleaved per prompt: plain decoding (HF ``generate``), HF assisted
generation with the same draft LM, HF prompt lookup, draftsmith's own plain decoding (the
control: our decoder with no drafter), and draftsmith with the n-gram drafter, the draft LM
(chain, with N fixed and with the adaptive length), EAGLE-3 (chain and dynamic tree), P-EAGLE
(a chain drafted in one pass), Medusa (static tree) and the hybrids of prompt lookup with each
network, each tree also adaptive (every round's shape chosen by ``draftsmith.decode.trees.policy``), at
each temperature. Adaptive rows pick each round's length in 0..``--adaptive-draft-tokens``
(room above the fixed N, which prices the fixed rows).
With ``--vllm`` (and ``--vllm-head``), vLLM's plain decoding and the same exported head run on
the same prompts at batch 1 (``draftsmith.scripts.engine_rows``).
Reports tokens/s, speedup over plain, tau, predicted tau, acceptance per position, held-out
overlap per position (from each drafter folder's ``eval_results.json``), and the peak resident
memory of each method (Linux: the process's high-water mark, reset before each call; on a GPU,
the CUDA allocator's peak). Plots: acceptance by position, speedup per method, and speedup
against num_draft_tokens.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch
from draftsmith.data.atomic_io import write_json_atomic
from draftsmith.decode.defaults import ADAPTIVE_DRAFT_TOKENS, LOOKUP_DRAFT_TOKENS, NUM_DRAFT_TOKENS
from draftsmith.decode.draft_length import adaptive_draft_bound
from draftsmith.decode.drafters.hybrid import HybridDrafter
from draftsmith.decode.drafters.registry import load_drafter
from draftsmith.decode.loading import check_device
from draftsmith.decode.measure.evaluate import load_targets_for
from draftsmith.decode.measure.machine import describe_machine, machine_record
from draftsmith.decode.measure.plots import (
    plot_acceptance_by_position,
    plot_speedup_against_draft_length,
    plot_speedups,
)
from draftsmith.decode.measure.prompts import (
    add_system_prompt_argument,
    drafters_system_prompt,
    load_eval_prompts,
)
from draftsmith.decode.measure.side_by_side import (
    UNREPRODUCED_TIMING,
    EvalSettings,
    Method,
    MethodResult,
    add_repeats_argument,
    add_tree_arguments,
    at_least_one,
    check_context,
    encode_prompt,
    hf_peer,
    measure_side_by_side,
    plain_method,
    speculative_method,
    temperature_value,
    tree_from_arguments,
)
from draftsmith.decode.precision import add_dtype_argument
from draftsmith.scripts.engine_rows import (
    add_engine_arguments,
    engine_problem,
    engine_summary,
    format_engine_summary,
    measure_engine_rows,
    wants_engine,
)

# Plain decoding through our own decoder (no drafter): the control that separates what the
# decoder's forward adds from what drafting adds.
CONTROL = "draftsmith plain (no drafter)"
PLAIN_ROW = "draftsmith plain, "  # + a dtype: the control in another dtype
HYBRID = "draftsmith hybrid: lookup"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: draftsmith-benchmark --target DIR --eagle3 DIR --json b.json --plots out",
    )
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft-lm", default=None, help="draft_lm drafter folder")
    parser.add_argument(
        "--draft-lm-pruned", default=None, help="draft_lm folder with a pruned output vocabulary"
    )
    parser.add_argument("--eagle3", default=None, help="EAGLE-3 drafter folder")
    parser.add_argument("--medusa", default=None, help="Medusa drafter folder")
    parser.add_argument("--peagle", default=None, help="P-EAGLE drafter folder")
    parser.add_argument("--dflash", default=None, help="DFlash (or DSpark) block drafter folder")
    parser.add_argument(
        "--dflash-draft-tokens",
        type=at_least_one,
        default=None,
        help="drafts a DFlash round verifies (default: the block's B - 1)",
    )
    parser.add_argument(
        "--prompts",
        nargs="+",
        default=["demo", "ood"],
        help="prompt sets, each measured in turn ('demo' held-out, 'ood' unseen code, files); "
        "the first is the headline",
    )
    add_system_prompt_argument(parser, "the one the drafters were trained with, if any")
    parser.add_argument("--num-prompts", type=int, default=6)
    add_repeats_argument(parser)
    parser.add_argument("--max-new-tokens", type=at_least_one, default=128)
    parser.add_argument("--num-draft-tokens", type=at_least_one, default=NUM_DRAFT_TOKENS)
    parser.add_argument(
        "--adaptive-draft-tokens",
        type=at_least_one,
        default=ADAPTIVE_DRAFT_TOKENS,
        help="the most drafts a round of the adaptive rows may take (chain length, or the "
        f"adaptive trees' depth; default {ADAPTIVE_DRAFT_TOKENS}, at least --num-draft-tokens)",
    )
    parser.add_argument("--temperatures", type=temperature_value, nargs="+", default=[0.0, 1.0])
    add_tree_arguments(parser)
    parser.add_argument(
        "--no-adaptive-tree",
        dest="adaptive_tree",
        action="store_false",
        help="skip the adaptive tree rows (each round's shape, a plain step, a chain or a tree "
        "up to --tree-top-k x --tree-total-tokens, chosen by draftsmith.decode.trees.policy)",
    )
    parser.add_argument(
        "--sweep",
        type=at_least_one,
        nargs="*",
        default=[1, 2, 3, 4, 6],
        help="num_draft_tokens values for the speedup-vs-N plot (temperature 0)",
    )
    parser.add_argument(
        "--lookup-tokens",
        type=at_least_one,
        default=LOOKUP_DRAFT_TOKENS,
        help="tokens a prompt-lookup round copies: the n-gram rows and the hybrids' rounds that "
        f"run no network (default {LOOKUP_DRAFT_TOKENS}, at least --num-draft-tokens)",
    )
    parser.add_argument(
        "--model-forward",
        action="store_true",
        help="verify with the target's own forward instead of the lean CPU forward (ablation)",
    )
    parser.add_argument("--threads", type=int, default=None, help="default: every core")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_dtype_argument(parser)
    parser.add_argument(
        "--plain-also",
        default="float32",
        help="comma-separated dtypes in which draftsmith's plain decoding runs too: every "
        "speedup is also stated over the fastest plain decoding ('' for none)",
    )
    add_engine_arguments(parser)
    parser.add_argument("--json", required=True)
    parser.add_argument("--plots", required=True)
    args = parser.parse_args(argv)
    problem = flags_problem(args) or engine_problem(args)
    if problem:
        parser.error(problem)
    args.adaptive_draft_tokens = adaptive_draft_bound(
        args.num_draft_tokens, args.adaptive_draft_tokens
    )
    return args


def flags_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``args`` before anything loads: a count below 1, a value given twice
    (its rows and plots would overwrite each other's), a bad tree shape."""
    if args.num_prompts < 1:  # a negative count would slice prompts off the end
        return f"--num-prompts must be >= 1, got {args.num_prompts}"
    for flag, values in (
        ("--prompts", args.prompts),
        ("--temperatures", [f"{t:g}" for t in args.temperatures]),
        ("--sweep", args.sweep),
    ):
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        if twice:
            return f"{flag} names {', '.join(twice)} more than once; give each value once"
    stems = [Path(source).stem for source in args.prompts]
    clash = sorted({stem for stem in stems if stems.count(stem) > 1})
    if clash:
        return (
            f"--prompts: several files are named {', '.join(clash)} (their plots would share a "
            "name); rename one of them"
        )
    try:
        tree_from_arguments(args)
    except ValueError as error:
        return str(error)
    return None


class PeakMemory:
    """Peak memory of the process while a method runs (reset before each call)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._proc = Path("/proc/self/clear_refs")
        self._baseline_mb: float | None = None

    def reset(self) -> None:
        """Start a new measurement from what is held now (the loaded models)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline_mb = torch.cuda.memory_allocated(self.device) / 2**20
        elif self._proc.exists():
            self._proc.write_text("5")  # resets VmHWM, the resident high-water mark
            self._baseline_mb = _proc_status_mb("VmRSS")

    def read_mb(self) -> tuple[float, float] | None:
        """``(peak, peak minus what was held at reset)`` in MiB, or None where unmeasurable."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            peak = _proc_status_mb("VmHWM")
        if peak is None or self._baseline_mb is None:
            return None
        return peak, peak - self._baseline_mb


def _proc_status_mb(field: str) -> float | None:
    """A memory field of /proc/self/status (Linux), in MiB."""
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return None


def with_peak_memory(method: Method, meter: PeakMemory, peaks: dict[str, tuple], name: str):
    """Record, over the method's calls, the largest (peak, peak above the models) in MiB."""

    def run(ids: torch.Tensor, index: int):
        meter.reset()
        out = method(ids, index)
        reading = meter.read_mb()
        if reading is not None:
            old = peaks.get(name, reading)
            peaks[name] = (max(old[0], reading[0]), max(old[1], reading[1]))
        return out

    return run


def held_out_overlap(folder: str | None) -> list[float] | None:
    """Training's held-out overlap per draft position, if the drafter folder recorded it."""
    path = Path(folder) / "eval_results.json" if folder is not None else None
    if path is None or not path.is_file():
        return None
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(
            f"{path} is not UTF-8 JSON ({error}); delete it or rewrite it with train/distill.py"
        ) from None
    if not isinstance(results, dict):
        results = {}
    keys = sorted(
        (k for k in results if k.startswith("overlap@") and k[8:].isdigit()),
        key=lambda k: int(k[8:]),
    )
    return [results[k] for k in keys] or None


def build_methods(
    args, target, drafters, settings: EvalSettings, meter, peaks, hybrids, plain_copies
):
    """Every method of one temperature; the hybrid drafters built here land in ``hybrids``."""
    tree = tree_from_arguments(args)
    methods: dict[str, Method] = {"plain (HF generate)": plain_method(target, settings)}
    if "draft_lm" in drafters:
        _, kwargs = hf_peer(drafters["draft_lm"], settings)
        methods["HF assisted (draft LM)"] = plain_method(target, settings, **kwargs)
    # Prompt lookup copies as many tokens as the hybrid's lookup rounds (a copy costs no
    # drafting, so N does not price it), ours and Hugging Face's alike.
    lookup = replace(settings, num_draft_tokens=max(settings.num_draft_tokens, args.lookup_tokens))
    _, kwargs = hf_peer(drafters["ngram"], lookup)
    methods["HF prompt lookup"] = plain_method(target, lookup, **kwargs)
    # The adaptive rows pick each round's length (or shape) with room above the fixed N.
    adaptive = replace(settings, adaptive=True, num_draft_tokens=args.adaptive_draft_tokens)
    methods[CONTROL] = speculative_method(target, drafters["none"], settings)
    for name, copy in plain_copies.items():
        methods[f"{PLAIN_ROW}{name}"] = speculative_method(copy, drafters["none"], settings)
    methods["draftsmith n-gram"] = speculative_method(target, drafters["ngram"], lookup)
    if "draft_lm" in drafters:
        methods["draftsmith draft LM"] = speculative_method(target, drafters["draft_lm"], settings)
        methods["draftsmith draft LM (adaptive N)"] = speculative_method(
            target, drafters["draft_lm"], adaptive
        )
    if "draft_lm_pruned" in drafters:
        methods["draftsmith draft LM, pruned vocabulary"] = speculative_method(
            target, drafters["draft_lm_pruned"], settings
        )
    if "eagle3" in drafters:
        methods["draftsmith EAGLE-3 chain"] = speculative_method(
            target, drafters["eagle3"], settings
        )
        methods["draftsmith EAGLE-3 chain (adaptive N)"] = speculative_method(
            target, drafters["eagle3"], adaptive
        )
    if "peagle" in drafters:  # the whole chain in one pass of the head
        methods["draftsmith P-EAGLE chain"] = speculative_method(
            target, drafters["peagle"], settings
        )
    if "dflash" in drafters:  # a whole block in one pass of the drafter
        block = replace(settings, num_draft_tokens=block_draft_tokens(args, drafters["dflash"]))
        methods["draftsmith DFlash block"] = speculative_method(target, drafters["dflash"], block)
        methods["draftsmith DFlash block (adaptive N)"] = speculative_method(
            target, drafters["dflash"], replace(block, adaptive=True)
        )
        name = f"{HYBRID} + DFlash"
        hybrids[name] = HybridDrafter(drafters["dflash"], lookup_tokens=args.lookup_tokens)
        methods[name] = speculative_method(target, hybrids[name], block)
    for kind, label in (("draft_lm", "draft LM"), ("eagle3", "EAGLE-3"), ("peagle", "P-EAGLE")):
        if kind in drafters:
            name = f"{HYBRID} + {label}"
            hybrids[name] = HybridDrafter(drafters[kind], lookup_tokens=args.lookup_tokens)
            methods[name] = speculative_method(target, hybrids[name], settings)
    if "eagle3" in drafters:  # the same hybrid with each round's length chosen
        name = f"{HYBRID} + EAGLE-3 (adaptive N)"
        hybrids[name] = HybridDrafter(drafters["eagle3"], lookup_tokens=args.lookup_tokens)
        methods[name] = speculative_method(target, hybrids[name], adaptive)
    for kind, label in (
        ("eagle3", "draftsmith EAGLE-3 tree"),
        ("medusa", "draftsmith Medusa tree"),
    ):
        if kind in drafters:
            tree_settings = replace(settings, tree=tree)
            if kind == "eagle3" and settings.temperature > 0:
                label += " (sampled)"  # root children drawn from q, each continued as a chain
            methods[label] = speculative_method(target, drafters[kind], tree_settings)
            if args.adaptive_tree:  # each round's shape: plain step, chain or tree
                methods[f"{label} (adaptive)"] = speculative_method(
                    target, drafters[kind], replace(adaptive, tree=tree)
                )
    return {name: with_peak_memory(m, meter, peaks, name) for name, m in methods.items()}


def block_draft_tokens(args, drafter) -> int:
    """The drafts a DFlash round verifies: ``--dflash-draft-tokens``, at most the block's
    B - 1 (its default)."""
    most = drafter.max_draft_tokens
    wanted = args.dflash_draft_tokens or most
    if wanted > most:
        raise ValueError(
            f"--dflash-draft-tokens {wanted}: the block drafts at most {most}; pass <= {most}"
        )
    return wanted


def summarise(
    results: dict[str, MethodResult],
    peaks: dict[str, tuple],
    overlaps,
    usage: dict[str, dict],
    flop_shares: dict[str, float] | None = None,
) -> list[dict]:
    plain = results["plain (HF generate)"]
    control = results[CONTROL]
    fastest_plain = max(
        r.tokens_per_s
        for name, r in results.items()
        if name == CONTROL or name.startswith(PLAIN_ROW)
    )
    target_step_ms = control.stats.verify_ms_per_pass
    rows = []
    for name, result in results.items():
        stats = result.stats
        draft_step_ms = (
            1000 * stats.draft_seconds / stats.draft_positions
            if stats and stats.draft_positions
            else None
        )
        rows.append(
            {
                "method": name,
                "tokens_per_s": result.tokens_per_s,
                "speedup": result.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0,
                "speedup_over_draftsmith_plain": result.tokens_per_s / control.tokens_per_s,
                "speedup_over_fastest_plain": result.tokens_per_s / fastest_plain,
                "gpu_projected_speedup": gpu_projection(name, stats, flop_shares or {}),
                "distinct_4gram_share": result.distinct_4gram_share,
                "draft_step_ms": draft_step_ms,
                "verify_pass_ms": stats.verify_ms_per_pass if stats else None,
                "target_step_ms": target_step_ms,
                "draft_cost_ratio": draft_step_ms / target_step_ms if draft_step_ms else None,
                "drafter_usage": usage.get(name),
                "tau": stats.tau if stats else result.tokens_per_pass,
                "predicted_tau": stats.predicted_tau if stats else None,
                "alpha_per_position": stats.alpha_per_position if stats else None,
                "held_out_overlap": overlaps.get(name),
                "peak_memory_mb": peaks.get(name, (None, None))[0],
                "extra_memory_mb": peaks.get(name, (None, None))[1],
                "unreproduced_repeats": result.unreproduced,
                "greedy_equal_to_plain": sum(
                    int(torch.equal(a, b))
                    for a, b in zip(result.outputs, plain.outputs, strict=True)
                ),
            }
        )
    return rows


# Row name fragments -> the drafter whose cost a row's draft passes carry (longest first).
ROW_DRAFTERS = (
    ("draft LM, pruned", "draft_lm_pruned"),
    ("P-EAGLE", "peagle"),
    ("DFlash", "dflash"),
    ("EAGLE-3", "eagle3"),
    ("draft LM", "draft_lm"),
    ("Medusa", "medusa"),
)


def matmul_params(module: torch.nn.Module, input_embedding: torch.Tensor | None = None) -> int:
    """Weights a forward multiplies by (2-D parameters), an untied input embedding left out:
    the FLOPs of one token through ``module`` are twice this."""
    total = sum(p.numel() for p in module.parameters() if p.ndim == 2)
    shared = input_embedding is not None and any(
        p is input_embedding for p in module.parameters() if p is not input_embedding
    )
    return total - (input_embedding.numel() if input_embedding is not None and not shared else 0)


def flop_shares(target: torch.nn.Module, drafters: dict) -> dict[str, float]:
    """Each trained drafter's FLOPs per drafted token as a share of one target token's."""
    embedding = target.get_input_embeddings().weight
    tied = embedding is target.get_output_embeddings().weight
    target_flops = matmul_params(target, None if tied else embedding)
    shares = {}
    for kind, drafter in drafters.items():
        module = next(
            (getattr(drafter, a) for a in ("head", "heads", "model") if hasattr(drafter, a)), None
        )
        if isinstance(module, torch.nn.Module):
            own = getattr(module, "get_input_embeddings", lambda: None)()
            shares[kind] = matmul_params(module, None if own is None else own.weight) / target_flops
    return shares


def gpu_projection(name: str, stats, shares: dict[str, float]) -> float | None:
    """A projection, not a measurement: the row's measured tau under a GPU cost profile where a
    verify pass over <= 64 tokens costs one target step and a draft pass costs the drafter's
    FLOP share of a step (docs/theory.md §5): ``tau / (1 + passes per round * share)``. A
    P-EAGLE or DFlash round is one pass; other drafters pass once per drafted position (a tree
    level)."""
    if stats is None or not name.startswith("draftsmith") or not stats.target_forward_passes:
        return None
    kind = next((k for fragment, k in ROW_DRAFTERS if fragment in name), None)
    share = shares.get(kind, 0.0) if kind else 0.0
    passes = stats.draft_positions / stats.target_forward_passes
    if kind in ("peagle", "dflash"):  # one pass per round
        passes = min(passes, 1.0)
    return stats.tau / (1.0 + passes * share)


def format_rows(rows: list[dict], temperature: float, best: dict) -> str:
    lines = [
        f"temperature {temperature:g} (vs HF: over HF generate; vs ours: over draftsmith plain "
        "in the run's dtype; vs fastest: over draftsmith's fastest plain decoding in any dtype; "
        "GPU proj.: a projection from the measured tau, not a measurement; 4-grams: distinct "
        "share of the output)",
        f"{'method':<40}{'tok/s':>8}{'vs HF':>8}{'vs ours':>8}{'vs fastest':>11}{'tau':>6}"
        f"{'pred':>6}{'draft/tgt':>10}{'GPU proj.':>10}{'4-grams':>8}{'peak MB':>9}{'+MB':>6}",
    ]
    for row in rows:
        predicted = f"{row['predicted_tau']:.2f}" if row["predicted_tau"] else "-"
        peak = f"{row['peak_memory_mb']:.0f}" if row["peak_memory_mb"] else "-"
        extra = f"{row['extra_memory_mb']:.1f}" if row["extra_memory_mb"] is not None else "-"
        cost = f"{row['draft_cost_ratio']:.2f}" if row["draft_cost_ratio"] else "-"
        gpu = row.get("gpu_projected_speedup")
        gpu_text = f"{gpu:.2f}x" if gpu else "-"
        lines.append(
            f"{row['method']:<40}{row['tokens_per_s']:>8.1f}{row['speedup']:>7.2f}x"
            f"{row['speedup_over_draftsmith_plain']:>7.2f}x"
            f"{row.get('speedup_over_fastest_plain', 0.0):>10.2f}x{row['tau']:>6.2f}{predicted:>6}"
            f"{cost:>10}{gpu_text:>10}{row.get('distinct_4gram_share', 1.0):>8.2f}{peak:>9}"
            f"{extra:>6}"
        )
        if row["drafter_usage"]:
            usage = row["drafter_usage"]
            lines.append(
                f"{'':<4}row-rounds: lookup {usage['lookup_rows']} (mean accepted "
                f"{usage['lookup_mean_accepted']:.2f}), learned drafter {usage['learned_rows']} "
                f"(mean accepted {usage['learned_mean_accepted']:.2f}), plain steps "
                f"{usage['plain_rows']}"
            )
    lines.append(
        f"best draftsmith ({best['draftsmith']}) / best HF ({best['hf']}): {best['ratio']:.2f}x;"
        f" / draftsmith plain: {best['over_draftsmith_plain']:.2f}x"
    )
    if best.get("trained"):
        lines.append(
            f"best trained drafter ({best['trained']}) / draftsmith plain: "
            f"{best['trained_over_draftsmith_plain']:.2f}x"
        )
    return "\n".join(lines)


def best_against_hf(rows: list[dict]) -> dict:
    """The fastest draftsmith drafting method against the fastest Hugging Face one (plain
    included), and against draftsmith's own fastest plain decoding in any dtype (what drafting
    alone adds)."""
    plain = [r for r in rows if r["method"] == CONTROL or r["method"].startswith(PLAIN_ROW)]
    drafting = [r for r in rows if r["method"].startswith("draftsmith") and r not in plain]
    ours = max(drafting, key=_speed)
    theirs = max((r for r in rows if not r["method"].startswith("draftsmith")), key=_speed)
    control = max(plain, key=_speed)
    ngram = next(r for r in rows if r["method"] == "draftsmith n-gram")
    # Trained drafters; a hybrid counts only where it beats prompt lookup alone.
    trained = [
        r
        for r in drafting
        if r["method"] not in (CONTROL, "draftsmith n-gram")
        and (not r["method"].startswith(HYBRID) or _speed(r) > _speed(ngram))
    ]
    best_trained = max(trained, key=_speed) if trained else None
    return {
        "draftsmith": ours["method"],
        "hf": theirs["method"],
        "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "fastest_plain": control["method"],
        "over_draftsmith_plain": ours["tokens_per_s"] / control["tokens_per_s"],
        "trained": best_trained["method"] if best_trained else None,
        "trained_over_draftsmith_plain": best_trained["tokens_per_s"] / control["tokens_per_s"]
        if best_trained
        else None,
    }


def _speed(row: dict) -> float:
    return row["tokens_per_s"]


def main(argv: list[str] | None = None) -> dict:
    from draftsmith.decode.command_line import check_output_file, check_output_folder

    args = parse_args(argv)
    check_device(args.device)
    check_output_file(args.json, "--json")
    check_output_folder(args.plots, "--plots")
    folders = {
        "draft_lm": args.draft_lm,
        "draft_lm_pruned": args.draft_lm_pruned,
        "eagle3": args.eagle3,
        "medusa": args.medusa,
        "peagle": args.peagle,
        "dflash": args.dflash,
    }
    system_prompt = drafters_system_prompt(args.system_prompt, [f for f in folders.values() if f])
    texts = {
        source: load_eval_prompts(source, args.num_prompts, system_prompt)
        for source in args.prompts
    }
    choice, target, tokenizer, plain_copies = load_targets_for(args)
    drafters = {kind: load_drafter(None, target, kind=kind) for kind in ("none", "ngram")}
    for kind, folder in folders.items():
        if folder:
            drafters[kind] = load_drafter(folder, target, kind=kind.removesuffix("_pruned"))
    shares = flop_shares(target, drafters)
    overlaps = {
        "draftsmith draft LM": held_out_overlap(args.draft_lm),
        "draftsmith draft LM (adaptive N)": held_out_overlap(args.draft_lm),
        "draftsmith draft LM, pruned vocabulary": held_out_overlap(args.draft_lm_pruned),
        "draftsmith EAGLE-3 chain": held_out_overlap(args.eagle3),
        "draftsmith EAGLE-3 tree": held_out_overlap(args.eagle3),
        "draftsmith EAGLE-3 tree (adaptive)": held_out_overlap(args.eagle3),
        "draftsmith Medusa tree": held_out_overlap(args.medusa),
        "draftsmith Medusa tree (adaptive)": held_out_overlap(args.medusa),
        "draftsmith P-EAGLE chain": held_out_overlap(args.peagle),
        "draftsmith DFlash block": held_out_overlap(args.dflash),
        "draftsmith DFlash block (adaptive N)": held_out_overlap(args.dflash),
    }
    prompt_sets = {
        source: [encode_prompt(tokenizer, p) for p in prompts] for source, prompts in texts.items()
    }
    for encoded in prompt_sets.values():
        check_context(target, encoded, args.max_new_tokens)
    headline = args.prompts[0]
    prompts = prompt_sets[headline]
    meter = PeakMemory(torch.device(args.device))
    report: dict = {
        "target": args.target,
        **choice.record(),
        "machine": machine_record(args.device),
        "system_prompt": system_prompt,
        "plain_also": list(plain_copies),
        "num_prompts": len(prompts),
        "repeats": args.repeats,
        "unreproduced_timing": UNREPRODUCED_TIMING,
        "max_new_tokens": args.max_new_tokens,
        "num_draft_tokens": args.num_draft_tokens,
        "adaptive_draft_tokens": args.adaptive_draft_tokens,
        "lookup_tokens": max(args.num_draft_tokens, args.lookup_tokens),
        "tree": {
            "top_k": args.tree_top_k,
            "total_tokens": args.tree_total_tokens,
            "frontier": args.tree_frontier,
        },
        "drafter_flop_share": shares,
        "gpu_profile": "verify of <= 64 tokens = one target step; a draft pass = the drafter's "
        "FLOP share of a step (a projection from measured tau, not a measurement)",
        "prompt_sets": {},
    }
    print(f"machine: {describe_machine(report['machine'])}", flush=True)
    plots = Path(args.plots)
    for source, encoded in prompt_sets.items():
        measured = report["prompt_sets"].setdefault(
            source, {"by_temperature": {}, "best_against_hf": {}}
        )
        engine = measure_engine_rows(args, choice.name, encoded) if wants_engine(args) else None
        for temperature in args.temperatures:
            settings = EvalSettings(
                num_draft_tokens=args.num_draft_tokens,
                max_new_tokens=args.max_new_tokens,
                temperature=temperature,
                lean_target=not args.model_forward,
                repeats=args.repeats,
            )
            peaks: dict[str, float] = {}
            hybrids: dict[str, HybridDrafter] = {}  # fresh per run: usage counts restart
            methods = build_methods(
                args, target, drafters, settings, meter, peaks, hybrids, plain_copies
            )
            results = measure_side_by_side(target, methods, encoded, repeats=settings.repeats)
            usage = {name: hybrid.usage() for name, hybrid in hybrids.items()}
            rows = summarise(results, peaks, overlaps, usage, shares)
            best = best_against_hf(rows)
            measured["by_temperature"][f"{temperature:g}"] = rows
            measured["best_against_hf"][f"{temperature:g}"] = best
            print(f"prompts: {source}")
            print(format_rows(rows, temperature, best), flush=True)
            if engine is not None:
                control = results[CONTROL]
                plain_outputs = [
                    sequence[0, length:].tolist()
                    for sequence, length in zip(
                        control.outputs, control.prompt_lengths, strict=True
                    )
                ]
                summary = engine_summary(engine, temperature, rows, plain_outputs)
                measured.setdefault("engine", {})[f"{temperature:g}"] = summary
                print(format_engine_summary(summary, temperature), flush=True)
            suffix = f"t{temperature:g}" + ("" if source == headline else f"_{Path(source).stem}")
            plot_acceptance_by_position(
                {r["method"]: r["alpha_per_position"] for r in rows if r["alpha_per_position"]},
                plots / f"acceptance_{suffix}.png",
                f"Acceptance by position ({source}, temperature {temperature:g})",
            )
            plot_speedups(
                {r["method"]: r["speedup_over_fastest_plain"] for r in rows},
                plots / f"speedup_{suffix}.png",
                f"Speedup over the fastest draftsmith plain decoding ({source}, T={temperature:g})",
            )
    # The headline set keeps the report's long-standing keys.
    report["by_temperature"] = report["prompt_sets"][headline]["by_temperature"]
    report["best_against_hf"] = report["prompt_sets"][headline]["best_against_hf"]
    if args.sweep:
        report["sweep"] = sweep_draft_length(args, target, drafters, prompts)
        plot_speedup_against_draft_length(report["sweep"], plots / "speedup_vs_draft_length.png")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, report)
    print(f"wrote {path} and plots under {plots}")
    return report


def sweep_draft_length(args, target, drafters, prompts) -> dict[str, dict[int, float]]:
    """Speedup against num_draft_tokens at temperature 0 for each draftsmith drafter."""
    tree = tree_from_arguments(args)
    curves: dict[str, dict[int, float]] = {}
    for length in args.sweep:
        settings = EvalSettings(
            num_draft_tokens=length,
            max_new_tokens=args.max_new_tokens,
            lean_target=not args.model_forward,
            repeats=args.repeats,
        )
        methods: dict[str, Method] = {"plain": plain_method(target, settings)}
        for kind, drafter in drafters.items():
            most = drafter.max_draft_tokens  # Medusa's heads, a DFlash block's B - 1
            if kind == "none" or (most is not None and length > most):
                continue
            shaped = settings
            if kind in ("eagle3", "medusa"):
                shaped = replace(settings, tree=tree)
            methods[kind] = speculative_method(target, drafter, shaped)
        results = measure_side_by_side(
            target, methods, prompts[: max(2, len(prompts) // 2)], repeats=settings.repeats
        )
        plain = results.pop("plain").tokens_per_s
        for kind, result in results.items():
            curves.setdefault(kind, {})[length] = result.tokens_per_s / plain
        print(
            f"N={length}: " + ", ".join(f"{k} {v[length]:.2f}x" for k, v in curves.items()),
            flush=True,
        )
    return curves


if __name__ == "__main__":
    from draftsmith.decode.command_line import run_command

    run_command(main)
