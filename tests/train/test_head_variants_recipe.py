"""EAGLE-3.1's (``fc_norm``, ``norm_output``) and speculators' (``norm_before_residual``) layer
variants from a recipe: the head the recipe builds has them, training moves the per-state norms,
the trained head decodes the target's greedy output from its folder and its vLLM layout, and
the flags are refused where they mean nothing or an engine would serve another head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from draftsmith.decode.drafters.eagle.config import VARIANT_FLAGS
from draftsmith.train.config import parse_config
from draftsmith.train.export.formats import export_eagle3
from draftsmith.train.losses import build_loss
from draftsmith.train.objectives.eagle3 import Eagle3Objective, recipe_head
from objective_helpers import assert_decodes_greedy_output, bind, sampled_batch, train
from tiny_models import tiny_llama

ALL_ON = [arg for flag in VARIANT_FLAGS for arg in (f"--{flag}", "true")]


def recipe(*args: str):
    """A recipe over the tiny target's whole vocabulary (64 tokens)."""
    config = parse_config(list(args))
    config.drafter.draft_vocab_size = None
    return config


def test_the_recipe_builds_the_head_with_the_chosen_variants() -> None:
    target = tiny_llama(num_layers=4)
    head = recipe_head(recipe(*ALL_ON), target)
    assert all(getattr(head.config, flag) for flag in VARIANT_FLAGS)
    assert len(head.fc_norm) == len(head.config.aux_hidden_state_layer_ids)
    plain = recipe_head(recipe(), target)
    assert not any(getattr(plain.config, flag) for flag in VARIANT_FLAGS)
    assert not hasattr(plain, "fc_norm")
    only = recipe_head(recipe("--norm_output", "true"), target)
    assert [getattr(only.config, flag) for flag in VARIANT_FLAGS] == [
        flag == "norm_output" for flag in VARIANT_FLAGS
    ]


def test_training_moves_the_per_state_norms_and_the_head_decodes_exactly(tmp_path: Path) -> None:
    target = tiny_llama(num_layers=4)  # float64: no argmax ties between decoding paths
    head = recipe_head(recipe(*ALL_ON), target)
    norms_before = [n.weight.detach().clone() for n in head.fc_norm]
    objective = bind(
        Eagle3Objective(head, target, build_loss("tv"), unroll_steps=3, export_formats=("vllm",))
    )
    train(objective, sampled_batch(target, rows=8, length=32, seed=5), steps=20)
    assert all(
        not torch.equal(before, n.weight)
        for before, n in zip(norms_before, head.fc_norm, strict=True)
    )
    folder = tmp_path / "drafter"
    objective.save_drafter(folder)
    engine = json.loads((folder / "vllm" / "config.json").read_text())
    assert all(engine[flag] is True for flag in VARIANT_FLAGS)
    assert_decodes_greedy_output(target, [folder, folder / "vllm"], "eagle3", [None])


def test_the_flags_are_refused_where_they_mean_nothing_or_another_head() -> None:
    with pytest.raises(ValueError, match=r"--fc_norm: these change the EAGLE-3 head's layer"):
        parse_config(["--drafter_kind", "medusa", "--fc_norm", "true"])
    with pytest.raises(ValueError, match="--drafter_kind dflash has no such layer"):
        parse_config(["--drafter_kind", "dflash", "--norm_before_residual", "true"])
    with pytest.raises(ValueError, match="export with --export_format vllm"):
        parse_config([*ALL_ON, "--export_format", "sglang"])
    assert parse_config(["--drafter_kind", "peagle", "--fc_norm", "true"]).drafter.fc_norm


def test_an_sglang_folder_of_a_head_with_a_variant_is_refused(tmp_path: Path) -> None:
    """A head read from a folder (``draftsmith-export``) meets the same refusal at export."""
    target = tiny_llama(num_layers=4)
    head = recipe_head(recipe("--fc_norm", "true"), target)
    with pytest.raises(ValueError, match=r"uses fc_norm, which vLLM's llama_eagle3\.py reads"):
        export_eagle3(head, tmp_path / "sglang", "sglang")
    assert not (tmp_path / "sglang").exists()
