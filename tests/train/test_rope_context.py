"""Rope and context of an EAGLE-3 head: one choice, identical everywhere it is read.

The head uses plain rope with the target's theta, no scaling, and the target's context
(``Eagle3Config.for_target``), as the reference heads do. Its rotary angles must agree
(cos and sin, max |diff| <= 1e-6 in float32) in training (the head's attention), in our decoder
(the eager head and ``LeanEagle3``) and in each export as the engine's config reader builds them,
at every position up to 4x the target's ``original_max_position_embeddings``; the exported
context must be at least the target's. A head exported with a shorter context (the 2048 trap)
makes the engine index past its cos/sin cache; one that inherited the target's llama3 scaling
rotates by other angles: both are shown to fail here.

The engine readers below restate, for the rope types these targets use, how vLLM
(``vllm/model_executor/models/llama_eagle3.py`` -> ``LlamaAttention`` -> ``get_rope``;
``rotary_embedding/base.py`` and ``llama3_rope.py``) and SGLang (``models/llama.py`` ->
``get_rope``; ``layers/rotary_embedding/base.py``) turn a head folder's config into a cos/sin
cache: float32 inverse frequencies ``1 / theta ** (arange(0, D, 2) / D)``, float32 positions
``arange(max_position_embeddings)``, their outer product, cos and sin; a lookup by position.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import draftsmith.decode.drafters.eagle.layers as eagle_layers
import pytest
import torch
from draftsmith.decode.drafters.eagle.head import Eagle3Config, Eagle3Head
from draftsmith.decode.drafters.eagle.lean import LeanEagle3
from draftsmith.train.export.formats import export_eagle3
from real_targets import LLAMA31, LLAMA33_70B, QWEN3, real_config
from transformers import AutoConfig

TOLERANCE = 1e-6
ENGINES = ("vllm", "sglang", "speculators")


# ---------------------------------------------------------------------- the engines' readers


def engine_rope(config: dict, fmt: str) -> tuple[dict, int, int]:
    """(rope parameters, rotary dim, max_position) an engine builds the head's rope from.

    vLLM reads the speculators format's ``transformer_layer_config`` as the draft's config and
    turns ``rope_scaling`` + ``rope_theta`` into ``rope_parameters`` (transformers 5 does the
    same); SGLang's Llama layer reads ``rope_theta`` and ``rope_scaling`` as they are. Both
    default ``max_position_embeddings`` to 8192 and theta to 10000.
    """
    layer = config["transformer_layer_config"] if fmt == "speculators" else config
    if fmt == "sglang":
        params = dict(layer.get("rope_scaling") or {})
        params["rope_theta"] = layer.get("rope_theta", 10000)
    else:
        params = dict(layer.get("rope_parameters") or layer.get("rope_scaling") or {})
        params.setdefault("rope_theta", layer.get("rope_theta", 10000))
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    head_dim = layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]
    return params, head_dim, layer.get("max_position_embeddings", 8192)


def engine_cos_sin_cache(params: dict, dim: int, max_position: int) -> torch.Tensor:  # [P, D]
    """``RotaryEmbedding._compute_cos_sin_cache`` (and Llama3RotaryEmbedding's frequencies)."""
    inverse = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if params["rope_type"] == "llama3":
        original = params["original_max_position_embeddings"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        wave_len = 2 * math.pi / inverse
        smooth = (original / wave_len - low) / (high - low)
        inverse = torch.where(
            wave_len < original / high,
            inverse,
            torch.where(
                wave_len > original / low,
                inverse / params["factor"],
                (1 - smooth) * inverse / params["factor"] + smooth * inverse,
            ),
        )
    elif params["rope_type"] != "default":
        raise NotImplementedError(params["rope_type"])
    angles = torch.einsum("i,j -> ij", torch.arange(max_position, dtype=torch.float), inverse)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def engine_cos_sin(
    config: dict, fmt: str, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:  # [N, D] each, our half-split layout
    params, dim, max_position = engine_rope(config, fmt)
    cache = engine_cos_sin_cache(params, dim, max_position)
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)  # IndexError past the cache
    return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)


# ---------------------------------------------------------------------- helpers


def _positions(target: dict) -> torch.Tensor:  # [N] up to 4x the original context, and edges
    scaling = target.get("rope_scaling") or {}
    original = scaling.get("original_max_position_embeddings", target["max_position_embeddings"])
    top = min(4 * original, target["max_position_embeddings"]) - 1
    return torch.unique(torch.cat((torch.arange(0, top + 1, 97), torch.arange(top - 64, top + 1))))


def _meta_head(target: dict, **overrides: object) -> Eagle3Head:
    """A full-size head with no memory behind it: the export configs read only its config."""
    with torch.device("meta"):
        return Eagle3Head(Eagle3Config.for_target(AutoConfig.for_model(**target), **overrides))


def _engine_configs(head: Eagle3Head, tmp_path: Path) -> dict[str, dict]:
    from draftsmith.train.export.formats import eagle3_engine_config, eagle3_speculators_config

    return {
        "vllm": eagle3_engine_config(head, "vllm", torch.bfloat16),
        "sglang": eagle3_engine_config(head, "sglang", torch.bfloat16),
        "speculators": eagle3_speculators_config(head, torch.bfloat16, "meta-llama/target"),
    }


def _max_diff(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------- the real targets


@pytest.mark.parametrize("family", [LLAMA31, QWEN3, LLAMA33_70B])
def test_every_engine_rotates_a_full_size_head_as_training_does(
    family: str, tmp_path: Path
) -> None:
    target = real_config(family)
    head = _meta_head(target)
    config = head.config
    assert config.rope_theta == target["rope_theta"]
    assert config.max_position_embeddings >= target["max_position_embeddings"]
    positions = _positions(target)
    training = eagle_layers.rope_tables(
        positions[None], config.head_dim, config.rope_theta, torch.float32
    )
    training = (training[0][0, 0], training[1][0, 0])  # [N, D]
    for fmt, exported in _engine_configs(head, tmp_path).items():
        params, dim, context = engine_rope(exported, fmt)
        assert params == {"rope_theta": target["rope_theta"], "rope_type": "default"}, fmt
        assert dim == config.head_dim and context >= target["max_position_embeddings"], fmt
        assert _max_diff(engine_cos_sin(exported, fmt, positions), training) <= TOLERANCE, fmt


def test_the_llama3_scaled_targets_own_rope_is_not_the_heads(tmp_path: Path) -> None:
    """The head deliberately drops the target's llama3 scaling: an export that inherited it
    would rotate by other angles past the original context (the check can fail)."""
    target = real_config(LLAMA31)
    head = _meta_head(target)
    exported = _engine_configs(head, tmp_path)["vllm"]
    positions = _positions(target)
    inherited = {**exported, "rope_scaling": target["rope_scaling"]}
    assert _max_diff(engine_cos_sin(inherited, "vllm", positions), engine_cos_sin(
        exported, "vllm", positions
    )) > 0.1  # fmt: skip
    # Our port of vLLM's llama3 frequencies is the target's own rope (Hugging Face's).
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(AutoConfig.for_model(**target))
    cos, sin = rotary(torch.zeros(1, 1, dtype=torch.float32), positions[None])
    params, dim, _ = engine_rope({**target, "head_dim": 128}, "vllm")
    cache = engine_cos_sin_cache(params, dim, int(positions.max()) + 1)
    ours = cache.index_select(0, positions).chunk(2, dim=-1)
    ported = (torch.cat((ours[0], ours[0]), -1), torch.cat((ours[1], ours[1]), -1))
    assert _max_diff(ported, (cos[0], sin[0])) <= TOLERANCE


def test_a_head_with_a_short_context_is_refused_and_would_break_the_engine(tmp_path: Path) -> None:
    target = real_config(LLAMA31)
    with pytest.raises(ValueError, match="max_position_embeddings 2048 is below the target's"):
        _meta_head(target, max_position_embeddings=2048)
    # What an engine does with such a folder: its cache ends at 2048.
    exported = {
        **_engine_configs(_meta_head(target), tmp_path)["vllm"],
        "max_position_embeddings": 2048,
    }
    with pytest.raises(IndexError):
        engine_cos_sin(exported, "vllm", _positions(target))


# ---------------------------------------------------------------------- a trained head, end to end


def test_training_decoder_and_exports_of_a_scaled_llama31_head_agree(
    llama31_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scaled Llama-3.1 target keeps the real rope (llama3, theta 5e5, 131,072 positions):
    record the angles the head's attention uses in a forward at far positions (training's
    code path), the lean decoder's, and each exported folder's, reloaded from disk."""
    target = json.loads((llama31_target / "config.json").read_text())
    config = Eagle3Config.for_target(AutoConfig.from_pretrained(llama31_target))
    torch.manual_seed(0)
    head = Eagle3Head(config).eval()
    positions = _positions(target)  # [N]
    recorded: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = eagle_layers.rope_tables

    def recording(*args, **kwargs):
        cos, sin = original(*args, **kwargs)
        recorded.append((cos[0, 0], sin[0, 0]))
        return cos, sin

    monkeypatch.setattr(eagle_layers, "rope_tables", recording)
    hidden = torch.randn(1, len(positions), config.hidden_size)
    with torch.no_grad():
        head(hidden, torch.randn_like(hidden), positions[None])
    monkeypatch.setattr(eagle_layers, "rope_tables", original)
    training = recorded[-1]
    lean = LeanEagle3(head)._rotary(positions[None], torch.float32)
    assert _max_diff((lean[0][0, 0], lean[1][0, 0]), training) <= TOLERANCE

    for fmt in ENGINES:
        folder = export_eagle3(
            head, tmp_path / fmt, fmt, dtype=torch.bfloat16, verifier=str(llama31_target)
        )
        exported = json.loads((folder / "config.json").read_text())
        assert engine_rope(exported, fmt)[2] >= target["max_position_embeddings"]
        card = (folder / "README.md").read_text()  # the folder states its rope and context
        assert "theta 500000" in card and "`max_position_embeddings` 131072" in card
        assert _max_diff(engine_cos_sin(exported, fmt, positions), training) <= TOLERANCE, fmt
    # Hugging Face's reader of the vLLM/SGLang folder (SpecForge and transformers-based tools).
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = AutoConfig.from_pretrained(tmp_path / "vllm")
    assert hf.rope_parameters["rope_type"] == "default"
    cos, sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions[None])
    assert _max_diff((cos[0], sin[0]), training) <= TOLERANCE
    # Our own loader reads the folder back with the same rope and context.
    reloaded = Eagle3Head.from_pretrained(tmp_path / "vllm")
    assert reloaded.config.rope_theta == config.rope_theta
    assert reloaded.config.max_position_embeddings == config.max_position_embeddings
