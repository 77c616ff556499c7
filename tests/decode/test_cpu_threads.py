"""Threads: the requested count, else DRAFTSMITH_THREADS, else this process's share of the cores."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from draftsmith.decode import cpu_threads


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


@pytest.mark.parametrize("count", [0, -1, 10**6])
def test_a_bad_thread_count_names_the_fix(count: int) -> None:
    """A count past the machine's CPUs used to abort the process inside OpenMP."""
    most = cpu_threads.max_threads()
    with pytest.raises(
        ValueError, match=f"--threads {count}: give a thread count from 1 to {most}"
    ):
        cpu_threads.set_cpu_threads(count)


@pytest.mark.parametrize("value", ["two", "-3", "1000000"])
def test_a_bad_threads_variable_names_the_fix(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAFTSMITH_THREADS", value)
    with pytest.raises(ValueError, match=f"DRAFTSMITH_THREADS='{value}': set a thread count"):
        cpu_threads.set_cpu_threads()


def test_a_single_process_keeps_libgomps_wait_policy_and_ranks_sleep_at_once() -> None:
    """PASSIVE halved the main job's plain decoding (65 against 94-100 tokens/s on a quiet
    2-core host): only ranks that share a machine's cores get it; a user's value stays."""
    alone: dict[str, str] = {}
    assert cpu_threads.default_openmp_wait_policy(alone) is None and alone == {}
    ranks = {"LOCAL_WORLD_SIZE": "2"}
    assert cpu_threads.default_openmp_wait_policy(ranks) == "PASSIVE"
    assert ranks["OMP_WAIT_POLICY"] == "PASSIVE"
    chosen = {"LOCAL_WORLD_SIZE": "4", "OMP_WAIT_POLICY": "ACTIVE"}
    assert cpu_threads.default_openmp_wait_policy(chosen) == "ACTIVE"
    busy_host = {"OMP_WAIT_POLICY": "PASSIVE"}
    assert cpu_threads.default_openmp_wait_policy(busy_host) == "PASSIVE"


@pytest.mark.parametrize(
    "command", ["distill", "regenerate", "ablate", "build-demo-target", "parallel-ceiling"]
)
def test_commands_leave_the_wait_policy_to_libgomp_in_a_single_process(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each command's ``__main__`` block, run as its console script runs it."""
    from draftsmith.scripts import console

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(sys, "argv", [f"draftsmith-{command}", "--help"])
    with pytest.raises(SystemExit) as exit_:
        console.run(command)
    assert exit_.value.code == 0 and "usage" in capsys.readouterr().out
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        console.run(command)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
