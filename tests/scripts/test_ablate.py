"""scripts/ablate.py over train/ablation/grid.py: grid parsing and the recipe flags of each cell,
regenerated data prepared once, and a 2 cells x 2 seeds grid on the tiny recipes that is
interrupted and resumed."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from types import ModuleType

import pytest
from draftsmith.train.ablation import grid as ablation
from draftsmith.train.ablation import results as ablation_results
from draftsmith.train.config import parse_config
from script_helpers import load_script


def _script() -> ModuleType:
    return load_script("ablate")


def test_grid_axes_map_to_real_recipe_flags(tmp_path: Path) -> None:
    ablate = _script()
    grid = ablation.parse_grid(
        ["kind=draft_lm,eagle3", "data=corpus,regenerated+onpolicy", "loss=lk,jsd:0.5"]
    )
    cells = ablation.cells_of(grid)
    assert len(cells) == 8 and cells[0] == {"kind": "draft_lm", "data": "corpus", "loss": "lk"}
    args = ablate.parse_args(
        ["--preset", "tiny", "--max-minutes", "2.5", "--set", "lr_scheduler=constant"]
    )
    regen = tmp_path / "regen.jsonl"
    regen.write_text("")
    args.regenerated = regen
    settings = ablate.settings_from(args)
    for cell in cells:
        run_dir = ablation.run_folder(tmp_path, ablation_results.run_key(cell, 1))
        try:
            argv = ablation.run_argv(cell, 1, settings, run_dir)
        except ablation.Skip as reason:  # only EAGLE-3 with on-policy data
            assert cell["kind"] == "eagle3" and "onpolicy" in cell["data"]
            assert "does not sample on-policy" in str(reason)
            continue
        config = parse_config(argv)  # every flag is a real recipe key with a valid value
        assert config.drafter.drafter_kind == cell["kind"]
        assert config.loss.loss == cell["loss"]
        assert config.optim.seed == 1 and config.optim.max_minutes == 2.5
        assert config.optim.lr_scheduler == "constant"
        assert config.output.output_dir == str(run_dir)
        assert config.speed_eval.speed_eval_prompts == 0  # tau comes from measure_tau
        assert config.data.train_source == "data"  # the data axis names the training text
        regenerated = "regenerated" in cell["data"]
        assert (config.data.dataset == str(regen)) == regenerated
        assert config.data.dataset == (str(regen) if regenerated else "stdlib")
        assert config.data.on_policy_fraction == (0.5 if "onpolicy" in cell["data"] else 0.0)
    assert len({ablation.run_folder(tmp_path, ablation_results.run_key(c, 0)) for c in cells}) == 8
    samples = ablation.run_argv({"kind": "eagle3", "data": "samples"}, 0, settings, tmp_path)
    assert parse_config(samples).data.train_source == "target_samples"
    assert parse_config(samples).data.dataset == "stdlib"
    assert parse_config(samples).data.train_samples_seed is None  # each run's seed
    shared = dataclasses.replace(settings, samples_seed=3)
    for seed in (0, 1):
        argv = ablation.run_argv({"kind": "eagle3", "data": "samples"}, seed, shared, tmp_path)
        assert parse_config(argv).data.train_samples_seed == 3
        assert parse_config(argv).optim.seed == seed
    corpus = ablation.run_argv({"kind": "eagle3", "data": "corpus"}, 0, shared, tmp_path)
    assert parse_config(corpus).data.train_samples_seed is None
    hard_labels = {"kind": "draft_lm", "data": "onpolicy", "loss": "ce"}
    with pytest.raises(ablation.Skip, match="own guesses"):
        ablation.run_argv(hard_labels, 0, settings, tmp_path / "ce")
    mixed = {**hard_labels, "loss": "tv+0.1*ce"}  # a target term: on-policy data is fine
    assert "--on_policy_fraction" in ablation.run_argv(mixed, 0, settings, tmp_path)
    for bad, message in [
        (["loss"], "write AXIS=V1,V2"),
        (["data=corpus,web"], r"unknown source\(s\) \['web'\]"),
        (["data=corpus+samples"], "join at most one of them with onpolicy"),
        (["train_source=data"], "set through data=samples"),
        (["seed=1,2"], "set through --seeds"),
        (["dataset=a,b"], "set through data=regenerated"),
        (["flavour=1,2"], "unknown axis"),
        (["loss=tv", "loss=ce"], "names axis 'loss' twice"),
        (["loss=tv,tv"], "repeats a value"),
    ]:
        with pytest.raises(ValueError, match=message):
            ablation.parse_grid(bad)
    with pytest.raises(ValueError, match="repeats a seed"):
        ablation.run_grid({"loss": ["tv"]}, [0, 0], settings)
    with pytest.raises(ValueError, match="set through --seeds"):
        ablate.settings_from(ablate.parse_args(["--set", "seed=3"]))
    with pytest.raises(ValueError, match="tau-prompts must be >= 1"):
        ablate.settings_from(ablate.parse_args(["--tau-prompts", "0"]))


def test_regenerated_data_is_written_once_per_grid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ablate = _script()
    calls = []

    def fake_run(command: list[str], **_: object) -> None:
        calls.append(command)
        output = Path(command[command.index("--output") + 1])
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text('{"prompt": "a", "response": "b", "text": "ab"}\n')

    monkeypatch.setattr(ablate.subprocess, "run", fake_run)
    settings = ablate.settings_from(
        ablate.parse_args(["--output", str(tmp_path), "--regen-prompts", "7"])
    )
    first = ablate.prepare_regenerated(settings, "tiny", max_files=40)
    again = ablate.prepare_regenerated(settings, "tiny", max_files=40)
    assert first == again == tmp_path / "data" / "regenerated.jsonl"
    assert len(calls) == 1
    command = calls[0]
    assert command[1].endswith("regenerate_data.py")
    assert command[command.index("--prompts") + 1] == "stdlib"
    assert command[command.index("--num-prompts") + 1] == "7"
    assert command[command.index("--max-files") + 1] == "40"
    given = ablate.settings_from(
        ablate.parse_args(["--regenerated", str(tmp_path / "missing.jsonl")])
    )
    with pytest.raises(FileNotFoundError, match="no such file"):
        ablate.prepare_regenerated(given, "tiny", max_files=None)
    # the grid runner itself never writes it: it asks for the file
    missing = ablation.GridSettings(output=tmp_path / "other", recipes=settings.recipes)
    with pytest.raises(FileNotFoundError, match="data=regenerated needs"):
        ablation.run_grid({"data": ["regenerated"]}, [0], missing)


def test_run_grid_resumes_retries_failures_and_summarizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner's bookkeeping with the training replaced by a deterministic stand-in."""
    trained: list[str] = []
    broken: set[str] = set()

    def fake(argv: list[str], *_: object) -> dict:
        loss, seed = argv[argv.index("--loss") + 1], int(argv[argv.index("--seed") + 1])
        key = f"loss={loss},seed={seed}"
        trained.append(key)
        if key in broken:
            raise RuntimeError("diverged")
        tau = {"ce": 2.0, "lk": 2.5}[loss] + 0.1 * seed
        return {
            "overlap": [0.5 + 0.1 * seed, 0.4],
            "greedy_match": [0.6],
            "tau": {"0": tau, "1": tau / 2},
            "machine": {"cpu": "Xeon", "cpu_kernels": ["AVX512"]},
        }

    monkeypatch.setattr(ablation, "train_and_measure", fake)
    settings = ablation.GridSettings(
        output=tmp_path, recipes=ablation.recipes_for("tiny"), max_steps=2
    )
    grid = {"loss": ["ce", "lk"]}
    first = ablation.run_grid(grid, [0, 1], settings, max_runs=3, log=lambda _: None)
    assert first["stopped"] and first["new_runs"] == 3
    assert trained == ["loss=ce,seed=0", "loss=lk,seed=0", "loss=ce,seed=1"]  # seeds outer
    second = ablation.run_grid(grid, [0, 1], settings, log=lambda _: None)
    assert trained[3:] == ["loss=lk,seed=1"] and not second["stopped"]
    saved = json.loads((tmp_path / "ablation.json").read_text())
    assert set(saved["runs"]) == {f"loss={loss},seed={s}" for loss in ("ce", "lk") for s in (0, 1)}
    assert saved["failed"] == {}
    assert saved["machine"] == {"cpu": "Xeon", "cpu_kernels": ["AVX512"]}  # the record names it
    cells = {c["key"]: c for c in saved["cells"]}
    lk = cells["loss=lk"]
    assert lk["tau"]["0"]["mean"] == pytest.approx(2.55) and lk["tau"]["0"]["n"] == 2
    assert lk["tau"]["0"]["std"] == pytest.approx(0.1 / 2**0.5)
    assert (lk["overlap"][0]["min"], lk["overlap"][0]["max"]) == pytest.approx((0.5, 0.6))
    assert len(lk["overlap"]) == 2 and len(lk["greedy_match"]) == 1
    assert saved["baselines"] == {"loss": "ce"}
    assert lk["gain"]["loss=ce"]["tau"]["1"] == pytest.approx(2.55 / 2.05 - 1)
    assert "gain" not in cells["loss=ce"] or cells["loss=ce"]["gain"] == {}
    # a failure is recorded, not kept as a run, and retried by the next call
    broken.add("loss=ce,seed=2")
    third = ablation.run_grid(grid, [0, 1, 2], settings, log=lambda _: None)
    assert trained[4:] == ["loss=ce,seed=2", "loss=lk,seed=2"]
    assert "loss=ce,seed=2" in third["failed"] and "loss=ce,seed=2" not in third["runs"]
    with pytest.raises(ValueError, match=r"other settings \(max_minutes\)"):
        ablation.run_grid(grid, [0], dataclasses.replace(settings, max_minutes=1.0))


def test_a_runs_measurement_is_its_summarys_held_out_and_temperature_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import draftsmith.train.distill

    row = {"tau": 2.0, "predicted_tau": 2.1, "speedup": 1.3}
    summary = {
        "held_out": {"overlap@2": 0.5, "overlap@1": 0.7, "greedy_match@1": 0.8, "loss": 1.0},
        "speed": {"0": row, "1": {**row, "tau": 1.5}, "ood demo 1": {**row, "tau": 9.0}},
        "steps": 3, "stop_reason": "max_steps", "minutes": 0.1, "tokens_seen": 10,
        "data": "stdlib", "eval_description": "held-out", "machine": {"cpu": "Xeon"},
    }  # fmt: skip
    monkeypatch.setattr(draftsmith.train.distill, "main", lambda argv: summary)
    measured = ablation.train_and_measure(["--loss", "tv"])
    assert measured["overlap"] == [0.7, 0.5] and measured["greedy_match"] == [0.8]
    assert measured["machine"] == {"cpu": "Xeon"}  # each run names where it ran
    assert measured["tau"] == {"0": 2.0, "1": 1.5}  # other prompt sets are not the grid's


def test_kind_axis_runs_peagle_beside_eagle3_with_per_position_acceptance_and_costs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import draftsmith.train.distill

    for recipes in ablation.RECIPES.values():  # every preset has a recipe for every kind
        assert all((ablation.REPO / path).is_file() for path in recipes.values())
    settings = _script().settings_from(_script().parse_args(["--preset", "tiny"]))
    for kind in ("eagle3", "peagle"):
        argv = ablation.run_argv({"kind": kind, "data": "corpus"}, 0, settings, tmp_path / kind)
        assert parse_config(argv).drafter.drafter_kind == kind
    row = {"tau": 2.0, "predicted_tau": 2.0, "alpha": [0.8, 0.5], "draft_ms_per_round": 1.5,
           "tokens_per_s": 90.0}  # fmt: skip
    summary = {"held_out": {"overlap@1": 0.7}, "steps": 3, "stop_reason": "max_steps",
               "target_path": "t", "minutes": 0.1, "tokens_seen": 10, "data": "stdlib",
               "eval_description": "x", "machine": {"cpu": "Xeon"}}  # fmt: skip
    monkeypatch.setattr(draftsmith.train.distill, "main", lambda argv: summary)
    monkeypatch.setattr(ablation, "measure_tau", lambda *args: {"0": row})
    measured = ablation.train_and_measure(argv, settings, tmp_path / "drafter")
    assert measured["alpha"] == {"0": [0.8, 0.5]} and measured["tau"] == {"0": 2.0}
    assert measured["draft_ms_per_round"] == {"0": 1.5} and measured["tokens_per_s"] == {"0": 90.0}


@pytest.mark.slow  # four tiny distillations with their decoding step: ~75 s on 2 loaded cores
def test_grid_of_two_cells_and_two_seeds_resumes_after_an_interruption(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ablate = _script()
    output = tmp_path / "ablation"
    argv = [
        "--preset", "tiny", "--target", str(target), "--grid", "loss=ce,lk",
        "--seeds", "0", "1", "--max-steps", "2", "--max-minutes", "5",
        "--tau-prompts", "1", "--tau-new-tokens", "8", "--output", str(output),
        "--set", "max_train_sequences=16", "--set", "eval_sequences=2",
        "--set", "eval_prompt_tokens=8", "--set", "eval_new_tokens=8",
        "--set", "per_device_batch_size=2", "--set", "checkpoint_every=0",
    ]  # fmt: skip
    first = ablate.main([*argv, "--max-runs", "1"])
    assert "stopped after 1 new runs" in capsys.readouterr().out
    saved = json.loads((output / "ablation.json").read_text())
    assert list(saved["runs"]) == ["loss=ce,seed=0"] == list(first["runs"])
    done = saved["runs"]["loss=ce,seed=0"]

    results = ablate.main(argv)
    out = capsys.readouterr().out
    assert "loss=ce,seed=0: done already, skipped" in out
    assert out.count("[ablate] run ") == 3  # only the three missing runs trained
    # each counted by its place in the grid, not by the runs the file already holds
    assert "[ablate] run 2/4: loss=lk,seed=0" in out and "[ablate] run 4/4: loss=lk,seed=1" in out
    saved = json.loads((output / "ablation.json").read_text())
    status = ("stopped", "new_runs", "path")  # the runner's own report, not in the file
    assert saved == {k: v for k, v in json.loads(json.dumps(results)).items() if k not in status}
    assert set(saved["runs"]) == {
        f"loss={loss},seed={seed}" for loss in ("ce", "lk") for seed in (0, 1)
    }
    assert saved["runs"]["loss=ce,seed=0"] == done  # kept as it was, not trained again
    for record in saved["runs"].values():
        assert record["steps"] == 2
        assert len(record["overlap"]) == 1 and 0.0 < record["overlap"][0] <= 1.0
        assert set(record["tau"]) == {"0", "1"}
        assert all(1.0 <= tau <= 5.0 for tau in record["tau"].values())  # N = 4 drafts
    cells = {cell["key"]: cell for cell in saved["cells"]}
    assert set(cells) == {"loss=ce", "loss=lk"}
    for key, cell in cells.items():
        assert cell["seeds"] == [0, 1]
        for t in ("0", "1"):
            values = [saved["runs"][f"{key},seed={s}"]["tau"][t] for s in (0, 1)]
            stats = cell["tau"][t]
            assert stats["n"] == 2 and stats["mean"] == pytest.approx(sum(values) / 2)
            assert stats["min"] == min(values) and stats["max"] == max(values)
            assert stats["std"] == pytest.approx(abs(values[0] - values[1]) / 2**0.5)
    gain = cells["loss=lk"]["gain"]["loss=ce"]
    assert gain["baseline"] == "loss=ce"
    assert gain["tau"]["1"] == pytest.approx(
        cells["loss=lk"]["tau"]["1"]["mean"] / cells["loss=ce"]["tau"]["1"]["mean"] - 1
    )
    assert "loss=ce" in out and "vs loss=ce" in out  # the printed table
    assert (output / "overlap.png").stat().st_size > 0 and (output / "tau.png").stat().st_size > 0
    assert "| loss=lk | " in (output / "ablation.md").read_text()  # the Markdown tables

    with pytest.raises(ValueError, match=r"other settings \(max_steps\)"):
        ablate.main([*argv, "--max-steps", "3"])


def test_settings_fingerprint_follows_recipe_content_not_places(tmp_path: Path) -> None:
    """A copied repository or a moved grid folder resumes; an edited recipe does not."""
    recipes = ablation.recipes_for("tiny")
    clone = tmp_path / "clone" / "configs"
    shutil.copytree(ablation.REPO / "configs", clone)
    copies = {kind: clone / path.name for kind, path in recipes.items()}
    here = ablation.GridSettings(output=tmp_path / "a", recipes=recipes)
    there = ablation.GridSettings(output=tmp_path / "b", recipes=copies)
    assert here.fingerprint() == there.fingerprint()
    recipe = copies["draft_lm"]
    recipe.write_text(recipe.read_text().replace("loss: tv", "loss: lk"))
    changed = there.fingerprint()
    assert changed["recipes"]["draft_lm"] != here.fingerprint()["recipes"]["draft_lm"]
    assert changed["recipes"]["eagle3"] == here.fingerprint()["recipes"]["eagle3"]


def test_merge_folds_grids_of_one_settings_and_refuses_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two grids run side by side (axes in another order) merge into one file whose cells
    compare with the other grid's baselines; other settings or other axes are refused."""

    def fake(argv: list[str], *_: object) -> dict:
        loss, data = argv[argv.index("--loss") + 1], "--dataset" in argv
        tau = {"ce": 2.0, "lk": 2.4}[loss] * (1.5 if data else 1.0)
        return {"overlap": [0.5], "greedy_match": [0.4], "tau": {"0": tau, "1": tau}}

    monkeypatch.setattr(ablation, "train_and_measure", fake)

    def settings(folder: str, **changes) -> ablation.GridSettings:
        regenerated = tmp_path / folder / "data" / "regenerated.jsonl"
        regenerated.parent.mkdir(parents=True)
        regenerated.write_text("")
        recipes = ablation.recipes_for("tiny")
        return ablation.GridSettings(output=tmp_path / folder, recipes=recipes, **changes)

    quiet = {"log": lambda _: None}
    ablation.run_grid({"loss": ["ce", "lk"], "data": ["corpus"]}, [0], settings("a"), **quiet)
    ablation.run_grid({"data": ["regenerated"], "loss": ["ce"]}, [0], settings("b"), **quiet)
    merged = ablation_results.merge_results(
        tmp_path / "a" / "ablation.json", [tmp_path / "b" / "ablation.json"]
    )
    assert merged["added"] == ["loss=ce,data=regenerated,seed=0"]
    cells = {c["key"]: c for c in merged["cells"]}
    assert set(cells) == {"loss=ce,data=corpus", "loss=lk,data=corpus", "loss=ce,data=regenerated"}
    assert cells["loss=ce,data=regenerated"]["gain"]["data=corpus"]["tau"]["1"] == pytest.approx(
        0.5
    )
    assert cells["loss=lk,data=corpus"]["gain"]["loss=ce"]["tau"]["1"] == pytest.approx(0.2)
    again = ablation_results.merge_results(
        tmp_path / "a" / "ablation.json", [tmp_path / "b" / "ablation.json"]
    )
    assert again["added"] == [] and len(again["runs"]) == 3  # idempotent

    ablation.run_grid({"loss": ["ce"]}, [0], settings("c", max_steps=9), **quiet)
    with pytest.raises(ValueError, match=r"other settings.*max_steps"):
        ablation_results.merge_results(
            tmp_path / "a" / "ablation.json", [tmp_path / "c" / "ablation.json"]
        )
    ablation.run_grid({"loss": ["ce"]}, [1], settings("d"), **quiet)
    with pytest.raises(ValueError, match="same axes"):
        ablation_results.merge_results(
            tmp_path / "a" / "ablation.json", [tmp_path / "d" / "ablation.json"]
        )
    with pytest.raises(FileNotFoundError, match="no such file"):
        ablation_results.merge_results(tmp_path / "a" / "ablation.json", [tmp_path / "none.json"])


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{not json", "not a results file"),
        ("[1, 2]", "top level is not an object"),
        ('{"format_version": 99, "settings": {}, "runs": {}}', "format_version 99"),
        ('{"format_version": 1, "settings": {}}', '"runs"'),
        ('{"format_version": 1, "settings": {}, "runs": {"k": {"cell": {}}}}', "run 'k' lacks"),
    ],
)
def test_a_file_that_is_not_a_results_file_is_refused_by_name(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = tmp_path / "ablation.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(problem)):
        ablation_results.merge_results(tmp_path / "merged.json", [path])
    with pytest.raises(ValueError, match=re.escape(problem)):
        ablation_results.load_results(path, {})


def test_remeasure_tau_keeps_a_second_tau_beside_the_grid_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake(argv: list[str], *_: object) -> dict:
        tau = {"ce": 2.0, "lk": 2.5}[argv[argv.index("--loss") + 1]]
        return {"overlap": [0.5], "greedy_match": [0.4], "tau": {"0": tau, "1": tau}}

    monkeypatch.setattr(ablation, "train_and_measure", fake)
    settings = ablation.GridSettings(output=tmp_path, recipes=ablation.recipes_for("tiny"))
    results = ablation.run_grid({"loss": ["ce", "lk"]}, [0, 1], settings, log=lambda _: None)
    for record in results["runs"].values():
        run_dir = Path(record["run_dir"])
        (run_dir / "drafter").mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({"target_path": "tiny"}))
    calls: list[tuple] = []

    def measure(target, drafter_dir, source, measure_settings):
        calls.append((target, drafter_dir.parent.name, source, measure_settings.tau_prompts))
        tau = 3.0 if "lk" in drafter_dir.parent.name else 2.0
        return {"0": {"tau": tau, "predicted_tau": tau}, "1": {"tau": tau, "predicted_tau": tau}}

    monkeypatch.setattr(ablation, "measure_tau", measure)
    path = tmp_path / "ablation.json"
    out = ablation.remeasure_tau(path, 32, log=lambda _: None)
    assert len(calls) == 4 and {c[3] for c in calls} == {32} and calls[0][0] == "tiny"
    cells = {c["key"]: c for c in out["cells"]}
    assert cells["loss=lk"]["tau_check"]["prompts"] == 32
    assert cells["loss=lk"]["tau_check"]["tau"]["1"]["mean"] == 3.0
    assert cells["loss=lk"]["gain"]["loss=ce"]["tau_check"]["1"] == pytest.approx(0.5)
    assert cells["loss=lk"]["gain"]["loss=ce"]["tau"]["1"] == pytest.approx(0.25)  # kept
    ablation.remeasure_tau(path, 32, log=lambda _: None)
    assert len(calls) == 4  # resumed: nothing left to measure
    record = next(iter(results["runs"].values()))
    shutil.rmtree(record["run_dir"])
    with pytest.raises(FileNotFoundError, match="lacks summary"):
        ablation.remeasure_tau(path, 16, log=lambda _: None)
    with pytest.raises(ValueError, match="must be >= 1"):
        ablation.remeasure_tau(path, 0)


def test_plot_styles_follow_the_axes_so_one_loss_reads_alike_across_data_and_kinds() -> None:
    ablate = _script()
    grid = ablation.parse_grid(
        ["loss=ce,lk,nla", "data=corpus,regenerated", "kind=draft_lm,eagle3"]
    )
    cells = [
        {"key": ablation_results.cell_key(cell), "cell": cell} for cell in ablation.cells_of(grid)
    ]
    styles = ablate._cell_styles(cells)
    by_loss: dict[str, set] = {}
    by_data: dict[str, set] = {}
    for entry in cells:
        colour, marker = styles[entry["key"]]
        by_loss.setdefault(entry["cell"]["loss"], set()).add(colour)
        by_data.setdefault(entry["cell"]["data"], set()).add(marker)
    assert all(len(colours) == 1 for colours in by_loss.values())
    assert len({next(iter(c)) for c in by_loss.values()}) == 3
    assert all(len(markers) == 1 for markers in by_data.values())
    assert by_data["corpus"] != by_data["regenerated"]


def test_a_run_stopped_by_its_time_box_before_the_step_cap_is_flagged(tmp_path: Path) -> None:
    settings = ablation.GridSettings(output=tmp_path, recipes={}, max_steps=100)
    early = {"stop_reason": "max_minutes", "steps": 59}
    assert "after 59 of 100 steps" in ablation.short_budget(early, settings)
    assert ablation.short_budget({"stop_reason": "max_steps", "steps": 100}, settings) is None
    no_cap = dataclasses.replace(settings, max_steps=None)
    assert ablation.short_budget(early, no_cap) is None  # the time box is the budget


def test_hostile_flags_are_refused_before_the_first_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each of these used to start the grid and fail in every run (a traceback per run, the
    failures written to ablation.json), or to be ignored: now the command stops at once."""
    ablate = _script()

    def no_run(*_: object) -> dict:
        raise AssertionError("a run started before the bad input was refused")

    monkeypatch.setattr(ablation, "train_and_measure", no_run)
    output = tmp_path / "grid"
    base = ["--preset", "tiny", "--output", str(output), "--max-steps", "1"]
    for flags, message in (
        (["--seeds", "-1"], "argument --seeds: must be an integer in 0..4294967295"),
        (["--seeds", str(2**70)], "argument --seeds: must be an integer in 0..4294967295"),
        (["--samples-seed", "-1"], "argument --samples-seed: must be an integer in 0.."),
        (["--temperatures", "-1"], "argument --temperatures: must be a finite number >= 0"),
        (["--temperatures", "nan"], "argument --temperatures: must be a finite number >= 0"),
        (["--merge", "a.json", "--remeasure-tau", "3"], "not allowed with argument --merge"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            ablate.main([*base, *flags])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, flags
    (tmp_path / "afile").write_text("x")
    for flags, error, message in (
        (["--seeds", "0", "0"], ValueError, "--seeds repeats a seed: [0, 0]"),
        (["--max-runs", "0"], ValueError, "--max-runs must be >= 1, got 0"),
        (["--max-steps", "0"], ValueError, "--max-steps must be >= 1, got 0"),
        (["--max-minutes", "nan"], ValueError, "--max-minutes must be a finite number"),
        (["--max-minutes", "inf"], ValueError, "--max-minutes must be a finite number"),
        (["--max-minutes", "-1"], ValueError, "--max-minutes must be a finite number"),
        (["--temperatures", "0", "0.0"], ValueError, "--temperatures repeats a temperature"),
        (["--regen-prompt-tokens", "1"], ValueError, "--regen-prompt-tokens must be >= 2"),
        (["--regen-new-tokens", "0"], ValueError, "--regen-new-tokens must be >= 1"),
        (["--grid", "loss=banana"], ValueError, "cell loss=banana: unknown loss 'banana'"),
        (["--grid", "learning_rate=fast"], ValueError, "invalid float value: 'fast'"),
        (["--set", "banana=1"], ValueError, "--set banana: not a recipe field"),
        (["--set", "max_train_sequences=many"], ValueError, "invalid int value: 'many'"),
        (["--set", "log_every=1", "--set", "log_every=2"], ValueError, "names 'log_every' twice"),
        (["--recipe", "eagle3=missing.yaml"], FileNotFoundError, "eagle3=missing.yaml: no such"),
        (["--baseline", "loss=lk"], ValueError, "of this grid take loss = ce, tv; name one"),
        (["--baseline", "kind=eagle3"], ValueError, "no cell of this grid varies 'kind'"),
        (["--target", str(tmp_path / "none")], FileNotFoundError, "cell loss=ce: --target"),
        (["--output", str(tmp_path / "afile")], ValueError, "afile is a file; pass a folder"),
        (["--output", str(tmp_path / "afile" / "g")], ValueError, "is a file, not a folder"),
    ):
        with pytest.raises(error, match=re.escape(message)):
            ablate.main([*base, *flags])
    assert not output.exists()


def test_a_failed_regeneration_is_one_line_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    ablate = _script()

    def failing(command: list[str], **_: object) -> None:
        raise subprocess.CalledProcessError(2, command)

    monkeypatch.setattr(ablate.subprocess, "run", failing)
    settings = ablate.settings_from(ablate.parse_args(["--output", str(tmp_path)]))
    with pytest.raises(ValueError, match=r"regenerate_data\.py stopped with exit status 2"):
        ablate.prepare_regenerated(settings, "tiny", max_files=None)


def test_a_baseline_may_be_a_cell_an_earlier_grid_left_in_the_results(tmp_path: Path) -> None:
    """As the guide's vocabulary grids do: one grid adds 8192 cells beside the 2048 ones."""
    path = tmp_path / "ablation.json"
    earlier = {"draft_vocab_size": "2048"}
    run = {"cell": earlier, "seed": 0, "tau": {}, "overlap": [], "greedy_match": []}
    results = {"format_version": 1, "settings": {}, "runs": {"draft_vocab_size=2048,seed=0": run}}
    path.write_text(json.dumps(results))
    cells = ablation.cells_of({"draft_vocab_size": ["8192"]})
    ablation.check_baselines({"draft_vocab_size": "2048"}, cells, path)
    with pytest.raises(ValueError, match=r"and the runs in .* take draft_vocab_size = 2048, 8192"):
        ablation.check_baselines({"draft_vocab_size": "4096"}, cells, path)


def test_a_grids_machine_is_its_runs_one_or_the_list_of_those_merged() -> None:
    xeon, epyc = {"cpu": "Xeon"}, {"cpu": "EPYC"}
    runs = {"a": {"machine": xeon}, "b": {"machine": xeon, "tau_check": {"machine": xeon}}}
    assert ablation_results.machine_of(runs) == xeon
    runs["c"] = {"machine": xeon, "tau_check": {"machine": epyc}}  # re-measured elsewhere
    assert ablation_results.machine_of(runs) == [xeon, epyc]
    assert ablation_results.machine_of({"old": {"seed": 0}}) is None  # a record keeps its own


def test_a_block_drafter_is_measured_over_its_whole_block_and_a_chain_at_the_grids_length() -> None:
    from types import SimpleNamespace

    from draftsmith.train.ablation.grid import round_drafts

    assert round_drafts(SimpleNamespace(kind="dflash", max_draft_tokens=7), 4) == 7
    assert round_drafts(SimpleNamespace(kind="eagle3", max_draft_tokens=None), 4) == 4
    assert round_drafts(SimpleNamespace(kind="medusa", max_draft_tokens=4), 3) == 3


def test_a_runs_decoding_times_plain_decoding_beside_the_drafter_and_the_rounds_parts(
    tiny_pair_dirs: tuple[Path, Path],
) -> None:
    """measure_tau decodes the drafter and draftsmith's plain decoding on the same prompts, so
    each run carries its speedup over plain and a round's draft and verify time."""
    target_dir, draft_dir = tiny_pair_dirs
    settings = dataclasses.replace(
        _script().settings_from(_script().parse_args(["--preset", "tiny"])),
        tau_prompts=2,
        tau_new_tokens=8,
        temperatures=(0.0, 1.0),
    )
    measured = ablation.measure_tau(target_dir, draft_dir, "demo", settings)
    assert set(measured) == {"0", "1"}
    for row in measured.values():
        assert row["speedup_over_plain"] == pytest.approx(
            row["tokens_per_s"] / row["plain_tokens_per_s"]
        )
        assert row["plain_step_ms"] > 0 and row["verify_ms_per_round"] > 0
        assert row["draft_ms_per_round"] > 0 and len(row["alpha"]) == settings.num_draft_tokens
    assert set(ablation.DECODE_MEASURES) <= set(measured["0"])
