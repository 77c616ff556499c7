"""Sampled speculative output follows the target's distribution exactly (docs/theory.md §7).

Many rows of one prompt run as one batch; the empirical law of the first and second emitted
tokens is compared with the target's exact law by a chi-square test. A wrong residual, a
missing bonus token or a ``q`` that is not the sampling distribution fails these tests.
"""

from __future__ import annotations

import pytest
import torch
from decode_helpers import (
    AdversarialDrafter,
    chi_square_p_value,
    exact_two_token_law,
    noisy_copy,
    tiny_dflash_drafter,
    tiny_peagle_drafter,
)
from draftsmith.decode import DraftModelDrafter, NgramDrafter, SpeculativeDecoder
from draftsmith.decode.sampling import SamplingConfig
from tiny_models import tiny_llama

ROWS = 3000
P_VALUE_FLOOR = 1e-4


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(seed=0)


@pytest.mark.parametrize(
    ("drafter_name", "temperature", "top_k", "top_p"),
    [
        ("noisy", 1.0, 0, 1.0),
        ("noisy", 0.7, 10, 1.0),
        ("noisy", 1.3, 0, 0.8),
        ("adversarial", 1.0, 0, 1.0),
        ("ngram", 1.0, 0, 0.9),
        ("noisy-adaptive", 1.0, 0, 1.0),
        ("peagle", 1.0, 0, 1.0),
        ("peagle", 0.7, 10, 1.0),
        ("peagle_two_layers", 1.0, 0, 1.0),
        ("dflash", 1.0, 0, 1.0),
        ("dflash", 1.3, 0, 0.8),
        ("dspark", 1.0, 0, 1.0),
    ],
)
def test_emitted_tokens_follow_target_law(
    target: torch.nn.Module, drafter_name: str, temperature: float, top_k: int, top_p: float
) -> None:
    drafters = {
        "noisy": lambda: DraftModelDrafter(noisy_copy(target, 0.6)),
        "adversarial": lambda: AdversarialDrafter(target),
        "ngram": lambda: NgramDrafter(vocab_size=64, max_ngram=2),
        "noisy-adaptive": lambda: DraftModelDrafter(noisy_copy(target, 0.6)),
        "peagle": lambda: tiny_peagle_drafter(target),  # all drafts of a round in one pass
        "peagle_two_layers": lambda: tiny_peagle_drafter(target, num_layers=2),
        "dflash": lambda: tiny_dflash_drafter(target),  # a block drafted in one pass
        "dspark": lambda: tiny_dflash_drafter(target, markov_rank=4, confidence_head=True),
    }
    prompt = torch.tensor([5, 9, 5, 9, 5, 9, 5, 9, 5])
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    first_law, second_law = exact_two_token_law(target, prompt, sampling)
    adaptive = drafter_name.endswith("adaptive")
    decoder = SpeculativeDecoder(target, drafters[drafter_name](), 3, adaptive=adaptive)
    if adaptive:  # estimates that make one draft worth it (the prefill emits the first token)
        for _ in range(2):  # a warm-up round, then a timed one, of each length
            decoder.draft_length.update(3, torch.tensor([3]), 0.004)
            decoder.draft_length.update(0, torch.tensor([0]), 0.003)
    out = decoder.generate(
        prompt[None].repeat(ROWS, 1),
        max_new_tokens=3 if adaptive else 2,  # adaptive rounds never draft for the last token
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_id=[],
        generator=torch.Generator().manual_seed(0),
    )
    new = out.sequences[:, prompt.numel() :]
    assert chi_square_p_value(torch.bincount(new[:, 0], minlength=64), first_law) > P_VALUE_FLOOR
    assert chi_square_p_value(torch.bincount(new[:, 1], minlength=64), second_law) > P_VALUE_FLOOR
    if drafter_name.startswith("noisy"):  # the draft is good enough to matter: it is exercised
        assert 0.05 < out.stats.alpha_per_position[0] < 0.95


def test_chi_square_detects_a_wrong_law(target: torch.nn.Module) -> None:
    """The test above has power: the draft's own law is rejected against the target's."""
    prompt = torch.tensor([5, 9, 5, 9, 5, 9, 5, 9, 5])
    sampling = SamplingConfig(temperature=1.0)
    draft = noisy_copy(target, 0.6)
    target_law, _ = exact_two_token_law(target, prompt, sampling)
    draft_law, _ = exact_two_token_law(draft, prompt, sampling)
    draws = torch.multinomial(draft_law.float(), ROWS, replacement=True, generator=None)
    assert chi_square_p_value(torch.bincount(draws, minlength=64), target_law) < P_VALUE_FLOOR


def test_seeded_runs_repeat_exactly(target: torch.nn.Module) -> None:
    decoder = SpeculativeDecoder(target, DraftModelDrafter(noisy_copy(target, 0.6)), 4)
    prompt = torch.randint(3, 64, (3, 8), generator=torch.Generator().manual_seed(0))

    def run(seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return decoder.generate(
            prompt, max_new_tokens=20, temperature=1.0, generator=generator, eos_token_id=[]
        ).sequences

    assert torch.equal(run(3), run(3))
    assert not torch.equal(run(3), run(4))


def test_batch_of_one_follows_target_law(target: torch.nn.Module) -> None:
    """The same law with one row per call (no other rows to share rounds with)."""
    prompt = torch.tensor([[7, 3, 7, 3, 7]])
    sampling = SamplingConfig(temperature=1.0)
    first_law, second_law = exact_two_token_law(target, prompt[0], sampling)
    decoder = SpeculativeDecoder(target, DraftModelDrafter(noisy_copy(target, 0.6)), 2)
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack(
        [
            decoder.generate(
                prompt, max_new_tokens=2, temperature=1.0, eos_token_id=[], generator=generator
            ).sequences[0, -2:]
            for _ in range(400)
        ]
    )
    assert chi_square_p_value(torch.bincount(draws[:, 0], minlength=64), first_law) > 1e-4
    assert chi_square_p_value(torch.bincount(draws[:, 1], minlength=64), second_law) > 1e-4
