"""FSDP2 on two CPU ranks over gloo: parameters sharded, resume exact, export = one process's.

accelerate 1.15 maps every CPU launch to DDP and drops the FSDP config; ``draftsmith.train.distributed``
restores it, so these launches run accelerate's own FSDP2 path (``fully_shard``) on CPU. Each
launch takes about a minute on 2 cores (two ranks importing torch), hence ``slow``; the
in-process tests at the end cover the pieces that need no second process.
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
from draftsmith.train.distributed import enable_cpu_fsdp, format_report, parallel_report
from draftsmith.train.losses import build_loss
from draftsmith.train.objectives import get_objective_class
from draftsmith.train.target.demo import default_target_path
from draftsmith.train.target.model import (
    load_model,
    load_tokenizer,
    resolve_target,
    target_location,
    target_on_main_first,
)
from draftsmith.train.tracking import read_metrics_log
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
FSDP_CONFIG = REPO / "configs" / "accelerate" / "fsdp.yaml"
STEPS = ("--max_steps", "4", "--checkpoint_every", "2", "--eval_every", "0")


def _launch(recipe: str, output_dir: Path, *flags: str, env: dict[str, str] | None = None) -> str:
    """``accelerate launch --config_file fsdp.yaml`` with 2 CPU ranks; returns stdout."""
    environment = {**os.environ, "ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1", **(env or {})}
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_CONFIG),
        "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", str(REPO / "train" / "distill.py"),
        "--config", str(REPO / "configs" / recipe), "--output_dir", str(output_dir), *flags,
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def _check_sharded(run: Path, stdout: str) -> dict:
    """The summary, provenance and log all say FSDP2 over 2 ranks, each holding about half."""
    summary = json.loads((run / "summary.json").read_text())
    report = summary["distributed"]
    assert report["distributed_type"] == "FSDP" and report["fsdp_version"] == 2
    assert report["world_size"] == summary["world_size"] == 2
    assert report["sharded"] is True
    full, shards = report["trainable_elements"], report["local_elements"]
    assert len(shards) == 2 and sum(shards) == full  # every element stored exactly once
    assert all(0 < n < full for n in shards)
    assert summary["params_in_sync"] is True  # the gathered parameters agree on both ranks
    provenance = json.loads((run / "drafter" / "provenance.json").read_text())
    assert provenance["distributed"] == report
    assert format_report(report) in stdout
    return summary


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    """The full model state FSDP wrote into the last checkpoint (FULL_STATE_DICT)."""
    last = sorted((run / "checkpoints").glob("checkpoint-*"))[-1]
    return torch.load(last / "pytorch_model_fsdp.bin", weights_only=True, map_location="cpu")


def _single_process_export(argv: list[str], weights: dict[str, torch.Tensor], folder: Path) -> Path:
    """What one process exports from ``weights``: its own objective, no gathered state."""
    config = parse_config(argv)
    location = target_location(resolve_target(config.target.target))[0]
    tokenizer = load_tokenizer(location)
    target = load_model(location)
    cls = get_objective_class(config.drafter.drafter_kind)
    objective = cls.from_config(config, target, tokenizer, build_loss(config.loss.loss))
    objective.trainable_module().load_state_dict(weights, strict=True)
    objective.save_drafter(folder, tokenizer)
    return folder


def _assert_same_tensors(folder_a: Path, folder_b: Path, name: str) -> None:
    a, b = load_file(str(folder_a / name)), load_file(str(folder_b / name))
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _assert_same_drafter(exported: Path, alone: Path) -> None:
    """Every weight file and drafter/model config one process writes, the FSDP run wrote too."""
    weights = sorted(p.name for p in alone.glob("*.safetensors"))
    assert weights
    for name in weights:
        _assert_same_tensors(exported, alone, name)
    for name in ("config.json", "drafter.json"):
        if (alone / name).is_file():
            assert json.loads((exported / name).read_text()) == json.loads(
                (alone / name).read_text()
            ), name


@pytest.fixture(scope="module")
def draft_lm_run(tmp_path_factory: pytest.TempPathFactory, tiny_target: Path) -> SimpleNamespace:
    run = tmp_path_factory.mktemp("fsdp") / "draft_lm"
    stdout = _launch("tiny.yaml", run, "--target", str(tiny_target), *STEPS)
    return SimpleNamespace(run=run, stdout=stdout, target=tiny_target)


@pytest.mark.slow
def test_fsdp_shards_the_draft_lm_and_exports_what_one_process_exports(
    draft_lm_run: SimpleNamespace, tmp_path: Path
) -> None:
    run = draft_lm_run.run
    _check_sharded(run, draft_lm_run.stdout)
    weights = _final_weights(run)
    argv = ["--config", str(REPO / "configs" / "tiny.yaml"), "--target", str(draft_lm_run.target)]
    alone = _single_process_export(argv, weights, tmp_path / "alone")
    _assert_same_drafter(run / "drafter", alone)


@pytest.mark.slow
def test_fsdp_resume_from_a_checkpoint_replays_the_same_losses(
    draft_lm_run: SimpleNamespace, tmp_path: Path
) -> None:
    first = draft_lm_run.run
    resumed = tmp_path / "resumed"
    middle = first / "checkpoints" / "checkpoint-0000002"
    flags = ("--target", str(draft_lm_run.target), *STEPS, "--resume_from_checkpoint", str(middle))
    _launch("tiny.yaml", resumed, *flags)

    def losses(run: Path) -> dict[int, float]:
        records = read_metrics_log(run / "logs" / "metrics.jsonl")
        return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}

    assert sorted(losses(resumed)) == [3, 4]
    assert all(losses(resumed)[step] == losses(first)[step] for step in (3, 4))
    end_first, end_resumed = _final_weights(first), _final_weights(resumed)
    for key, tensor in end_first.items():
        assert torch.equal(tensor, end_resumed[key]), key


@pytest.mark.slow
def test_fsdp_lora_builds_the_demo_target_on_the_main_process_and_merges_like_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"  # no demo target yet: the main rank builds it, the other waits
    flags = ("--target", "tiny", "--lora_rank", "4", *STEPS)
    stdout = _launch("tiny.yaml", tmp_path / "run", *flags, env={"XDG_CACHE_HOME": str(cache)})
    assert "building the demo target 'tiny'" in stdout
    built = list((cache / "draftsmith" / "targets").glob("tiny-*"))  # <preset>-<dtype>-<key>
    assert len(built) == 1 and (built[0] / "BUILD_COMPLETE").is_file(), built
    summary = _check_sharded(tmp_path / "run", stdout)
    assert summary["distributed"]["trainable_elements"] < 73_920  # the LoRA deltas only

    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))  # one process reads the same target
    argv = ["--config", str(REPO / "configs" / "tiny.yaml"), "--target", "tiny", "--lora_rank", "4"]
    alone = _single_process_export(argv, _final_weights(tmp_path / "run"), tmp_path / "alone")
    _assert_same_drafter(tmp_path / "run" / "drafter", alone)


@pytest.mark.slow
def test_fsdp_eagle3_head_is_sharded_and_exports_what_one_process_exports(
    tmp_path: Path, tiny_target: Path
) -> None:
    run = tmp_path / "run"
    stdout = _launch("tiny_eagle3.yaml", run, "--target", str(tiny_target), *STEPS)
    _check_sharded(run, stdout)
    argv = ["--config", str(REPO / "configs" / "tiny_eagle3.yaml"), "--target", str(tiny_target)]
    alone = _single_process_export(argv, _final_weights(run), tmp_path / "alone")
    _assert_same_drafter(run / "drafter", alone)


# -- in-process pieces ---------------------------------------------------------------------------


class _Rank:
    """The parts of an Accelerator that ``target_on_main_first`` uses."""

    def __init__(self, main: bool) -> None:
        self.num_processes = 2
        self.is_main_process = main
        self.barriers = 0

    def wait_for_everyone(self) -> None:
        self.barriers += 1


def test_a_waiting_rank_that_never_sees_the_target_names_the_shared_filesystem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(TimeoutError, match="XDG_CACHE_HOME on a shared filesystem"):
        target_on_main_first(resolve_target("tiny"), _Rank(main=False), 0.0005, 0.01)
    assert not (tmp_path / "draftsmith").exists()  # a waiting rank builds nothing


def test_a_waiting_rank_goes_on_once_the_main_rank_has_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_target: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = default_target_path("tiny")  # keyed by the preset's settings and dtype
    assert folder.parent == tmp_path / "draftsmith" / "targets"
    folder.parent.mkdir(parents=True)
    shutil.copytree(tiny_target, folder)
    rank = _Rank(main=False)
    location, _ = target_on_main_first(resolve_target("tiny"), rank)
    assert location == str(folder) and rank.barriers == 1


def test_a_single_process_or_a_non_fsdp_launch_is_left_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from accelerate import Accelerator

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    accelerator = Accelerator(cpu=True)
    assert enable_cpu_fsdp(accelerator) is False  # one process: nothing to shard
    model = torch.nn.Linear(4, 2)
    report = parallel_report(model, accelerator)
    assert report["world_size"] == 1 and report["sharded"] is False
    assert report["local_elements"] == [report["trainable_elements"]] == [10]
    assert "replicated" in format_report(report)
