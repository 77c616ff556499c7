"""Medusa objective: head i against the target's law i+1 ahead, learning per head, cache ==
online, exports decode the target's greedy output, and train/distill.py end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_llama

from decode.drafters.base import TreeSpec
from decode.drafters.medusa import MedusaHeads
from decode.drafters.registry import load_drafter
from decode.engine import SpeculativeDecoder
from decode.sampling import SamplingConfig
from train.generation import sample_continuations
from train.loop import make_accelerator
from train.losses import build_loss
from train.objectives.medusa import MedusaObjective

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def sampled_batch(
    target: torch.nn.Module, rows: int, length: int, seed: int, temperature: float = 1.0
) -> dict[str, torch.Tensor]:
    """Sequences the target writes itself from 4 random prompt tokens; the continuation counts."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, target.config.vocab_size, (rows, 4), generator=generator)
    out = sample_continuations(
        target,
        prompt,
        torch.ones_like(prompt),
        length - 4,
        SamplingConfig(temperature=temperature),
        generator,
    )
    input_ids = torch.cat((prompt, out.tokens), dim=1)
    loss_mask = torch.ones_like(input_ids)
    loss_mask[:, :4] = 0
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "loss_mask": loss_mask,
    }


def make_objective(
    target: torch.nn.Module, loss: str = "fkl", num_heads: int = 3, **kwargs
) -> MedusaObjective:
    heads = MedusaHeads.from_target(target, num_heads).float()
    objective = MedusaObjective(heads, target, build_loss(loss), **kwargs)
    objective.bind(objective.trainable_module(), make_accelerator(cpu=True))
    return objective


def train(objective: MedusaObjective, batch: dict, steps: int, lr: float = 3e-3) -> list[float]:
    optimizer = torch.optim.AdamW(objective.trainable_module().parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss, _ = objective.compute_loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def means(sums: dict[str, tuple[float, float]]) -> dict[str, float]:
    return {name: total / weight for name, (total, weight) in sums.items()}


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
    seen = 0
    for i, (weight, draft, target_i, mask, labels) in enumerate(
        objective._aligned(batch, logits, target_logits)
    ):
        assert weight == pytest.approx(0.8**i)
        assert draft.shape[1] == target_i.shape[1] == 20 - 2 - i
        assert torch.equal(target_i.argmax(-1)[mask], labels[mask])
        seen += 1
    assert seen == 3


def test_training_lowers_the_loss_and_raises_held_out_overlap_per_head() -> None:
    target = tiny_llama(num_layers=2, dtype=torch.float32)
    train_batch = sampled_batch(target, rows=16, length=32, seed=1)
    held_out = sampled_batch(target, rows=8, length=32, seed=2)
    objective = make_objective(target, loss="fkl")
    before = means(objective.evaluate(held_out))
    losses = train(objective, train_batch, steps=40)
    after = means(objective.evaluate(held_out))
    assert losses[-1] < 0.7 * losses[0]
    assert after["loss"] < before["loss"]
    for j in (1, 2, 3):
        assert after[f"overlap@{j}"] > before[f"overlap@{j}"] + 0.03, (j, before, after)
    describe = objective.describe()
    assert describe["num_heads"] == 3 and describe["trainable_parameters"] > 0


def test_offline_cache_gives_the_online_loss(tmp_path: Path) -> None:
    from data.cache import TargetCache, TargetCacheWriter, collate_cached

    target = tiny_llama(num_layers=2, dtype=torch.float32)
    batch = sampled_batch(target, rows=4, length=20, seed=4)
    objective = make_objective(target, loss="0.5*fkl+0.5*tv")
    layers = objective.target_cache_hidden_layers()
    assert layers == [2]  # the post-norm last hidden state
    with torch.no_grad(), TargetCacheWriter(tmp_path, 64, hidden_layer_ids=layers) as writer:
        out = target(batch["input_ids"], output_hidden_states=True)
        for row in range(4):
            hidden = torch.stack([out.hidden_states[i][row] for i in layers])
            writer.add(batch["input_ids"][row], out.logits[row], hidden)
    cache = TargetCache(tmp_path)
    cached = collate_cached([cache[i] for i in range(4)], pad_token_id=0)
    cached["loss_mask"] = batch["loss_mask"]
    online, _ = objective.compute_loss(batch)
    offline, _ = objective.compute_loss(cached)
    assert float(offline.detach()) == pytest.approx(float(online.detach()), rel=1e-3)
    del cached["hidden_states"]
    with pytest.raises(ValueError, match="without hidden states"):
        objective.compute_loss(cached)


def test_bad_settings_name_the_problem() -> None:
    target = tiny_llama(num_layers=2)
    with pytest.raises(ValueError, match="SGLang loads no Medusa layout"):
        make_objective(target, export_formats=("sglang",))
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
    prompt = torch.tensor([[5, 9, 11, 3, 7, 8], [0, 0, 4, 13, 6, 21]])
    mask = (prompt != 0).long()
    with torch.no_grad():
        expected = target.generate(
            input_ids=prompt, attention_mask=mask, max_new_tokens=20, do_sample=False
        )
    for path in (folder, folder / "vllm"):
        drafter = load_drafter(path, target)
        assert drafter.kind == "medusa"
        for tree in (None, TreeSpec(choices=((0,), (1,), (0, 0), (1, 0), (0, 0, 0)))):
            decoder = SpeculativeDecoder(target, drafter, num_draft_tokens=3, tree=tree)
            out = decoder.generate(prompt, mask, max_new_tokens=20)
            assert torch.equal(out.sequences, expected), (path, tree)


def test_distill_main_trains_and_exports_medusa_heads(tiny_argv, tmp_path: Path) -> None:
    from train.distill import main

    argv = tiny_argv(tmp_path / "run", "--max_steps", "6", "--export_format", "vllm")
    summary = main(["--config", str(CONFIGS / "tiny_medusa.yaml"), *argv[2:]])
    held_out = summary["held_out"]
    assert all(0.0 < held_out[f"overlap@{j}"] <= 1.0 for j in (1, 2, 3))
    folder = Path(summary["drafter_dir"])
    assert "| 3 |" in (folder / "README.md").read_text()
    heads = MedusaHeads.from_pretrained(folder / "vllm")
    assert heads.config.num_heads == 3
