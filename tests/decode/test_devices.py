"""The decoder on every device this machine has: each drafter kind, float32 and bfloat16.

The same tests run on the CPU here and on a CUDA device where there is one (those cases are
marked ``gpu`` and skip cleanly without CUDA; ``pytest -m gpu`` runs them alone). On CUDA the
CPU-only paths stand aside: the target runs its own forward, drafters' products use
``F.linear`` (``draftsmith.decode.forward.projection``), attention keeps the input's dtype. In float32 greedy
output must equal Hugging Face ``generate`` on the same device token for token, and sampled
output must follow the target's exact law (chi-square); in bfloat16 and float16, where kernels for one row
and for a verify block may round a near-tie apart, every kind must run, stay on the device,
and repeat itself under a seed.
"""

from __future__ import annotations

import pytest
import torch
from decode_helpers import (
    DRAFTER_KINDS,
    KIND_TREE,
    chi_square_p_value,
    exact_two_token_law,
    noisy_copy,
    tiny_eagle_drafter,
)
from draftsmith.decode import DraftModelDrafter, SpeculativeDecoder
from draftsmith.decode.sampling import SamplingConfig
from family_variants import ragged_prompts
from tiny_models import tiny_llama

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.gpu),  # skipped without CUDA (tests/conftest.py)
]
NEW_TOKENS = 12


def _target(device: str, dtype: torch.dtype) -> torch.nn.Module:
    return tiny_llama(seed=0, dtype=dtype, vocab_size=96).to(device)


def _prompts(device: str) -> tuple[torch.Tensor, torch.Tensor]:  # [3, T] each, left-padded
    ids, mask = ragged_prompts(3, repeat_tail=True)
    return ids.to(device), mask.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_every_kind_equals_generate_in_float32(device: str) -> None:
    target = _target(device, torch.float32)
    ids, mask = _prompts(device)
    reference = target.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False
    )
    kinds = {"draft_lm": (lambda t: DraftModelDrafter(noisy_copy(t, 0.4)), None, False)}
    for kind, (make, tree, adaptive) in {**kinds, **DRAFTER_KINDS}.items():
        decoder = SpeculativeDecoder(target, make(target), 3, tree=tree, adaptive=adaptive)
        out = decoder.generate(ids, mask, max_new_tokens=NEW_TOKENS)
        assert out.sequences.device.type == device, kind
        assert torch.equal(out.sequences, reference), kind


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device", DEVICES)
def test_every_kind_runs_in_half_precision_and_repeats_under_a_seed(
    device: str, dtype: torch.dtype
) -> None:
    """Greedy and sampled (chains, top-k trees at T = 0, sampled trees at T = 1)."""
    target = _target(device, dtype)
    ids, mask = _prompts(device)
    vocab = target.config.vocab_size
    for kind, (make, tree, adaptive) in DRAFTER_KINDS.items():
        decoder = SpeculativeDecoder(target, make(target), 3, tree=tree, adaptive=adaptive)
        for temperature in (0.0, 1.0):

            def run(decoder=decoder, temperature=temperature) -> torch.Tensor:
                generator = torch.Generator(device=device).manual_seed(0)
                return decoder.generate(
                    ids, mask, max_new_tokens=NEW_TOKENS, temperature=temperature,
                    generator=generator, eos_token_id=[],
                ).sequences  # fmt: skip

            first = run()
            assert first.device.type == device and first.shape == (3, ids.shape[1] + NEW_TOKENS)
            new = first[:, ids.shape[1] :]
            assert bool(((new >= 0) & (new < vocab)).all()), (kind, temperature)
            if not (adaptive or kind.startswith("hybrid")):  # choices that follow measured times
                assert torch.equal(run(), first), (kind, temperature)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["eagle3-pruned-chain", "eagle3-sampled-tree"])
def test_sampled_output_follows_the_target_law(device: str, kind: str) -> None:
    """The first two emitted tokens of 3000 rows at T = 1 follow the target's exact law."""
    target = _target(device, torch.float32)
    tree = KIND_TREE if kind.endswith("tree") else None
    drafter = tiny_eagle_drafter(target, draft_vocab_size=None if tree else 40)
    prompt = torch.tensor([5, 9, 5, 9, 5, 9, 5, 9, 5], device=device)
    sampling = SamplingConfig(temperature=1.0)
    first_law, second_law = exact_two_token_law(target, prompt, sampling)
    out = SpeculativeDecoder(target, drafter, 3, tree=tree).generate(
        prompt[None].repeat(3000, 1),
        max_new_tokens=2,
        sampling=sampling,
        eos_token_id=[],
        generator=torch.Generator(device=device).manual_seed(0),
    )
    new = out.sequences[:, prompt.numel() :].cpu()
    for column, law in ((0, first_law.cpu()), (1, second_law.cpu())):
        counts = torch.bincount(new[:, column], minlength=law.numel())
        assert chi_square_p_value(counts, law) > 1e-4, (kind, column)
    assert out.stats.alpha_per_position[0] > 0
