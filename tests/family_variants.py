"""The model families' configuration variants the exactness tests sweep: rope types,
sliding windows, grouped/multi-query attention, biases and tied heads, as tiny random models
whose LM head is peaked (no greedy near-ties), with left-padded ragged prompts."""

from __future__ import annotations

import torch
from tiny_models import tiny_config_kwargs
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 96
HEAD_DIM = 8
WINDOW = 6  # smaller than the prompt (10), let alone prompt + new tokens (12)
PROMPT_LEN = 10
NEW_TOKENS = 12

COMMON = tiny_config_kwargs(VOCAB, hidden_size=32, head_dim=HEAD_DIM, max_position_embeddings=64)


def longrope(original_max_position_embeddings: int) -> dict:
    """Longrope parameters whose long factors start at ``original_max_position_embeddings``."""
    half = HEAD_DIM // 2
    return dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=[1.0 + 0.25 * i for i in range(half)],
        long_factor=[3.0 + 2.0 * i for i in range(half)],
        original_max_position_embeddings=original_max_position_embeddings,
    )


# name -> (model_type, config overrides)
VARIANTS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),  # grouped-query attention: 4 query heads over 2 key/value heads
    "llama-mqa-wide-heads": ("llama", dict(num_key_value_heads=1, head_dim=16)),  # 1 kv head
    "llama-biases-tied": (
        "llama",
        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    ),
    "llama-linear": (
        "llama",
        dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
    ),
    # Below max_position_embeddings dynamic NTK leaves the angles alone (see the lean test).
    "llama-dynamic": (
        "llama",
        dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)),
    ),
    "llama-yarn": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=16,
            )
        ),
    ),
    "llama-llama3": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            )
        ),
    ),
    "llama-proportional": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="proportional", rope_theta=10000.0, factor=2.0, partial_rotary_factor=0.5
            )
        ),
    ),
    # Short factors throughout: every position stays below original_max_position_embeddings.
    "llama-longrope-short": ("llama", dict(rope_parameters=longrope(64))),
    # Long factors throughout: the prompt already exceeds original_max_position_embeddings.
    "llama-longrope-long": ("llama", dict(rope_parameters=longrope(8))),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral-no-window-theta-1e6": (
        "mistral",
        dict(sliding_window=None, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
    ),
    "mistral-window": ("mistral", dict(sliding_window=WINDOW)),
    # Layer 0 full attention, layer 1 windowed.
    "qwen2-window": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "qwen3-window": (
        "qwen3",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0),
    ),
    # Local then global layers; eager attention with logit soft-capping (the model's own path).
    # float32: in float64 Hugging Face's own eager Gemma2 turns fully masked padding queries
    # into NaN (its float32 softmax of float64-minimum scores), and its generate emits pad ids.
    "gemma2-window": ("gemma2", dict(sliding_window=WINDOW)),
    "gemma3-window": (
        "gemma3_text",
        dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    ),
}
LEAN_FAMILIES = {"llama", "mistral", "qwen2", "qwen3"}


def build_variant(name: str, dtype: torch.dtype, seed: int = 0, **extra: object) -> torch.nn.Module:
    """A tiny target of the variant ``name`` in ``dtype``, its LM head random and peaked."""
    model_type, overrides = VARIANTS[name]
    config = AutoConfig.for_model(model_type, **{**COMMON, **overrides, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    # A peaked next-token law (random init is nearly uniform), so greedy ties cannot occur.
    generator = torch.Generator().manual_seed(seed + 1000)
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head.copy_(torch.randn(head.shape, generator=generator, dtype=head.dtype) * 0.5)
    return model


def ragged_prompts(
    batch: int, seed: int = 0, *, repeat_tail: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts; row r has 3 r padding slots. ``repeat_tail``: the last 4 tokens
    repeat the 4 before them, so prompt lookup (n-gram, hybrid) finds matches."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, PROMPT_LEN), generator=generator)
    if repeat_tail:
        ids[:, -4:] = ids[:, -8:-4].clone()
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        mask[row, : 3 * row] = 0
    return ids.masked_fill(mask == 0, 0), mask
