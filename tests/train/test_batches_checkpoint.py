"""Deterministic sharded batches and atomic, pruned checkpoints."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from draftsmith.train.batches import ShardedBatches, shard_list
from draftsmith.train.checkpoint import STATE_FILE, CheckpointManager
from draftsmith.train.loop import make_accelerator


def _rows(n: int) -> list[dict[str, int]]:
    return [{"i": i} for i in range(n)]


def _collate(rows: list[dict[str, int]]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor([[row["i"]] for row in rows])}


def test_processes_partition_each_global_batch() -> None:
    shards = [
        ShardedBatches(_rows(20), 3, _collate, seed=4, process_index=r, num_processes=2)
        for r in range(2)
    ]
    assert shards[0].batches_per_epoch == 3  # 20 // 6, the tail of 2 rows is dropped
    for number in range(6):
        first, second = (set(shard.indices(number)) for shard in shards)
        assert len(first) == len(second) == 3
        assert not first & second
    epoch_rows = [i for number in range(3) for shard in shards for i in shard.indices(number)]
    assert len(set(epoch_rows)) == 18


def test_batch_order_is_a_pure_function_of_the_batch_number() -> None:
    stream = ShardedBatches(_rows(32), 4, _collate, seed=7)
    sequential = [
        batch["input_ids"].tolist() for _, batch in itertools.islice(stream.iterate(), 20)
    ]
    fresh = ShardedBatches(_rows(32), 4, _collate, seed=7)
    resumed = [batch["input_ids"].tolist() for _, batch in itertools.islice(fresh.iterate(12), 8)]
    assert resumed == sequential[12:]
    assert sequential[:8] != sequential[8:16]  # a new epoch reshuffles


def test_too_small_a_dataset_is_explained() -> None:
    with pytest.raises(ValueError, match="fewer than one global batch"):
        ShardedBatches(_rows(3), 2, _collate, num_processes=2)


def test_shard_list_round_robins() -> None:
    assert shard_list([0, 1, 2, 3, 4], 1, 2) == [1, 3]


def test_checkpoints_are_atomic_pruned_and_resolvable(tmp_path: Path) -> None:
    accelerator = make_accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    manager = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        manager.resolve("latest")
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.fill_(float(step))
        manager.save(accelerator, step, {"step": step})
    names = [path.name for path in manager.checkpoints()]
    assert names == ["checkpoint-0000002", "checkpoint-0000003"]
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))
    # A half-written folder (no trainer_state.json) never counts as a checkpoint.
    (tmp_path / "ckpt" / "checkpoint-0000009").mkdir()
    assert manager.resolve("latest").name == "checkpoint-0000003"
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        manager.resolve(str(tmp_path / "ckpt" / "checkpoint-0000009"))
    with torch.no_grad():
        model.weight.zero_()
    state = manager.load(accelerator, manager.resolve("latest"))
    assert state == {"step": 3}
    assert torch.all(model.weight == 3.0)
    assert (manager.resolve("latest") / STATE_FILE).is_file()
