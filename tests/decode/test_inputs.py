"""Bad input gets a clear error, never a wrong answer."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_llama

from decode import DraftModelDrafter, SpeculativeDecoder
from decode.sampling import SamplingConfig, logits_to_probs


@pytest.fixture(scope="module")
def decoder() -> SpeculativeDecoder:
    return SpeculativeDecoder(tiny_llama(seed=0), DraftModelDrafter(tiny_llama(seed=1)), 2)


def test_vocabulary_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="vocabulary of 80 tokens but the target's has 64"):
        SpeculativeDecoder(tiny_llama(), DraftModelDrafter(tiny_llama(vocab_size=80)), 2)


@pytest.mark.parametrize("bad", [0, -3])
def test_num_draft_tokens_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 1"):
        SpeculativeDecoder(tiny_llama(), DraftModelDrafter(tiny_llama(seed=1)), bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be a number >= 0"),
        ({"top_p": 0.0}, r"top_p must lie in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must lie in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ],
)
def test_bad_sampling_parameters(decoder: SpeculativeDecoder, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decoder.generate(torch.tensor([[4, 5]]), **kwargs)


def test_empty_prompts(decoder: SpeculativeDecoder) -> None:
    with pytest.raises(ValueError, match="empty prompt batch"):
        decoder.generate(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="a prompt row is empty"):
        decoder.generate(torch.tensor([[0, 0], [4, 5]]), torch.tensor([[0, 0], [1, 1]]))
    with pytest.raises(ValueError, match="left-padded"):
        decoder.generate(torch.tensor([[4, 0]]), torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="outside"):
        decoder.generate(torch.tensor([[4, 99]]))


def test_sampling_transforms_match_transformers_warpers() -> None:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    config = SamplingConfig(temperature=0.7, top_k=20, top_p=0.85)
    scores = TemperatureLogitsWarper(0.7)(None, logits.clone())
    scores = TopKLogitsWarper(20)(None, scores)
    scores = TopPLogitsWarper(0.85)(None, scores)
    assert torch.allclose(logits_to_probs(logits, config), torch.softmax(scores, -1), atol=1e-6)
    greedy = logits_to_probs(logits, SamplingConfig())
    assert torch.equal(greedy.argmax(-1), logits.argmax(-1)) and greedy.sum(-1).eq(1).all()
