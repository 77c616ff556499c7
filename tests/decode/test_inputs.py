"""Bad input gets a clear error, never a wrong answer."""

from __future__ import annotations

import pytest
import torch
from draftsmith.decode import DraftModelDrafter, SpeculativeDecoder
from draftsmith.decode.sampling import GREEDY_TEMPERATURE_FLOOR, SamplingConfig, logits_to_probs
from tiny_models import tiny_llama


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
        ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0"),
        ({"temperature": True}, r"temperature must be .* got True \(bool\)"),
        ({"temperature": "0.7"}, r"temperature must be .* got '0.7' \(str\)"),
        ({"top_p": 0.0}, r"top_p must lie in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must lie in \(0, 1\]"),
        ({"top_p": float("nan")}, r"top_p must be a number in \(0, 1\]"),
        ({"top_p": True}, r"top_p must be a number in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_k": 2.0}, "top_k must be an integer >= 0"),
        ({"top_k": True}, "top_k must be an integer >= 0"),
        ({"max_new_tokens": 0}, r"max_new_tokens must lie in \[1, 2\*\*62\]"),
        ({"max_new_tokens": 2**64}, r"max_new_tokens must lie in \[1, 2\*\*62\], got 1844"),
        ({"eos_token_id": 64}, r"token id 64, outside the vocabulary \[0, 64\)"),
        ({"eos_token_id": [2, -1]}, r"token id -1, outside the vocabulary \[0, 64\)"),
        ({"pad_token_id": -1}, r"pad_token_id holds token id -1, outside the vocabulary"),
        ({"pad_token_id": 69}, r"pad_token_id holds token id 69, outside the vocabulary"),
        (
            {"sampling": SamplingConfig(temperature=0.5), "temperature": 0.5},
            "pass either sampling or temperature, not both",
        ),
    ],
)
def test_bad_sampling_parameters(decoder: SpeculativeDecoder, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decoder.generate(torch.tensor([[4, 5]]), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eos_token_id": 2.0}, "eos_token_id must be a token id or a list of token ids"),
        ({"eos_token_id": "2"}, "eos_token_id must be a token id or a list of token ids"),
        ({"eos_token_id": [2, 3.0]}, "eos_token_id must hold integer token ids"),
        ({"pad_token_id": 0.0}, "pad_token_id must hold integer token ids"),
        ({"pad_token_id": "0"}, "pad_token_id must hold integer token ids"),
        ({"generator": 7}, "generator must be a torch.Generator"),
        ({"sampling": {"temperature": 0.5}}, "sampling must be a SamplingConfig"),
    ],
)
def test_wrong_argument_types(decoder: SpeculativeDecoder, kwargs: dict, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        decoder.generate(torch.tensor([[4, 5]]), **kwargs)


def test_input_ids_must_be_integers(decoder: SpeculativeDecoder) -> None:
    with pytest.raises(TypeError, match="input_ids must hold integer token ids"):
        decoder.generate(torch.tensor([[4.0, 5.0]]))
    with pytest.raises(ValueError, match="attention_mask must hold only 0"):
        decoder.generate(torch.tensor([[4, 5]]), torch.tensor([[1, 2]]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_generator_on_another_device_is_refused(decoder: SpeculativeDecoder) -> None:
    with pytest.raises(ValueError, match="generator lives on cuda"):
        decoder.generate(torch.tensor([[4, 5]]), generator=torch.Generator(device="cuda"))


def test_sampling_config_is_the_one_validator_and_tiny_temperatures_are_greedy() -> None:
    numpy = pytest.importorskip("numpy")
    config = SamplingConfig(numpy.float32(0.5), numpy.int64(3), numpy.float64(0.9))
    assert (type(config.temperature), type(config.top_k), type(config.top_p)) == (float, int, float)
    for tiny in (0.0, 5e-324, 1e-38, GREEDY_TEMPERATURE_FLOOR / 2):
        assert SamplingConfig(temperature=tiny).greedy
    assert not SamplingConfig(temperature=GREEDY_TEMPERATURE_FLOOR).greedy
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingConfig(temperature=10**400)  # too large for a float
    with pytest.raises(ValueError, match="temperature must be"):
        SamplingConfig(temperature=torch.tensor(0.5))


def test_denormal_temperature_decodes_greedily_in_vocabulary(decoder: SpeculativeDecoder) -> None:
    """5e-324 used to turn the logits into inf/NaN and draw token id V (out of range)."""
    ids = torch.tensor([[4, 5, 6]])
    greedy = decoder.generate(ids, max_new_tokens=6, eos_token_id=[])
    for temperature in (5e-324, 1e-38, 1e-6):
        out = decoder.generate(
            ids,
            max_new_tokens=6,
            eos_token_id=[],
            temperature=temperature,
            generator=torch.Generator().manual_seed(0),
        )
        assert torch.equal(out.sequences, greedy.sequences)
    for max_new_tokens in (1, 6):
        out = decoder.generate(
            ids,
            max_new_tokens=max_new_tokens,
            eos_token_id=[],
            sampling=SamplingConfig(temperature=GREEDY_TEMPERATURE_FLOOR, top_k=5),
            generator=torch.Generator().manual_seed(1),
        )
        assert int(out.sequences.max()) < 64 and int(out.sequences.min()) >= 0


def test_sampling_object_and_keywords_give_the_same_draws(decoder: SpeculativeDecoder) -> None:
    ids = torch.tensor([[4, 5, 6], [0, 7, 8]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    config = SamplingConfig(temperature=0.8, top_k=10, top_p=0.9)
    by_keywords = decoder.generate(
        ids, mask, 8, 0.8, 10, 0.9, eos_token_id=[], generator=torch.Generator().manual_seed(3)
    )
    by_object = decoder.generate(
        ids, mask, 8, eos_token_id=[], generator=torch.Generator().manual_seed(3), sampling=config
    )
    assert torch.equal(by_keywords.sequences, by_object.sequences)


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


def test_a_huge_max_new_tokens_ended_by_eos_allocates_as_tokens_come(
    decoder: SpeculativeDecoder,
) -> None:
    """The record of emitted tokens grows on demand: 10**12 used to allocate 8 TB up front."""
    prompt = torch.tensor([[4, 5, 6]])
    free = decoder.generate(prompt, max_new_tokens=12, eos_token_id=[]).sequences
    eos = int(free[0, 3 + 7])  # the 8th new token, if it first appears there
    first = int((free[0, 3:] == eos).nonzero()[0])
    out = decoder.generate(prompt, max_new_tokens=10**12, eos_token_id=[eos]).sequences
    assert torch.equal(out, free[:, : 3 + first + 1])
