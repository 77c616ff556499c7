"""EAGLE-3 head: layer math against Hugging Face Llama, vocab maps, unrolling, folders."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import tiny_llama
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from decode.drafters.eagle import (
    Eagle3Config,
    Eagle3Head,
    block_visibility,
    build_vocab_maps,
    default_aux_layer_ids,
    positions_from_mask,
)


def _head(target: torch.nn.Module, seed: int = 0, **overrides) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target.config, **overrides)).double()
    with torch.no_grad():  # random norms, so that a swapped norm would be caught
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return head


def test_default_aux_layer_ids_follow_eagle3_and_clamp_for_shallow_targets() -> None:
    assert default_aux_layer_ids(32) == (2, 16, 29)
    assert default_aux_layer_ids(8) == (2, 4, 5)
    assert default_aux_layer_ids(4) == (1, 2, 3)
    assert default_aux_layer_ids(2) == (1, 1, 1)
    with pytest.raises(ValueError, match="at least 2 decoder layers"):
        default_aux_layer_ids(1)


def test_config_rejects_bad_layer_ids_and_vocab() -> None:
    base = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        target_vocab_size=64,
        target_num_hidden_layers=4,
    )
    with pytest.raises(ValueError, match=r"in \[0, 3\]"):
        Eagle3Config(**base, aux_hidden_state_layer_ids=(1, 2, 4))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config(**base, draft_vocab_size=65)
    with pytest.raises(ValueError, match="unknown Eagle3Config fields"):
        Eagle3Config.from_dict({**base, "hidden_act": "gelu"})


def test_midlayer_equals_a_hf_llama_layer_when_the_embedding_half_is_zero() -> None:
    """With the embedding columns of q/k/v zeroed, EAGLE-3's layer is a Llama layer on g."""
    target = tiny_llama(num_layers=4)
    head = _head(target)
    hf_layer = LlamaDecoderLayer(target.config, layer_idx=0).double().eval()
    rotary = LlamaRotaryEmbedding(target.config).double()
    mid = head.midlayer
    hidden = head.config.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            ours = getattr(mid.self_attn, name).weight
            ours[:, :hidden] = 0
            getattr(hf_layer.self_attn, name).weight.copy_(ours[:, hidden:])
        hf_layer.self_attn.o_proj.weight.copy_(mid.self_attn.o_proj.weight)
        hf_layer.input_layernorm.weight.copy_(mid.hidden_norm.weight)
        hf_layer.post_attention_layernorm.weight.copy_(mid.post_attention_layernorm.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(hf_layer.mlp, name).weight.copy_(getattr(mid.mlp, name).weight)
    generator = torch.Generator().manual_seed(0)
    g = torch.randn(2, 6, hidden, generator=generator, dtype=torch.float64)
    embeds = torch.randn(2, 6, hidden, generator=generator, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8]])
    ours, _ = head(g, embeds, positions)
    causal = torch.full((6, 6), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    expected = hf_layer(g, attention_mask=causal, position_embeddings=rotary(g, positions))
    expected = expected[0] if isinstance(expected, tuple) else expected
    torch.testing.assert_close(ours, expected)


def test_incremental_cache_equals_one_pass_and_padding_is_ignored() -> None:
    target = tiny_llama()
    head = _head(target)
    generator = torch.Generator().manual_seed(1)
    g = torch.randn(1, 7, 32, generator=generator, dtype=torch.float64)
    embeds = torch.randn(1, 7, 32, generator=generator, dtype=torch.float64)
    positions = torch.arange(7)[None]
    full, _ = head(g, embeds, positions)
    first, kv = head(g[:, :4], embeds[:, :4], positions[:, :4])
    rest, _ = head(g[:, 4:], embeds[:, 4:], positions[:, 4:], past=kv)
    torch.testing.assert_close(torch.cat((first, rest), 1), full)
    # The same row left-padded by two junk entries gives the same outputs on its real part.
    junk = torch.randn(1, 2, 32, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[0, 0] + [1] * 7])
    visible = block_visibility(None, mask.bool())
    padded, _ = head(
        torch.cat((junk, g), 1),
        torch.cat((junk, embeds), 1),
        positions_from_mask(mask),
        None,
        visible,
    )
    torch.testing.assert_close(padded[:, 2:], full)


def test_build_vocab_maps_keeps_the_most_frequent_tokens() -> None:
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = build_vocab_maps(counts, 4)
    kept = torch.arange(4) + d2t
    assert kept.tolist() == [0, 2, 3, 5]
    assert t2d.tolist() == [True, False, True, True, False, True, False, False]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    # ties towards lower ids
    d2t, _ = build_vocab_maps(torch.tensor([1, 1, 1, 1]), 2)
    assert (torch.arange(2) + d2t).tolist() == [0, 1]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_maps(counts, 9)
    with pytest.raises(ValueError, match="1-D"):
        build_vocab_maps(counts[None], 2)


def test_pruned_vocab_logits_map_back_to_target_ids() -> None:
    target = tiny_llama()
    head = _head(target, draft_vocab_size=16)
    counts = torch.arange(64).flip(0).double()  # token 0 most frequent
    counts[40] = 1000
    d2t, t2d = build_vocab_maps(counts, 16)
    head.set_vocab_maps(d2t, t2d)
    draft_logits = torch.randn(2, 3, 16, dtype=torch.float64)
    full = head.to_target_logits(draft_logits)
    assert full.shape == (2, 3, 64)
    assert torch.isinf(full[..., ~t2d]).all()
    torch.testing.assert_close(head.to_draft_vocab(full), draft_logits)
    assert full.argmax(-1).eq(head.draft_to_target_ids[draft_logits.argmax(-1)]).all()
    assert 40 in head.draft_to_target_ids.tolist()
    with pytest.raises(ValueError, match="t2d must mark"):
        head.set_vocab_maps(d2t, ~t2d)


def test_unroll_step_k_matches_drafting_k_tokens_past_each_position() -> None:
    """Training-time test sees at (step k, position t) what the drafter sees when drafting."""
    target = tiny_llama(num_layers=4)
    head = _head(target)
    generator = torch.Generator().manual_seed(2)
    batch, length, steps = 2, 6, 3
    aux = torch.randn(batch, length, 3 * 32, generator=generator, dtype=torch.float64)
    tokens = torch.randint(0, 64, (batch, length + 1), generator=generator)
    embed = target.get_input_embeddings()
    next_embeds = embed(tokens[:, 1:])
    mask = torch.ones(batch, length)
    mask[1, :2] = 0  # a left-padded row
    with torch.no_grad():
        unrolled = head.unroll(aux, next_embeds, mask, steps)
        # Reference: for position t, run the committed prefix causally, then draft step by step
        # feeding the ground-truth tokens x_{t+2}, x_{t+3}, ...
        for row in range(batch):
            start = int((mask[row] == 0).sum())
            g = head.fuse(aux[row : row + 1, start:])
            emb = next_embeds[row : row + 1, start:]
            pos = torch.arange(length - start)[None]
            prenorm, kv = head(g, emb, pos)
            for t in range(length - start - steps + 1):
                keys, values = kv[0][:, :, : t + 1], kv[1][:, :, : t + 1]
                hidden = prenorm[:, t : t + 1]
                torch.testing.assert_close(
                    head.compute_logits(hidden)[0, 0], unrolled[0][row, start + t]
                )
                for k in range(1, steps):
                    token_embed = emb[:, t + k : t + k + 1]
                    hidden, (key, value) = head(
                        hidden, token_embed, pos[:, t : t + 1] + k, past=(keys, values)
                    )
                    keys, values = torch.cat((keys, key), 2), torch.cat((values, value), 2)
                    torch.testing.assert_close(
                        head.compute_logits(hidden)[0, 0], unrolled[k][row, start + t]
                    )


def test_native_folder_round_trip(tmp_path) -> None:
    target = tiny_llama(num_layers=4)
    head = _head(target, draft_vocab_size=20, aux_hidden_state_layer_ids=(1, 2, 3))
    d2t, t2d = build_vocab_maps(torch.rand(64, generator=torch.Generator().manual_seed(0)), 20)
    head.set_vocab_maps(d2t, t2d)
    head.save_pretrained(tmp_path / "eagle")
    assert json.loads((tmp_path / "eagle" / "drafter.json").read_text())["kind"] == "eagle3"
    loaded = Eagle3Head.from_pretrained(tmp_path / "eagle")
    assert loaded.config == head.config
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    aux = torch.randn(1, 5, 96, dtype=torch.float64)
    embeds = torch.randn(1, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        expected = head.unroll(aux, embeds, torch.ones(1, 5), 2)
        got = loaded.unroll(aux, embeds, torch.ones(1, 5), 2)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_from_pretrained_names_the_problem(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        Eagle3Head.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLMEagle3"):
        Eagle3Head.from_pretrained(tmp_path)
    (tmp_path / "drafter.json").write_text(json.dumps({"kind": "medusa"}))
    with pytest.raises(ValueError, match="not 'eagle3'"):
        Eagle3Head.from_pretrained(tmp_path)
