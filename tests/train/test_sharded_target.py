"""A frozen target sharded over two CPU ranks (``--target_sharding fsdp``, FSDP2 over gloo).

The EAGLE-3 head reads the target's hidden states and embeds tokens with the target's own
embedding, so it sees every part of the sharded target. Launches of 2 ranks take about a
minute each on 2 cores, hence ``slow``: the unsharded run, the sharded one, the sharded one
resumed from its step-10 checkpoint, and an FSDP2-sharded drafter with the whole target and
with the sharded one. The in-process tests at the end need no second process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from draftsmith.train.config import parse_config
from draftsmith.train.target.sharding import format_target_memory, shard_target
from draftsmith.train.tracking import read_metrics_log
from safetensors.torch import load_file
from tiny_models import tiny_llama

REPO = Path(__file__).resolve().parents[2]
FSDP_CONFIG = REPO / "configs" / "accelerate" / "fsdp.yaml"
RECIPE = REPO / "configs" / "tiny_eagle3.yaml"
FLAGS = (
    "--max_steps", "20", "--checkpoint_every", "10", "--keep_checkpoints", "2",
    "--eval_every", "0", "--eval_source", "data", "--log_every", "1",
    "--target_dtype", "float32", "--mixed_precision", "no",
)  # fmt: skip


def _launch(output_dir: Path, *flags: str, fsdp_drafter: bool = False) -> str:
    """2 CPU ranks through accelerate launch (DDP for the drafter, or FSDP2); stdout."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1"}
    layout = ["--config_file", str(FSDP_CONFIG)] if fsdp_drafter else ["--multi_gpu"]
    command = [
        sys.executable, "-m", "accelerate.commands.launch", *layout, "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        str(REPO / "train" / "distill.py"), "--config", str(RECIPE),
        "--output_dir", str(output_dir), *flags,
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def _losses(run: Path) -> dict[int, float]:
    records = read_metrics_log(run / "logs" / "metrics.jsonl")
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def _exported(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "drafter" / "model.safetensors"))


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest elementwise difference of two exports (the vocabulary maps included)."""
    assert sorted(a) == sorted(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_target: Path) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("sharded")
    target = ("--target", str(tiny_target))
    _launch(root / "whole", *target, *FLAGS)
    sharded_stdout = _launch(root / "sharded", *target, *FLAGS, "--target_sharding", "fsdp")
    middle = root / "sharded" / "checkpoints" / "checkpoint-0000010"
    resume = ("--resume_from_checkpoint", str(middle))
    _launch(root / "resumed", *target, *FLAGS, "--target_sharding", "fsdp", *resume)
    _launch(root / "fsdp_drafter", *target, *FLAGS, fsdp_drafter=True)
    both = ("--target_sharding", "fsdp")
    _launch(root / "fsdp_both", *target, *FLAGS, *both, fsdp_drafter=True)
    return SimpleNamespace(root=root, sharded_stdout=sharded_stdout)


@pytest.mark.slow
def test_sharded_target_holds_half_per_rank_and_says_so(runs: SimpleNamespace) -> None:
    summary = json.loads((runs.root / "sharded" / "summary.json").read_text())
    memory = summary["target_memory"]
    assert memory["sharding"] == "fsdp" and len(memory["bytes_per_rank"]) == 2
    assert memory["ratio"] <= 0.55, memory  # measured: 0.500 on the tiny target
    assert format_target_memory(memory) in runs.sharded_stdout
    provenance = json.loads((runs.root / "sharded" / "drafter" / "provenance.json").read_text())
    assert provenance["target_memory"] == memory
    whole = json.loads((runs.root / "whole" / "summary.json").read_text())["target_memory"]
    assert whole["ratio"] == 1.0 and whole["full_bytes"] == memory["full_bytes"]


@pytest.mark.slow
def test_sharded_target_reproduces_the_unsharded_run(runs: SimpleNamespace) -> None:
    whole, sharded = _losses(runs.root / "whole"), _losses(runs.root / "sharded")
    assert sorted(whole) == sorted(sharded) == list(range(1, 21))
    assert max(abs(whole[s] - sharded[s]) for s in whole) <= 1e-5  # measured: 0 (bitwise)
    assert (
        _largest_difference(_exported(runs.root / "whole"), _exported(runs.root / "sharded"))
        <= 1e-6
    )


@pytest.mark.slow
def test_sharded_run_resumes_bit_identically(runs: SimpleNamespace) -> None:
    first, resumed = _losses(runs.root / "sharded"), _losses(runs.root / "resumed")
    assert sorted(resumed) == list(range(11, 21))
    assert all(resumed[s] == first[s] for s in resumed)
    a, b = _exported(runs.root / "sharded"), _exported(runs.root / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sharded_target_under_an_fsdp_drafter(runs: SimpleNamespace) -> None:
    summary = json.loads((runs.root / "fsdp_both" / "summary.json").read_text())
    assert summary["distributed"]["distributed_type"] == "FSDP"
    assert summary["target_memory"]["ratio"] <= 0.55
    # FSDP2 reduces gradients in another order than DDP: compare with its own whole-target run.
    whole, both = _losses(runs.root / "fsdp_drafter"), _losses(runs.root / "fsdp_both")
    assert max(abs(whole[s] - both[s]) for s in whole) <= 1e-5
    exports = _exported(runs.root / "fsdp_drafter"), _exported(runs.root / "fsdp_both")
    assert _largest_difference(*exports) <= 1e-6


# --------------------------------------------------------------------------- in one process


def test_sharding_one_process_names_the_fix() -> None:
    accelerator = SimpleNamespace(num_processes=1, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="--nproc_per_node N"):
        shard_target(tiny_llama(), accelerator)


def test_sharding_a_model_without_decoder_layers_names_the_fix() -> None:
    accelerator = SimpleNamespace(num_processes=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="--target_sharding none"):
        shard_target(torch.nn.Linear(2, 2), accelerator)


def test_sharded_target_refuses_generated_rows(tmp_path: Path) -> None:
    argv = ["--config", str(RECIPE), "--output_dir", str(tmp_path), "--target_sharding", "fsdp"]
    with pytest.raises(ValueError, match="--eval_source data"):
        parse_config(argv)  # the recipe continues held-out prompts with the target
    parse_config([*argv, "--eval_source", "data"])
    with pytest.raises(ValueError, match="target_sharding"):
        parse_config([*argv, "--eval_source", "data", "--target_sharding", "tp"])
    shutil.rmtree(tmp_path, ignore_errors=True)
