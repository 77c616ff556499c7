"""train/ablation/report.py: the Markdown tables of a grid, from a results file's summary."""

from __future__ import annotations

from typing import Any

import pytest
from draftsmith.train.ablation import results as ablation_results
from draftsmith.train.ablation.report import format_markdown, format_table, tau_source


def _results(check: bool = True) -> dict[str, Any]:
    """Two kinds x {ce, lk} x {corpus, regenerated}, seeds 0 and 1 (one seed for a cell)."""
    runs: dict[str, dict[str, Any]] = {}
    taus = {"ce": 2.0, "lk": 2.5}
    for kind in ("draft_lm", "eagle3"):
        for loss in ("ce", "lk"):
            for data in ("corpus", "regenerated"):
                seeds = (0,) if (kind, loss, data) == ("eagle3", "lk", "regenerated") else (0, 1)
                for seed in seeds:
                    cell = {"loss": loss, "kind": kind, "data": data}
                    tau = taus[loss] * (1.2 if data == "regenerated" else 1.0) + 0.2 * seed
                    record = {
                        "cell": cell,
                        "seed": seed,
                        "overlap": [0.5 + 0.1 * seed],
                        "greedy_match": [0.4],
                        "tau": {"0": tau, "1": tau + 1.0},
                    }
                    if check:
                        record["tau_check"] = {"prompts": 32, "tau": {"0": tau, "1": 2 * tau}}
                    runs[ablation_results.run_key(cell, seed)] = record
    baselines = {"loss": "ce", "data": "corpus"}
    cells = ablation_results.compare_with_baselines(ablation_results.summarize(runs), baselines)
    settings = {"max_steps": 150, "tau_new_tokens": 64, "num_draft_tokens": 4, "tau_prompts": 4}
    return {"cells": cells, "baselines": baselines, "settings": settings, "runs": runs}


def test_markdown_tables_give_mean_std_and_gains_per_kind_with_data_as_columns() -> None:
    text = format_markdown(_results())
    lines = text.splitlines()
    assert lines[0].startswith("mean ± std over 2 seeds; 150 steps per run; tau: tokens per ")
    assert "on 32 held-out prompts x 64 tokens, chains of 4" in lines[0]  # the re-measured tau
    assert lines.index("**kind=draft_lm**") < lines.index("**kind=eagle3**")
    header = (
        "| cell | corpus: overlap@1 | corpus: tau T=0 | corpus: tau T=1 | "
        "regenerated: overlap@1 | regenerated: tau T=0 | regenerated: tau T=1 |"
    )
    assert lines.count(header) == 2
    # ce on the corpus: tau 2.0 and 2.2 over the seeds, tau_check's T=1 is twice T=0
    assert "| loss=ce | 0.550 ± 0.071 | 2.10 ± 0.14 | 4.20 ± 0.28 | " in text
    # lk gains over ce of the same data and kind: 2.6 / 2.1 - 1 = +24%
    assert "| loss=lk | 0.550 ± 0.071 | 2.60 ± 0.14 (+24%) | 5.20 ± 0.28 (+24%) | " in text
    # the data table: regenerated over the corpus, same loss (2.4+0.1 / 2.1 = +19%)
    assert "| loss=ce | regenerated | T=0 +19% / T=1 +19% |" in text
    # a cell with fewer seeds than its table is marked; its std is 0 for one seed
    assert "0.500 ± 0.000 (n=1) | 3.00 ± 0.00 (+20%) | 6.00 ± 0.00 (+20%) |" in text


def test_markdown_uses_the_grids_own_tau_unless_every_cell_was_remeasured() -> None:
    results = _results(check=False)
    assert tau_source(results["cells"]) == "tau"
    text = format_markdown(results)
    assert "on 4 held-out prompts" in text
    # the grid's own T=1 is T=0 + 1: ce corpus 3.10, lk +16% (3.6 / 3.1)
    assert "| loss=lk | 0.550 ± 0.071 | 2.60 ± 0.14 (+24%) | 3.60 ± 0.14 (+16%) | " in text
    partial = _results()
    partial["cells"][0].pop("tau_check")
    assert tau_source(partial["cells"]) == "tau"


def test_markdown_of_an_empty_grid_and_a_grid_without_kind_or_data_axes() -> None:
    assert format_markdown({"cells": [], "baselines": {}}) == "No finished runs.\n"
    runs = {
        ablation_results.run_key({"loss": loss}, 0): {
            "cell": {"loss": loss}, "seed": 0, "overlap": [0.5], "greedy_match": [0.4],
            "tau": {"0": tau},
        }
        for loss, tau in (("ce", 2.0), ("lk", 3.0))
    }  # fmt: skip
    cells = ablation_results.compare_with_baselines(
        ablation_results.summarize(runs), {"loss": "ce"}
    )
    text = format_markdown({"cells": cells, "baselines": {"loss": "ce"}, "settings": {}})
    assert "**kind=" not in text and "tau gain over" not in text
    assert "| cell | overlap@1 | tau T=0 |" in text
    assert "| loss=lk | 0.500 ± 0.000 | 3.00 ± 0.00 (+50%) |" in text
    assert "vs loss=ce: T=0 +50.0%" in format_table(cells)


def test_a_cell_missing_from_a_column_is_a_dash() -> None:
    results = _results()
    results["cells"] = [
        c
        for c in results["cells"]
        if not (c["cell"]["kind"] == "eagle3" and c["cell"]["data"] == "regenerated"
                and c["cell"]["loss"] == "ce")
    ]  # fmt: skip
    text = format_markdown(results)
    assert "| loss=ce | 0.550 ± 0.071 | 2.10 ± 0.14 | 4.20 ± 0.28 | – | – | – |" in text


def test_a_pruned_cell_keeps_the_draftable_mass_of_its_seeds_and_a_full_one_none() -> None:
    runs = {}
    for vocab, masses in (("2048", (0.86, 0.88)), ("8192", (None, None))):
        for seed, mass in enumerate(masses):
            held_out = {"overlap@1": 0.6} | ({} if mass is None else {"draftable_mass": mass})
            runs[ablation_results.run_key({"draft_vocab_size": vocab}, seed)] = {
                "cell": {"draft_vocab_size": vocab}, "seed": seed, "overlap": [0.6],
                "greedy_match": [0.5], "tau": {"1": 2.5}, "held_out": held_out,
                "tokens_seen": 60_000 * (seed + 1), "minutes": 2.0,
            }  # fmt: skip
    cells = {c["key"]: c for c in ablation_results.summarize(runs)}
    pruned = cells["draft_vocab_size=2048"]["draftable_mass"]
    assert pruned["mean"] == 0.87 and pruned["n"] == 2
    assert "draftable_mass" not in cells["draft_vocab_size=8192"]
    speed = cells["draft_vocab_size=8192"]["train_tokens_per_s"]  # 500 and 1000 tokens/s
    assert (speed["mean"], speed["min"], speed["max"]) == (750.0, 500.0, 1000.0)
    del runs[ablation_results.run_key({"draft_vocab_size": "8192"}, 1)]["minutes"]
    cells = {c["key"]: c for c in ablation_results.summarize(runs)}
    assert "train_tokens_per_s" not in cells["draft_vocab_size=8192"]  # a run did not record it


def test_a_cell_keeps_the_acceptance_per_position_and_the_timed_measures_over_its_seeds() -> None:
    runs = {}
    for seed, (alpha, speedup) in enumerate((([0.8, 0.6, 0.4], 1.5), ([0.6, 0.4], 2.5))):
        runs[ablation_results.run_key({"kind": "dflash"}, seed)] = {
            "cell": {"kind": "dflash"}, "seed": seed, "overlap": [0.6], "greedy_match": [0.5],
            "tau": {"0": 3.0}, "alpha": {"0": alpha, "1": alpha},
            "speedup_over_plain": {"0": speedup}, "verify_ms_per_round": {"0": 10.0 + seed},
        }  # fmt: skip
    (cell,) = ablation_results.summarize(runs)
    assert [a["mean"] for a in cell["alpha"]["0"]] == pytest.approx([0.7, 0.5])  # both seeds'
    assert list(cell["alpha"]) == ["0", "1"]
    assert cell["speedup_over_plain"]["0"]["mean"] == 2.0
    assert cell["verify_ms_per_round"]["0"]["max"] == 11.0
    assert "plain_step_ms" not in cell  # no run recorded it
