"""After training: measure the exported drafter end to end and write the run's report.

The held-out overlaps predict acceptance (docs/theory.md §5); this step checks the
prediction with the real decoder. Held-out prompts (the demo set: stdlib files the target never
trained on) are decoded one at a time by plain target decoding, by our speculative decoder with
the new drafter and, where one exists, by the Hugging Face peer, at each temperature. The report
(``report.json``), the plots (``acceptance.png``, ``speedup.png``) and a summary table land in
the run folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data.atomic_io import write_json_atomic


def measure_and_report(
    target_path: str | Path,
    drafter_dir: str | Path,
    output_dir: str | Path,
    held_out: dict[str, float],
    *,
    num_prompts: int = 6,
    max_new_tokens: int = 128,
    num_draft_tokens: int = 4,
    temperatures: tuple[float, ...] = (0.0, 1.0),
    tree: dict[str, int] | None = None,
    prompts: str = "demo",
) -> dict[str, Any]:
    """Decode held-out prompts with and without the drafter; return and save the report."""
    import torch

    from decode.drafters.base import TreeSpec
    from decode.drafters.registry import load_drafter
    from decode.evaluate import EvalSettings, encode_prompt, evaluate_drafter, load_target
    from decode.plots import plot_acceptance_by_position, plot_speedups
    from decode.prompts import load_eval_prompts

    target, tokenizer = load_target(str(target_path))
    drafter = load_drafter(drafter_dir, target)
    tree_spec = TreeSpec(**tree) if tree and drafter.supports_trees else None
    encoded = [encode_prompt(tokenizer, p) for p in load_eval_prompts(prompts, num_prompts)]
    report: dict[str, Any] = {
        "target": str(target_path),
        "drafter": str(drafter_dir),
        "held_out_overlap": _overlaps(held_out),
        "by_temperature": {},
    }
    for temperature in temperatures:
        settings = EvalSettings(
            num_draft_tokens=num_draft_tokens,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            tree=tree_spec,
        )
        with torch.inference_mode():
            result = evaluate_drafter(target, drafter, encoded, settings)
        report["by_temperature"][f"{temperature:g}"] = result
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
    speedups = {"plain": 1.0}
    for t, r in report["by_temperature"].items():
        speedups[f"draftsmith, T={t}"] = r["speedup"]
        if r.get("peer"):
            speedups[f"{r['peer']['name']}, T={t}"] = r["peer"]["speedup"]
    plot_speedups(speedups, output / "speedup.png")
    print(format_summary(report))
    return report


def format_summary(report: dict[str, Any]) -> str:
    """The end-of-run table: overlap per position, tau, predicted tau, tokens/s, speedup."""
    overlap = " ".join(f"{v:.3f}" for v in report["held_out_overlap"]) or "-"
    lines = [
        f"held-out overlap per position (training): {overlap}",
        f"{'temperature':<12}{'tau':>6}{'pred tau':>9}{'plain tok/s':>12}{'spec tok/s':>11}"
        f"{'speedup':>9}{'peer':>20}",
    ]
    for temperature, r in report["by_temperature"].items():
        peer = r.get("peer")
        peer_text = f"{peer['name']} {peer['speedup']:.2f}x" if peer else "-"
        lines.append(
            f"{temperature:<12}{r['tau']:>6.2f}{r['predicted_tau']:>9.2f}"
            f"{r['tokens_per_s_baseline']:>12.1f}{r['tokens_per_s_speculative']:>11.1f}"
            f"{r['speedup']:>8.2f}x{peer_text:>20}"
        )
        alphas = " ".join(f"{a:.2f}" for a in r["alpha_per_position"])
        lines.append(f"{'':<12}measured acceptance per position: {alphas}")
    return "\n".join(lines)


def _overlaps(held_out: dict[str, float]) -> list[float]:
    keys = sorted((k for k in held_out if k.startswith("overlap@")), key=lambda k: int(k[8:]))
    return [held_out[k] for k in keys]
