"""The sampler draws from exactly the given law and never a token without mass."""

from __future__ import annotations

import torch
from decode_helpers import chi_square_p_value

from decode.sampling import sample


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
