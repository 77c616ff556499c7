"""Atomic training checkpoints, the last K kept, resumable from ``latest`` or a path.

A checkpoint is ``<root>/checkpoint-<step:07d>/``: accelerate's ``save_state`` output (model,
optimizer, scheduler, per-process RNG states, registered objects such as the objective's
generators) plus ``trainer_state.json`` (step, data position, tokens seen, elapsed time). It is
written into ``<root>/.tmp-checkpoint-<step>`` and renamed into place only once complete, so a
run killed at any moment leaves either the previous checkpoints or the new one, never half of
one. ``trainer_state.json`` is written last, and only folders holding it count as checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from accelerate import Accelerator

STATE_FILE = "trainer_state.json"
_PATTERN = re.compile(r"^checkpoint-(\d+)$")


class CheckpointManager:
    """Writes, lists, prunes and resolves checkpoints under ``root``."""

    def __init__(self, root: Path, keep_last: int = 2) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (checkpoints to keep), got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = _PATTERN.match(path.name)
            if match and (path / STATE_FILE).is_file():
                found.append((int(match.group(1)), path))
        return [path for _, path in sorted(found)]

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def resolve(self, spec: str) -> Path:
        """``"latest"`` -> the newest complete checkpoint under root; otherwise a path."""
        if spec == "latest":
            latest = self.latest()
            if latest is None:
                raise FileNotFoundError(
                    f"--resume_from_checkpoint latest: no complete checkpoint under {self.root}; "
                    "start without resuming or pass a checkpoint folder"
                )
            return latest
        path = Path(spec).expanduser()
        if not (path / STATE_FILE).is_file():
            raise FileNotFoundError(
                f"--resume_from_checkpoint {spec}: {path} is not a complete checkpoint (no "
                f"{STATE_FILE}); pass 'latest' or a checkpoint-<step> folder"
            )
        return path

    def save(self, accelerator: Accelerator, step: int, state: dict[str, Any]) -> Path:
        """Save everything atomically on all processes; returns the final folder."""
        final = self.root / f"checkpoint-{step:07d}"
        temp = self.root / f".tmp-checkpoint-{step:07d}"
        if accelerator.is_main_process:
            shutil.rmtree(temp, ignore_errors=True)
            temp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(temp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            _write_json(temp / STATE_FILE, state)
            if final.exists():
                shutil.rmtree(final)
            os.replace(temp, final)
            self._prune()
        accelerator.wait_for_everyone()
        return final

    def load(self, accelerator: Accelerator, path: Path) -> dict[str, Any]:
        """Restore model, optimizer, scheduler, RNG and registered objects; return the state."""
        accelerator.load_state(str(path))
        return json.loads((path / STATE_FILE).read_text())

    def _prune(self) -> None:
        for path in self.checkpoints()[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    temp = path.with_suffix(".json.tmp")
    temp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(temp, path)
