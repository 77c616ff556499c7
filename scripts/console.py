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
    "distill": "draftsmith.train.distill",
    "evaluate": "draftsmith.decode.measure.evaluate",
    "serve": "draftsmith.decode.serve",
    "benchmark": "draftsmith.scripts.benchmark",
    "regenerate": "draftsmith.scripts.regenerate_data",
    "ablate": "draftsmith.scripts.ablate",
    "check-engine": "draftsmith.scripts.check_engine",
    "build-demo-target": "draftsmith.scripts.build_demo_target",
    "load-test": "draftsmith.scripts.load_test",
    "report": "draftsmith.scripts.report",
    "parallel-ceiling": "draftsmith.scripts.parallel_ceiling",
    "export": "draftsmith.scripts.export",
    "profile-serve": "draftsmith.scripts.profile_serve",
    "compare-policies": "draftsmith.scripts.compare_policies",
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


def export() -> None:
    run("export")


def profile_serve() -> None:
    run("profile-serve")


def compare_policies() -> None:
    run("compare-policies")
