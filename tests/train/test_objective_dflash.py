"""DFlash objective: anchors (seeded, evenly spaced when evaluating, only where a block trains
something), the decay weights, each block row aligned with the target's law of the token it
guesses, training lowers the loss and raises held-out overlap, the cache gives the online loss,
DSpark's confidence BCE, the mask token and the generator's state, the refusals, and the
trained head (plain and DSpark) decodes the target's greedy output."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from draftsmith.decode.drafters.dflash.head import DFlashConfig, DFlashHead
from draftsmith.train.losses import build_loss
from draftsmith.train.objectives.dflash import DFlashObjective, decay_weights, sample_anchors
from objective_helpers import (
    assert_decodes_greedy_output,
    bind,
    cached_batch,
    sampled_batch,
    train_on_own_text,
)
from tiny_models import tiny_llama

BLOCK = 4


def make_objective(target: torch.nn.Module, loss: str = "fkl", **kwargs) -> DFlashObjective:
    config = {
        k: kwargs.pop(k) for k in ("mask_token_id", "markov_rank", "confidence_head") if k in kwargs
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        head = DFlashHead(DFlashConfig.for_target(target.config, block_size=BLOCK, **config))
    return DFlashObjective(head, target, build_loss(loss), **kwargs)


def test_anchors_are_candidates_seeded_and_evenly_spaced_when_evaluating() -> None:
    candidates = torch.zeros(3, 30, dtype=torch.bool)
    candidates[0, 1:28] = True
    candidates[1, 10:28] = True  # a left-padded row
    candidates[2, 5:8] = True  # fewer candidates than anchors
    anchors, valid = sample_anchors(candidates, 6, torch.Generator().manual_seed(0))
    assert anchors.shape == valid.shape == (3, 6)
    assert valid.sum(1).tolist() == [6, 6, 3]
    assert candidates.gather(1, anchors)[valid].all()
    for row in range(3):  # distinct and sorted
        kept = anchors[row][valid[row]].tolist()
        assert kept == sorted(set(kept))
    again, _ = sample_anchors(candidates, 6, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)
    spaced, ok = sample_anchors(candidates, 6, None)
    assert torch.equal(spaced, sample_anchors(candidates, 6, None)[0])
    assert spaced[0][ok[0]].tolist() == [1, 5, 10, 14, 19, 23]  # ranks 0, 4, 9, 13, 18, 22
    assert decay_weights(3, 7.0) == pytest.approx((1.0, math.exp(-1 / 7), math.exp(-2 / 7)))
    with pytest.raises(ValueError, match="dflash_loss_decay"):
        decay_weights(3, 0.0)


def test_each_block_row_is_aligned_with_the_targets_law_of_its_token() -> None:
    """Row j of the block at anchor a guesses x_{a+j}, scored against the target at a + j - 1;
    on greedy text the target's argmax there is the label."""
    target = tiny_llama(num_layers=2, dtype=torch.float32)
    objective = bind(make_objective(target, num_anchors=5))
    batch = sampled_batch(target, rows=3, length=20, seed=4, temperature=0.0)
    with torch.no_grad():
        features, target_logits = objective._target_outputs(batch)
        for training in (False, True):
            objective.module.train(training)
            drafts = objective._draft_logits(batch, features)
            assert len(drafts) == BLOCK - 1
            aligned = list(objective._aligned(batch, drafts, target_logits))
            for k, (_, _, target_k, mask, labels) in enumerate(aligned):
                assert mask.any() and torch.equal(target_k.argmax(-1)[mask], labels[mask])
                t = drafts[k].anchors[mask]  # t = a - 1
                row = torch.arange(3)[:, None].expand_as(mask)[mask]
                assert torch.equal(labels[mask], batch["input_ids"][row, t + 2 + k])
                assert torch.equal(target_k[mask], target_logits[row, t + 1 + k])


def test_training_lowers_the_loss_and_raises_held_out_overlap_at_every_position() -> None:
    target = tiny_llama(num_layers=2, dtype=torch.float32)
    objective = bind(make_objective(target, num_anchors=12))
    before, after, _ = train_on_own_text(objective, target, steps=40)
    for j in range(1, BLOCK):
        assert after[f"overlap@{j}"] > before[f"overlap@{j}"], j


def test_offline_cache_gives_the_online_loss(tmp_path: Path) -> None:
    target = tiny_llama(num_layers=2, dtype=torch.float32)
    objective = bind(make_objective(target))
    batch = sampled_batch(target, rows=2, length=16, seed=5)
    cached = cached_batch(target, batch, tmp_path, 64, objective.target_cache_hidden_layers())
    state = objective.state_dict()
    online, _ = objective.compute_loss(batch)
    objective.load_state_dict(state)  # the same anchors for the cached pass
    offline, _ = objective.compute_loss(cached)
    assert float(offline.detach()) == pytest.approx(float(online.detach()), rel=1e-4)


def test_confidence_head_learns_each_positions_acceptance() -> None:
    """The BCE term is reported and trains the confidence head; it is zero-weighted away."""
    target = tiny_llama(num_layers=2, dtype=torch.float32)
    objective = bind(make_objective(target, confidence_head=True, markov_rank=2))
    batch = sampled_batch(target, rows=4, length=20, seed=6)
    loss, metrics = objective.compute_loss(batch)
    assert "confidence_bce" in metrics and metrics["confidence_bce"] > 0
    loss.backward()
    grad = objective.head.confidence.score.weight.grad
    assert grad is not None and bool(grad.abs().sum() > 0)
    silent = bind(make_objective(target, confidence_head=True, confidence_weight=0.0))
    assert "confidence_bce" not in silent.compute_loss(batch)[1]


def test_mask_token_generator_state_and_refusals() -> None:
    target = tiny_llama(num_layers=2, dtype=torch.float32)
    objective = bind(make_objective(target))
    rows = [{"input_ids": list(range(3, 60)) + list(range(3, 64))}]  # 0, 1 and 2 never occur
    objective.prepare(rows)
    assert objective.head.config.mask_token_id == 2  # the rarest, ties to the highest id
    fixed = bind(make_objective(target, mask_token_id=7, choose_mask_token=False))
    fixed.prepare(rows)
    assert fixed.head.config.mask_token_id == 7
    batch = sampled_batch(target, rows=2, length=16, seed=6)
    state = objective.state_dict()
    first = objective.compute_loss(batch)[0]
    objective.load_state_dict(state)
    assert float(objective.compute_loss(batch)[0].detach()) == float(first.detach())
    with pytest.raises(ValueError, match="align_topk"):
        make_objective(target, align_topk=2)
    with pytest.raises(ValueError, match="sglang"):
        make_objective(target, export_formats=("sglang",))
    with pytest.raises(ValueError, match="Markov or confidence"):
        make_objective(target, markov_rank=2, export_formats=("vllm",))
    with pytest.raises(ValueError, match="dflash_num_anchors"):
        make_objective(target, num_anchors=0)


@pytest.mark.parametrize("options", [{}, {"markov_rank": 2, "confidence_head": True}])
def test_trained_head_decodes_the_targets_greedy_output(tmp_path: Path, options: dict) -> None:
    target = tiny_llama(num_layers=2, dtype=torch.float32)
    objective = bind(make_objective(target, **options))
    train_on_own_text(objective, target, steps=5)
    objective.save_drafter(tmp_path / "drafter")
    marker = json.loads((tmp_path / "drafter" / "drafter.json").read_text())
    assert marker["kind"] == "dflash"
    assert_decodes_greedy_output(target, [tmp_path / "drafter"], "dflash", [None])
