"""scripts/report.py: the README's and the guides' results sections equal what the saved JSON
says, and no result figure is typed outside them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from script_helpers import load_script

report = load_script("report", "draftsmith_report")


def test_every_results_section_matches_the_saved_json() -> None:
    """What ``draftsmith-report --check`` runs: a new run's JSON needs `draftsmith-report`."""
    problems = report.check(report.documents())
    assert not problems, "\n".join(problems)


def test_every_section_is_used_somewhere() -> None:
    used = {
        m.group(2) for path in report.documents() for m in report.MARKER.finditer(path.read_text())
    }
    assert used == set(report.SECTIONS), f"unused sections: {set(report.SECTIONS) - used}"


def test_a_stale_section_is_found_and_rewritten() -> None:
    text = "before\n<!-- report:main-job -->\n| stale |\n<!-- /report:main-job -->\nafter\n"
    new = report.rewrite(text, {})
    assert new != text and new.startswith("before\n") and new.endswith("after\n")
    assert "| stale |" not in new and "| held-out |" in new
    assert report.rewrite(new, {}) == new  # idempotent


def test_an_unknown_section_is_an_error() -> None:
    with pytest.raises(ValueError, match="no section 'nope'"):
        report.rewrite("<!-- report:nope -->\n<!-- /report:nope -->", {})


@pytest.mark.parametrize(
    "line",
    [
        "the hybrid reaches 1.37x plain decoding",
        "tau 2.54 at T=1",
        "LK gains +12% at T=1",
        "2.85 ± 0.07",
        "it decodes 141.6 tokens/s",
    ],
)
def test_figures_outside_sections_are_flagged(line: str) -> None:
    assert report.unmarked_figures(f"intro\n{line}\n") == [line]
    inside = f"<!-- report:main-job -->\n{line}\n<!-- /report:main-job -->\n"
    assert report.unmarked_figures(inside) == []


def test_quoted_figures_projections_and_code_blocks_are_exempt() -> None:
    quoted = "<!-- quoted -->\n| EAGLE-3 paper | tau 3.49 |\n<!-- /quoted -->\n"
    projected = "<!-- projection -->\non a GPU about 2.5x\n<!-- /projection -->\n"
    fenced = "```bash\necho 2.31x\n```\n"
    assert report.unmarked_figures(quoted + projected + fenced) == []
    assert report.unmarked_figures(quoted + fenced + "it gives 2.31x\n") == ["it gives 2.31x"]
    # example output in a text block reads as measured: it is checked like prose
    output = "```text\nmtbench  80  3.21  2.31x\n```\n"
    assert report.unmarked_figures(output) == ["mtbench  80  3.21  2.31x"]


@pytest.mark.parametrize(
    "line",
    [
        "an 8x512 target",
        "--loss 0.5*fkl+0.5*tv",
        "--dtype bfloat16",
        "about 10 minutes",
        "4 x 12 trees",
        "jsd:0.5",
    ],
)
def test_settings_are_not_figures(line: str) -> None:
    assert report.unmarked_figures(line) == []


def _summary() -> dict:
    """A summary.json as train/distill.py writes it (the keys the report reads)."""

    def figures(speedup: float) -> dict:
        return {
            "speedup": 1.5 * speedup,
            "speedup_over_draftsmith_plain": speedup,
            "tau": 2.5,
            "draft_cost_ratio": 0.3,
        }

    return {
        "drafter_kind": "eagle3",
        "loss": "fkl",
        "steps": 10,
        "stop_reason": "max_steps",
        "minutes": 1.25,
        "train_sequences": 64,
        "held_out": {"overlap@2": 0.5, "overlap@1": 0.75, "greedy_match@1": 0.5, "loss": 1.0},
        "speed": {
            "0": figures(1.1),
            "hybrid 0": figures(1.2),
            "ood drafter 0": figures(1.3),
            "ood hybrid 0": figures(1.4),
        },
    }


MACHINE = {
    "cpu": "Xeon",
    "logical_cpus": 2,
    "torch_threads": 2,
    "cpu_kernels": ["AVX512", "AVX512-BF16"],
    "torch": "2.13.0",
}


def test_the_main_job_table_reads_a_run_summary(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(_summary()))
    destination = tmp_path / "main_job.json"
    report.take_main_job(run, destination)
    summary = json.loads(destination.read_text())
    table = report.main_job_table(summary).splitlines()
    # a summary from before the fastest-plain, 4-gram and verify fields: "-" in their columns
    assert table[2] == "| held-out | eagle3 chain | 0 | 1.10x | - | 1.65x | 2.50 | - | 0.30 | - |"
    first = summary["speed"]["0"]
    first |= {
        "speedup_over_fastest_plain": 1.05,
        "distinct_4gram_share": 0.61,
        "verify_cost_ratio": 1.12,
    }
    assert report.main_job_table(summary).splitlines()[2] == (
        "| held-out | eagle3 chain | 0 | 1.10x | 1.05x | 1.65x | 2.50 | 0.61 | 0.30 | 1.12 |"
    )
    assert table[5].startswith("| ood | hybrid | 0 | 1.40x |")
    text = report.main_job_run(summary)
    assert "10 steps (max_steps) in 1.2 min" in text and "position 0.75 / 0.50," in text
    assert "Trained in" not in text  # the summary does not say
    summary |= {"dtype": "float32", "dtype_reason": "bfloat16 was slower here"}
    assert report.main_job_run(summary).endswith(
        "greedy agreement 0.50. Trained in float32 (bfloat16 was slower here)."
    )
    summary["machine"] = MACHINE
    assert report.main_job_run(summary).endswith(
        "(bfloat16 was slower here). Machine: Xeon, 2 logical CPUs, 2 torch threads, CPU "
        "kernels AVX512 + AVX512-BF16 (no AMX), torch 2.13.0."
    )
    summary["held_out"]["draftable_mass"] = 0.8412
    assert "position 0.75 / 0.50 (the target's probability on the draft vocabulary, which " in (
        report.main_job_run(summary)
    )
    assert "caps each overlap: 0.84), greedy" in report.main_job_run(summary)


def test_a_run_without_a_speed_step_is_refused(tmp_path: Path) -> None:
    summary = _summary()
    del summary["speed"]
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match="no speed step"):
        report.take_main_job(tmp_path, tmp_path / "out.json")


@pytest.mark.parametrize("repeats", [None, 1, 3])
def test_the_benchmark_setting_says_how_prompts_were_timed(repeats: int | None) -> None:
    bench = {"target": "/x/demo-t", "num_prompts": 6, "max_new_tokens": 128, "num_draft_tokens": 4}
    if repeats is not None:
        bench["repeats"] = repeats
    setting = report._setting(bench)
    assert setting.startswith("Benchmark on target `demo-t`: 6 held-out prompts x 128 tokens")
    assert ("3 passes, each prompt of each method timed by its fastest pass of the" in setting) == (
        repeats == 3
    )
    assert setting.endswith(".") and "Machine" not in setting  # a record from before the field
    ood = report._setting(bench | {"machine": MACHINE}, "out-of-distribution (`ood`)")
    assert ood.startswith("Benchmark on target `demo-t`: 6 out-of-distribution (`ood`) prompts")
    assert ood.endswith(". Machine: Xeon, 2 logical CPUs, 2 torch threads, CPU kernels AVX512 + "
                        "AVX512-BF16 (no AMX), torch 2.13.0.")  # fmt: skip


def test_the_depth_table_names_the_draftable_mass_where_a_cell_has_one(tmp_path: Path) -> None:
    from draftsmith.train.ablation import results as ablation_results

    runs = {}
    for vocab, mass in (("2048", 0.87), ("8192", None)):
        held_out = {} if mass is None else {"draftable_mass": mass}
        runs[ablation_results.run_key({"draft_vocab_size": vocab}, 0)] = {
            "cell": {"draft_vocab_size": vocab}, "seed": 0, "overlap": [0.6, 0.5],
            "greedy_match": [0.5, 0.4], "tau": {"1": 2.5}, "held_out": held_out,
        }  # fmt: skip
    results = {
        "format_version": 1, "settings": {"max_steps": 100}, "runs": runs,
        "cells": ablation_results.summarize(runs), "baselines": {}, "skipped": {}, "failed": {},
    }  # fmt: skip
    path = tmp_path / "ablation.json"
    path.write_text(json.dumps(results))
    lines = report.depth_overlaps_table(path).splitlines()
    assert "draftable mass: the target's held-out probability on the draft vocabulary" in lines[0]
    assert lines[2] == "| cell | seeds | overlap@1 | overlap@2 | draftable mass | tau T=1 |"
    assert lines[4].startswith(
        "| draft_vocab_size=2048 | 1 | 0.600 ± 0.000 | 0.500 ± 0.000 | 0.870"
    )
    assert lines[5].startswith("| draft_vocab_size=8192 | 1 | 0.600 ± 0.000 | 0.500 ± 0.000 | – |")


def test_the_depth_table_says_how_far_a_time_boxed_run_got(tmp_path: Path) -> None:
    from draftsmith.train.ablation import results as ablation_results

    runs = {}
    for vocab, steps in (("2048", 141), ("8192", 71)):
        runs[ablation_results.run_key({"draft_vocab_size": vocab}, 0)] = {
            "cell": {"draft_vocab_size": vocab}, "seed": 0, "overlap": [0.7],
            "greedy_match": [0.6], "tau": {"0": 2.6}, "steps": steps,
        }  # fmt: skip
    settings = {"max_steps": 300, "max_minutes": 8.0}
    results = {"format_version": 1, "settings": settings, "runs": runs}
    path = tmp_path / "ablation.json"
    path.write_text(json.dumps(results))
    lines = report.depth_overlaps_table(path).splitlines()
    assert "up to 300 steps or 8 minutes per run;" in lines[0]
    assert lines[2] == "| cell | seeds | overlap@1 | tau T=0 | steps |"
    assert lines[5].endswith("| 71 ± 0 |")
    settings["max_steps"] = 71  # where no run stopped early: no column, the cap is the budget
    runs[ablation_results.run_key({"draft_vocab_size": "2048"}, 0)]["steps"] = 71
    path.write_text(json.dumps(results))
    lines = report.depth_overlaps_table(path).splitlines()
    assert "71 steps per run;" in lines[0] and lines[2] == "| cell | seeds | overlap@1 | tau T=0 |"
    settings["max_steps"] = None  # max_steps was a grid axis: each cell's own cap, shown
    path.write_text(json.dumps(results))
    lines = report.depth_overlaps_table(path).splitlines()
    assert "each cell's step cap, up to 8 minutes per run;" in lines[0] and "None" not in lines[0]
    assert lines[2] == "| cell | seeds | overlap@1 | tau T=0 | steps |"


def test_the_decoding_table_compares_each_cell_with_the_first(tmp_path: Path) -> None:
    """Tau, drafting time and speed per temperature over seeds, then ratios of the means."""
    from draftsmith.train.ablation import results as ablation_results

    runs = {}
    for kind, tau, draft_ms, speed in (("eagle3", 4.0, 4.0, 200.0), ("peagle", 3.0, 2.0, 220.0)):
        for seed, wobble in ((0, -0.5), (1, 0.5)):
            runs[ablation_results.run_key({"kind": kind}, seed)] = {
                "cell": {"kind": kind}, "seed": seed, "overlap": [0.6], "greedy_match": [0.5],
                "tau": {"0": tau + wobble / 10}, "draft_ms_per_round": {"0": draft_ms + wobble},
                "tokens_per_s": {"0": speed},
            }  # fmt: skip
    path = tmp_path / "ablation.json"
    path.write_text(json.dumps({"format_version": 1, "settings": {}, "runs": runs}))
    lines = report.decoding_table(path).splitlines()
    assert lines[2] == "| cell | seeds | tau T=0 | draft ms/round T=0 | tokens/s T=0 |"
    assert lines[4] == "| kind=eagle3 | 2 | 4.00 ± 0.07 | 4.00 ± 0.71 | 200 ± 0 |"
    assert lines[6] == "| kind=peagle / kind=eagle3 | – | 0.75 | 0.50 | 1.10 |"


def test_the_timing_clause_names_the_rule_the_record_was_measured_under() -> None:
    """Records before the quietest-pass rule kept a non-reproducing row's first pass; the
    header says which rule a record used, and nothing for a single pass."""
    assert report._repeats_clause({"repeats": 1}) == ""
    older = report._repeats_clause({"repeats": 2})
    newer = report._repeats_clause({"repeats": 2, "unreproduced_timing": "quietest pass"})
    assert "keep their first pass" in older and "quietest pass" not in older
    assert "quietest pass" in newer and "first pass" not in newer


def test_into_names_which_main_job_record_a_run_replaces(capsys) -> None:
    assert report.parse_args(["--main-job", "run"]).into == "main_job.json"
    amd = report.parse_args(["--main-job", "run", "--into", "main_job_amd.json"])
    assert amd.into == "main_job_amd.json"
    avx2 = report.parse_args(["--main-job", "run", "--into", "main_job_avx2.json"])
    assert avx2.into == "main_job_avx2.json"
    with pytest.raises(SystemExit):
        report.parse_args(["--main-job", "run", "--into", "../README.md"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--check", "--main-job", "run"], "--check changes nothing, so it takes no --main-job"),
        (["--into", "main_job_amd.json"], "--into names the record --main-job replaces"),
    ],
)
def test_flags_that_would_be_ignored_are_refused(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        report.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_run_summary_that_would_not_render_leaves_the_record_untouched(tmp_path: Path) -> None:
    """Copied first and read afterwards, a damaged summary replaced docs/results/'s record and
    then failed with a KeyError, breaking every later report; now it is refused by name."""
    destination = tmp_path / "main_job.json"
    destination.write_text("the saved record")
    run = tmp_path / "run"
    run.mkdir()
    no_held_out = {k: v for k, v in _summary().items() if k != "held_out"}
    not_a_number = _summary()
    not_a_number["speed"]["0"]["tau"] = float("nan")
    for content, error, message in (
        ("", ValueError, "summary.json is not valid JSON"),
        ('{"speed": ', ValueError, "summary.json is not valid JSON"),
        ("[1, 2]", ValueError, "holds a JSON list, not an object"),
        (json.dumps({"speed": 5}), ValueError, "is not a run summary the report can read"),
        (json.dumps(no_held_out), ValueError, "KeyError: 'held_out'"),
        (json.dumps(not_a_number), ValueError, "holds NaN or infinite figures"),
    ):
        (run / "summary.json").write_text(content)
        with pytest.raises(error, match=re.escape(message)):
            report.take_main_job(run, destination)
        assert destination.read_text() == "the saved record"
    with pytest.raises(FileNotFoundError, match=r"--main-job .*: no such folder"):
        report.take_main_job(tmp_path / "missing", destination)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"--main-job .*: no such folder"):
        report.take_main_job(tmp_path / "afile", destination)
    assert destination.read_text() == "the saved record"


def test_a_kind_grid_shows_verify_time_the_speedup_over_plain_and_acceptance_per_position(
    tmp_path: Path,
) -> None:
    """A grid that timed plain decoding beside each drafter shows the round's verify time and
    the speedup; the acceptance table gives each position per temperature, a block's past a
    chain's end marked '–'."""
    from draftsmith.train.ablation import results as ablation_results

    runs = {}
    for kind, alpha in (("eagle3", [0.8, 0.7]), ("dflash", [0.9, 0.6, 0.5])):
        for seed in (0, 1):
            runs[ablation_results.run_key({"kind": kind}, seed)] = {
                "cell": {"kind": kind}, "seed": seed, "overlap": [0.6], "greedy_match": [0.5],
                "tau": {"0": 3.0}, "draft_ms_per_round": {"0": 2.0},
                "verify_ms_per_round": {"0": 9.0}, "tokens_per_s": {"0": 300.0},
                "speedup_over_plain": {"0": 2.0 if kind == "eagle3" else 3.0},
                "alpha": {"0": alpha},
            }  # fmt: skip
    path = tmp_path / "ablation.json"
    path.write_text(json.dumps({"format_version": 1, "settings": {}, "runs": runs}))
    lines = report.decoding_table(path).splitlines()
    assert "verify ms/round T=0" in lines[2] and "x plain T=0" in lines[2]
    assert lines[-1].endswith("| 1.50 |")  # dflash over eagle3: 3.0 / 2.0
    assert "a DFlash block" in lines[0]
    table = report.acceptance_table(path).splitlines()
    assert table[2] == "| cell | T | position 1 | position 2 | position 3 |"
    assert table[4] == "| kind=eagle3 | 0 | 0.80 ± 0.00 | 0.70 ± 0.00 | – |"


def test_the_cost_model_of_a_kind_grid_predicts_each_speedup_from_its_parts(
    tmp_path: Path,
) -> None:
    """Steps are the unit: draft 2 ms and verify 10 ms at a 5 ms step are 0.4 and 2.0 steps;
    tau 3.6 then predicts 3.6 / 2.4 = 1.5x, 1.8x with drafting free, and a 2.6x goal at T = 0
    needs tau 2.6 * 2.4 = 6.24."""
    from draftsmith.train.ablation import results as ablation_results

    runs = {}
    for seed, step in ((0, 4.0), (1, 6.0)):  # seed means: a 5 ms step
        runs[ablation_results.run_key({"kind": "eagle3"}, seed)] = {
            "cell": {"kind": "eagle3"}, "seed": seed, "tau": {"0": 3.6}, "overlap": [0.6],
            "greedy_match": [0.5],
            "plain_step_ms": {"0": step}, "draft_ms_per_round": {"0": 2.0},
            "verify_ms_per_round": {"0": 10.0}, "speedup_over_plain": {"0": 1.4},
        }  # fmt: skip
    path = tmp_path / "ablation.json"
    path.write_text(json.dumps({"format_version": 1, "settings": {}, "runs": runs}))
    row = report.kinds_cost_model(path).splitlines()[4]
    assert (
        row
        == "| kind=eagle3 | 0 | 2 | 5.00 | 0.40 | 2.00 | 3.60 | 1.50x | 1.40x | 1.80x | 2.6x: 6.24 |"
    )
    runs.clear()
    path.write_text(json.dumps({"format_version": 1, "settings": {}, "runs": runs}))
    with pytest.raises(ValueError, match="no run timed a plain step"):
        report.kinds_cost_model(path)
