"""P-EAGLE objective: COD sampling (nested, its counts and floor, every anchor when evaluating),
each depth aligned with the target's law of the label it predicts, training lowers the loss
at every depth, the cache gives the online loss, the mask token and the generator's state,
and the trained head decodes the target's greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from draftsmith.decode.drafters.eagle.peagle import PEagleConfig, PEagleHead
from draftsmith.train.losses import build_loss
from draftsmith.train.objectives.heads import SampledRows
from draftsmith.train.objectives.peagle import PEagleObjective, cod_anchors, rows_per_position
from objective_helpers import (
    assert_decodes_greedy_output,
    bind,
    cached_batch,
    sampled_batch,
    train_on_own_text,
)
from tiny_models import tiny_llama

DEPTHS = 3


def make_objective(target: torch.nn.Module, loss: str = "fkl", **kwargs) -> PEagleObjective:
    config = {k: kwargs.pop(k) for k in ("mask_token_id",) if k in kwargs}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        head = PEagleHead(PEagleConfig.for_target(target.config, num_depths=DEPTHS, **config))
    return PEagleObjective(head, target, build_loss(loss), unroll_steps=DEPTHS, **kwargs)


def test_cod_sampling_is_nested_with_its_counts_and_floor() -> None:
    length, rows = 40, 3
    real = torch.ones(rows, length, dtype=torch.bool)
    real[2, :10] = False  # a left-padded row
    candidates = [real & (torch.arange(length) < length - 2 - k) for k in range(1, 5)]
    anchors, valid = cod_anchors(candidates, real, 0.7, 0.2, torch.Generator().manual_seed(0))
    kept = real
    for k, (index, ok) in enumerate(zip(anchors, valid, strict=True), start=1):
        members = torch.zeros_like(real).scatter(1, index, ok)
        assert not (members & ~kept).any()  # nested: a chain's shallower rows exist
        assert not (members & ~candidates[k - 1]).any()
        share = max(0.7**k, 0.2)
        wanted = (candidates[k - 1].sum(1) * share).floor().long()
        assert (
            members.sum(1).tolist()
            == torch.minimum(wanted, (kept & candidates[k - 1]).sum(1)).tolist()
        )
        kept = members
    every, _ = cod_anchors(candidates, real, 0.7, 0.2, None)  # evaluation keeps every anchor
    assert [a.shape[1] for a in every] == [c.sum(1).max() for c in candidates]
    again, _ = cod_anchors(candidates, real, 0.7, 0.2, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(anchors, again, strict=True))
    assert rows_per_position(0.7, 0.2, 4) == pytest.approx(1 + 0.7 + 0.49 + 0.343)
    assert rows_per_position(0.7, 0.2, 8) == pytest.approx(
        1 + 0.7 + 0.49 + 0.343 + 0.2401 + 3 * 0.2
    )


def test_each_depth_is_aligned_with_the_targets_law_of_its_label() -> None:
    """Depth k + 1 at anchor t guesses x_{t+2+k} against the target's law at t + 1 + k, with
    every anchor (evaluation) and with COD's sample (training); on greedy text the target's
    argmax is the label."""
    target = tiny_llama(num_layers=2, dtype=torch.float32)
    objective = bind(make_objective(target))
    batch = sampled_batch(target, rows=3, length=16, seed=4, temperature=0.0)
    with torch.no_grad():
        features, target_logits = objective._target_outputs(batch)
        for training in (False, True):
            objective.module.train(training)
            drafts = objective._draft_logits(batch, features)
            assert drafts[0].shape[1] == 16 and all(isinstance(d, SampledRows) for d in drafts[1:])
            aligned = list(objective._aligned(batch, drafts, target_logits))
            assert len(aligned) == DEPTHS
            for k, (_, draft, target_k, mask, labels) in enumerate(aligned):
                assert draft.shape[:2] == target_k.shape[:2] == mask.shape == labels.shape
                assert mask.any() and torch.equal(target_k.argmax(-1)[mask], labels[mask])
                if k == 0:
                    continue
                t = drafts[k].anchors[mask]
                row = torch.arange(3)[:, None].expand_as(mask)[mask]
                assert torch.equal(labels[mask], batch["input_ids"][row, t + 2 + k])
                assert torch.equal(target_k[mask], target_logits[row, t + 1 + k])
                # Evaluation keeps every nested anchor: depth 2 at t = 1..12 (x_{t+3} scored),
                # depth 3 at t = 1..11 (t = 0's depth-2 token is the unscored prompt's).
                every = (12, 11)[k - 1]
                kept = mask.sum(1)
                assert (kept < every).all() if training else (kept == every).all()


def test_training_lowers_the_loss_and_raises_held_out_overlap_at_every_depth() -> None:
    target = tiny_llama(num_layers=2, dtype=torch.float32)
    objective = bind(make_objective(target))
    before, after, _ = train_on_own_text(objective, target, steps=40)
    for j in range(1, DEPTHS + 1):
        assert after[f"overlap@{j}"] > before[f"overlap@{j}"], j


def test_offline_cache_gives_the_online_loss(tmp_path: Path) -> None:
    target = tiny_llama(num_layers=2, dtype=torch.float32)
    objective = bind(make_objective(target, cod_ratio=1.0))
    batch = sampled_batch(target, rows=2, length=16, seed=5)
    cached = cached_batch(target, batch, tmp_path, 64, objective.target_cache_hidden_layers())
    online, _ = objective.compute_loss(batch)
    offline, _ = objective.compute_loss(cached)
    assert float(offline.detach()) == pytest.approx(float(online.detach()), rel=1e-4)


def test_mask_token_generator_state_and_refusals() -> None:
    target = tiny_llama(num_layers=2, dtype=torch.float32)
    objective = bind(make_objective(target))
    rows = [{"input_ids": list(range(3, 60)) + list(range(3, 64))}]  # 0, 1 and 2 never occur
    objective.prepare(rows)
    assert objective.head.config.mask_token_id == 2  # the rarest, ties to the highest id
    embed = target.get_input_embeddings().weight
    assert torch.equal(objective.head.mask_embed.detach(), embed[2])
    fixed = bind(make_objective(target, mask_token_id=7, choose_mask_token=False))
    fixed.prepare(rows)
    assert fixed.head.config.mask_token_id == 7
    batch = sampled_batch(target, rows=2, length=16, seed=6)
    state = objective.state_dict()
    first = objective.compute_loss(batch)[0]
    objective.load_state_dict(state)
    assert float(objective.compute_loss(batch)[0].detach()) == float(
        first.detach()
    )  # same anchors again
    with pytest.raises(ValueError, match="align_topk"):
        make_objective(target, align_topk=2)
    with pytest.raises(ValueError, match="speculators"):
        make_objective(target, export_formats="vllm")
    with pytest.raises(ValueError, match="cod_ratio"):
        make_objective(target, cod_ratio=0.0)


def test_trained_head_decodes_the_targets_greedy_output(tmp_path: Path) -> None:
    target = tiny_llama(num_layers=2, dtype=torch.float32)
    objective = bind(make_objective(target))
    objective.save_drafter(tmp_path / "drafter")
    assert (tmp_path / "drafter" / "drafter.json").is_file()
    assert_decodes_greedy_output(target, [tmp_path / "drafter"], "peagle", [None])


def test_a_recipe_widens_the_heads_mlp_and_the_head_still_decodes_exactly(tmp_path: Path) -> None:
    from draftsmith.train.config import parse_config
    from draftsmith.train.objectives.eagle3 import recipe_head

    target = tiny_llama(num_layers=2, dtype=torch.float32)
    config = parse_config(["--drafter_kind", "peagle", "--drafter_intermediate_size", "96"])
    config.drafter.draft_vocab_size = None  # the tiny target's whole vocabulary
    head = recipe_head(config, target, PEagleHead, num_depths=DEPTHS)
    assert head.midlayer.mlp.gate_proj.out_features == 96 != target.config.intermediate_size
    objective = bind(PEagleObjective(head, target, build_loss("fkl"), unroll_steps=DEPTHS))
    objective.save_drafter(tmp_path / "drafter")
    assert_decodes_greedy_output(target, [tmp_path / "drafter"], "peagle", [None])
    with pytest.raises(ValueError, match="--drafter_intermediate_size must be >= 1"):
        parse_config(["--drafter_kind", "peagle", "--drafter_intermediate_size", "0"])


def test_a_recipe_gives_the_head_two_layers_that_train_save_and_decode_exactly(
    tmp_path: Path,
) -> None:
    from draftsmith.train.config import parse_config
    from draftsmith.train.objectives.eagle3 import recipe_head

    target = tiny_llama(num_layers=2, dtype=torch.float32)
    config = parse_config(["--drafter_kind", "peagle", "--drafter_num_layers", "2"])
    config.drafter.draft_vocab_size = None
    head = recipe_head(config, target, PEagleHead, num_depths=DEPTHS)
    assert head.config.num_hidden_layers == 2 and list(head.layers) == ["1"]
    assert head.layers["1"].self_attn.q_proj.in_features == target.config.hidden_size
    objective = bind(PEagleObjective(head, target, build_loss("fkl"), unroll_steps=DEPTHS))
    objective.save_drafter(tmp_path / "drafter")
    assert_decodes_greedy_output(target, [tmp_path / "drafter"], "peagle", [None])
