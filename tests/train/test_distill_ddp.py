"""Two CPU processes through accelerate launch: real DDP over gloo, to a valid checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]


def test_two_process_cpu_ddp_run(tmp_path: Path, tiny_target: Path) -> None:
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        str(REPO / "train" / "distill.py"), "--config", str(REPO / "configs" / "tiny.yaml"),
        "--target", str(tiny_target), "--output_dir", str(tmp_path), "--max_steps", "6",
        "--checkpoint_every", "3",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2
    # Each rank saw different batches; identical weights afterwards means synchronised gradients.
    assert summary["params_in_sync"] is True
    assert summary["tokens_seen"] == 6 * 2 * 4 * 64  # steps x ranks x batch x block
    checkpoint = tmp_path / "checkpoints" / "checkpoint-0000006"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 6 and state["micro_step"] == 6
    for rank in (0, 1):  # per-process RNG and objective states, as JSON and safetensors
        assert (checkpoint / f"rng_state_{rank}.json").is_file()
        assert (checkpoint / f"objective_state_{rank}.safetensors").is_file()
    assert not list(checkpoint.glob("*.pkl"))
    saved = load_file(str(checkpoint / "model.safetensors"))
    exported = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    for name, tensor in exported.items():
        assert torch.equal(saved[name], tensor), name
