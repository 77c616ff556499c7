"""train/distill.py: on-policy batches, push_to_hub offline, tracker back ends."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from draftsmith.train.distill import main
from draftsmith.train.tracking import read_metrics_log, resolve_wandb_mode

Argv = Callable[..., list[str]]


def test_on_policy_batches_are_sampled_by_the_drafter(tmp_path: Path, tiny_argv: Argv) -> None:
    main(
        tiny_argv(
            tmp_path,
            "--on_policy_fraction",
            "0.5",
            "--on_policy_prompt_tokens",
            "16",
            "--max_steps",
            "8",
            "--loss",
            "jsd:0.5",
        )
    )
    records = [
        r for r in read_metrics_log(tmp_path / "logs" / "metrics.jsonl") if "train/loss" in r
    ]
    flags = [r["train/on_policy"] for r in records]
    assert set(flags) == {0.0, 1.0}
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in records)


def test_push_to_hub_offline_saves_first_then_fails_fast(
    tmp_path: Path, tiny_argv: Argv, monkeypatch: pytest.MonkeyPatch
) -> None:
    from draftsmith.train.export.folder import HubUploadError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUploadError, match=r"HF_HUB_OFFLINE is set.*saved at"):
        main(tiny_argv(tmp_path, "--max_steps", "1", "--push_to_hub", "someone/tiny-draft"))
    assert (tmp_path / "drafter" / "model.safetensors").is_file()


def test_tensorboard_and_offline_wandb_trackers(
    tmp_path: Path, tiny_argv: Argv, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    summary = main(tiny_argv(tmp_path, "--max_steps", "2", "--report_to", "tensorboard,wandb"))
    assert summary["wandb_mode"] == "offline"
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert list(tmp_path.rglob("events.out.tfevents.*"))


def test_wandb_goes_offline_without_key_or_network() -> None:
    def yes() -> bool:
        return True

    def no() -> bool:
        return False

    assert resolve_wandb_mode({"WANDB_MODE": "online"}, no, no) == "online"
    assert resolve_wandb_mode({}, no, yes) == "offline"
    assert resolve_wandb_mode({}, yes, no) == "offline"
    assert resolve_wandb_mode({}, yes, yes) == "online"
    assert resolve_wandb_mode({"WANDB_DISABLED": "true"}, yes, yes) == "disabled"
