"""scripts/gpu_check.sh: the prepared GPU run, rehearsed on the CPU (``--dry-run``).

A lent GPU gives a session a few minutes, so the run must work the first time: the dry run
takes every step (machine, tests, target, distillation, benchmark) with the same commands and
flags on the CPU at tiny sizes, and a renamed flag anywhere fails here first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"
STEPS = ("machine", "tests", "target", "distill", "benchmark")


def _run(*args: str, out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), **env}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=environ, timeout=600
    )


def test_dry_run_takes_every_step_and_writes_the_benchmark(tmp_path: Path) -> None:
    result = _run("--dry-run", out=tmp_path, TMPDIR=str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    statuses = (tmp_path / "steps.txt").read_text().splitlines()
    assert [line.split()[0] for line in statuses] == [*STEPS, "total"]
    assert all(" rc=0 " in line for line in statuses[:-1])
    for name in STEPS:
        assert (tmp_path / f"{name}.log").is_file()
    bench = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert "accelerator" not in bench["machine"]  # the rehearsal decodes on the CPU
    methods = [row["method"] for row in bench["by_temperature"]["0"]]
    assert "draftsmith EAGLE-3 chain" in methods and "plain (HF generate)" in methods
    assert set(bench["by_temperature"]) == {"0", "1"}


def test_a_step_past_the_deadline_is_skipped_and_fails_the_run(tmp_path: Path) -> None:
    result = _run("--dry-run", out=tmp_path, DEADLINE_S="5")
    assert result.returncode != 0
    assert "machine skipped: the deadline has passed" in (tmp_path / "steps.txt").read_text()


def test_an_unknown_argument_is_refused(tmp_path: Path) -> None:
    result = _run("--gpu", out=tmp_path)
    assert result.returncode == 2
    assert "unknown argument '--gpu'" in result.stderr
