"""How many CPU threads torch uses, and how its idle OpenMP threads wait.

``accelerate launch`` sets ``OMP_NUM_THREADS=1`` for a process it starts without ``--cpu``,
so a single-process run would use one core of many. Every command sets its threads here
instead: the requested count (``--threads``), else ``DRAFTSMITH_THREADS`` when set (tests
set it to 1), else the cores available to the process (its CPU affinity) divided among the
processes of this machine (``LOCAL_WORLD_SIZE``).

Standard library only at import: commands call :func:`default_openmp_wait_policy` from their
``__main__`` blocks, before anything loads torch (and with it OpenMP, which reads the policy
once).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

PASSIVE = "PASSIVE"
"""``OMP_WAIT_POLICY`` value that puts an OpenMP thread to sleep as soon as it is idle."""


def default_openmp_wait_policy(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` where ranks share this machine; return the policy.

    libgomp's default lets an idle thread spin (about 300,000 iterations) before it sleeps.
    Decoding issues hundreds of small products per token back to back, and the spin catches
    the next one: plain decoding of the demo target ran at 94-100 tokens/s with it against
    65 with ``PASSIVE`` (2 threads on a quiet 2-core host, where one thread gives 68), and a
    head's training step took 2.7-3.3 s against 3.2-3.5. Where another busy process shares
    the cores, the spinning thread takes them from it instead: 22 against 65 tokens/s.
    Several ranks of one run on one machine are that case (each waits in collectives while
    the others compute), so they sleep at once; a single process keeps libgomp's default.
    A value the user set is kept: ``OMP_WAIT_POLICY=PASSIVE`` is the choice for a machine
    other jobs keep busy.
    """
    if local_processes(environ) > 1:
        environ.setdefault("OMP_WAIT_POLICY", PASSIVE)
    return environ.get("OMP_WAIT_POLICY")


def local_processes(environ: MutableMapping[str, str] = os.environ) -> int:
    """The ranks of this run on this machine (``LOCAL_WORLD_SIZE``, set by the launchers)."""
    return max(int(environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)


def available_cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def max_threads() -> int:
    """The most intra-op threads a command accepts: one per CPU of the machine (OpenMP
    aborts the process on absurd counts, and threads beyond the cores only wait)."""
    return max(available_cores(), os.cpu_count() or 1)


def check_thread_count(count: int, flag: str = "--threads") -> None:
    """``ValueError`` naming ``flag`` unless ``count`` lies in ``1 .. max_threads()``."""
    most = max_threads()
    if not 1 <= count <= most:
        raise ValueError(
            f"{flag} {count}: give a thread count from 1 to {most} (this machine's CPUs; more "
            "only makes threads wait for cores), or leave it out"
        )


def _threads_from_environment(most: int) -> int:
    """``DRAFTSMITH_THREADS`` as a count in ``1 .. most`` (0 or unset: not set)."""
    raw = os.environ.get("DRAFTSMITH_THREADS", "").strip()
    try:
        value = int(raw or 0)
    except ValueError:
        value = -1
    if not 0 <= value <= most:
        raise ValueError(
            f"DRAFTSMITH_THREADS={raw!r}: set a thread count from 1 to {most}, or unset it"
        )
    return value


def set_cpu_threads(requested: int | None = None) -> int:
    """Set torch's intra-op threads to ``requested`` (or the process's share of the cores)."""
    import torch

    if requested is not None:
        check_thread_count(requested)
    from_env = _threads_from_environment(max_threads())
    threads = requested or from_env or max(available_cores() // local_processes(), 1)
    torch.set_num_threads(threads)
    return threads
