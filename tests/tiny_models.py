"""Tiny random-init causal LMs built in code: fast, offline, deterministic."""

from __future__ import annotations

import torch

TINY_VOCAB = 64


def tiny_llama(
    vocab_size: int = TINY_VOCAB,
    hidden_size: int = 32,
    num_layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> torch.nn.Module:
    """A 2-layer Llama with random weights; float64 so argmax ties cannot flip between paths."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    _sharpen(model, seed)
    return model


def tiny_qwen2(
    vocab_size: int = TINY_VOCAB,
    hidden_size: int = 32,
    num_layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> torch.nn.Module:
    """A 2-layer Qwen2 (attention biases, a second architecture) with random weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype).eval()
    _sharpen(model, seed)
    return model


def _sharpen(model: torch.nn.Module, seed: int) -> None:
    """Scale the LM head up so random models have peaked, non-uniform next-token laws.

    Random init gives nearly uniform distributions; real models are peaked, and acceptance
    tests are only meaningful when drafts are sometimes right and sometimes wrong.
    """
    generator = torch.Generator().manual_seed(seed + 1000)
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head.copy_(torch.randn(head.shape, generator=generator, dtype=head.dtype) * 0.5)
