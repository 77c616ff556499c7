"""vLLM/SGLang/speculators export layouts: key names, shapes, dtypes, configs, aux-id
conventions as each engine reads them, and loading them back."""

from __future__ import annotations

import json

import pytest
import torch
from draftsmith.decode.drafters.eagle.head import Eagle3Config, Eagle3Head, build_vocab_maps
from draftsmith.decode.drafters.medusa import MedusaHeads
from draftsmith.train.export.formats import (
    export_eagle3,
    export_medusa,
    read_speculators_eagle3,
    write_folder_atomically,
)
from safetensors import safe_open
from tiny_models import tiny_llama
from transformers import LlamaConfig

HIDDEN, VOCAB, DRAFT_VOCAB, LAYERS = 32, 64, 24, 8


def _eagle_head(**overrides) -> Eagle3Head:
    target = tiny_llama(num_layers=LAYERS)
    torch.manual_seed(0)
    config = Eagle3Config.for_target(target.config, draft_vocab_size=DRAFT_VOCAB, **overrides)
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


def _vllm_reads(config: dict) -> list[int]:
    """vLLM's reader: top-level ids, else ``eagle_config``'s, both as layer inputs."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    return list(ids or (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))


def _sglang_reads(config: dict) -> list[int]:
    """SGLang's reader: ``eagle_config``'s ids (top level when absent), as layer outputs (+1)."""
    nested = config.get("eagle_config")
    ids = nested["eagle_aux_hidden_state_layer_ids"] if isinstance(nested, dict) else None
    return [i + 1 for i in (ids or config["eagle_aux_hidden_state_layer_ids"])]


def _captured(hidden_states, layer_inputs: list[int], depth: int) -> torch.Tensor:
    """What an engine concatenates: the input of each listed layer once, in layer order (vLLM
    also offers index ``depth``, the last layer's output before the final norm)."""
    wanted = set(layer_inputs)
    return torch.cat([hidden_states[i] for i in range(depth) if i in wanted], dim=-1)


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_eagle3_export_layout_and_round_trip(tmp_path, fmt: str) -> None:
    head = _eagle_head()
    out = export_eagle3(head, tmp_path / fmt, fmt, dtype=torch.bfloat16)
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
    ]
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
    # Both engines' keys, each in its own numbering: vLLM layer inputs, SGLang layer outputs.
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert config["num_aux_hidden_states"] == 3
    assert _vllm_reads(config) == _sglang_reads(config) == [2, 4, 5]
    card = (out / "README.md").read_text()
    assert ("for vLLM" if fmt == "vllm" else "for SGLang") in card
    assert "check_engine.py" in card
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


@pytest.mark.parametrize("depth", [2, 3, 4, 8])
def test_every_depth_exports_distinct_ids_each_engine_captures_as_trained(
    tmp_path, depth: int
) -> None:
    target = tiny_llama(num_layers=depth)
    head = Eagle3Head(Eagle3Config.for_target(target.config))
    ids = list(head.config.aux_hidden_state_layer_ids)
    assert ids == sorted(set(ids)) and len(ids) == min(3, depth)
    config = json.loads((export_eagle3(head, tmp_path / "v", "vllm") / "config.json").read_text())
    assert config["num_aux_hidden_states"] == len(ids)
    with torch.no_grad():
        hidden = target(torch.tensor([[5, 6, 7, 8]]), output_hidden_states=True).hidden_states
    trained = head.gather_aux(hidden)  # [1, 4, A*H]
    assert torch.equal(_captured(hidden, _vllm_reads(config), depth), trained)
    if ids[0] >= 1:  # SGLang's Llama cannot capture the embedding output
        folder = export_eagle3(head, tmp_path / "s", "sglang")
        config = json.loads((folder / "config.json").read_text())
        assert torch.equal(_captured(hidden, _sglang_reads(config), depth), trained)
    else:
        with pytest.raises(ValueError, match="embedding output"):
            export_eagle3(head, tmp_path / "s", "sglang")


def test_full_vocabulary_heads_carry_no_vocabulary_maps(tmp_path) -> None:
    target = tiny_llama(num_layers=4)
    head = Eagle3Head(Eagle3Config.for_target(target.config))  # draft vocab = target vocab
    for fmt in ("vllm", "sglang"):
        out = export_eagle3(head, tmp_path / fmt, fmt)
        tensors = _safetensors(out)
        assert "d2t" not in tensors and "t2d" not in tensors  # vLLM has no parameter for them
        assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == VOCAB
        assert "full target vocabulary" in (out / "README.md").read_text()
        loaded = Eagle3Head.from_pretrained(out)
        assert torch.equal(loaded.draft_to_target_ids, torch.arange(VOCAB))


# SGLang's LlamaForCausalLMEagle3 parameters (shared embeddings excluded), as its loader maps
# checkpoint names: q/k/v into qkv_proj, gate/up into gate_up_proj, "model." added unless the
# name is already a parameter (lm_head). Names it cannot map are skipped silently, so every
# exported tensor must land on one of these.
SGLANG_PARAMETERS = {
    "model.fc.weight": (HIDDEN, 3 * HIDDEN),
    "model.midlayer.self_attn.qkv_proj.weight": ((4 + 2 + 2) * 8, 2 * HIDDEN),
    "model.midlayer.self_attn.o_proj.weight": (HIDDEN, 4 * 8),
    "model.midlayer.mlp.gate_up_proj.weight": (4 * HIDDEN, HIDDEN),
    "model.midlayer.mlp.down_proj.weight": (HIDDEN, 2 * HIDDEN),
    "model.midlayer.input_layernorm.weight": (HIDDEN,),
    "model.midlayer.hidden_norm.weight": (HIDDEN,),
    "model.midlayer.post_attention_layernorm.weight": (HIDDEN,),
    "model.norm.weight": (HIDDEN,),
    "lm_head.weight": (DRAFT_VOCAB, HIDDEN),
}
_SGLANG_STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj"}
_SGLANG_STACKED |= {".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}


def test_sglang_folder_matches_its_loaders_names_and_shapes(tmp_path) -> None:
    out = export_eagle3(_eagle_head(), tmp_path / "s", "sglang")
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in _safetensors(out).items():
        if name in ("d2t", "t2d"):  # d2t becomes hot_token_id, t2d is skipped
            continue
        for piece, stacked in _SGLANG_STACKED.items():
            name = name.replace(piece, stacked)
        name = name if name in SGLANG_PARAMETERS else f"model.{name}"
        assert name in SGLANG_PARAMETERS, f"SGLang would skip {name}"
        rows = shapes.get(name, (0, *tensor.shape[1:]))
        shapes[name] = (rows[0] + tensor.shape[0], *tensor.shape[1:])
    assert shapes == SGLANG_PARAMETERS
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_config"]["use_aux_hidden_state"] is True
    assert config["target_hidden_size"] * 3 == HIDDEN * 3  # SGLang's fc input width


def test_speculators_export_is_what_vllms_reader_expects(tmp_path) -> None:
    head = _eagle_head()
    out = export_eagle3(
        head,
        tmp_path / "sp",
        "speculators",
        verifier="/models/target",
        verifier_architectures=["LlamaForCausalLM"],
        num_speculative_tokens=4,
    )
    config = json.loads((out / "config.json").read_text())
    # vLLM detects the format by speculators_config and validates these paths.
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and config["speculators_model_type"] == "eagle3"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4
    assert spec["default_proposal_method"] == spec["proposal_methods"][0]["proposal_type"]
    assert spec["verifier"] == {
        "name_or_path": "/models/target",
        "architectures": ["LlamaForCausalLM"],
    }
    layer = config["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["vocab_size"]) == (
        "llama",
        1,
        VOCAB,
    )
    assert layer["num_aux_hidden_states"] == 3
    assert config["norm_before_residual"] is False  # vLLM's reader defaults it to True
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM's layer inputs
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    names = set(_safetensors(out))
    assert not any(n.startswith("midlayer.") for n in names)
    assert {n.replace("layers.0.", "midlayer.") for n in names} == set(EAGLE_SHAPES)
    assert "vLLM" in (out / "README.md").read_text()
    loaded = read_speculators_eagle3(out)
    assert loaded.config == head.config
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="names its verifier"):
        export_eagle3(head, tmp_path / "sp2", "speculators")


def test_eagle3_export_in_the_heads_own_dtype_is_lossless(tmp_path) -> None:
    head = _eagle_head()
    loaded = Eagle3Head.from_pretrained(export_eagle3(head, tmp_path / "e", "vllm"))
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_eagle3_engine_folder_without_ids_needs_the_target_depth(tmp_path) -> None:
    out = export_eagle3(_eagle_head(), tmp_path / "e", "vllm")
    config = json.loads((out / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"], config["target_num_hidden_layers"]
    del config["eagle_config"]
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
        export_eagle3(two_ids, tmp_path / "a", "sglang")
    export_eagle3(two_ids, tmp_path / "a2", "vllm")  # vLLM sizes fc from num_aux_hidden_states
    embeddings = Eagle3Head(
        Eagle3Config.for_target(target.config, aux_hidden_state_layer_ids=(0, 1, 3))
    )
    with pytest.raises(ValueError, match="embedding output"):
        export_eagle3(embeddings, tmp_path / "b", "sglang")
    with pytest.raises(ValueError, match="fmt must be one of"):
        export_eagle3(_eagle_head(), tmp_path / "c", "tensorrt")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strictly increasing"):
        Eagle3Config.for_target(target.config, aux_hidden_state_layer_ids=(1, 1, 1))


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
    assert "Medusa heads for vLLM" in (out / "README.md").read_text()

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
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary folders left


def test_multi_layer_eagle3_exports_vllms_layer_names_and_round_trips(tmp_path) -> None:
    head = _eagle_head(num_hidden_layers=3)
    later = {
        f"layers.{i}.{name}": shape
        for i in (1, 2)
        for name, shape in {
            "input_layernorm.weight": (HIDDEN,),
            "hidden_norm.weight": (HIDDEN,),  # vLLM builds it in every layer; unused after 0
            "post_attention_layernorm.weight": (HIDDEN,),
            "self_attn.q_proj.weight": (4 * 8, HIDDEN),  # later layers read H, not 2H
            "self_attn.k_proj.weight": (2 * 8, HIDDEN),
            "self_attn.v_proj.weight": (2 * 8, HIDDEN),
            "self_attn.o_proj.weight": (HIDDEN, 4 * 8),
            "mlp.gate_proj.weight": (2 * HIDDEN, HIDDEN),
            "mlp.up_proj.weight": (2 * HIDDEN, HIDDEN),
            "mlp.down_proj.weight": (HIDDEN, 2 * HIDDEN),
        }.items()
    }
    out = export_eagle3(head, tmp_path / "vllm", "vllm")
    tensors = _safetensors(out)
    assert {name: tuple(t.shape) for name, t in tensors.items()} == {**EAGLE_SHAPES, **later}
    assert torch.equal(tensors["layers.2.hidden_norm.weight"], torch.ones(HIDDEN).double())
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3
    assert "3 decoder layers" in (out / "README.md").read_text()
    speculators = export_eagle3(head, tmp_path / "sp", "speculators", verifier="/models/t")
    layer = json.loads((speculators / "config.json").read_text())["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 3
    assert set(_safetensors(speculators)) == {
        n.replace("midlayer.", "layers.0.") for n in {**EAGLE_SHAPES, **later}
    }
    aux = torch.randn(1, 5, 3 * HIDDEN, dtype=torch.float64)
    embeds = torch.randn(1, 5, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        expected = head.unroll(aux, embeds, torch.ones(1, 5), 3)
    for loaded in (Eagle3Head.from_pretrained(out), read_speculators_eagle3(speculators)):
        assert loaded.config == head.config
        with torch.no_grad():
            got = loaded.unroll(aux, embeds, torch.ones(1, 5), 3)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    with pytest.raises(ValueError, match="single-layer EAGLE-3 heads only"):
        export_eagle3(head, tmp_path / "sglang", "sglang")
    with pytest.raises(ValueError, match="num_hidden_layers must be an integer >= 1"):
        Eagle3Config.for_target(tiny_llama(num_layers=4).config, num_hidden_layers=0)


def test_a_layer_count_the_weights_do_not_hold_is_refused_before_building(tmp_path) -> None:
    out = export_eagle3(_eagle_head(num_hidden_layers=2), tmp_path / "e", "vllm")
    config = json.loads((out / "config.json").read_text())
    for layers in (1, 3, 10**9):  # 10**9 would allocate a billion layers if built first
        config["num_hidden_layers"] = layers
        (out / "config.json").write_text(json.dumps(config))
        # 10**9 exceeds every weight dimension: refused by draftsmith.decode.drafters.folder first
        with pytest.raises(ValueError, match=r"do not belong together|does not describe them"):
            Eagle3Head.from_pretrained(out)
    config["num_hidden_layers"] = "2"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_hidden_layers must be an integer"):
        Eagle3Head.from_pretrained(out)


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda c: c.update(transformer_layer_config=[1]), "is not a speculators-format"),
        (lambda c: c["transformer_layer_config"].pop("hidden_size"), "KeyError: 'hidden_size'"),
        (
            lambda c: c["transformer_layer_config"].update(intermediate_size="64"),
            r"Eagle3Config\.intermediate_size must be an integer",
        ),
        (
            lambda c: c["transformer_layer_config"].update(hidden_size=10**7),
            r"hidden_size 10000000 is larger than every dimension",
        ),
    ],
)
def test_a_damaged_speculators_folder_is_named(tmp_path, damage, expected) -> None:
    """read_speculators_* (scripts/check_engine.py reads a user's folder with them) used to
    raise a bare KeyError, TypeError or torch allocation error."""
    from draftsmith.decode.loading import LoadError

    out = export_eagle3(_eagle_head(), tmp_path / "s", "speculators", verifier="t")
    config = json.loads((out / "config.json").read_text())
    damage(config)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=expected):
        read_speculators_eagle3(out)
    (out / "config.json").write_text("{oops")
    with pytest.raises(LoadError, match=r"config\.json is not valid JSON"):
        read_speculators_eagle3(out)


def test_non_finite_speculators_weights_are_refused(tmp_path) -> None:
    from draftsmith.decode.loading import LoadError
    from safetensors.torch import load_file, save_file

    out = export_eagle3(_eagle_head(), tmp_path / "s", "speculators", verifier="t")
    weights = load_file(str(out / "model.safetensors"))
    weights["fc.weight"][0, 0] = float("inf")
    save_file(weights, str(out / "model.safetensors"))
    with pytest.raises(LoadError, match=r"weight fc\.weight holds 1 NaN or infinite"):
        read_speculators_eagle3(out)
