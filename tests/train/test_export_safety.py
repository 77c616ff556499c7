"""Exports are atomic, leave no temporary folder behind, and never hold NaN weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from draftsmith.data.atomic_io import atomic_folder, remove_stale_siblings, write_json_atomic
from draftsmith.train.export.folder import NonFiniteWeightsError, export_drafter


class _Objective:
    """The part of an Objective that export_drafter uses."""

    kind = "draft_lm"

    def __init__(self, weight: float) -> None:
        self.unwrapped_module = torch.nn.Linear(2, 2)
        with torch.no_grad():
            self.unwrapped_module.weight.fill_(weight)

    def save_drafter(self, folder: Path, tokenizer: Any, state_dict: Any) -> None:
        (folder / "drafter.json").write_text(json.dumps({"kind": self.kind}))

    def describe(self) -> dict[str, Any]:
        return {}


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    return int(done.stdout)


def _export(objective: _Objective, folder: Path, state_dict: Any = None) -> Path:
    return export_drafter(objective, folder, None, {}, {"held_out": {}}, state_dict)


def test_nan_weights_are_never_exported(tmp_path: Path) -> None:
    folder = tmp_path / "drafter"
    _export(_Objective(1.0), folder)
    before = (folder / "provenance.json").read_text()
    with pytest.raises(NonFiniteWeightsError, match=r"NaN or infinite.*weight.*lower"):
        _export(_Objective(float("nan")), folder)
    bad_state = {"w": torch.tensor([1.0, float("inf")]), "steps": torch.tensor([3])}
    with pytest.raises(NonFiniteWeightsError, match=r"\(w\)"):
        _export(_Objective(1.0), folder, bad_state)
    assert (folder / "provenance.json").read_text() == before  # the earlier export is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


def test_a_killed_export_leaves_nothing_behind_after_the_next(tmp_path: Path) -> None:
    folder = tmp_path / "drafter"
    dead = _dead_pid()
    for leftover in (f".drafter.tmp-{dead}", f".drafter.old-{dead}"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "model.safetensors").write_bytes(b"half")
    alive = tmp_path / ".drafter.tmp-1"  # pid 1 exists: another export may be running
    alive.mkdir()
    _export(_Objective(1.0), folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".drafter.tmp-1", "drafter"]
    assert json.loads((folder / "drafter.json").read_text())["kind"] == "draft_lm"


def test_a_failed_write_keeps_the_previous_folder(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    with atomic_folder(folder) as temp:
        (temp / "a").write_text("1")
    with pytest.raises(RuntimeError), atomic_folder(folder) as temp:
        (temp / "a").write_text("2")
        raise RuntimeError("killed")
    assert (folder / "a").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert remove_stale_siblings(folder) == []
    write_json_atomic(tmp_path / "r.json", {"x": 1})
    assert json.loads((tmp_path / "r.json").read_text()) == {"x": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "r.json"]
