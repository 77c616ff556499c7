"""Published EAGLE-3 heads read as the engines read them (tests/fixtures/published_heads).

Each fixture's config.json is a published head's, value for value; the tests shrink its widths
(the rope, the norms, the variants and the layout stay), write tiny random weights under the
published key names (built here, never downloaded) and check that our decoder drafts what an
independent Hugging Face-style computation of the same weights drafts, that greedy decoding
equals the target's, and that the layouts we cannot serve are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from draftsmith.decode.drafters.base import TargetPass
from draftsmith.decode.drafters.eagle.drafter import Eagle3Drafter
from draftsmith.decode.drafters.eagle.head import Eagle3Head
from draftsmith.decode.drafters.eagle.layers import rope_tables
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.decode.sampling import SamplingConfig
from draftsmith.train.export.formats import read_speculators_eagle3
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tests.decode_helpers import hf_greedy
from tests.tiny_models import tiny_llama

FIXTURES = Path(__file__).parents[1] / "fixtures" / "published_heads"
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 64, 32, 4, 2, 8, 48
TARGET_LAYERS, TINY_IDS = 6, [1, 3, 5]
LOADED = [
    "eagle-llama3.1-8b",
    "specforge-llama3.3-70b",
    "specforge-qwen3-32b",
    "specforge-qwen3-30b-a3b-eagle3.1",
    "speculators-gemma-4-31b-eagle3",
    "speculators-qwen3-8b-eagle3",
]
REFUSED = {
    "speculators-qwen3-eagle3.1-sliding": "sliding window of 2048 tokens",
    "specforge-gpt-oss-20b": "'gpt_oss' layer",
}


def published(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name / "config.json").read_text())


def is_speculators(raw: dict[str, Any]) -> bool:
    return "speculators_model_type" in raw


def shrunk(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with tiny widths and our tiny target's aux ids; everything else as published."""
    raw = json.loads(json.dumps(raw))
    layer = raw["transformer_layer_config"] if is_speculators(raw) else raw
    pruned = raw.get("draft_vocab_size", layer["vocab_size"]) < layer["vocab_size"]
    layer.update(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, intermediate_size=MLP, vocab_size=VOCAB,
    )  # fmt: skip
    raw["draft_vocab_size"] = VOCAB // 2 if pruned else VOCAB
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        raw["eagle_aux_hidden_state_layer_ids"] = TINY_IDS
    return raw


def variant(raw: dict[str, Any], flag: str) -> bool:
    """A flag as vLLM reads it (speculators' eagle3 default norm_before_residual: true)."""
    default = flag == "norm_before_residual" and is_speculators(raw)
    return bool(raw.get(flag, default))


def published_weights(raw: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random weights under the published names: ``midlayer.*`` (EAGLE, SpecForge) or
    ``layers.0.*`` and ``embed_tokens`` (speculators), ``fc_norm.{i}`` for EAGLE-3.1, the vocab
    maps for a pruned vocabulary."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm() -> torch.Tensor:
        return 1 + rand(HIDDEN, scale=0.1)

    draft = raw["draft_vocab_size"]
    layer = "layers.0" if is_speculators(raw) else "midlayer"
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    weights = {
        "fc.weight": rand(HIDDEN, 3 * HIDDEN),
        f"{layer}.hidden_norm.weight": norm(),
        f"{layer}.input_layernorm.weight": norm(),
        f"{layer}.post_attention_layernorm.weight": norm(),
        f"{layer}.self_attn.q_proj.weight": rand(q, 2 * HIDDEN),
        f"{layer}.self_attn.k_proj.weight": rand(kv, 2 * HIDDEN),
        f"{layer}.self_attn.v_proj.weight": rand(kv, 2 * HIDDEN),
        f"{layer}.self_attn.o_proj.weight": rand(HIDDEN, q),
        f"{layer}.mlp.gate_proj.weight": rand(MLP, HIDDEN),
        f"{layer}.mlp.up_proj.weight": rand(MLP, HIDDEN),
        f"{layer}.mlp.down_proj.weight": rand(HIDDEN, MLP),
        "norm.weight": norm(),
        "lm_head.weight": rand(draft, HIDDEN, scale=1.0),
    }
    if variant(raw, "fc_norm"):
        weights |= {f"fc_norm.{i}.weight": norm() for i in range(3)}
    if is_speculators(raw):
        weights["embed_tokens.weight"] = rand(VOCAB, HIDDEN)
    if draft < VOCAB:
        kept = torch.sort(torch.randperm(VOCAB, generator=g)[:draft]).values
        weights["d2t"] = kept - torch.arange(draft)
        weights["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, kept, True)
    return weights


def write_folder(folder: Path, raw: dict[str, Any], weights: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def load(folder: Path) -> Eagle3Head:
    raw = json.loads((folder / "config.json").read_text())
    if is_speculators(raw):
        return read_speculators_eagle3(folder, TARGET_LAYERS)
    return Eagle3Head.from_pretrained(folder, target_num_hidden_layers=TARGET_LAYERS)


# -- the reference: the published head computed from its weights with transformers' pieces ---
def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class ReferenceHead:
    """The head as vLLM's ``llama_eagle3.py`` computes it, from the published weights and
    config: transformers' rotary embedding, eager attention, one entry at a time."""

    def __init__(self, raw: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
        layer = raw["transformer_layer_config"] if is_speculators(raw) else raw
        self.w = {k.replace("layers.0.", "midlayer."): v for k, v in weights.items()}
        self.eps = layer["rms_norm_eps"]
        self.flags = {
            f: variant(raw, f) for f in ("norm_before_residual", "fc_norm", "norm_output")
        }
        rope = dict(layer.get("rope_scaling") or layer.get("rope_parameters") or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        theta = layer.get("rope_theta", rope.get("rope_theta", 10000.0))
        config = LlamaConfig(
            hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=HEAD_DIM,
            max_position_embeddings=layer.get("max_position_embeddings", 4096),
            rope_parameters={**rope, "rope_theta": theta},
        )  # fmt: skip
        self.rotary = LlamaRotaryEmbedding(config)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        draft = self.w["lm_head.weight"].shape[0]
        self.to_target = torch.arange(draft) + self.w.get(
            "d2t", torch.zeros(draft, dtype=torch.long)
        )

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:  # [A*H] -> [H]
        if self.flags["fc_norm"]:
            chunks = aux.chunk(3, dim=-1)
            aux = torch.cat(
                [rms(c, self.w[f"fc_norm.{i}.weight"], self.eps) for i, c in enumerate(chunks)]
            )
        return aux @ self.w["fc.weight"].T

    def step(
        self, hidden: torch.Tensor, embed: torch.Tensor, position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One entry: (its output fed to the next step, its draft logits)."""
        w, m = self.w, "midlayer."
        normed = rms(hidden, w[m + "hidden_norm.weight"], self.eps)
        residual = normed if self.flags["norm_before_residual"] else hidden
        x = torch.cat((rms(embed, w[m + "input_layernorm.weight"], self.eps), normed))
        q = (x @ w[m + "self_attn.q_proj.weight"].T).view(1, HEADS, 1, HEAD_DIM)
        k = (x @ w[m + "self_attn.k_proj.weight"].T).view(1, KV_HEADS, 1, HEAD_DIM)
        v = (x @ w[m + "self_attn.v_proj.weight"].T).view(1, KV_HEADS, 1, HEAD_DIM)
        cos, sin = self.rotary(x[None, None], torch.tensor([[position]]))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        self.keys.append(k)
        self.values.append(v)
        keys = torch.cat(self.keys, 2).repeat_interleave(HEADS // KV_HEADS, 1)
        values = torch.cat(self.values, 2).repeat_interleave(HEADS // KV_HEADS, 1)
        attn = torch.softmax(q @ keys.transpose(-1, -2) / HEAD_DIM**0.5, -1) @ values
        r = residual + attn.reshape(-1) @ w[m + "self_attn.o_proj.weight"].T
        n = rms(r, w[m + "post_attention_layernorm.weight"], self.eps)
        mlp = F.silu(n @ w[m + "mlp.gate_proj.weight"].T) * (n @ w[m + "mlp.up_proj.weight"].T)
        h = r + mlp @ w[m + "mlp.down_proj.weight"].T
        final = rms(h, w["norm.weight"], self.eps)
        logits = final @ w["lm_head.weight"].T
        return (final if self.flags["norm_output"] else h), logits


def reference_drafts(
    head: ReferenceHead, aux: torch.Tensor, embed: torch.nn.Module, tokens: list[int], n: int
) -> list[int]:
    """Greedy chain of ``n`` drafts after the committed ``tokens`` (the last one pending):
    every committed entry (feature t, token t+1), then the head fed its own outputs."""
    with torch.no_grad():
        for t in range(len(tokens) - 1):
            out, logits = head.step(head.fuse(aux[t]), embed(torch.tensor(tokens[t + 1])), t)
        drafts = []
        for step in range(n):
            token = int(head.to_target[logits.argmax()])
            drafts.append(token)
            out, logits = head.step(out, embed(torch.tensor(token)), len(tokens) - 1 + step)
    return drafts


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(num_layers=TARGET_LAYERS, vocab_size=VOCAB, dtype=torch.float32, seed=3)


@pytest.mark.parametrize("name", LOADED)
def test_published_layout_drafts_as_the_reference(name: str, target, tmp_path) -> None:
    """Our drafter's greedy chain (lean path) and the head's own forward (reference path)
    equal an independent computation of the published head from the same weights, rope and
    norms included, at every step; and greedy decoding with it equals the target's."""
    raw = shrunk(published(name))
    weights = published_weights(raw, seed=len(name))
    head = load(write_folder(tmp_path / name, raw, weights))
    drafter = Eagle3Drafter(head, target)
    prompt = [5, 9, 17, 33, 2, 40, 11, 7, 60, 21]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    pending = out.logits[:, -1].argmax(-1)
    drafter.prefill(ids, torch.ones_like(ids), TargetPass(out.logits, out.hidden_states), pending)
    proposal = drafter.propose(4, SamplingConfig(), None)
    aux = torch.cat([out.hidden_states[i][0] for i in head.config.aux_hidden_state_layer_ids], -1)
    reference = ReferenceHead(raw, weights)
    embed = target.get_input_embeddings()
    expected = reference_drafts(reference, aux, embed, [*prompt, int(pending)], 4)
    assert proposal.tokens[0].tolist() == expected
    decoder = SpeculativeDecoder(target, Eagle3Drafter(head, target), num_draft_tokens=3)
    got = decoder.generate(ids, max_new_tokens=12, eos_token_id=[]).sequences
    assert torch.equal(got, hf_greedy(target, ids, 12))


def test_published_configs_read_as_published() -> None:
    """The fields the engines read: the EAGLE authors' head names no theta (10000) and a
    2048-token context; SpecForge's 70B head keeps llama3 scaling; EAGLE-3.1 sets fc_norm and
    norm_output; speculators' heads normalise before the residual."""
    from draftsmith.decode.drafters.eagle.config import config_from_engine_dict

    eagle = config_from_engine_dict(published("eagle-llama3.1-8b"), 32)
    assert (eagle.rope_theta, eagle.max_position_embeddings, eagle.rope_scaling) == (
        10000.0,
        2048,
        None,
    )
    specforge = config_from_engine_dict(published("specforge-llama3.3-70b"), 80)
    assert specforge.rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 4096,
    }  # fmt: skip
    assert specforge.rope_theta == 500000.0
    eagle31 = config_from_engine_dict(published("specforge-qwen3-30b-a3b-eagle3.1"), 48)
    assert (eagle31.fc_norm, eagle31.norm_output, eagle31.norm_before_residual) == (
        True,
        True,
        False,
    )


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unservable_layouts_are_refused_by_name(name: str, tmp_path) -> None:
    raw = shrunk(published(name))
    raw.pop("eagle_config", None)
    folder = write_folder(tmp_path / name, raw, published_weights(raw, seed=1))
    with pytest.raises(ValueError, match=REFUSED[name]):
        if is_speculators(raw):
            read_speculators_eagle3(folder, TARGET_LAYERS)
        else:
            from draftsmith.decode.drafters.eagle.config import config_from_engine_dict

            config_from_engine_dict(raw, TARGET_LAYERS)


def test_mismatched_keys_are_named_never_loaded_random(tmp_path) -> None:
    """A folder whose weights are not the config's layout is refused with the keys named: an
    EAGLE-3.1 config over weights without fc_norm, and a head missing a projection."""
    raw = shrunk(published("specforge-qwen3-30b-a3b-eagle3.1"))
    weights = published_weights(raw, seed=2)
    no_norms = {k: v for k, v in weights.items() if not k.startswith("fc_norm")}
    with pytest.raises(ValueError, match=r"missing \['fc_norm\.0\.weight'"):
        load(write_folder(tmp_path / "a", raw, no_norms))
    plain = shrunk(published("specforge-qwen3-32b"))
    partial = published_weights(plain, seed=2)
    del partial["midlayer.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"midlayer\.self_attn\.k_proj\.weight"):
        load(write_folder(tmp_path / "b", plain, partial))


# -- rope tables against the references ----------------------------------------------------
SCALINGS = {
    "specforge-llama3.3-70b": published("specforge-llama3.3-70b")["rope_scaling"],
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    "yarn-betas": {
        "rope_type": "yarn",
        "factor": 8.0,
        "beta_fast": 16,
        "beta_slow": 2,
        "original_max_position_embeddings": 4096,
    },
}


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_rope_tables_equal_transformers(name: str) -> None:
    """Our float32 cos/sin tables equal transformers' (its rope init function, its rotary
    embedding) exactly: max difference 0.0 at every position up to the context."""
    scaling, theta, dim, context = SCALINGS[name], 500000.0, 128, 8192
    config = LlamaConfig(
        hidden_size=dim * 4, num_attention_heads=4, head_dim=dim, max_position_embeddings=context,
        rope_parameters={**scaling, "rope_theta": theta},
    )  # fmt: skip
    positions = torch.arange(context)[None]
    cos_ref, sin_ref = LlamaRotaryEmbedding(config)(
        torch.zeros(1, 1, dtype=torch.float32), positions
    )
    from draftsmith.decode.drafters.eagle.rope import checked_rope_scaling

    cos, sin = rope_tables(
        positions, dim, theta, torch.float32, checked_rope_scaling(scaling), context
    )
    assert (cos[:, 0] - cos_ref).abs().max().item() == 0.0
    assert (sin[:, 0] - sin_ref).abs().max().item() == 0.0


@pytest.mark.parametrize(
    ("scaling", "reason"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "running sequence length"),
        ({"rope_type": "longrope", "factor": 2.0}, "factor sets"),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "part of each head"),
        ({"rope_type": "llama3", "factor": 8.0}, "lacks"),
        ({"rope_type": "linear", "factor": 2.0, "mrope_section": [1]}, "mrope_section"),
    ],
)
def test_unsupported_rope_is_refused_with_the_reason(scaling, reason) -> None:
    from draftsmith.decode.drafters.eagle.rope import checked_rope_scaling

    with pytest.raises(ValueError, match=reason):
        checked_rope_scaling(scaling)


_VLLM_TABLES = """
import json, sys, torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
args = json.loads(sys.argv[1])
with set_current_vllm_config(VllmConfig()):
    rope = get_rope(args["dim"], args["context"], True, args["parameters"], torch.float32)
print(json.dumps(rope.cos_sin_cache[: args["context"]].tolist()))
"""


def _engine_python() -> str | None:
    import importlib.util
    import os
    import sys

    if os.environ.get("DRAFTSMITH_ENGINE_PYTHON"):
        return os.environ["DRAFTSMITH_ENGINE_PYTHON"]
    return sys.executable if importlib.util.find_spec("vllm") else None


@pytest.mark.engines
@pytest.mark.slow
@pytest.mark.parametrize("name", ["specforge-llama3.3-70b", "linear"])
def test_rope_tables_equal_vllm(name: str) -> None:
    """vLLM's own rotary embedding (``get_rope``, run in the engine's Python) builds the same
    float32 cos/sin cache as our head for every fixture with scaling: max difference 0.0."""
    import subprocess

    from draftsmith.decode.drafters.eagle.rope import checked_rope_scaling

    python = _engine_python()
    if python is None:
        pytest.skip("set DRAFTSMITH_ENGINE_PYTHON to a Python with vLLM")
    scaling, theta, dim, context = SCALINGS[name], 500000.0, 128, 4096
    args = {"dim": dim, "context": context, "parameters": {**scaling, "rope_theta": theta}}
    done = subprocess.run(
        [python, "-c", _VLLM_TABLES, json.dumps(args)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    cache = torch.tensor(json.loads(done.stdout.strip().splitlines()[-1]))  # [P, D]: cos, sin
    positions = torch.arange(context)[None]
    cos, sin = rope_tables(positions, dim, theta, torch.float32, checked_rope_scaling(scaling))
    half = dim // 2
    assert (cos[0, 0, :, :half] - cache[:, :half]).abs().max().item() == 0.0
    assert (sin[0, 0, :, :half] - cache[:, half:]).abs().max().item() == 0.0
