"""The rows and the target the offline-cache tests share with their 2-rank worker."""

from __future__ import annotations

import torch
from tiny_models import tiny_llama

CACHE_SEQUENCES = 24


def cache_target() -> torch.nn.Module:
    """A 2-layer float32 Llama, vocab 64: the same weights in every process."""
    return tiny_llama(vocab_size=64, dtype=torch.float32, seed=5)


def cache_rows(count: int = CACHE_SEQUENCES) -> list[dict[str, list[int]]]:
    """``count`` rows of 5 to 16 tokens, each one's first token its index (so every cached
    sequence says which row it is)."""
    generator = torch.Generator().manual_seed(7)
    rows = []
    for index in range(count):
        length = int(torch.randint(5, 17, (), generator=generator))
        ids = [index + 3, *torch.randint(3, 64, (length - 1,), generator=generator).tolist()]
        rows.append({"input_ids": ids, "loss_mask": [1] * length})
    return rows
