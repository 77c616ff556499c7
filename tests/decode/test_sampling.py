"""The sampler draws from exactly the given law and never a token without mass."""

from __future__ import annotations

import pytest
import torch
from decode_helpers import chi_square_p_value
from draftsmith.decode.sampling import (
    GREEDY_TEMPERATURE_FLOOR,
    SamplingConfig,
    greedy_tokens,
    logits_to_probs,
    sample,
    select_tokens,
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_greedy_tokens_are_argmax_with_ties_and_nan(dtype: torch.dtype) -> None:
    """The first largest index, as argmax gives it, over coarse values full of ties."""
    generator = torch.Generator().manual_seed(0)
    for vocab in (1, 7, 2048, 8192):
        logits = (torch.randint(-3, 4, (3, 13, vocab), generator=generator) * 0.5).to(dtype)
        if vocab > 1:
            logits[1, 2, vocab // 2] = float("nan")  # NaN wins, as in argmax
            logits[2, 0] = 1.0  # one row entirely tied: index 0
        assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    assert greedy_tokens(logits)[2, 0] == 0


def test_sample_follows_the_law_and_skips_zero_mass() -> None:
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(40, generator=generator), dim=0)
    probs[[0, 7, 39]] = 0.0  # the first, a middle and the last token carry no mass
    probs = probs / probs.sum()
    drawn = sample(probs.expand(20000, -1), generator)  # [20000]
    counts = torch.bincount(drawn, minlength=40)
    assert counts[[0, 7, 39]].sum() == 0
    assert chi_square_p_value(counts, probs) > 1e-3


def test_sample_keeps_leading_shape_and_repeats_with_a_seed() -> None:
    probs = torch.softmax(torch.randn(2, 3, 11), dim=-1)
    first = sample(probs, torch.Generator().manual_seed(5))
    again = sample(probs, torch.Generator().manual_seed(5))
    assert first.shape == (2, 3)
    assert torch.equal(first, again)


def test_temperatures_below_the_floor_are_greedy_and_at_the_floor_finite() -> None:
    """Denormal temperatures used to divide logits into inf/NaN and draw token id V."""
    logits = torch.tensor([[3.0, -1.0, 2.5, 0.0], [-50.0, 40.0, 39.0, 1.0]])
    for tiny in (5e-324, 1e-38, GREEDY_TEMPERATURE_FLOOR / 10):
        tokens, probs = select_tokens(logits, SamplingConfig(temperature=tiny), None)
        assert probs is None and torch.equal(tokens, logits.argmax(-1))
    floor = SamplingConfig(temperature=GREEDY_TEMPERATURE_FLOOR, top_k=3, top_p=0.9)
    probs = logits_to_probs(logits, floor)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(2))
    tokens, _ = select_tokens(logits, floor, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, logits.argmax(-1))  # a 1e-5 temperature leaves no other mass
