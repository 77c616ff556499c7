"""The decoder on a CUDA device: same exactness as on the CPU (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from decode_helpers import noisy_copy
from tiny_models import tiny_llama

from decode import DraftModelDrafter, SpeculativeDecoder

pytestmark = pytest.mark.gpu


def test_greedy_equals_generate_on_cuda() -> None:
    target = tiny_llama(seed=0).cuda()
    draft = noisy_copy(tiny_llama(seed=0), 0.4).cuda()
    ids = torch.randint(3, 64, (4, 10), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    reference = target.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False
    )
    out = SpeculativeDecoder(target, DraftModelDrafter(draft), 4).generate(
        ids, mask, max_new_tokens=32
    )
    assert out.sequences.device.type == "cuda"
    assert torch.equal(out.sequences, reference)


def test_seeded_sampling_on_cuda_repeats() -> None:
    target = tiny_llama(seed=0).cuda()
    decoder = SpeculativeDecoder(target, DraftModelDrafter(noisy_copy(tiny_llama(), 0.4).cuda()), 3)
    ids = torch.tensor([[5, 6, 7]], device="cuda")

    def run() -> torch.Tensor:
        generator = torch.Generator(device="cuda").manual_seed(0)
        return decoder.generate(
            ids, max_new_tokens=16, temperature=1.0, generator=generator, eos_token_id=[]
        ).sequences

    assert torch.equal(run(), run())
