"""A run killed with SIGKILL and resumed logs the same losses as an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from draftsmith.train.distill import main
from draftsmith.train.tracking import read_metrics_log

REPO = Path(__file__).resolve().parents[2]
# On-policy batches make the objective's generators part of the state that must be restored.
FLAGS = (
    "--max_steps",
    "24",
    "--checkpoint_every",
    "4",
    "--eval_every",
    "0",
    "--on_policy_fraction",
    "0.5",
    "--on_policy_prompt_tokens",
    "16",
)


def _losses(log: Path) -> dict[int, float]:
    """Step -> train loss."""
    return {r["step"]: r["train/loss"] for r in read_metrics_log(log) if "train/loss" in r}


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_sigkill_then_resume_replays_the_uninterrupted_losses(
    tmp_path: Path, tiny_argv: Callable[..., list[str]], dtype: str
) -> None:
    flags = (*FLAGS, "--dtype", dtype)  # bfloat16: the target in bfloat16, the drafter autocast
    reference = main(tiny_argv(tmp_path / "reference", *flags))
    assert reference["dtype"] == dtype

    run = tmp_path / "killed"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, str(REPO / "train" / "distill.py"), *tiny_argv(run, *flags)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    first = run / "checkpoints" / "checkpoint-0000004" / "trainer_state.json"
    deadline = time.monotonic() + 180
    while not first.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    stderr = process.communicate()[1].decode()
    assert process.returncode == -signal.SIGKILL, f"run ended before the kill: {stderr[-2000:]}"
    assert first.exists()
    assert not (run / "drafter").exists()
    killed_at = max(_losses(run / "logs" / "metrics.jsonl"))
    assert killed_at < 24

    resumed = main(tiny_argv(run, *flags, "--resume_from_checkpoint", "latest"))
    expected = _losses(tmp_path / "reference" / "logs" / "metrics.jsonl")
    got = _losses(run / "logs" / "metrics.jsonl")
    assert sorted(got) == list(range(1, 25))
    # The steps re-run after the checkpoint replaced their first rows: one row per step.
    logged = [r["step"] for r in read_metrics_log(run / "logs" / "metrics.jsonl")]
    assert logged == [
        r["step"] for r in read_metrics_log(tmp_path / "reference" / "logs" / "metrics.jsonl")
    ]
    for step in range(1, 25):
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step
    assert resumed["held_out"]["overlap@1"] == pytest.approx(
        reference["held_out"]["overlap@1"], rel=1e-5
    )
    assert resumed["tokens_seen"] == reference["tokens_seen"]
