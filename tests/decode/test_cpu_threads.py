"""Threads: the requested count, else DRAFTSMITH_THREADS, else this process's share of the cores."""

from __future__ import annotations

import pytest
import torch

from decode import cpu_threads


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_share_of_the_cores_ignores_accelerates_one_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DRAFTSMITH_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what `accelerate launch` sets without --cpu
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu_threads.set_cpu_threads() == 4 == torch.get_num_threads()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert cpu_threads.set_cpu_threads() == 8
    assert cpu_threads.set_cpu_threads(3) == 3
    monkeypatch.setenv("DRAFTSMITH_THREADS", "2")
    assert cpu_threads.set_cpu_threads() == 2


def test_a_bad_thread_count_names_the_fix() -> None:
    with pytest.raises(ValueError, match="--threads 0: give a positive thread count"):
        cpu_threads.set_cpu_threads(0)
