"""Tables of an ablation grid's results (``draftsmith.train.ablation.grid``): the terminal form and Markdown.

Both read the per-cell summary of a results file (``results["cells"]``: mean, sample standard
deviation, min and max over seeds, and each cell's relative gain over its baseline cells). The
tau they show is the steadier re-measured one (``tau_check``, more prompts) where every cell
has it, else the grid's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draftsmith.decode.measure.tables import markdown_table

MARKDOWN_FILE = "ablation.md"
GROUP_AXIS = "kind"  # one Markdown table per drafter kind
COLUMN_AXIS = "data"  # one column group per data source


def format_table(cells: list[dict[str, Any]]) -> str:
    """One line per cell: overlap@1 and tau per temperature, mean +- std [min, max]."""
    lines = []
    for entry in cells:
        parts = [f"{entry['key']:<44} n={len(entry['seeds'])}"]
        if entry["overlap"]:
            parts.append(f"overlap@1 {_fmt(entry['overlap'][0])}")
        for t in temperatures_of(cells):
            if t in entry["tau"]:
                parts.append(f"tau(T={t}) {_fmt(entry['tau'][t])}")
        check = entry.get("tau_check")
        for t, stats in (check["tau"] if check else {}).items():
            parts.append(f"tau(T={t}, {check['prompts']} prompts) {_fmt(stats)}")
        for name, gain in entry.get("gain", {}).items():
            text = " ".join(f"T={t} {g:+.1%}" for t, g in gain["tau"].items())
            if "tau_check" in gain:
                text += " | more prompts: "
                text += " ".join(f"T={t} {g:+.1%}" for t, g in gain["tau_check"].items())
            parts.append(f"vs {name}: {text}")
        lines.append("  ".join(parts))
    return "\n".join(lines)


def format_markdown(results: dict[str, Any]) -> str:
    """Markdown tables of a results file, one per drafter kind.

    Rows are the cells' other axes (e.g. the loss), column groups the data sources; each entry
    is ``mean ± std`` over seeds with, for tau, the relative gain over the baseline of the row
    axis (``loss=ce``: the cell equal on every other axis). A second table per kind gives the
    gain of each data source over the data baseline (``data=corpus``) with the same row.
    """
    cells: list[dict[str, Any]] = results["cells"]
    if not cells:
        return "No finished runs.\n"
    baselines: dict[str, str] = results.get("baselines", {})
    source = tau_source(cells)
    temperatures = temperatures_of(cells)
    settings = results.get("settings", {})
    prompts = cells[0]["tau_check"]["prompts"] if source == "tau_check" else None
    lines = [
        _caption(settings, prompts, max(len(c["seeds"]) for c in cells)),
        "",
    ]
    for group, members in _grouped(cells, GROUP_AXIS).items():
        if group is not None:
            lines += [f"**{GROUP_AXIS}={group}**", ""]
        lines += _cell_table(members, baselines, source, temperatures)
        column_base = baselines.get(COLUMN_AXIS)
        if column_base is not None:
            lines += _column_gain_table(members, f"{COLUMN_AXIS}={column_base}", source)
    return "\n".join(lines) + "\n"


def tau_source(cells: list[dict[str, Any]]) -> str:
    """``tau_check`` when every cell was re-measured on the same prompt count, else ``tau``."""
    checks = [c.get("tau_check") for c in cells]
    if all(checks) and len({c["prompts"] for c in checks}) == 1:
        return "tau_check"
    return "tau"


def temperatures_of(cells: list[dict[str, Any]]) -> list[str]:
    return sorted({t for c in cells for t in c["tau"]}, key=float)


def _caption(settings: dict[str, Any], prompts: int | None, seeds: int) -> str:
    steps = settings.get("max_steps")
    parts = [f"mean ± std over {seeds} seeds"]
    if steps is not None:
        parts.append(f"{steps} steps per run")
    tau_prompts = prompts if prompts is not None else settings.get("tau_prompts")
    chain = settings.get("num_draft_tokens")
    tau = f"tau: tokens per target pass on {tau_prompts} held-out prompts"
    if settings.get("tau_new_tokens") is not None:
        tau += f" x {settings['tau_new_tokens']} tokens"
    if chain is not None:
        tau += f", chains of {chain}"
        if "dflash" in settings.get("recipes", {}):
            tau += " (a DFlash block: its B - 1)"
    parts.append(tau)
    parts.append("in brackets: the relative gain over the baseline cell")
    return "; ".join(parts) + "."


def _grouped(cells: list[dict[str, Any]], axis: str) -> dict[str | None, list[dict[str, Any]]]:
    groups: dict[str | None, list[dict[str, Any]]] = {}
    for entry in cells:
        groups.setdefault(entry["cell"].get(axis), []).append(entry)
    return groups


def _row_label(cell: dict[str, str]) -> str:
    kept = [f"{k}={v}" for k, v in cell.items() if k not in (GROUP_AXIS, COLUMN_AXIS)]
    return ", ".join(kept) or "recipe"


def _column_of(entry: dict[str, Any]) -> str:
    return entry["cell"].get(COLUMN_AXIS, "")


def _columns(members: list[dict[str, Any]]) -> list[str]:
    """The column axis's values in the order the cells first show them."""
    return list(dict.fromkeys(_column_of(c) for c in members))


def _cell_table(
    members: list[dict[str, Any]],
    baselines: dict[str, str],
    source: str,
    temperatures: Sequence[str],
) -> list[str]:
    columns = _columns(members)
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for entry in members:
        rows.setdefault(_row_label(entry["cell"]), {})[_column_of(entry)] = entry
    row_gains = [f"{a}={v}" for a, v in baselines.items() if a != COLUMN_AXIS]
    most = max(len(c["seeds"]) for c in members)  # fewer seeds in a cell are marked
    heads = []
    for column in columns:
        prefix = f"{column}: " if column else ""
        heads += [f"{prefix}overlap@1"] + [f"{prefix}tau T={t}" for t in temperatures]
    table = []
    for label, by_column in rows.items():
        values = []
        for column in columns:
            entry = by_column.get(column)
            if entry is None:
                values += ["–"] * (1 + len(temperatures))
                continue
            overlap = entry["overlap"][0] if entry["overlap"] else None
            seeds = len(entry["seeds"])
            values.append(_mean_std(overlap, 3) + (f" (n={seeds})" if seeds < most else ""))
            taus = entry[source]["tau"] if source == "tau_check" else entry["tau"]
            for t in temperatures:
                text = _mean_std(taus.get(t), 2)
                gains = [
                    entry.get("gain", {}).get(name, {}).get(source, {}).get(t) for name in row_gains
                ]
                shown = [f"{g:+.0%}" for g in gains if g is not None]
                values.append(text + (f" ({', '.join(shown)})" if shown and text != "–" else ""))
        table.append([label, *values])
    return [*markdown_table(["cell", *heads], table), ""]


def _column_gain_table(members: list[dict[str, Any]], baseline: str, source: str) -> list[str]:
    """Gain of each data source over the baseline source, same row, per temperature."""
    columns = _columns(members)
    rows = []
    for entry in sorted(members, key=lambda c: columns.index(_column_of(c))):
        gain = entry.get("gain", {}).get(baseline)
        if not gain or not gain.get(source):
            continue
        by_t = " / ".join(f"T={t} {g:+.0%}" for t, g in gain[source].items())
        rows.append(f"| {_row_label(entry['cell'])} | {_column_of(entry)} | {by_t} |")
    if not rows:
        return []
    return [f"| cell | {COLUMN_AXIS} | tau gain over {baseline} |", "|---|---|---|", *rows, ""]


def _mean_std(stats: dict[str, float] | None, digits: int) -> str:
    if stats is None:
        return "–"
    return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"


def _fmt(stats: dict[str, float]) -> str:
    return f"{stats['mean']:.3f}+-{stats['std']:.3f} [{stats['min']:.3f}, {stats['max']:.3f}]"
