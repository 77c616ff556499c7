"""EAGLE-3 objective: alignment, training-time test learns, pruned vocabulary, cache == online,
exports decode the target's greedy output, and train/distill.py end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from draftsmith.decode.drafters.base import TreeSpec
from draftsmith.decode.drafters.eagle.head import Eagle3Config, Eagle3Head
from draftsmith.train.losses import build_loss
from draftsmith.train.objectives.eagle3 import Eagle3Objective, count_tokens
from draftsmith.train.objectives.heads import future_mask
from objective_helpers import (
    CONFIGS,
    assert_aligned_with_greedy_labels,
    assert_decodes_greedy_output,
    bind,
    cached_batch,
    means,
    sampled_batch,
    train,
    train_on_own_text,
)
from tiny_models import tiny_llama


def make_objective(target: torch.nn.Module, loss: str = "fkl", **kwargs) -> Eagle3Objective:
    config_overrides = {
        k: kwargs.pop(k) for k in ("draft_vocab_size", "aux_hidden_state_layer_ids") if k in kwargs
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        head = Eagle3Head(Eagle3Config.for_target(target.config, **config_overrides))
    return Eagle3Objective(head, target, build_loss(loss), **kwargs)


# -- draft vocabulary ---------------------------------------------------------------------------
def test_count_tokens_counts_labels_only_and_rejects_foreign_ids() -> None:
    rows = [{"input_ids": [1, 2, 2, 3], "loss_mask": [0, 1, 1, 0]}, {"input_ids": [3, 3]}]
    assert count_tokens(rows, 5).tolist() == [0, 0, 2, 2, 0]
    with pytest.raises(ValueError, match="another tokenizer"):
        count_tokens([{"input_ids": [7]}], 5)


# -- alignment and learning ---------------------------------------------------------------------
def test_step_k_targets_are_the_targets_law_of_the_label_it_predicts() -> None:
    """On the target's own greedy text the target's argmax at t+1+k is exactly x_{t+2+k}."""
    target = tiny_llama(num_layers=4)
    batch = sampled_batch(target, rows=3, length=20, seed=1, temperature=0.0)
    objective = bind(make_objective(target, unroll_steps=3))
    _, target_logits = objective._target_outputs(batch)
    steps = objective._unroll(batch, objective._target_outputs(batch)[0])
    assert_aligned_with_greedy_labels(objective._aligned(batch, steps, target_logits), 20, 3)


def test_training_time_test_lowers_the_loss_and_raises_held_out_overlap_per_step() -> None:
    target = tiny_llama(num_layers=4, dtype=torch.float32)
    objective = bind(make_objective(target, loss="tv", unroll_steps=3))
    before, after, held_out = train_on_own_text(objective, target)
    for j in (1, 2, 3):
        assert after[f"overlap@{j}"] > before[f"overlap@{j}"] + 0.1, (j, before, after)
        assert 0.0 <= after[f"greedy_match@{j}"] <= 1.0
    # Weighted loss: the mean of the per-step losses under weights 1, 0.8, 0.64.
    loss, metrics = objective.compute_loss(held_out)
    per_step = [metrics[f"loss@{j}"] for j in (1, 2, 3)]
    expected = sum(w * v for w, v in zip((1, 0.8, 0.64), per_step, strict=True)) / 2.44
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)


def test_pruned_vocabulary_comes_from_label_counts_and_overlap_stays_in_target_vocab() -> None:
    target = tiny_llama(num_layers=4, dtype=torch.float32)
    batch = sampled_batch(target, rows=8, length=24, seed=3)
    objective = make_objective(target, loss="fkl+0.1*ce", draft_vocab_size=20, unroll_steps=2)
    rows = [
        {"input_ids": ids.tolist(), "loss_mask": mask.tolist()}
        for ids, mask in zip(batch["input_ids"], batch["loss_mask"], strict=True)
    ]
    objective.prepare(rows)
    head = objective.head
    counts = count_tokens(rows, 64)
    kept = head.draft_to_target_ids
    assert kept.tolist() == sorted(kept.tolist())
    assert counts[kept].min() >= counts[~head.t2d].max()
    assert objective.vocab_coverage == pytest.approx(float(counts[kept].sum() / counts.sum()))
    # The LM head starts as the target's rows of the kept tokens.
    torch.testing.assert_close(head.lm_head.weight, target.lm_head.weight[kept])
    bind(objective)
    train(objective, batch, steps=5)
    metrics = means(objective.evaluate(batch))
    # q is zero outside the draft vocabulary, so the overlap cannot exceed p's mass inside it.
    _, target_logits = objective._target_outputs(batch)
    inside = torch.softmax(target_logits, -1)[..., kept].sum(-1)  # [B, T]
    mask = torch.zeros_like(inside, dtype=torch.bool)
    mask[:, 1:-1] = future_mask(batch, 2)
    assert 0 < metrics["overlap@1"] <= float(inside[mask].mean()) + 1e-6
    assert metrics["draftable_mass"] == pytest.approx(float(inside[mask].mean()), rel=1e-5)
    assert objective.describe()["draft_vocab_size"] == 20
    full = bind(make_objective(target, loss="fkl", unroll_steps=2))
    assert "draftable_mass" not in full.evaluate(batch)  # nothing pruned, nothing to cap


def test_offline_cache_gives_the_online_loss(tmp_path: Path) -> None:
    target = tiny_llama(num_layers=4, dtype=torch.float32)
    batch = sampled_batch(target, rows=4, length=20, seed=4)
    objective = bind(make_objective(target, loss="0.5*fkl+0.5*tv", unroll_steps=2))
    layers = objective.target_cache_hidden_layers()
    assert layers == sorted(set(objective.head.config.aux_hidden_state_layer_ids))
    online, _ = objective.compute_loss(batch)
    for k, folder in ((64, tmp_path / "full"), (16, tmp_path / "top16")):
        cached = cached_batch(target, batch, folder, k, layers)
        offline, _ = objective.compute_loss(cached)
        tolerance = 1e-3 if k == 64 else 0.02  # fp16 storage; top-16 also flattens the tail
        assert float(offline.detach()) == pytest.approx(float(online.detach()), rel=tolerance)
    del cached["hidden_states"]
    with pytest.raises(ValueError, match="without hidden states"):
        objective.compute_loss(cached)


def test_bad_settings_name_the_problem() -> None:
    target = tiny_llama(num_layers=4)
    with pytest.raises(ValueError, match="unroll_steps must be >= 1"):
        make_objective(target, unroll_steps=0)
    with pytest.raises(ValueError, match="gives 2 weights for 3"):
        make_objective(target, unroll_steps=3, step_weights=[1.0, 0.5])
    with pytest.raises(ValueError, match="built for another target"):
        head = Eagle3Head(Eagle3Config.for_target(tiny_llama(num_layers=6).config))
        Eagle3Objective(head, target, build_loss("tv"))


# -- export and decoding ------------------------------------------------------------------------
def test_exported_heads_decode_exactly_the_targets_greedy_output(tmp_path: Path) -> None:
    target = tiny_llama(num_layers=4)  # float64: no argmax ties between decoding paths
    batch = sampled_batch(target, rows=8, length=32, seed=5)
    objective = bind(make_objective(target, export_formats=("vllm", "sglang"), unroll_steps=3))
    train(objective, batch, steps=20)
    folder = tmp_path / "drafter"
    objective.save_drafter(folder)
    assert json.loads((folder / "drafter.json").read_text())["kind"] == "eagle3"
    assert_decodes_greedy_output(
        target,
        [folder, folder / "vllm", folder / "sglang"],
        "eagle3",
        [None, TreeSpec(top_k=3, total_tokens=10)],
    )


def test_distill_main_trains_and_exports_an_eagle3_head(tiny_argv, tmp_path: Path) -> None:
    from draftsmith.train.distill import main

    argv = tiny_argv(tmp_path / "run", "--max_steps", "6", "--export_format", "vllm")
    summary = main(["--config", str(CONFIGS / "tiny_eagle3.yaml"), *argv[2:]])
    held_out = summary["held_out"]
    assert {f"overlap@{j}" for j in (1, 2, 3)} <= set(held_out)
    assert all(0.0 < held_out[f"overlap@{j}"] <= 1.0 for j in (1, 2, 3))
    folder = Path(summary["drafter_dir"])
    card = (folder / "README.md").read_text()
    assert "| 3 |" in card and "eagle3" in card
    config = json.loads((folder / "vllm" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]

    cached = main(
        [
            "--config",
            str(CONFIGS / "tiny_eagle3.yaml"),
            *argv[2:4],
            "--output_dir",
            str(tmp_path / "cached"),
            "--max_steps",
            "4",
            "--target_outputs",
            "cache",
            "--draft_vocab_size",
            "300",
            "--eval_sequences",
            "4",
        ]
    )
    assert cached["cache"]["num_sequences"] > 0
    meta = json.loads((tmp_path / "cached" / "target_cache" / "cache.json").read_text())
    # The 2-layer target's two distinct states (embedding output and layer 0's output).
    assert meta["has_hidden_states"] and meta["hidden_layer_ids"] == [0, 1]
    head = Eagle3Head.from_pretrained(cached["drafter_dir"])
    assert head.config.draft_vocab_size == 300 and int(head.t2d.sum()) == 300


def test_an_sglang_export_the_head_cannot_take_is_refused_before_training() -> None:
    """A 2-layer target's default ids read the embedding output (id 0), which SGLang cannot
    capture: refused when the objective is built, not after training at export."""
    with pytest.raises(ValueError, match="read the embedding output"):
        make_objective(tiny_llama(num_layers=2), export_formats="sglang")
    assert make_objective(tiny_llama(num_layers=2), export_formats="vllm").export_formats
