"""PNG plots of acceptance and speed (matplotlib, imported lazily, headless backend)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_acceptance_by_position(
    alphas: Mapping[str, Sequence[float]], path: str | Path, title: str = ""
) -> Path:
    """alpha_j (acceptance at draft position j given j - 1 accepted), one line per drafter."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    for name, values in alphas.items():
        axes.plot(range(1, len(values) + 1), values, marker="o", label=name)
    axes.set_xlabel("draft position j")
    axes.set_ylabel("acceptance rate alpha_j")
    axes.set_ylim(0, 1.02)
    axes.set_title(title or "Acceptance by draft position")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    return _save(figure, path)


def plot_speedups(speedups: Mapping[str, float], path: str | Path, title: str = "") -> Path:
    """Horizontal bars: tokens/s of each method over plain decoding."""
    plt = _pyplot()
    names = list(speedups)
    figure, axes = plt.subplots(figsize=(7, 0.45 * len(names) + 1.2))
    bars = axes.barh(names, [speedups[name] for name in names], color="#4472c4")
    axes.axvline(1.0, color="black", linewidth=0.8)
    axes.bar_label(bars, fmt="%.2fx", fontsize=8, padding=2)
    axes.set_xlabel("speedup over plain decoding (tokens/s ratio)")
    axes.set_title(title or "Speedup per method")
    axes.invert_yaxis()
    return _save(figure, path)


def plot_speedup_against_draft_length(
    sweeps: Mapping[str, Mapping[int, float]], path: str | Path, title: str = ""
) -> Path:
    """Speedup as a function of num_draft_tokens, one line per drafter."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    for name, curve in sweeps.items():
        lengths = sorted(curve)
        axes.plot(lengths, [curve[n] for n in lengths], marker="o", label=name)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xlabel("num_draft_tokens (N)")
    axes.set_ylabel("speedup over plain decoding")
    axes.set_title(title or "Speedup against draft length")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    return _save(figure, path)


def plot_against_clients(
    panels: Mapping[str, Mapping[str, Mapping[int, float]]], path: str | Path, title: str = ""
) -> Path:
    """One panel per measure (tokens/s, TTFT, ...) against concurrent clients, one line per
    server and setting (a load test's sweep)."""
    plt = _pyplot()
    figure, axes_row = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for axes, (measure, curves) in zip(axes_row[0], panels.items(), strict=True):
        for name, curve in curves.items():
            clients = sorted(curve)
            axes.plot(clients, [curve[c] for c in clients], marker="o", label=name)
        axes.set_xscale("log", base=2)
        ticks = sorted({c for curve in curves.values() for c in curve})
        axes.set_xticks(ticks, [str(c) for c in ticks])
        axes.set_xlabel("concurrent clients")
        axes.set_ylabel(measure)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    figure.suptitle(title or "Serving under load")
    return _save(figure, path)


def _save(figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    _pyplot().close(figure)
    return path
