"""scripts/benchmark.py end to end on tiny saved models: JSON, table rows and PNG plots."""

from __future__ import annotations

import json
import os

import pytest
from draftsmith.decode.defaults import TREE_TOP_K, TREE_TOTAL_TOKENS
from draftsmith.decode.measure.machine import machine_record
from script_helpers import load_script


def _load_script():
    return load_script("benchmark")


def test_benchmark_writes_report_and_plots(tiny_pair_dirs, tmp_path) -> None:
    from draftsmith.decode.drafters.dflash.head import DFlashConfig, DFlashHead
    from draftsmith.decode.drafters.eagle.peagle import PEagleConfig, PEagleHead
    from transformers import AutoConfig

    target_dir, draft_dir = tiny_pair_dirs
    target_config = AutoConfig.from_pretrained(target_dir)
    peagle = PEagleHead(PEagleConfig.for_target(target_config))
    peagle.save_pretrained(tmp_path / "peagle")
    dflash = DFlashHead(DFlashConfig.for_target(target_config, block_size=3))
    dflash.save_pretrained(tmp_path / "dflash")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nclass Point:\n")
    report = _load_script().main(
        [
            "--target",
            str(target_dir),
            "--draft-lm",
            str(draft_dir),
            "--peagle",
            str(tmp_path / "peagle"),
            "--dflash",
            str(tmp_path / "dflash"),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "10",
            "--num-draft-tokens",
            "3",
            "--temperatures",
            "0",
            "1",
            "--sweep",
            "1",
            "2",
            "--dtype",
            "float32",  # greedy equality token for token (bfloat16 agrees up to near-ties)
            "--plain-also",
            "bfloat16",
            "--tree-frontier",
            "1",
            "--lookup-tokens",
            "5",
            "--adaptive-draft-tokens",
            "5",
            "--json",
            str(tmp_path / "bench.json"),
            "--plots",
            str(tmp_path / "plots"),
        ]
    )
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["by_temperature"].keys() == {"0", "1"}
    assert saved["tree"] == {"top_k": TREE_TOP_K, "total_tokens": TREE_TOTAL_TOKENS, "frontier": 1}
    assert saved["lookup_tokens"] == 5  # prompt lookup copies past N = 3
    assert saved["adaptive_draft_tokens"] == 5  # adaptive rows have room past N = 3
    greedy = {row["method"]: row for row in report["by_temperature"]["0"]}
    assert set(greedy) >= {
        "plain (HF generate)",
        "HF assisted (draft LM)",
        "HF prompt lookup",
        "draftsmith plain (no drafter)",
        "draftsmith n-gram",
        "draftsmith draft LM",
        "draftsmith draft LM (adaptive N)",
        "draftsmith P-EAGLE chain",
        "draftsmith hybrid: lookup + P-EAGLE",
    }
    for name in (
        "draftsmith plain (no drafter)",
        "draftsmith n-gram",
        "draftsmith draft LM",
        "draftsmith draft LM (adaptive N)",
        "draftsmith P-EAGLE chain",
    ):
        assert greedy[name]["greedy_equal_to_plain"] == 2  # exact at temperature 0
    assert greedy["draftsmith plain (no drafter)"]["tau"] == 1.0
    best = saved["best_against_hf"]["0"]
    assert best["draftsmith"] != "draftsmith plain (no drafter)"  # the control is not a method
    assert not best["hf"].startswith("draftsmith")
    assert best["ratio"] == greedy[best["draftsmith"]]["tokens_per_s"] / max(
        row["tokens_per_s"] for name, row in greedy.items() if not name.startswith("draftsmith")
    )
    plain_rows = ("draftsmith plain (no drafter)", "draftsmith plain, bfloat16")
    fastest = max(greedy[name]["tokens_per_s"] for name in plain_rows)
    assert best["over_draftsmith_plain"] == greedy[best["draftsmith"]]["tokens_per_s"] / fastest
    assert best["fastest_plain"] in plain_rows
    assert saved["dtype"] == "float32" and saved["plain_also"] == ["bfloat16"]
    here = machine_record("cpu")  # every figure names its machine
    assert {k: saved["machine"][k] for k in ("cpu", "cpu_kernels", "torch")} == {
        k: here[k] for k in ("cpu", "cpu_kernels", "torch")
    }
    for name, row in greedy.items():
        assert row["speedup_over_fastest_plain"] == row["tokens_per_s"] / fastest
        assert 0.0 < row["distinct_4gram_share"] <= 1.0
        projected = row["gpu_projected_speedup"]
        assert (projected is None) == (not name.startswith("draftsmith")), name
    share = saved["drafter_flop_share"]["peagle"]
    assert 0.0 < share < 1.0  # a one-layer head against a two-layer target
    peagle = greedy["draftsmith P-EAGLE chain"]
    assert peagle["gpu_projected_speedup"] == pytest.approx(peagle["tau"] / (1.0 + share))
    for row in greedy.values():  # linux: the high-water mark, and what the call added to it
        assert row["peak_memory_mb"] > 0 and 0 <= row["extra_memory_mb"] <= row["peak_memory_mb"]
    assert set(saved["sweep"]) == {"ngram", "draft_lm", "peagle", "dflash"}
    assert set(saved["sweep"]["dflash"]) == {1, 2} or set(saved["sweep"]["dflash"]) == {"1", "2"}
    block = greedy["draftsmith DFlash block"]  # one pass per round, B - 1 = 2 drafts
    assert block["gpu_projected_speedup"] == pytest.approx(
        block["tau"] / (1.0 + saved["drafter_flop_share"]["dflash"])
    )
    for png in ("acceptance_t0.png", "speedup_t1.png", "speedup_vs_draft_length.png"):
        assert (tmp_path / "plots" / png).stat().st_size > 1000


def test_hostile_flags_are_refused_before_loading(tmp_path, capsys) -> None:
    """Values given twice (rows and plots would overwrite each other), counts below 1, bad
    temperatures, and output paths that cannot be written: refused before any model loads."""
    script = _load_script()
    base = ["--target", str(tmp_path / "no-target"), "--json", str(tmp_path / "b.json"),
            "--plots", str(tmp_path / "plots")]  # fmt: skip
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for flags, message in (
        (["--temperatures", "0", "0.0"], "--temperatures names 0 more than once"),
        (["--sweep", "2", "2"], "--sweep names 2 more than once"),
        (["--prompts", "demo", "demo"], "--prompts names demo more than once"),
        (["--prompts", str(tmp_path / "a/x.txt"), str(tmp_path / "b/x.jsonl")], "named x"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--sweep", "0"], "argument --sweep: must be an integer >= 1"),
        (["--temperatures", "nan"], "argument --temperatures: must be a finite number"),
        (["--max-new-tokens", "-1"], "argument --max-new-tokens: must be an integer >= 1"),
        (["--tree-frontier", "-1"], "tree frontier must lie"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            script.parse_args([*base, *flags])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, flags
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ValueError, match=r"--plots .* is a file; pass a folder"):
        script.main([*base[:4], "--plots", str(afile)])
    with pytest.raises(ValueError, match=r"--json .* is a folder"):
        script.main([*base[:2], "--json", str(tmp_path), *base[4:]])
    with pytest.raises(ValueError, match="is a folder; pass a file in it"):
        script.main([*base, "--prompts", str(tmp_path)])


def test_a_broken_eval_results_file_is_a_clear_error(tmp_path) -> None:
    script = _load_script()
    (tmp_path / "eval_results.json").write_bytes(b"{not json")
    with pytest.raises(ValueError, match=r"eval_results\.json is not UTF-8 JSON"):
        script.held_out_overlap(str(tmp_path))
    (tmp_path / "eval_results.json").write_text('{"overlap@x": 1, "overlap@2": 0.5}')
    assert script.held_out_overlap(str(tmp_path)) == [0.5]


def test_engine_flags_are_refused_before_loading(tmp_path, capsys) -> None:
    script = _load_script()
    base = ["--target", str(tmp_path / "no-target"), "--json", str(tmp_path / "b.json"),
            "--plots", str(tmp_path / "plots")]  # fmt: skip
    python = tmp_path / "python"
    python.write_text("")
    for flags, message in (
        (["--vllm", "--engine-python", str(tmp_path / "nope")], "no such file"),
        (["--vllm-head", str(tmp_path / "nowhere"), "--engine-python", str(python)],
         "--vllm-head"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            script.parse_args([*base, *flags])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, flags


def test_engine_summary_sets_vllm_beside_the_runs_own_rows() -> None:
    from draftsmith.scripts.engine_rows import VLLM_HEAD, VLLM_PLAIN, engine_summary

    engine = {
        "engine": "vllm 0.32.0",
        "rows": [
            {"engine_row": "plain", "temperature": 0.0, "tokens_per_s": 100.0, "tau": 1.0,
             "accepted_per_position": [], "outputs": [[1, 2], [3, 4]]},
            {"engine_row": "head", "temperature": 0.0, "tokens_per_s": 200.0, "tau": 2.5,
             "accepted_per_position": [5, 3], "outputs": [[1, 2], [3, 5]]},
            {"engine_row": "head", "temperature": 1.0, "tokens_per_s": 1.0, "tau": 1.0,
             "accepted_per_position": [], "outputs": [[9], [9]]},
        ],
    }  # fmt: skip
    ours = [
        {"method": "draftsmith plain (no drafter)", "tokens_per_s": 120.0},
        {"method": "draftsmith plain, float32", "tokens_per_s": 80.0},
        {"method": "draftsmith EAGLE-3 chain", "tokens_per_s": 300.0},
        {"method": "plain (HF generate)", "tokens_per_s": 500.0},  # not draftsmith's
    ]
    summary = engine_summary(engine, 0.0, ours, [[1, 2], [3, 4]])
    assert set(summary["rows"]) == {VLLM_PLAIN, VLLM_HEAD}
    assert summary["rows"][VLLM_HEAD]["over_draftsmith_fastest_plain"] == pytest.approx(200 / 120)
    assert summary["rows"][VLLM_PLAIN]["greedy_equal_to_draftsmith_plain"] == 2
    assert summary["rows"][VLLM_HEAD]["greedy_equal_to_draftsmith_plain"] == 1
    assert summary["draftsmith_best"] == "draftsmith EAGLE-3 chain"
    assert summary["vllm_best"] == VLLM_HEAD
    assert summary["draftsmith_best_over_vllm_best"] == pytest.approx(1.5)
    sampled = engine_summary(engine, 1.0, ours, [])
    assert set(sampled["rows"]) == {VLLM_HEAD}
    assert "greedy_equal_to_draftsmith_plain" not in sampled["rows"][VLLM_HEAD]


ENGINE_PYTHON = os.environ.get("DRAFTSMITH_ENGINE_PYTHON")


@pytest.mark.engines
@pytest.mark.slow
@pytest.mark.skipif(not ENGINE_PYTHON, reason="set DRAFTSMITH_ENGINE_PYTHON to a Python with vLLM")
def test_vllm_rows_run_on_the_same_prompts(tmp_path) -> None:
    """vLLM's plain and head rows on the benchmark's prompts: float32 greedy output equals
    draftsmith's plain output on every prompt, and the head drafts."""
    import torch
    from draftsmith.decode.drafters.eagle.head import Eagle3Config, Eagle3Head
    from draftsmith.scripts.engine_rows import VLLM_HEAD, VLLM_PLAIN
    from draftsmith.train.export.formats import export_eagle3
    from tiny_models import tiny_causal_lm, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    target = tiny_causal_lm(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_layers=2,
        dtype=torch.float32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )  # fmt: skip  (vLLM's CPU attention refuses head_dim 16)
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    head = Eagle3Head(Eagle3Config.for_target(target.config))
    head.save_pretrained(tmp_path / "eagle3")
    folder = export_eagle3(head, tmp_path / "eagle3_vllm", "vllm")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nclass Point:\n")
    report = _load_script().main(
        ["--target", str(tmp_path / "target"), "--eagle3", str(tmp_path / "eagle3"),
         "--vllm-head", str(folder), "--engine-python", ENGINE_PYTHON,
         "--prompts", str(prompts), "--max-new-tokens", "8", "--num-draft-tokens", "3",
         "--temperatures", "0", "1", "--sweep", "--dtype", "float32", "--plain-also", "",
         "--repeats", "1", "--json", str(tmp_path / "r.json"), "--plots", str(tmp_path / "p")]
    )  # fmt: skip
    engine = report["prompt_sets"][str(prompts)]["engine"]
    assert set(engine) == {"0", "1"}
    greedy = engine["0"]["rows"]
    assert greedy[VLLM_PLAIN]["greedy_equal_to_draftsmith_plain"] == 2
    assert greedy[VLLM_HEAD]["greedy_equal_to_draftsmith_plain"] == 2
    assert all(row["tokens_per_s"] > 0 for row in greedy.values())
