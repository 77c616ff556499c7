"""The demo target: a normal offline-loadable HF folder, atomic, cached and reused."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import draftsmith.train.target.demo as demo
import pytest
import torch
from draftsmith.train.target.demo import (
    MARKER,
    build_demo_target,
    default_target_path,
    is_complete,
    load_metrics,
)
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_folder_is_a_normal_hf_model_that_reloads_and_generates(tiny_target: Path) -> None:
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (tiny_target / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    assert model.config.vocab_size == len(tokenizer) <= 512
    text = "def main():\n    return 0\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    inputs = tokenizer("import os\n", return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert output.shape[1] == inputs["input_ids"].shape[1] + 8


def test_metrics_report_held_out_loss_accuracy_and_throughput(tiny_target: Path) -> None:
    metrics = load_metrics(tiny_target)
    assert metrics["steps"] == 60  # the session fixture in conftest.py
    assert metrics["tokens_seen"] == 60 * 8 * 64
    assert 0.0 < metrics["test_loss"] < 7.0  # below ln(512) = 6.24 only if it learned a bit
    assert 0.0 <= metrics["test_top1_accuracy"] <= 1.0
    assert metrics["tokens_per_s"] > 0
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    assert metrics["params"] == sum(p.numel() for p in model.parameters())
    assert json.loads((tiny_target / "metrics.json").read_text()) == metrics


def test_second_call_reuses_the_complete_folder(
    tiny_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = tiny_target / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert is_complete(tiny_target)
    assert build_demo_target(tiny_target, preset="tiny") == tiny_target
    assert weights.stat().st_mtime_ns == before
    assert "reusing" in capsys.readouterr().out
    assert not [p for p in tiny_target.parent.iterdir() if p.name.startswith(".")]


def test_an_unrelated_existing_folder_is_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="force"):
        build_demo_target(tmp_path, preset="tiny")
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_a_failed_build_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def explode(folder: Path, *args: object) -> dict[str, object]:
        folder.mkdir(parents=True, exist_ok=True)  # an empty temporary folder is handed in
        (folder / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(demo, "_train_into", explode)
    target = tmp_path / "t"
    with pytest.raises(RuntimeError, match="boom"):
        build_demo_target(target, preset="tiny")
    assert list(tmp_path.iterdir()) == []
    assert not is_complete(target)


def test_force_replaces_a_previous_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake(folder: Path, *args: object) -> dict[str, object]:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MARKER).write_text("tiny\n")
        (folder / "metrics.json").write_text("{}")
        return {}

    monkeypatch.setattr(demo, "_train_into", fake)
    target = tmp_path / "t"
    target.mkdir()
    (target / "stale.bin").write_text("old")
    build_demo_target(target, preset="tiny", force=True, verbose=False)
    assert is_complete(target)
    assert not (target / "stale.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


def test_default_location_is_the_user_cache_keyed_by_preset_and_dtype(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    bench = default_target_path("bench", "float32")
    assert bench.parent == tmp_path / "draftsmith" / "targets"
    assert bench.name.startswith("bench-float32-")
    assert default_target_path("bench", "bfloat16") != bench  # another training dtype
    changed = {**demo.PRESETS, "bench": replace(demo.PRESETS["bench"], learning_rate=7e-4)}
    monkeypatch.setattr(demo, "PRESETS", changed)
    assert default_target_path("bench", "float32") != bench  # a changed preset is a new build
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_target_path().parent == Path.home() / ".cache" / "draftsmith" / "targets"


def test_unknown_preset_is_explained() -> None:
    with pytest.raises(ValueError, match="choose one of demo, bench, tiny"):
        build_demo_target(preset="huge")


def test_presets_match_the_documented_shapes() -> None:
    demo_preset = demo.PRESETS["demo"]
    assert (demo_preset.num_layers, demo_preset.hidden_size, demo_preset.intermediate_size) == (
        8,
        512,
        1408,
    )
    assert demo_preset.hidden_size // demo_preset.num_heads == 64  # heads vLLM's CPU path runs
    assert demo_preset.vocab_size == 8192 and demo_preset.block_size == 256


def test_a_bfloat16_build_trains_under_autocast_and_keeps_float32_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []
    make = demo.make_accelerator

    def recording(**kwargs: object):
        asked.append(str(kwargs.get("mixed_precision")))
        return make(**kwargs)

    monkeypatch.setattr(demo, "make_accelerator", recording)
    folder = build_demo_target(
        tmp_path / "t",
        preset="tiny",
        max_steps=4,
        dtype="bfloat16",
        progress_bar=False,
        verbose=False,
    )
    metrics = load_metrics(folder)
    assert asked == ["bf16"]
    assert metrics["dtype"] == "bfloat16" and metrics["dtype_requested"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the master weights
