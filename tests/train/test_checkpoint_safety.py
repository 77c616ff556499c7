"""Checkpoints hold tensors and JSON only: tampered or damaged files raise, nothing is unpickled."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from draftsmith.train.checkpoint import CheckpointError, CheckpointManager, objective_file, rng_file
from draftsmith.train.loop import make_accelerator


class _Payload:
    """Unpickling this creates a folder: the stand-in for arbitrary code in a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.makedirs, (str(self.marker),))


class _Stateful:
    """An objective's state: a generator and a scalar."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.count = 3

    def state_dict(self) -> dict[str, Any]:
        return {"gen": {"sampler": self.generator.get_state()}, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["gen"]["sampler"])
        self.count = state["count"]


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Any, CheckpointManager, Path]:
    accelerator = make_accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    manager = CheckpointManager(tmp_path / "ckpt")
    path = manager.save(accelerator, 4, {"step": 4}, _Stateful(seed=7))
    return accelerator, manager, path


def test_a_checkpoint_is_tensors_and_json_and_restores_every_generator(saved: Any) -> None:
    accelerator, manager, path = saved
    assert not list(path.glob("*.pkl"))
    assert json.loads((path / rng_file(0)).read_text())["python"]["version"] == 3
    manager.save(accelerator, 5, {"step": 5}, _Stateful(seed=7))
    # What every generator draws next; drawing moves them all on.
    expected = (random.random(), float(np.random.rand()), torch.rand(2).tolist())
    reference_draws = torch.rand(4, generator=_Stateful(seed=7).generator).tolist()
    restored = _Stateful(seed=99)
    restored.count = 0
    assert manager.load(accelerator, manager.resolve("latest"), restored) == {"step": 5}
    assert (random.random(), float(np.random.rand()), torch.rand(2).tolist()) == expected
    assert torch.rand(4, generator=restored.generator).tolist() == reference_draws
    assert restored.count == 3


def test_a_pickle_planted_in_a_checkpoint_never_runs(saved: Any, tmp_path: Path) -> None:
    accelerator, manager, path = saved
    live = tmp_path / "payload-is-live"
    torch.save(_Payload(live), tmp_path / "probe.bin")
    torch.load(tmp_path / "probe.bin", weights_only=False)  # what accelerate's loader did
    assert live.is_dir()

    marker = tmp_path / "code-ran"
    for name in ("custom_checkpoint_0.pkl", "random_states_0.pkl"):
        torch.save(_Payload(marker), path / name)
        with pytest.raises(CheckpointError, match=rf"pickled state \({name}\).*never unpickled"):
            manager.load(accelerator, path, _Stateful(seed=0))
        (path / name).unlink()
        assert not marker.exists()
    # The optimizer state is read with torch's restricted (weights-only) unpickler.
    torch.save({"state": _Payload(marker), "param_groups": []}, path / "optimizer.bin")
    with pytest.raises(CheckpointError, match="optimizer or scheduler state could not be restored"):
        manager.load(accelerator, path, _Stateful(seed=0))
    assert not marker.exists()


@pytest.mark.parametrize(
    "damage",
    [
        lambda path: path.write_text("{not json"),
        lambda path: path.write_text(json.dumps({"python": {"state": [1, 2]}})),
        lambda path: path.unlink(),
    ],
    ids=["garbage", "truncated-state", "missing"],
)
def test_an_unrestorable_rng_state_is_an_error(saved: Any, damage: Any) -> None:
    accelerator, manager, path = saved
    damage(path / rng_file(0))
    with pytest.raises(CheckpointError, match=rf"{rng_file(0)} cannot be restored"):
        manager.load(accelerator, path, _Stateful(seed=0))


def test_a_bad_objective_state_is_an_error(saved: Any) -> None:
    accelerator, manager, path = saved
    (path / objective_file(0)).write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match=rf"{objective_file(0)} cannot be restored: unread"):
        manager.load(accelerator, path, _Stateful(seed=0))
    (path / objective_file(0)).unlink()
    with pytest.raises(CheckpointError, match="the file is missing"):
        manager.load(accelerator, path, _Stateful(seed=0))


def test_a_state_the_objective_refuses_is_an_error(saved: Any) -> None:
    accelerator, manager, path = saved

    class Other(_Stateful):
        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.generator.set_state(state["coin"])

    with pytest.raises(CheckpointError, match="the objective refused it"):
        manager.load(accelerator, path, Other(seed=0))


def test_a_damaged_trainer_state_or_model_is_an_error(saved: Any) -> None:
    accelerator, manager, path = saved
    (path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="model, optimizer or scheduler"):
        manager.load(accelerator, path)
    (path / "trainer_state.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        manager.load(accelerator, path)


def test_killed_writes_leave_no_temporary_folder(saved: Any) -> None:
    accelerator, manager, _ = saved
    stale = manager.root / ".tmp-checkpoint-0000009"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    manager.save(accelerator, 6, {"step": 6})
    assert not list(manager.root.glob(".tmp-*"))


def test_a_checkpoint_records_the_exports_provenance(tmp_path: Path) -> None:
    from draftsmith.decode.drafters.folder import PROVENANCE_FILE
    from draftsmith.train.config import DistillConfig
    from draftsmith.train.provenance import PACKAGES, build_provenance

    accelerator = make_accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(3, 2))
    config = DistillConfig(config_file="configs/tiny.yaml").to_dict()
    path = CheckpointManager(tmp_path / "ckpt", resolved_config=config).save(
        accelerator, 1, {"step": 1}
    )
    recorded = json.loads((path / PROVENANCE_FILE).read_text())
    expected = build_provenance(config)  # the very function the export writes with
    assert recorded.keys() == expected.keys()
    assert recorded["config"] == config and recorded["config"]["config_file"] == "configs/tiny.yaml"
    assert recorded["git"] == expected["git"] and recorded["git"]["commit"]  # this checkout
    assert recorded["packages"] == expected["packages"] and list(recorded["packages"]) == list(
        PACKAGES
    )
    assert recorded["packages"]["torch"] and recorded["python"] == expected["python"]
    # Without a config (a caller outside distill), no provenance and the checkpoint still loads.
    bare = CheckpointManager(tmp_path / "bare").save(accelerator, 1, {"step": 1})
    assert not (bare / PROVENANCE_FILE).exists()


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("tokens_seen", "many", r"tokens_seen must be an integer >= 0, got 'many'"),
        ("micro_step", -1, r"micro_step must be an integer >= 0"),
        ("world_size", 0, r"world_size must be an integer >= 1"),
        ("elapsed_s", float("nan"), r"elapsed_s must be a finite number >= 0"),
        ("elapsed_s", "1", r"elapsed_s must be a finite number >= 0"),
        ("last_eval", [1], r"last_eval must map metric names to numbers"),
    ],
)
def test_a_tampered_trainer_state_field_is_an_error(
    saved: Any, field: str, value: Any, expected: str
) -> None:
    """These fields used to be restored unchecked and fail later inside the loop (a string
    tokens_seen: a TypeError at the first step) or silently (a NaN elapsed time)."""
    from draftsmith.train.loop import _restored_state

    accelerator, manager, path = saved
    state = json.loads((path / "trainer_state.json").read_text())
    state[field] = value
    (path / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=expected) as error:
        _restored_state(manager.load(accelerator, path), path)
    assert "trainer_state.json" in str(error.value)


def test_a_sound_trainer_state_restores(saved: Any) -> None:
    from draftsmith.train.loop import _restored_state

    accelerator, manager, path = saved
    assert _restored_state(manager.load(accelerator, path), path).step == 4
