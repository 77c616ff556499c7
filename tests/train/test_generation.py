"""sample_continuations: greedy equals HF generate, padding-invariant, seeded, stops at eos."""

from __future__ import annotations

import pytest
import torch
from draftsmith.decode.sampling import SamplingConfig
from draftsmith.train.generation import sample_continuations
from tiny_models import tiny_llama, tiny_qwen2

GREEDY = SamplingConfig(temperature=0.0)


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2])
def test_greedy_matches_hf_generate(build: object) -> None:
    model = build(seed=3)
    prompt = torch.tensor([[5, 9, 12, 7, 30], [3, 3, 8, 41, 2]])
    ours = sample_continuations(model, prompt, torch.ones_like(prompt), 12, GREEDY, None)
    reference = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert torch.equal(ours.tokens, reference[:, prompt.shape[1] :])
    assert bool(ours.valid.all())


def test_left_padding_does_not_change_a_row() -> None:
    model = tiny_llama(seed=4)
    short = torch.tensor([[11, 12, 13]])
    alone = sample_continuations(model, short, torch.ones_like(short), 8, GREEDY, None)
    batch = torch.tensor([[0, 0, 11, 12, 13], [7, 8, 9, 10, 11]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    padded = sample_continuations(model, batch, mask, 8, GREEDY, None)
    assert torch.equal(padded.tokens[0], alone.tokens[0])


def test_sampling_is_reproducible_with_a_seeded_generator() -> None:
    model = tiny_llama(seed=5)
    prompt = torch.tensor([[1, 2, 3, 4]] * 3)
    warm = SamplingConfig(temperature=1.0)

    def draw(seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return sample_continuations(
            model, prompt, torch.ones_like(prompt), 10, warm, generator
        ).tokens

    assert torch.equal(draw(0), draw(0))
    assert not torch.equal(draw(0), draw(1))


def test_rows_stop_after_a_stop_token() -> None:
    model = tiny_llama(seed=6)
    prompt = torch.tensor([[4, 5, 6], [7, 8, 9]])
    free = sample_continuations(model, prompt, torch.ones_like(prompt), 6, GREEDY, None)
    stop = int(free.tokens[0, 1])
    out = sample_continuations(
        model,
        prompt,
        torch.ones_like(prompt),
        6,
        GREEDY,
        None,
        eos_token_id=[stop],
        pad_token_id=63,
    )
    first = int((free.tokens[0] == stop).nonzero()[0])
    assert out.valid[0].tolist() == [True] * (first + 1) + [False] * (5 - first)
    assert bool((out.tokens[0, first + 1 :] == 63).all())


def test_bad_prompts_are_explained() -> None:
    model = tiny_llama(seed=0)
    prompt = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="at least one real token"):
        sample_continuations(model, prompt, torch.zeros_like(prompt), 2, GREEDY, None)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sample_continuations(model, prompt, torch.ones_like(prompt), 0, GREEDY, None)
