"""The objective protocol and what head objectives share: every objective kind is declared,
built from its tiny recipe with the parsed loss, trains one step with every loss (lk and nla
included) and exports a folder its drafter kind loads; the shared head helpers."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from draftsmith.decode.drafters.medusa import MedusaHeads
from draftsmith.decode.drafters.registry import DRAFTER_LOADERS, load_drafter
from draftsmith.train.config import parse_config, read_recipe
from draftsmith.train.losses import build_loss
from draftsmith.train.objectives import OBJECTIVES, Objective, get_objective_class
from draftsmith.train.objectives.heads import (
    cached_target_logprobs,
    future_mask,
    in_top_k,
    parse_export_formats,
    position_weights,
)
from objective_helpers import CONFIGS, bind, sampled_batch
from tiny_models import tiny_llama

TINY_RECIPES = {
    read_recipe(path)["drafter_kind"]: path for path in sorted(CONFIGS.glob("tiny*.yaml"))
}
"""Drafter kind -> its tiny recipe: a new kind's ``configs/tiny_<kind>.yaml`` joins the tests."""


# -- the protocol -------------------------------------------------------------------------------
def test_every_drafter_objective_declares_the_protocol_and_has_a_loadable_drafter_kind() -> None:
    drafter_kinds = []
    for kind in OBJECTIVES:
        cls = get_objective_class(kind)
        assert cls.kind == kind
        if not cls.trains_drafter:
            config = parse_config(["--config", str(TINY_RECIPES["draft_lm"])])
            with pytest.raises(ValueError, match=f"{kind!r} trains no drafter"):
                cls.from_config(config, tiny_llama(), None, build_loss("tv"))
            continue
        drafter_kinds.append(kind)
        for name in ("from_config", "save_drafter", "describe"):
            own = getattr(cls, name)
            assert getattr(own, "__func__", own) is not getattr(
                getattr(Objective, name), "__func__", getattr(Objective, name)
            ), (kind, name)
        assert kind in DRAFTER_LOADERS, f"objective kind {kind!r} has no drafter loader"
        module_name, function_name = DRAFTER_LOADERS[kind].split(":")
        assert callable(getattr(importlib.import_module(module_name), function_name))
    assert set(drafter_kinds) == set(TINY_RECIPES)  # a new kind needs its tiny recipe here too


@pytest.mark.parametrize("kind", sorted(TINY_RECIPES))
@pytest.mark.parametrize("loss", ["lk", "nla", "0.5*lk+0.5*nla+0.1*ce"])
def test_each_objective_trains_one_step_with_lk_and_nla(
    kind: str, loss: str, tmp_path: Path
) -> None:
    config = parse_config(["--config", str(TINY_RECIPES[kind]), "--loss", loss])
    target = tiny_llama(num_layers=2, dtype=torch.float32)
    parsed = build_loss(config.loss.loss)
    objective = bind(get_objective_class(kind).from_config(config, target, None, parsed))
    assert objective.loss is parsed  # the parsed spec is used as given, not parsed again
    batch = sampled_batch(target, rows=3, length=16, seed=7)
    params = [p for p in objective.trainable_module().parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    value, metrics = objective.compute_loss(batch)
    assert torch.isfinite(value) and value > 0, (kind, loss, metrics)
    value.backward()
    grads = [p.grad for p in params if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    optimizer.step()
    assert any(not torch.equal(p, b) for p, b in zip(params, before, strict=True))
    held_out = objective.evaluate(batch)
    assert "overlap@1" in held_out and held_out["loss"][1] > 0
    objective.save_drafter(tmp_path / "drafter")
    assert load_drafter(tmp_path / "drafter", target).kind == kind


# -- GRIFFIN's chain masking (align_topk) ------------------------------------------------------
HEAD_KINDS = ("eagle3", "medusa")


def _head_objective(kind: str, *flags: str):
    config = parse_config(["--config", str(TINY_RECIPES[kind]), "--loss", "fkl", *flags])
    torch.manual_seed(0)
    target = tiny_llama(num_layers=2, dtype=torch.float32)
    cls = get_objective_class(kind)
    return bind(cls.from_config(config, target, None, build_loss(config.loss.loss)))


def test_in_top_k_counts_ties_and_never_an_undraftable_token() -> None:
    logits = torch.tensor([[[3.0, 1.0, 1.0, -float("inf")], [0.0, 2.0, 5.0, 4.0]]])  # [1, 2, 4]
    assert in_top_k(logits, torch.tensor([[0, 3]]), 1).tolist() == [[True, False]]
    assert in_top_k(logits, torch.tensor([[2, 3]]), 2).tolist() == [[True, True]]  # a tie at 1.0
    assert in_top_k(logits, torch.tensor([[1, 0]]), 2).tolist() == [[True, False]]
    assert in_top_k(logits, torch.tensor([[3, 0]]), 10).tolist() == [[False, True]]  # -inf


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_align_topk_trains_each_position_only_where_the_chain_reaches_it(kind: str) -> None:
    """Output k's term sums the loss over the positions whose earlier outputs all held the
    chain's token in their top K and divides by all its positions; computed here independently
    from the drafts and labels."""
    aligned = _head_objective(kind, "--align_topk", "2")
    plain = _head_objective(kind)
    assert aligned.align_topk == 2 and plain.align_topk == 0
    assert aligned.describe()["align_topk"] == 2
    batch = sampled_batch(aligned.target, rows=4, length=20, seed=3)
    value, metrics = aligned.compute_loss(batch)
    assert torch.isfinite(value)
    with torch.no_grad():
        features, target = aligned._target_outputs(batch)
        drafts = aligned._draft_logits(batch, features)
        outputs = list(aligned._aligned(batch, drafts, target))
        reached = None
        expected_total = expected_weight = 0.0
        for k, (weight, draft, target_k, valid, labels) in enumerate(outputs):
            mask = valid if reached is None else valid & reached[:, : valid.shape[1]]
            if reached is not None:
                share = float(mask.sum()) / float(valid.sum())
                assert metrics[f"reached@{k + 1}"] == pytest.approx(share)
            top2 = draft.topk(2, dim=-1).indices  # full vocabulary in the tiny recipes
            hit = (top2 == labels.unsqueeze(-1)).any(-1)
            reached = hit if reached is None else reached[:, : hit.shape[1]] & hit
            expected_weight += weight
            if not mask.any():
                continue
            # the sum over the reached positions over all of output k's positions
            summed = aligned.loss(draft, target_k, mask, aligned.loss_temperature, reduction="sum")
            expected_total += weight * float(summed) / float(valid.sum())
            mean = float(aligned.loss(draft, target_k, mask, aligned.loss_temperature))
            assert metrics[f"loss@{k + 1}"] == pytest.approx(mean, rel=1e-5)
        assert float(value) == pytest.approx(expected_total / expected_weight, rel=1e-5)
        assert metrics["reached@2"] < 1.0  # an untrained drafter misses: the mask bites
        # the first output is never masked, and K = V keeps every position (the plain loss)
        _, plain_metrics = plain.compute_loss(batch)
        assert metrics["loss@1"] == pytest.approx(plain_metrics["loss@1"])
        vocab = aligned.target_vocab_size
        aligned.align_topk = vocab
        everything, everything_metrics = aligned.compute_loss(batch)
        assert float(everything) == pytest.approx(float(plain.compute_loss(batch)[0]), rel=1e-6)
        assert everything_metrics["reached@2"] == 1.0
        # the held-out metrics stay unmasked, comparable with and without the masking
        assert aligned.evaluate(batch) == plain.evaluate(batch)


def test_align_topk_is_refused_where_it_means_nothing() -> None:
    with pytest.raises(ValueError, match="--align_topk must be >= 0"):
        parse_config(["--config", str(TINY_RECIPES["eagle3"]), "--align_topk", "-1"])
    with pytest.raises(ValueError, match="--drafter_kind draft_lm trains one position per token"):
        parse_config(["--config", str(TINY_RECIPES["draft_lm"]), "--align_topk", "3"])
    target = tiny_llama(num_layers=2, dtype=torch.float32)
    heads = MedusaHeads.from_target(target, 2, 1)
    for bad in (True, -1, 1.5):
        with pytest.raises(ValueError, match="--align_topk must be an integer >= 0"):
            get_objective_class("medusa")(heads, target, build_loss("tv"), align_topk=bad)


# -- shared head helpers ------------------------------------------------------------------------
def test_position_weights_and_export_formats() -> None:
    assert position_weights(3) == pytest.approx((1.0, 0.8, 0.64))
    assert position_weights(2, decay=0.5) == (1.0, 0.5)
    assert position_weights(2, [1, 3]) == (1.0, 3.0)
    with pytest.raises(ValueError, match="gives 1 weights for 3 draft positions"):
        position_weights(3, [1.0])
    with pytest.raises(ValueError, match="not all 0"):
        position_weights(2, [0.0, 0.0])
    with pytest.raises(ValueError, match="position_weight_decay"):
        position_weights(2, decay=0.0)
    assert parse_export_formats(None) == ()
    assert parse_export_formats("vllm, sglang,vllm") == ("vllm", "sglang")
    assert parse_export_formats(("sglang", "vllm")) == ("sglang", "vllm")
    with pytest.raises(ValueError, match=r"unknown format\(s\) \['onnx'\]"):
        parse_export_formats("vllm,onnx")


def test_future_mask_needs_both_ends_real_and_the_label_counted() -> None:
    batch = {
        "input_ids": torch.zeros(2, 6, dtype=torch.long),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]]),
        "loss_mask": torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 0, 1]]),
    }
    mask = future_mask(batch, 2)  # position t trains the prediction of x_{t+2}
    assert mask.tolist() == [
        [True, True, True, False],
        [False, True, False, True],
    ]
    assert future_mask(batch, 6).shape == (2, 0)


def test_cached_logprobs_are_the_caches_distribution_in_log_space() -> None:
    from draftsmith.data.cache import compress_logits, topk_to_probs

    logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(0)) * 3
    for k in (5, 50):
        ids, logprobs, rest = compress_logits(logits, k)
        ours = torch.softmax(cached_target_logprobs(ids, logprobs.half(), rest, 50), -1)
        torch.testing.assert_close(ours, topk_to_probs(ids, logprobs.half(), rest, 50))
