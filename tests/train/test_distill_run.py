"""train/distill.py end to end on the tiny recipe: export, overlap, cache, LoRA, on-policy."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from draftsmith.train.distill import main
from draftsmith.train.tracking import read_metrics_log
from transformers import AutoModelForCausalLM

Argv = Callable[..., list[str]]


def test_tiny_run_exports_the_drafter_folder(
    tmp_path: Path, tiny_argv: Argv, tiny_target: Path
) -> None:
    summary = main(tiny_argv(tmp_path, "--max_steps", "6", "--checkpoint_every", "2"))
    drafter = tmp_path / "drafter"
    assert json.loads((drafter / "drafter.json").read_text())["kind"] == "draft_lm"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        assert (drafter / name).is_file(), name
    provenance = json.loads((drafter / "provenance.json").read_text())
    assert provenance["config"]["optim"]["max_steps"] == 6
    assert provenance["packages"]["torch"] == torch.__version__
    assert "git" in provenance
    card = (drafter / "README.md").read_text()
    assert f"{summary['held_out']['overlap@1']:.4f}" in card
    assert "| draft position | overlap | greedy match |" in card
    assert summary["dtype"] == "float32" and summary["mixed_precision"] == "no"  # the tiny recipe
    assert "- dtype: float32 (target in float32, mixed precision no" in card
    model = AutoModelForCausalLM.from_pretrained(drafter)
    target = AutoModelForCausalLM.from_pretrained(tiny_target)
    assert model.config.num_hidden_layers == 1
    assert model.get_output_embeddings().weight.shape == target.get_output_embeddings().weight.shape
    # Checkpoints at 2, 4, 6, the last 2 kept; the log holds steps 1..6.
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["checkpoint-0000004", "checkpoint-0000006"]
    # Each checkpoint carries the export's provenance (the same config, code and versions).
    for name in names:
        recorded = json.loads((tmp_path / "checkpoints" / name / "provenance.json").read_text())
        assert recorded["config"] == provenance["config"]
        assert recorded["packages"] == provenance["packages"]
        assert (recorded["git"] or {}).get("commit") == (provenance["git"] or {}).get("commit")
    steps = [
        r["step"]
        for r in read_metrics_log(tmp_path / "logs" / "metrics.jsonl")
        if "train/loss" in r
    ]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert summary["world_size"] == 1 and summary["steps"] == 6
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 6


def test_decode_loads_the_exported_drafter(
    tmp_path: Path, tiny_argv: Argv, tiny_target: Path
) -> None:
    from draftsmith.decode.drafters.registry import detect_drafter_kind, load_drafter

    main(tiny_argv(tmp_path, "--max_steps", "2"))
    target = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    assert detect_drafter_kind(tmp_path / "drafter") == "draft_lm"
    drafter = load_drafter(tmp_path / "drafter", target)
    assert drafter.kind == "draft_lm"
    assert drafter.vocab_size == target.get_output_embeddings().weight.shape[0]


def test_distillation_raises_held_out_overlap(tmp_path: Path, tiny_argv: Argv) -> None:
    main(
        tiny_argv(
            tmp_path,
            "--max_steps",
            "30",
            "--eval_every",
            "1",
            "--checkpoint_every",
            "0",
            "--learning_rate",
            "0.005",
        )
    )
    records = read_metrics_log(tmp_path / "logs" / "metrics.jsonl")
    overlaps = [r["eval/overlap@1"] for r in records if "eval/overlap@1" in r]
    assert len(overlaps) == 30
    assert overlaps[-1] > overlaps[0] + 0.05, overlaps


def test_offline_cache_is_smaller_than_logits_and_reused(tmp_path: Path, tiny_argv: Argv) -> None:
    argv = tiny_argv(
        tmp_path / "run",
        "--target_outputs",
        "cache",
        "--cache_top_k",
        "8",
        "--cache_dir",
        str(tmp_path / "cache"),
        "--max_steps",
        "4",
    )
    summary = main(argv)
    cache = summary["cache"]
    assert cache["k"] == 8 and cache["num_sequences"] == 4 * 4  # max_steps x batch
    assert cache["full_fp16_bytes_per_token"] == 2 * 512
    assert cache["bytes_per_token"] < cache["full_fp16_bytes_per_token"] / 5
    assert "bytes/token" in (tmp_path / "run" / "drafter" / "README.md").read_text()
    shard = next((tmp_path / "cache").glob("shard-*.safetensors"))
    before = shard.stat().st_mtime_ns
    main([*argv, "--overwrite_output_dir"])
    assert shard.stat().st_mtime_ns == before
    main([*argv, "--overwrite_output_dir", "--seed", "1"])  # same rows, another training seed
    assert shard.stat().st_mtime_ns == before


def test_lora_trains_adapters_and_exports_merged_weights(tmp_path: Path, tiny_argv: Argv) -> None:
    summary = main(
        tiny_argv(tmp_path, "--lora_rank", "4", "--max_steps", "3", "--learning_rate", "0.01")
    )
    assert summary["held_out"]["overlap@1"] > 0
    card = (tmp_path / "drafter" / "README.md").read_text()
    assert '"lora": true' in card
    from safetensors import safe_open

    with safe_open(str(tmp_path / "drafter" / "model.safetensors"), "pt") as handle:
        keys = list(handle.keys())
    assert keys and not [k for k in keys if "lora" in k]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "drafter")
    assert type(model).__name__ == "LlamaForCausalLM"


def test_a_missing_demo_target_is_built_on_every_core_under_accelerate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`accelerate launch` starts one process with OMP_NUM_THREADS=1: the build must not
    inherit it (it did, and trained the demo target on one core of two)."""
    from draftsmith.decode import cpu_threads
    from draftsmith.train.target import model as target_model

    class Built(Exception):
        pass

    threads_at_build: list[int] = []

    def build(ref: object, allow_build: bool = True) -> tuple[str, str]:
        threads_at_build.append(torch.get_num_threads())
        raise Built

    before = torch.get_num_threads()
    monkeypatch.delenv("DRAFTSMITH_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 2)
    monkeypatch.setattr(target_model, "target_location", build)
    torch.set_num_threads(1)
    try:
        with pytest.raises(Built):
            main(["--output_dir", str(tmp_path / "run")])
    finally:
        torch.set_num_threads(before)
    assert threads_at_build == [2]
