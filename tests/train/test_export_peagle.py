"""The speculators-format P-EAGLE export against what vLLM's reader and weight loader expect,
and loading it back: the same drafts as the native head.

The reader's expectations are restated here from vLLM's source (``transformers_utils/configs/
speculators/base.py`` and ``algos.py``: the speculators type ``peagle`` becomes method
``eagle3`` with ``parallel_drafting``, ``mask_token_id`` is required and becomes
``pard_token``; ``model_executor/models/llama_eagle3.py``: ``mask_hidden`` is required under
parallel drafting, ``embed_tokens`` is the draft's own when present, ``t2d`` is skipped and
``d2t`` becomes ``draft_id_to_target_id``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from draftsmith.decode.drafters.base import TargetPass
from draftsmith.decode.drafters.eagle.head import build_vocab_maps
from draftsmith.decode.drafters.eagle.peagle import PEagleConfig, PEagleDrafter, PEagleHead
from draftsmith.decode.sampling import SamplingConfig
from draftsmith.train.export.formats import export_peagle, read_speculators_peagle
from safetensors import safe_open
from tiny_models import tiny_llama

HIDDEN, VOCAB, DRAFT_VOCAB, LAYERS = 32, 64, 24, 8


def _head(
    target: torch.nn.Module, aux: tuple[int, ...] | None = None, layers: int = 1
) -> PEagleHead:
    torch.manual_seed(0)
    config = PEagleConfig.for_target(
        target.config,
        draft_vocab_size=DRAFT_VOCAB,
        num_depths=4,
        mask_token_id=7,
        aux_hidden_state_layer_ids=aux,
        num_hidden_layers=layers,
    )
    head = PEagleHead(config).double()
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0, 0.2)
    counts = torch.rand(VOCAB, generator=torch.Generator().manual_seed(1))
    head.set_vocab_maps(*build_vocab_maps(counts, DRAFT_VOCAB))
    return head


def _vllm_config(raw: dict) -> tuple[dict, dict]:
    """vLLM's speculators reader: the draft's hf config fields and the speculative config."""
    spec = raw["speculators_config"]
    assert spec["verifier"]["name_or_path"]  # validated: a KeyError when missing
    layer = dict(raw["transformer_layer_config"])
    layer["draft_vocab_size"] = raw.get("draft_vocab_size")
    layer["norm_before_residual"] = raw.get("norm_before_residual", False)
    layer["pard_token"] = raw["mask_token_id"]  # required
    layer["eagle_aux_hidden_state_layer_ids"] = raw["eagle_aux_hidden_state_layer_ids"]
    method = raw["speculators_model_type"]
    speculative = {"method": method, "num_speculative_tokens": spec["proposal_methods"][0][
        "speculative_tokens"]}  # fmt: skip
    if method == "peagle":
        speculative.update(method="eagle3", parallel_drafting=True)
    return layer, speculative


def _vllm_parameters(tensors: dict[str, torch.Tensor], fc_input: int) -> dict[str, tuple]:
    """Eagle3LlamaForCausalLM.load_weights under parallel drafting: parameter -> shape."""
    stacked = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj",
               ".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}  # fmt: skip
    params: dict[str, tuple] = {}
    assert "mask_hidden" in tensors  # else: "mask_hidden not found in weights"
    for name, tensor in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = "draft_id_to_target_id"
        elif "mask_hidden" in name:
            assert tensor.view(1, -1).shape == (1, fc_input)  # the buffer: fc's input width
            continue
        elif "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        shape = tuple(tensor.shape)
        for shard, fused in stacked.items():
            if shard in name:  # shards stack along the output dimension
                name = name.replace(shard, fused)
                rows = params.get(name, (0,))[0]
                shape = (rows + shape[0], *shape[1:])
        params[name] = shape
    return params


def _vllm_layer_parameters(index: int) -> dict[str, tuple]:
    """The parameters vLLM's multi-layer EAGLE-3 builds for layer ``index`` (every layer has a
    ``hidden_norm``; only the first reads 2H inputs)."""
    width = 2 * HIDDEN if index == 0 else HIDDEN
    prefix = f"model.layers.{index}."
    return {
        prefix + "input_layernorm.weight": (HIDDEN,),
        prefix + "hidden_norm.weight": (HIDDEN,),
        prefix + "post_attention_layernorm.weight": (HIDDEN,),
        prefix + "self_attn.qkv_proj.weight": ((4 + 2 + 2) * 8, width),
        prefix + "self_attn.o_proj.weight": (HIDDEN, 4 * 8),
        prefix + "mlp.gate_up_proj.weight": (2 * 2 * HIDDEN, HIDDEN),
        prefix + "mlp.down_proj.weight": (HIDDEN, 2 * HIDDEN),
    }


@pytest.mark.parametrize("head_layers", [1, 2])
def test_export_is_what_vllms_reader_and_loader_expect_and_loads_back(
    tmp_path: Path, head_layers: int
) -> None:
    target = tiny_llama(num_layers=LAYERS)
    head = _head(target, layers=head_layers)
    embed = target.get_input_embeddings().weight
    out = export_peagle(head, embed, tmp_path / "sp", verifier="/models/target")
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["PEagleSpeculator"]
    assert raw["speculators_config"]["algorithm"] == "peagle"
    assert raw["norm_before_residual"] is False and raw["mask_token_id"] == 7
    layer, speculative = _vllm_config(raw)
    assert speculative == {"method": "eagle3", "num_speculative_tokens": 4,
                           "parallel_drafting": True}  # fmt: skip
    assert layer["pard_token"] == raw["transformer_layer_config"]["pard_token"] == 7
    assert layer["num_hidden_layers"] == head_layers and layer["vocab_size"] == VOCAB
    assert layer["draft_vocab_size"] == DRAFT_VOCAB
    assert layer["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM's layer inputs
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    params = _vllm_parameters(tensors, 3 * HIDDEN)
    layer_params = {}
    for index in range(head_layers):
        layer_params.update(_vllm_layer_parameters(index))
    assert params == {
        "model.fc.weight": (HIDDEN, 3 * HIDDEN),
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        **layer_params,
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (DRAFT_VOCAB, HIDDEN),
        "draft_id_to_target_id": (DRAFT_VOCAB,),
    }
    table = tensors["embed_tokens.weight"]  # the target's, but for the mask token's row
    assert torch.equal(table[7], head.mask_embed.detach())
    assert torch.equal(torch.cat((table[:7], table[8:])), torch.cat((embed[:7], embed[8:])))
    assert "parallel_drafting" in (out / "README.md").read_text()
    loaded = read_speculators_peagle(out)
    assert loaded.config == head.config
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    prompt = torch.tensor([[5, 9, 7, 11, 3, 7, 8]])
    with torch.no_grad():
        out_pass = target(prompt, output_hidden_states=True)
    proposals = []
    for drafter in (PEagleDrafter(head, target), PEagleDrafter(loaded, target)):
        drafter.prefill(prompt, torch.ones_like(prompt), TargetPass(out_pass.logits,
                        out_pass.hidden_states), torch.tensor([7]))  # fmt: skip
        proposals.append(drafter.propose(4, SamplingConfig(), None).tokens)
    assert torch.equal(*proposals)


def test_export_of_two_fused_states_and_refusals(tmp_path: Path) -> None:
    target = tiny_llama(num_layers=LAYERS)
    embed = target.get_input_embeddings().weight
    two = export_peagle(_head(target, aux=(2, 5)), embed, tmp_path / "a", verifier="t")
    layer = json.loads((two / "config.json").read_text())["transformer_layer_config"]
    assert layer["num_aux_hidden_states"] == 2  # vLLM 0.32 sizes fc and mask_hidden by it
    with pytest.raises(ValueError, match="names its verifier"):
        export_peagle(_head(target), embed, tmp_path / "b")
    with pytest.raises(ValueError, match="embeddings have shape"):
        export_peagle(_head(target), embed[:10], tmp_path / "c", verifier="t")
