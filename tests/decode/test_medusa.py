"""Medusa heads: identity start, shapes, folders."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import tiny_llama

from decode.drafters.medusa import MedusaConfig, MedusaHeads


def _trained_like(heads: MedusaHeads, seed: int = 0) -> MedusaHeads:
    """Random block weights, as after training (zero-init heads would hide ordering bugs)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in heads.blocks.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.3)
    return heads


def test_heads_start_as_the_targets_lm_head() -> None:
    target = tiny_llama()
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=2)
    ids = torch.tensor([[3, 9, 27, 4]])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        logits = heads(out.hidden_states[-1])
    assert logits.shape == (1, 4, 3, 64)
    for i in range(3):
        torch.testing.assert_close(logits[:, :, i], out.logits)


def test_head_i_uses_block_i_and_lm_head_i() -> None:
    heads = _trained_like(MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=11, num_heads=3)))
    hidden = torch.randn(2, 8)
    logits = heads(hidden)
    for i in range(3):
        x = hidden
        for layer in heads.blocks[i].layers:
            x = x + torch.nn.functional.silu(x @ layer.weight.T + layer.bias)
        torch.testing.assert_close(logits[:, i], x @ heads.lm_heads[i].weight.T)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="num_heads must be a positive integer"):
        MedusaConfig(hidden_size=8, vocab_size=11, num_heads=0)
    with pytest.raises(ValueError, match="unknown MedusaConfig fields"):
        MedusaConfig.from_dict({"hidden_size": 8, "vocab_size": 11, "medusa_num_heads": 2})


def test_native_folder_round_trip(tmp_path) -> None:
    heads = _trained_like(MedusaHeads.from_target(tiny_llama(), num_heads=2, num_layers=2))
    heads.save_pretrained(tmp_path / "medusa")
    assert json.loads((tmp_path / "medusa" / "drafter.json").read_text())["kind"] == "medusa"
    loaded = MedusaHeads.from_pretrained(tmp_path / "medusa")
    assert loaded.config == heads.config
    for name, tensor in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
        assert loaded.state_dict()[name].dtype == torch.float64
    hidden = torch.randn(3, 32, dtype=torch.float64)
    assert torch.equal(loaded(hidden), heads(hidden))


def test_from_pretrained_names_the_problem(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        MedusaHeads.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="MedusaModel"):
        MedusaHeads.from_pretrained(tmp_path)
    (tmp_path / "drafter.json").write_text(json.dumps({"kind": "eagle3"}))
    with pytest.raises(ValueError, match="not 'medusa'"):
        MedusaHeads.from_pretrained(tmp_path)
