"""Exact laws of the first sampled tokens and the chi-square check of a tree decoder's output
(shared by the sampled-tree and tree-policy tests)."""

from __future__ import annotations

import torch
from decode_helpers import chi_square_p_value
from draftsmith.decode.sampling import SamplingConfig, logits_to_probs

PROMPT = [5, 9, 5, 9, 5, 9, 5]
VOCAB = 64
P_VALUE_FLOOR = 1e-4
SETTINGS = [(0.7, 10, 1.0), (1.0, 0, 0.9)]  # (temperature, top_k, top_p)


def three_token_law(
    target: torch.nn.Module, prompt: torch.Tensor, sampling: SamplingConfig
) -> torch.Tensor:  # [V, V, V] exact law of the first three sampled tokens
    with torch.no_grad():
        first = logits_to_probs(target(prompt[None]).logits[0, -1], sampling).double()  # [V]
        vocab = first.shape[0]
        grid = torch.arange(vocab)
        one = torch.cat([prompt[None].repeat(vocab, 1), grid[:, None]], 1)  # [V, T+1]
        second = logits_to_probs(target(one).logits[:, -1], sampling).double()  # [V, V]
        two = torch.cat(
            [
                prompt[None].repeat(vocab * vocab, 1),
                grid.repeat_interleave(vocab)[:, None],
                grid.repeat(vocab)[:, None],
            ],
            1,
        )  # [V*V, T+2]
        third = logits_to_probs(target(two).logits[:, -1], sampling).double()  # [V*V, V]
    return first[:, None, None] * second[:, :, None] * third.view(vocab, vocab, vocab)


def assert_follows(new: torch.Tensor, law: torch.Tensor, label: str) -> None:
    """Chi-square of the joint laws of (x1, x2) and (x2, x3) of the rows of ``new`` [R, >= 3]:
    x1 comes from the prefill, x2 and x3 from the first round(s)."""
    vocab = law.shape[0]
    pairs = {
        "x1,x2": (new[:, 0] * vocab + new[:, 1], law.sum(2).flatten()),
        "x2,x3": (new[:, 1] * vocab + new[:, 2], law.sum(0).flatten()),
    }
    for name, (cells, expected) in pairs.items():
        counts = torch.bincount(cells, minlength=vocab * vocab)
        p_value = chi_square_p_value(counts, expected)
        assert p_value > P_VALUE_FLOOR, (label, name, p_value)
