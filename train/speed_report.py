"""After training: measure the exported drafter end to end and write the run's report.

The held-out overlaps predict acceptance (docs/theory.md §5); this step checks the
prediction with the real decoder. Prompts the target never trained on (the demo set: held-out
stdlib files; and, with ``ood_prompts``, installed third-party code of another style) are
decoded one at a time, interleaved per prompt, by Hugging Face ``generate``, by draftsmith's
own plain decoding (the same decoder with no drafter: what drafting itself adds is measured
against it), by our decoder with the new drafter, by the hybrid of prompt lookup and the new
drafter (for drafters that can share rounds), and by the Hugging Face peer where one exists,
at each temperature. The report (``report.json``), the plots (``acceptance.png``,
``speedup.png``) and a summary table land in the run folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftsmith.data.atomic_io import write_json_atomic
from draftsmith.decode.defaults import ADAPTIVE_DRAFT_TOKENS, NUM_DRAFT_TOKENS
from draftsmith.decode.draft_length import adaptive_draft_bound

if TYPE_CHECKING:
    from draftsmith.train.config import DistillConfig


def measure_recipe_speed(
    config: DistillConfig, target_path: Any, output_dir: Path, held_out: dict[str, float]
) -> dict[str, Any]:
    """The speed step of a recipe (its ``speed_eval`` section): :func:`measure_and_report`
    on the exported drafter in ``output_dir``, reduced to the figures ``summary.json`` keeps
    per temperature, for the hybrid and on the ood prompts."""
    speed = config.speed_eval
    tree = None
    if speed.speed_eval_tree_total_tokens > 0:
        tree = {
            "top_k": speed.speed_eval_tree_top_k,
            "total_tokens": speed.speed_eval_tree_total_tokens,
            "frontier": speed.speed_eval_tree_frontier,
        }
    report = measure_and_report(
        target_path,
        output_dir / "drafter",
        output_dir,
        held_out,
        num_prompts=speed.speed_eval_prompts,
        max_new_tokens=speed.speed_eval_new_tokens,
        repeats=speed.speed_eval_repeats,
        num_draft_tokens=speed.speed_eval_draft_tokens,
        temperatures=tuple(speed.speed_eval_temperatures),
        tree=tree,
        prompts=speed.speed_eval_prompt_source,
        ood_prompts=speed.speed_eval_ood_prompts or None,
        adaptive=speed.speed_eval_adaptive,
        adaptive_draft_tokens=speed.speed_eval_adaptive_draft_tokens,
        dtype=config.target.dtype,  # decoding: choose_dtype's answer, not training's
    )
    keys = (
        "tau",
        "predicted_tau",
        "speedup",
        "speedup_over_draftsmith_plain",
        "tokens_per_s_baseline",
        "tokens_per_s_draftsmith_plain",
        "tokens_per_s_speculative",
        "draft_cost_ratio",
        "verify_cost_ratio",
        "speedup_over_fastest_plain",
        "fastest_plain_dtype",
        "distinct_4gram_share",
        "repeats",
        "adaptive",
        "num_draft_tokens",
    )
    summary = {t: {k: r[k] for k in keys} for t, r in report["by_temperature"].items()}
    for t, r in report.get("hybrid", {}).items():
        summary[f"hybrid {t}"] = {k: r[k] for k in keys}
    for t, results in report.get("ood", {}).items():
        if t != "prompts":
            for name, r in results.items():
                summary[f"ood {name} {t}"] = {k: r[k] for k in keys}
    return summary


def measure_and_report(
    target_path: str | Path,
    drafter_dir: str | Path,
    output_dir: str | Path,
    held_out: dict[str, float],
    *,
    num_prompts: int = 6,
    max_new_tokens: int = 128,
    repeats: int = 1,
    num_draft_tokens: int = NUM_DRAFT_TOKENS,
    temperatures: tuple[float, ...] = (0.0, 1.0),
    tree: dict[str, int] | None = None,
    prompts: str = "demo",
    ood_prompts: str | None = None,
    adaptive: bool = False,
    adaptive_draft_tokens: int = ADAPTIVE_DRAFT_TOKENS,
    dtype: str = "auto",
    plain_also: tuple[str, ...] = ("float32",),
) -> dict[str, Any]:
    """Decode the prompts with and without the drafter; return and save the report.

    ``report["by_temperature"][t]`` is the drafter's evaluation on ``prompts``;
    ``report["hybrid"][t]`` the hybrid's; ``report["ood"][t]`` both on ``ood_prompts``.
    ``repeats`` passes over the prompts time each prompt by its fastest (``draftsmith.decode.measure.side_by_side``).
    Chains draft ``num_draft_tokens`` per round, or with ``adaptive`` a length the decoder picks
    per round in 0..``adaptive_draft_tokens`` (at least ``num_draft_tokens``); trees are
    ``num_draft_tokens`` deep.
    The target decodes in ``dtype`` (``draftsmith.decode.precision``); draftsmith's plain decoding is
    measured in ``plain_also`` too, so every speedup can be stated over the fastest plain
    decoding draftsmith has for the target (``speedup_over_fastest_plain``).
    """
    from draftsmith.decode.drafters.registry import load_drafter
    from draftsmith.decode.measure.evaluate import load_target
    from draftsmith.decode.measure.machine import machine_record
    from draftsmith.decode.measure.plots import plot_acceptance_by_position, plot_speedups
    from draftsmith.decode.measure.prompts import drafters_system_prompt, load_eval_prompts
    from draftsmith.decode.measure.side_by_side import encode_prompt
    from draftsmith.decode.precision import choose_dtype
    from tqdm.auto import tqdm

    choice = choose_dtype(dtype)
    target, tokenizer = load_target(str(target_path), dtype=choice.name)
    copies = {name: load_target(str(target_path), dtype=name)[0] for name in plain_also}
    drafter = load_drafter(drafter_dir, target)
    report: dict[str, Any] = {
        "target": str(target_path),
        "drafter": str(drafter_dir),
        **choice.record(),
        "machine": machine_record(),
        "held_out_overlap": _overlaps(held_out),
        "prompts": prompts,
        "repeats": repeats,
        "by_temperature": {},
        "hybrid": {},
    }
    sets = {"held_out": prompts} | ({"ood": ood_prompts} if ood_prompts else {})
    system_prompt = drafters_system_prompt(None, [drafter_dir])  # the recipe's, as trained
    bar = tqdm(total=len(sets) * len(temperatures), desc="measure", dynamic_ncols=True)
    for name, source in sets.items():
        texts = load_eval_prompts(source, num_prompts, system_prompt)
        encoded = [encode_prompt(tokenizer, p) for p in texts]
        for temperature in temperatures:
            bar.set_postfix_str(f"{name} T={temperature:g}")
            results = _measure(
                target,
                copies,
                drafter,
                encoded,
                temperature,
                num_draft_tokens,
                max_new_tokens,
                tree,
                adaptive_draft_bound(num_draft_tokens, adaptive_draft_tokens) if adaptive else None,
                repeats,
            )
            bar.update()  # a cell counts once measured
            key = f"{temperature:g}"
            if name == "held_out":
                report["by_temperature"][key] = results["drafter"]
                if "hybrid" in results:
                    report["hybrid"][key] = results["hybrid"]
            else:
                report.setdefault("ood", {"prompts": source})[key] = results
    bar.close()
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    write_json_atomic(output / "report.json", report)
    plot_acceptance_by_position(
        {
            **{
                f"measured, T={t}": r["alpha_per_position"]
                for t, r in report["by_temperature"].items()
            },
            "held-out overlap (training)": report["held_out_overlap"],
        },
        output / "acceptance.png",
    )
    speedups = {"draftsmith plain": 1.0}
    for t, r in report["by_temperature"].items():
        own = r["tokens_per_s_draftsmith_plain"]
        speedups[f"HF generate, T={t}"] = r["tokens_per_s_baseline"] / own if own else 0.0
        speedups[f"draftsmith {r['drafter_kind']}, T={t}"] = r["speedup_over_draftsmith_plain"]
        if t in report["hybrid"]:
            speedups[f"hybrid, T={t}"] = report["hybrid"][t]["speedup_over_draftsmith_plain"]
    plot_speedups(speedups, output / "speedup.png", "Speedup over draftsmith's plain decoding")
    print(format_summary(report))
    return report


def _measure(
    target: Any,
    copies: dict[str, Any],
    drafter: Any,
    prompts: list[Any],
    temperature: float,
    num_draft_tokens: int,
    max_new_tokens: int,
    tree: dict[str, int] | None,
    adaptive_draft_tokens: int | None,
    repeats: int,
) -> dict[str, dict[str, Any]]:
    """One interleaved run of every method at one temperature; one report per drafting method.

    Chain rounds (the drafter's without a tree, the hybrid's) pick their length in
    0..``adaptive_draft_tokens`` when it is given, else draft ``num_draft_tokens``."""
    from dataclasses import replace

    import torch
    from draftsmith.decode.drafters.base import TreeSpec
    from draftsmith.decode.drafters.hybrid import HybridDrafter
    from draftsmith.decode.drafters.none import NoDrafter
    from draftsmith.decode.measure.evaluate import (
        fastest_plain,
        plain_in_dtypes,
        speculative_report,
    )
    from draftsmith.decode.measure.side_by_side import (
        EvalSettings,
        hf_peer,
        measure_side_by_side,
        plain_method,
        speculative_method,
    )

    # Top-k trees accept a child only with the target's probability of it: they win greedy
    # and lose to chains when sampling (docs/theory.md §4).
    use_tree = tree is not None and drafter.supports_trees and temperature == 0
    fixed = EvalSettings(
        num_draft_tokens=num_draft_tokens,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        repeats=repeats,
    )
    chain = fixed
    if adaptive_draft_tokens is not None:
        chain = replace(fixed, num_draft_tokens=adaptive_draft_tokens, adaptive=True)
    settings = replace(fixed, tree=TreeSpec(**tree)) if use_tree else chain
    no_drafter = NoDrafter(drafter.vocab_size)
    methods = {
        "baseline": plain_method(target, fixed),
        "draftsmith_plain": speculative_method(target, no_drafter, fixed),
        "drafter": speculative_method(target, drafter, settings),
    }
    methods |= plain_in_dtypes(target, copies, no_drafter, fixed)
    hybrid = HybridDrafter(drafter) if drafter.supports_external_drafts else None
    if hybrid is not None:
        methods["hybrid"] = speculative_method(target, hybrid, chain)
    peer = hf_peer(drafter, fixed)  # Hugging Face's own drafting: the fixed N
    if peer is not None:
        methods["peer"] = plain_method(target, fixed, **peer[1])
    with torch.inference_mode():
        results = measure_side_by_side(target, methods, prompts, repeats=settings.repeats)
    if peer is not None:
        results["peer"].name = peer[0]
    reports = {
        "drafter": speculative_report(
            settings,
            drafter,
            results["baseline"],
            results["drafter"],
            results.get("peer"),
            own_plain=results["draftsmith_plain"],
        )
    }
    if hybrid is not None:
        reports["hybrid"] = speculative_report(
            chain,
            hybrid,
            results["baseline"],
            results["hybrid"],
            own_plain=results["draftsmith_plain"],
        )
    for report in reports.values():
        report |= fastest_plain(target, results, report["tokens_per_s_speculative"])
    return reports


def format_summary(report: dict[str, Any]) -> str:
    """The end-of-run table: overlap per position, tau, speedups over draftsmith's own plain
    decoding (the figure that says whether drafting pays) and over HF ``generate``."""
    from draftsmith.decode.measure.machine import describe_machine

    overlap = " ".join(f"{v:.3f}" for v in report["held_out_overlap"]) or "-"
    plain = report["by_temperature"][next(iter(report["by_temperature"]))]
    rates = plain.get("tokens_per_s_draftsmith_plain_by_dtype", {})
    lines = [
        *([f"machine: {describe_machine(report['machine'])}"] if "machine" in report else []),
        f"decoding in {report.get('dtype', '?')} ({report.get('dtype_reason', '')}); draftsmith "
        "plain tokens/s by dtype: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()),
        f"held-out overlap per position (training): {overlap}",
        "speedup over draftsmith's own plain decoding (vs ours) and over HF generate (vs HF):",
        f"{'prompts':<10}{'T':>4}  {'method':<18}{'tau':>6}{'pred tau':>9}{'tok/s':>8}"
        f"{'vs ours':>9}{'vs fastest':>11}{'vs HF':>8}{'draft/tgt':>10}{'verify/tgt':>11}"
        f"{'4-grams':>8}{'peer vs HF':>22}",
    ]
    rows = []
    for temperature, r in report["by_temperature"].items():
        rows.append(("held-out", temperature, r))
        if temperature in report.get("hybrid", {}):
            rows.append(("held-out", temperature, report["hybrid"][temperature]))
    for temperature, results in report.get("ood", {}).items():
        if temperature != "prompts":
            rows += [("ood", temperature, r) for r in results.values()]
    for prompts, temperature, r in rows:
        peer = r.get("peer")
        peer_text = f"{peer['name']} {peer['speedup']:.2f}x" if peer else "-"
        lines.append(
            f"{prompts:<10}{temperature:>4}  {r['drafter_kind']:<18}{r['tau']:>6.2f}"
            f"{r['predicted_tau']:>9.2f}{r['tokens_per_s_speculative']:>8.1f}"
            f"{r['speedup_over_draftsmith_plain']:>8.2f}x"
            f"{r.get('speedup_over_fastest_plain', 0.0):>10.2f}x{r['speedup']:>7.2f}x"
            f"{r['draft_cost_ratio']:>10.2f}{r['verify_cost_ratio']:>11.2f}"
            f"{r['distinct_4gram_share']:>8.2f}{peer_text:>22}"
        )
    for prompts, temperature, r in rows:
        alphas = " ".join(f"{a:.2f}" for a in r["alpha_per_position"])
        timing = (
            f"draft {r['draft_step_ms']:.2f} ms/token, verify {r['verify_pass_ms']:.2f} ms, "
            f"target step {r['target_step_ms']:.2f} ms"
        )
        lines.append(
            f"{prompts} T={temperature} {r['drafter_kind']}: acceptance {alphas}; {timing}"
        )
    return "\n".join(lines)


def _overlaps(held_out: dict[str, float]) -> list[float]:
    keys = sorted((k for k in held_out if k.startswith("overlap@")), key=lambda k: int(k[8:]))
    return [held_out[k] for k in keys]
