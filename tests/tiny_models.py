"""Tiny random-init causal LMs built in code: fast, offline, deterministic."""

from __future__ import annotations

import torch

TINY_VOCAB = 64


# Architecture -> (config class, model class) in ``transformers``.
_ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),  # attention biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),  # per-head query/key norms
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def tiny_config_kwargs(
    vocab_size: int = TINY_VOCAB,
    hidden_size: int = 32,
    num_layers: int = 2,
    **overrides: object,
) -> dict[str, object]:
    """The keyword arguments of a tiny model's config: 4 query heads over 2 key/value heads, an
    MLP twice the width, untied head, ids pad 0 / bos 1 / eos 2; ``overrides`` replace any."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
        **overrides,
    }


def tiny_causal_lm(
    architecture: str,
    vocab_size: int = TINY_VOCAB,
    hidden_size: int = 32,
    num_layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    **config_overrides: object,
) -> torch.nn.Module:
    """A small random causal LM of ``architecture``; float64 so argmax ties cannot flip between
    paths. ``config_overrides`` go to the config (e.g. ``sliding_window`` for Mistral, or
    ``num_attention_heads``), replacing :func:`tiny_config_kwargs`' values."""
    import transformers

    config_name, model_name = _ARCHITECTURES[architecture]
    config = getattr(transformers, config_name)(
        **tiny_config_kwargs(vocab_size, hidden_size, num_layers, **config_overrides)
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype).eval()
    _sharpen(model, seed)
    return model


def tiny_llama(**kwargs: object) -> torch.nn.Module:
    """A 2-layer Llama with random weights (see ``tiny_causal_lm``)."""
    return tiny_causal_lm("llama", **kwargs)


def tiny_qwen2(**kwargs: object) -> torch.nn.Module:
    """A 2-layer Qwen2 (attention biases, a second architecture) with random weights."""
    return tiny_causal_lm("qwen2", **kwargs)


def _sharpen(model: torch.nn.Module, seed: int) -> None:
    """Scale the LM head up so random models have peaked, non-uniform next-token laws.

    Random init gives nearly uniform distributions; real models are peaked, and acceptance
    tests are only meaningful when drafts are sometimes right and sometimes wrong.
    """
    generator = torch.Generator().manual_seed(seed + 1000)
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head.copy_(torch.randn(head.shape, generator=generator, dtype=head.dtype) * 0.5)


TINY_TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
] * 8


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE with the demo target's special tokens, trained on a few snippets."""
    from draftsmith.data.tokenizer import train_byte_level_bpe

    return train_byte_level_bpe(TINY_TEXTS, vocab_size=vocab_size, min_frequency=1)


def save_tiny_pair(folder, seed: int = 0) -> tuple:
    """Save a tiny float32 Llama target and a one-layer draft, sharing one tokenizer.

    Returns ``(target_dir, draft_dir)``; the draft folder carries ``drafter.json``.
    """
    import json
    from pathlib import Path

    folder = Path(folder)
    tokenizer = tiny_tokenizer()
    vocab = len(tokenizer)
    target = tiny_llama(vocab_size=vocab, seed=seed, dtype=torch.float32)
    draft = tiny_llama(vocab_size=vocab, num_layers=1, seed=seed + 1, dtype=torch.float32)
    for model in (target, draft):
        model.config.bos_token_id = tokenizer.bos_token_id
        model.config.eos_token_id = tokenizer.eos_token_id
        model.config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.bos_token_id = tokenizer.bos_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    target_dir, draft_dir = folder / "target", folder / "draft"
    for model, path in ((target, target_dir), (draft, draft_dir)):
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    (draft_dir / "drafter.json").write_text(json.dumps({"kind": "draft_lm", "format_version": 1}))
    return target_dir, draft_dir
