"""vLLM/SGLang export layouts: key names, shapes, dtypes, configs, and loading them back."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tiny_models import tiny_llama
from transformers import LlamaConfig

from decode.drafters.eagle import Eagle3Config, Eagle3Head, build_vocab_maps
from decode.drafters.medusa import MedusaHeads
from train.export_formats import export_eagle3, export_medusa, write_folder_atomically

HIDDEN, VOCAB, DRAFT_VOCAB, LAYERS = 32, 64, 24, 8


def _eagle_head() -> Eagle3Head:
    target = tiny_llama(num_layers=LAYERS)
    torch.manual_seed(0)
    config = Eagle3Config.for_target(target.config, draft_vocab_size=DRAFT_VOCAB)
    head = Eagle3Head(config).double()
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0, 0.2)
    counts = torch.rand(VOCAB, generator=torch.Generator().manual_seed(1))
    head.set_vocab_maps(*build_vocab_maps(counts, DRAFT_VOCAB))
    return head


def _safetensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


EAGLE_SHAPES = {
    "fc.weight": (HIDDEN, 3 * HIDDEN),
    "midlayer.input_layernorm.weight": (HIDDEN,),
    "midlayer.hidden_norm.weight": (HIDDEN,),
    "midlayer.post_attention_layernorm.weight": (HIDDEN,),
    "midlayer.self_attn.q_proj.weight": (4 * 8, 2 * HIDDEN),
    "midlayer.self_attn.k_proj.weight": (2 * 8, 2 * HIDDEN),
    "midlayer.self_attn.v_proj.weight": (2 * 8, 2 * HIDDEN),
    "midlayer.self_attn.o_proj.weight": (HIDDEN, 4 * 8),
    "midlayer.mlp.gate_proj.weight": (2 * HIDDEN, HIDDEN),
    "midlayer.mlp.up_proj.weight": (2 * HIDDEN, HIDDEN),
    "midlayer.mlp.down_proj.weight": (HIDDEN, 2 * HIDDEN),
    "norm.weight": (HIDDEN,),
    "lm_head.weight": (DRAFT_VOCAB, HIDDEN),
    "d2t": (DRAFT_VOCAB,),
    "t2d": (VOCAB,),
}


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_eagle3_export_layout_and_round_trip(tmp_path, fmt: str) -> None:
    head = _eagle_head()
    out = export_eagle3(head, tmp_path / fmt, fmt, dtype=torch.bfloat16)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    tensors = _safetensors(out)
    assert {name: tuple(t.shape) for name, t in tensors.items()} == EAGLE_SHAPES
    assert not any("embed_tokens" in name for name in tensors)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert all(t.dtype == torch.bfloat16 for n, t in tensors.items() if n not in ("d2t", "t2d"))
    assert torch.equal(torch.arange(DRAFT_VOCAB) + tensors["d2t"], head.draft_to_target_ids)

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (config["num_hidden_layers"], config["vocab_size"], config["draft_vocab_size"]) == (
        1,
        VOCAB,
        DRAFT_VOCAB,
    )
    assert head.config.aux_hidden_state_layer_ids == (2, 4, 5)  # hidden_states indices
    if fmt == "vllm":  # vLLM: top level, layer-input indices
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
        assert "eagle_config" not in config
    else:  # SGLang: nested, layer-output indices (it adds one)
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
        assert "eagle_aux_hidden_state_layer_ids" not in config
    # Engines parse the file with transformers' LlamaConfig: the fields must survive that.
    parsed = LlamaConfig.from_pretrained(out)
    assert (parsed.hidden_size, parsed.num_key_value_heads, parsed.draft_vocab_size) == (
        HIDDEN,
        2,
        DRAFT_VOCAB,
    )
    assert parsed.rope_parameters["rope_theta"] == head.config.rope_theta

    loaded = Eagle3Head.from_pretrained(out)
    assert loaded.config == head.config
    reference = head.to(torch.bfloat16)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    aux = torch.randn(2, 5, 3 * HIDDEN).to(torch.bfloat16)
    embeds = torch.randn(2, 5, HIDDEN).to(torch.bfloat16)
    with torch.no_grad():
        for a, b in zip(
            reference.unroll(aux, embeds, torch.ones(2, 5), 2),
            loaded.unroll(aux, embeds, torch.ones(2, 5), 2),
            strict=True,
        ):
            assert torch.equal(a, b)


def test_eagle3_export_in_the_heads_own_dtype_is_lossless(tmp_path) -> None:
    head = _eagle_head()
    loaded = Eagle3Head.from_pretrained(export_eagle3(head, tmp_path / "e", "vllm"))
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_eagle3_engine_folder_without_ids_needs_the_target_depth(tmp_path) -> None:
    out = export_eagle3(_eagle_head(), tmp_path / "e", "vllm")
    config = json.loads((out / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"], config["target_num_hidden_layers"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="target_num_hidden_layers"):
        Eagle3Head.from_pretrained(out)
    # vLLM's default for an 8-layer target is (2, 4, 5), the ids the head was built with.
    head = Eagle3Head.from_pretrained(out, target_num_hidden_layers=LAYERS)
    assert head.config.aux_hidden_state_layer_ids == (2, 4, 5)


def test_eagle3_export_refuses_what_engines_cannot_load(tmp_path) -> None:
    target = tiny_llama(num_layers=4)
    two_ids = Eagle3Head(Eagle3Config.for_target(target.config, aux_hidden_state_layer_ids=(1, 3)))
    with pytest.raises(ValueError, match="exactly 3"):
        export_eagle3(two_ids, tmp_path / "a", "vllm")
    embeddings = Eagle3Head(
        Eagle3Config.for_target(target.config, aux_hidden_state_layer_ids=(0, 1, 3))
    )
    with pytest.raises(ValueError, match="aux id 0"):
        export_eagle3(embeddings, tmp_path / "b", "sglang")
    with pytest.raises(ValueError, match="fmt must be one of"):
        export_eagle3(_eagle_head(), tmp_path / "c", "tensorrt")  # type: ignore[arg-type]


def test_medusa_export_layout_and_round_trip(tmp_path) -> None:
    heads = MedusaHeads.from_target(tiny_llama(), num_heads=3, num_layers=2)
    with torch.no_grad():
        for param in heads.blocks.parameters():
            param.normal_(0, 0.2)
    out = export_medusa(heads, tmp_path / "medusa", dtype=torch.float16)
    tensors = _safetensors(out)
    expected = {f"lm_heads.{i}.weight": (VOCAB, HIDDEN) for i in range(3)}
    for i in range(3):
        for j in range(2):
            expected[f"blocks.{i}.layers.{j}.weight"] = (HIDDEN, HIDDEN)
            expected[f"blocks.{i}.layers.{j}.bias"] = (HIDDEN,)
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected
    assert all(t.dtype == torch.float16 for t in tensors.values())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["model_type"] == "medusa"
    assert (
        config["num_heads"],
        config["num_hidden_layers"],
        config["hidden_size"],
        config["vocab_size"],
    ) == (3, 2, HIDDEN, VOCAB)
    assert config["medusa_fc_bias"] is True and config["truncated_vocab_size"] == VOCAB

    loaded = MedusaHeads.from_pretrained(out)
    assert loaded.config == heads.config
    reference = heads.to(torch.float16)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    hidden = torch.randn(4, HIDDEN).to(torch.float16)
    assert torch.equal(loaded(hidden), reference(hidden))


def test_exports_are_atomic_and_do_not_clobber(tmp_path) -> None:
    heads = MedusaHeads.from_target(tiny_llama(), num_heads=2)
    out = export_medusa(heads, tmp_path / "m")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_medusa(heads, tmp_path / "m")
    export_medusa(heads, tmp_path / "m", overwrite=True)

    def crash(folder) -> None:
        (folder / "partial").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_folder_atomically(tmp_path / "m", crash, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary folders left
