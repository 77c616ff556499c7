"""How many CPU threads torch uses: the cores this process may run on, shared by the ranks.

``accelerate launch`` sets ``OMP_NUM_THREADS=1`` for a process it starts without ``--cpu``,
so a single-process run would use one core of many. Every command sets its threads here
instead: the requested count (``--threads``), else ``DRAFTSMITH_THREADS`` when set (tests
set it to 1), else the cores available to the process (its CPU affinity) divided among the
processes of this machine (``LOCAL_WORLD_SIZE``).
"""

from __future__ import annotations

import os

import torch


def available_cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_cpu_threads(requested: int | None = None) -> int:
    """Set torch's intra-op threads to ``requested`` (or the process's share of the cores)."""
    if requested is not None and requested < 1:
        raise ValueError(f"--threads {requested}: give a positive thread count, or leave it out")
    local_processes = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    from_env = int(os.environ.get("DRAFTSMITH_THREADS", "0") or 0)
    threads = requested or from_env or max(available_cores() // local_processes, 1)
    torch.set_num_threads(threads)
    return threads
