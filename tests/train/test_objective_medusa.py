"""Medusa objective: head i against the target's law i+1 ahead, learning per head, cache ==
online, exports decode the target's greedy output, and train/distill.py end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from draftsmith.decode.drafters.base import TreeSpec
from draftsmith.decode.drafters.medusa import MedusaHeads
from draftsmith.train.losses import build_loss
from draftsmith.train.objectives.medusa import MedusaObjective
from objective_helpers import (
    CONFIGS,
    assert_aligned_with_greedy_labels,
    assert_decodes_greedy_output,
    bind,
    cached_batch,
    sampled_batch,
    train,
    train_on_own_text,
)
from tiny_models import tiny_llama


def make_objective(
    target: torch.nn.Module, loss: str = "fkl", num_heads: int = 3, **kwargs
) -> MedusaObjective:
    heads = MedusaHeads.from_target(target, num_heads).float()
    return bind(MedusaObjective(heads, target, build_loss(loss), **kwargs))


def test_head_i_is_compared_with_the_targets_law_of_the_token_it_guesses() -> None:
    """On greedy text the target's argmax at t+1+i is x_{t+2+i}; untrained heads are the LM head."""
    target = tiny_llama(num_layers=2)
    batch = sampled_batch(target, rows=3, length=20, seed=1, temperature=0.0)
    objective = make_objective(target)
    hidden, target_logits = objective._target_outputs(batch)
    logits = objective.module(hidden)  # 3 x [B, T-2-i, V]
    for i in range(3):  # zero residual blocks: each head starts as the target's own head
        expected = target_logits[:, : 20 - 2 - i]
        torch.testing.assert_close(logits[i].double(), expected, rtol=1e-4, atol=1e-4)
    weights = assert_aligned_with_greedy_labels(
        objective._aligned(batch, logits, target_logits), 20, 3
    )
    assert weights == pytest.approx([0.8**i for i in range(3)])


def test_training_lowers_the_loss_and_raises_held_out_overlap_per_head() -> None:
    target = tiny_llama(num_layers=2, dtype=torch.float32)
    objective = make_objective(target, loss="fkl")
    before, after, _ = train_on_own_text(objective, target)
    for j in (1, 2, 3):
        assert after[f"overlap@{j}"] > before[f"overlap@{j}"] + 0.03, (j, before, after)
    describe = objective.describe()
    assert describe["num_heads"] == 3 and describe["trainable_parameters"] > 0


def test_offline_cache_gives_the_online_loss(tmp_path: Path) -> None:
    target = tiny_llama(num_layers=2, dtype=torch.float32)
    batch = sampled_batch(target, rows=4, length=20, seed=4)
    objective = make_objective(target, loss="0.5*fkl+0.5*tv")
    layers = objective.target_cache_hidden_layers()
    assert layers == [2]  # the post-norm last hidden state
    cached = cached_batch(target, batch, tmp_path, 64, layers)
    online, _ = objective.compute_loss(batch)
    offline, _ = objective.compute_loss(cached)
    assert float(offline.detach()) == pytest.approx(float(online.detach()), rel=1e-3)
    del cached["hidden_states"]
    with pytest.raises(ValueError, match="without hidden states"):
        objective.compute_loss(cached)


def test_bad_settings_name_the_problem() -> None:
    target = tiny_llama(num_layers=2)
    for fmt in ("sglang", "speculators"):
        with pytest.raises(ValueError, match=f"{fmt} has no Medusa layout"):
            make_objective(target, export_formats=(fmt,))
    with pytest.raises(ValueError, match="gives 2 weights for 3"):
        make_objective(target, head_weights=[1.0, 0.5])
    other = tiny_llama(num_layers=2, hidden_size=16)
    with pytest.raises(ValueError, match=r"MedusaHeads\.from_target"):
        MedusaObjective(MedusaHeads.from_target(other, 2), target, build_loss("tv"))


def test_exported_heads_decode_exactly_the_targets_greedy_output(tmp_path: Path) -> None:
    target = tiny_llama(num_layers=2)  # float64: no argmax ties between decoding paths
    objective = make_objective(target, export_formats=("vllm",))
    train(objective, sampled_batch(target, rows=8, length=32, seed=5), steps=15)
    folder = tmp_path / "drafter"
    objective.save_drafter(folder)
    assert json.loads((folder / "drafter.json").read_text())["kind"] == "medusa"
    assert json.loads((folder / "vllm" / "config.json").read_text())["architectures"] == [
        "MedusaModel"
    ]
    trees = [None, TreeSpec(choices=((0,), (1,), (0, 0), (1, 0), (0, 0, 0)))]
    assert_decodes_greedy_output(target, [folder, folder / "vllm"], "medusa", trees)


def test_distill_main_trains_and_exports_medusa_heads(tiny_argv, tmp_path: Path) -> None:
    from draftsmith.train.distill import main

    argv = tiny_argv(tmp_path / "run", "--max_steps", "6", "--export_format", "vllm")
    summary = main(["--config", str(CONFIGS / "tiny_medusa.yaml"), *argv[2:]])
    held_out = summary["held_out"]
    assert all(0.0 < held_out[f"overlap@{j}"] <= 1.0 for j in (1, 2, 3))
    folder = Path(summary["drafter_dir"])
    assert "| 3 |" in (folder / "README.md").read_text()
    heads = MedusaHeads.from_pretrained(folder / "vllm")
    assert heads.config.num_heads == 3
