"""Deterministic, resumable, sharded micro-batches.

Batch number ``i`` of a run is a pure function of (seed, dataset size, global batch size, i):
epoch ``e = i // batches_per_epoch`` shuffles the examples with a generator seeded by
``seed + e`` and process ``r`` of ``W`` takes rows ``[r * b, (r + 1) * b)`` of each global batch
of ``W * b`` rows. Resuming at micro-batch ``i`` therefore costs nothing and replays exactly the
batches an uninterrupted run would have seen, on any number of processes that divides the
global batch the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

Collate = Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]]


class ShardedBatches:
    """An endless stream of collated micro-batches for one process, in a fixed order.

    Incomplete global batches at the end of an epoch are dropped, so every process sees
    batches of the same shape and the epoch boundary is identical on all processes.
    """

    def __init__(
        self,
        dataset: Sequence[dict[str, Any]],
        batch_size: int,
        collate: Collate,
        seed: int = 0,
        process_index: int = 0,
        num_processes: int = 1,
        shuffle: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= process_index < num_processes:
            raise ValueError(f"process_index {process_index} outside [0, {num_processes})")
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate = collate
        self.seed = seed
        self.process_index = process_index
        self.num_processes = num_processes
        self.shuffle = shuffle
        global_batch = batch_size * num_processes
        self.batches_per_epoch = len(dataset) // global_batch
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"the training set has {len(dataset)} sequences, fewer than one global batch "
                f"({batch_size} per process x {num_processes} processes): add data or lower "
                "the batch size"
            )
        self._order_epoch = -1
        self._order = torch.arange(len(dataset))

    def indices(self, batch_number: int) -> list[int]:
        """Dataset rows of micro-batch ``batch_number`` on this process."""
        epoch, within = divmod(batch_number, self.batches_per_epoch)
        if epoch != self._order_epoch:
            self._order = self._epoch_order(epoch)
            self._order_epoch = epoch
        start = within * self.batch_size * self.num_processes + self.process_index * self.batch_size
        return self._order[start : start + self.batch_size].tolist()

    def batch(self, batch_number: int) -> dict[str, torch.Tensor]:
        """The collated micro-batch ``batch_number`` on this process."""
        return self.collate([self.dataset[i] for i in self.indices(batch_number)])

    def iterate(self, start: int = 0) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Yield ``(batch_number, batch)`` from ``start`` on, forever."""
        number = start
        while True:
            yield number, self.batch(number)
            number += 1

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(len(self.dataset))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.dataset), generator=generator)


def shard_list(items: Sequence[Any], process_index: int, num_processes: int) -> list[Any]:
    """Every ``num_processes``-th item starting at ``process_index`` (held-out sets)."""
    return list(items[process_index::num_processes])
