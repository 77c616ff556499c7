"""The console scripts of ``pyproject.toml`` (``[project.scripts]``): one per command line.

Each runs its module as ``python -m`` would, ``if __name__ == "__main__":`` block included, so
``draftsmith-benchmark ...`` and ``python scripts/benchmark.py ...`` are the same command: the
environment defaults those blocks set before torch loads (``OMP_WAIT_POLICY``,
``HF_HUB_OFFLINE``) and their exit statuses hold for both. This module imports nothing of the
project itself, so it loads nothing before those blocks run.
"""

from __future__ import annotations

import runpy

COMMANDS: dict[str, str] = {
    "distill": "train.distill",
    "evaluate": "decode.evaluate",
    "serve": "decode.serve",
    "benchmark": "scripts.benchmark",
    "regenerate": "scripts.regenerate_data",
    "ablate": "scripts.ablate",
    "check-engine": "scripts.check_engine",
    "build-demo-target": "scripts.build_demo_target",
    "load-test": "scripts.load_test",
    "report": "scripts.report",
    "parallel-ceiling": "scripts.parallel_ceiling",
}
"""``draftsmith-<key>`` runs module ``COMMANDS[key]``."""


def run(command: str) -> None:
    """Run ``draftsmith-<command>``'s module as ``__main__`` with the process's arguments."""
    runpy.run_module(COMMANDS[command], run_name="__main__", alter_sys=True)


def distill() -> None:
    run("distill")


def evaluate() -> None:
    run("evaluate")


def serve() -> None:
    run("serve")


def benchmark() -> None:
    run("benchmark")


def regenerate() -> None:
    run("regenerate")


def ablate() -> None:
    run("ablate")


def check_engine() -> None:
    run("check-engine")


def build_demo_target() -> None:
    run("build-demo-target")


def load_test() -> None:
    run("load-test")


def report() -> None:
    run("report")


def parallel_ceiling() -> None:
    run("parallel-ceiling")
