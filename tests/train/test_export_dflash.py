"""The vLLM ``qwen3_dflash`` export of a DFlash head: the config and weight names vLLM's reader
takes (checked against what that reader does with them), a round trip to the same drafts, and
the refusals (DSpark's heads, other layouts)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from draftsmith.decode.drafters.dflash.head import DFlashConfig, DFlashHead
from draftsmith.decode.drafters.eagle.head import build_vocab_maps
from draftsmith.decode.loading import LoadError
from draftsmith.train.export.dflash import export_dflash
from safetensors.torch import load_file
from tiny_models import tiny_llama

ENGINE_PYTHON = os.environ.get("DRAFTSMITH_ENGINE_PYTHON")


def _head(**overrides) -> DFlashHead:
    target = tiny_llama(num_layers=4)
    torch.manual_seed(0)
    config = DFlashConfig.for_target(target.config, block_size=6, mask_token_id=9, **overrides)
    return DFlashHead(config)


def _vllm_aux_layers(config: dict) -> list[int]:
    """vLLM 0.32's ``get_eagle3_aux_layers_from_config`` for a DFlash folder: the top-level ids,
    else ``dflash_config.target_layer_ids`` plus one."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = [i + 1 for i in (config.get("dflash_config") or {}).get("target_layer_ids") or []]
    return ids


@pytest.mark.parametrize("draft_vocab_size", [None, 40])
def test_vllm_layout_round_trip_and_reader_fields(tmp_path, draft_vocab_size) -> None:
    head = _head(draft_vocab_size=draft_vocab_size, num_hidden_layers=2)
    if draft_vocab_size:
        counts = torch.rand(64, generator=torch.Generator().manual_seed(1))
        head.set_vocab_maps(*build_vocab_maps(counts, draft_vocab_size))
    folder = export_dflash(head, tmp_path / "vllm")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert _vllm_aux_layers(config) == list(head.config.aux_hidden_state_layer_ids)
    assert _vllm_aux_layers({"dflash_config": config["dflash_config"]}) == _vllm_aux_layers(config)
    assert config["rope_theta"] == head.config.rope_theta  # vLLM's DFlash default would be 1e6
    assert config["dflash_config"]["mask_token_id"] == 9
    assert config["block_size"] == 6 and config["num_hidden_layers"] == 2
    assert not {"is_causal", "layer_types"} & set(config)  # non-causal inside the block
    assert "causal" not in config["dflash_config"]
    tensors = load_file(folder / "model.safetensors")
    assert not any(n.startswith("model.") or "embed_tokens" in n for n in tensors)
    assert "t2d" in tensors and "d2t" in tensors  # vLLM skips t2d, maps d2t
    for name in ("fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight",
                 "layers.1.self_attn.k_norm.weight", "layers.0.mlp.gate_proj.weight"):  # fmt: skip
        assert name in tensors, name
    assert tensors["lm_head.weight"].shape[0] == config["draft_vocab_size"]
    back = DFlashHead.from_pretrained(folder)
    assert back.config == head.config
    for name, tensor in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_export_refuses_what_the_layout_cannot_hold(tmp_path) -> None:
    with pytest.raises(ValueError, match="Markov or confidence"):
        export_dflash(_head(markov_rank=2), tmp_path / "a")
    with pytest.raises(ValueError, match="Markov or confidence"):
        export_dflash(_head(confidence_head=True), tmp_path / "b")
    with pytest.raises(ValueError, match="not 'sglang'"):
        export_dflash(_head(), tmp_path / "c", "sglang")
    with pytest.raises(ValueError, match="embeddings"):
        export_dflash(_head(aux_hidden_state_layer_ids=(0, 2)), tmp_path / "d")
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_speculators_layout_round_trip_and_fields(tmp_path) -> None:
    head = _head(draft_vocab_size=40, num_hidden_layers=2)
    head.set_vocab_maps(*build_vocab_maps(torch.rand(64), 40))
    with pytest.raises(ValueError, match="names its verifier"):
        export_dflash(head, tmp_path / "none", "speculators")
    folder = export_dflash(head, tmp_path / "spec", "speculators", verifier="/models/target")
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash"
    assert config["aux_hidden_state_layer_ids"] == list(head.config.aux_hidden_state_layer_ids)
    assert config["mask_token_id"] == 9 and config["block_size"] == 6
    assert not config["sample_from_anchor"] and config["sliding_window_non_causal"]
    method = config["speculators_config"]["proposal_methods"][0]
    assert method["speculative_tokens"] == head.config.draft_tokens == 5
    assert config["speculators_config"]["verifier"]["name_or_path"] == "/models/target"
    assert config["transformer_layer_config"]["model_type"] == "qwen3"
    back = DFlashHead.from_pretrained(folder)
    assert back.config == head.config
    for name, tensor in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    "variant",
    [
        {"sample_from_anchor": True},
        {"projector_type": "domino"},
        {"shift_label": True},
        {"sliding_window_non_causal": False},
    ],
)
def test_speculators_variants_this_head_cannot_run_are_refused_by_name(tmp_path, variant) -> None:
    folder = export_dflash(_head(), tmp_path / "spec", "speculators", verifier="t")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **variant}))
    (key,) = variant
    with pytest.raises(LoadError, match=key):
        DFlashHead.from_pretrained(folder)


@pytest.mark.engines
@pytest.mark.skipif(not ENGINE_PYTHON, reason="set DRAFTSMITH_ENGINE_PYTHON to a Python with vLLM")
def test_vllm_reads_the_speculators_layout_as_the_vllm_layout(tmp_path) -> None:
    """vLLM's own converter (``SpeculatorsConfig``) turns our speculators folder into the same
    drafter config our vllm folder states: aux layers, mask, block, non-causal, draft length."""
    head = _head(num_hidden_layers=2)
    spec = export_dflash(head, tmp_path / "spec", "speculators", verifier="t")
    plain = json.loads((export_dflash(head, tmp_path / "vllm") / "config.json").read_text())
    script = (
        "import json, sys\n"
        "from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig as S\n"
        "raw = json.load(open(sys.argv[1]))\n"
        "print(json.dumps([S.extract_transformers_pre_trained_config(dict(raw)),"
        " S.build_vllm_speculative_config(raw)]))\n"
    )
    out = subprocess.run(
        [ENGINE_PYTHON, "-c", script, str(spec / "config.json")],
        capture_output=True,
        text=True,
        check=True,
    )
    converted, speculative = json.loads(out.stdout.strip().splitlines()[-1])
    assert converted["architectures"] == plain["architectures"]
    assert (
        converted["eagle_aux_hidden_state_layer_ids"] == (plain["eagle_aux_hidden_state_layer_ids"])
    )
    for key in ("mask_token_id", "target_layer_ids"):
        assert converted["dflash_config"][key] == plain["dflash_config"][key], key
    assert converted["dflash_config"]["causal"] is False
    assert not converted["dflash_config"]["sample_from_anchor"]
    assert speculative == {"method": "dflash", "num_speculative_tokens": 5}
