"""Atomic training checkpoints of tensors and JSON only, the last K kept, resumable.

A checkpoint is ``<root>/checkpoint-<step:07d>/``:

- accelerate's ``save_state`` output for the prepared objects: ``model.safetensors``, and the
  optimizer and scheduler states (``optimizer.bin``, ``scheduler.bin``: plain tensors and
  numbers, read back with ``torch.load(weights_only=True)``, whose restricted unpickler builds
  tensors and containers and refuses every other object);
- ``rng_state_<rank>.json`` per process: Python's, NumPy's and torch's generator states;
- ``objective_state_<rank>.safetensors`` per process: the objective's own state (its sampling
  generators, say) as tensors, with any scalar leaves as JSON in the file's metadata;
- ``provenance.json`` (``draftsmith.train.provenance``, as in the exported folder: the resolved config,
  git revision, package versions, platform, time), when the manager was given the config;
- ``trainer_state.json`` (step, data position, tokens seen, elapsed time), written last.

Nothing in a checkpoint is unpickled with arbitrary classes: accelerate would pickle registered
objects (``custom_checkpoint_<i>.pkl``, loaded with ``weights_only=False``) and its RNG states
(``random_states_<rank>.pkl``, skipped silently when unreadable), so the objective is not
registered with it and those files are neither written nor accepted. A checkpoint folder may
have been tampered with: any ``.pkl`` file in it, a missing or malformed state file, or a state
the objects refuse is a ``CheckpointError`` naming the file, never a silent skip.

The folder is written into ``<root>/.tmp-checkpoint-<step>`` and renamed into place only once
complete, so a run killed at any moment leaves either the previous checkpoints or the new one,
never half of one. Only folders holding ``trainer_state.json`` count as checkpoints.
"""

from __future__ import annotations

import base64
import binascii
import json
import random
import re
import shutil
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from accelerate import Accelerator
from draftsmith.data.atomic_io import replace_folder, write_json_atomic
from draftsmith.decode.drafters.folder import PROVENANCE_FILE
from draftsmith.train.provenance import build_provenance
from safetensors import safe_open
from safetensors.torch import save_file

STATE_FILE = "trainer_state.json"
_PATTERN = re.compile(r"^checkpoint-(\d+)$")
_TEMP_PREFIX = ".tmp-checkpoint-"
_METADATA_KEY = "draftsmith_scalars"
_PYTHON_STATE_LENGTH = 625  # random.getstate()[1]: the Mersenne Twister words and the index
_NUMPY_KEY_LENGTH = 624


class CheckpointError(ValueError):
    """A checkpoint cannot be restored: missing, malformed, pickled or tampered state."""


class Stateful(Protocol):
    """What the manager saves besides accelerate's objects (an ``Objective``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def rng_file(rank: int) -> str:
    return f"rng_state_{rank}.json"


def objective_file(rank: int) -> str:
    return f"objective_state_{rank}.safetensors"


class CheckpointManager:
    """Writes, lists, prunes, resolves and restores checkpoints under ``root``."""

    def __init__(
        self, root: Path, keep_last: int = 2, resolved_config: dict[str, Any] | None = None
    ) -> None:
        """``resolved_config`` (``DistillConfig.to_dict()``) goes into each checkpoint's
        ``provenance.json``; without it no provenance is written."""
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (checkpoints to keep), got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.resolved_config = resolved_config

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

    def step_of(self, path: Path) -> int:
        """The step a checkpoint was written at (from its ``trainer_state.json``)."""
        state = _read_json(Path(path) / STATE_FILE)
        step = state.get("step") if isinstance(state, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CheckpointError(
                broken_file_message(Path(path) / STATE_FILE, "it holds no valid 'step'")
            )
        return step

    def save(
        self,
        accelerator: Accelerator,
        step: int,
        state: dict[str, Any],
        stateful: Stateful | None = None,
    ) -> Path:
        """Save everything atomically on all processes; returns the final folder."""
        final = self.root / f"checkpoint-{step:07d}"
        temp = self.root / f"{_TEMP_PREFIX}{step:07d}"
        if accelerator.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f"{_TEMP_PREFIX}*"):  # left by a run killed mid-write
                shutil.rmtree(stale, ignore_errors=True)
            temp.mkdir()
        accelerator.wait_for_everyone()
        accelerator.save_state(str(temp), safe_serialization=True)
        rank = accelerator.process_index
        # accelerate pickles the RNG states; ours are JSON (below), so its copy is dropped.
        (temp / f"random_states_{rank}.pkl").unlink(missing_ok=True)
        write_json_atomic(temp / rng_file(rank), capture_rng(accelerator), indent=None)
        save_state_tensors(temp / objective_file(rank), stateful.state_dict() if stateful else {})
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            if self.resolved_config is not None:
                write_json_atomic(temp / PROVENANCE_FILE, build_provenance(self.resolved_config))
            write_json_atomic(temp / STATE_FILE, state)
            replace_folder(temp, final)
            self._prune()
        accelerator.wait_for_everyone()
        return final

    def load(
        self, accelerator: Accelerator, path: Path, stateful: Stateful | None = None
    ) -> dict[str, Any]:
        """Restore model, optimizer, scheduler, RNG and ``stateful``; return the trainer state.

        Every file is checked before anything is restored; raises ``CheckpointError``.
        """
        path = Path(path)
        state = _read_json(path / STATE_FILE)
        if not isinstance(state, dict):
            raise CheckpointError(broken_file_message(path / STATE_FILE, "it is not a JSON object"))
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in (".pkl", ".pickle"))
        if pickled:
            raise CheckpointError(
                f"checkpoint {path} holds pickled state ({', '.join(pickled)}); draftsmith "
                "checkpoints hold tensors and JSON only and are never unpickled, so it was "
                "written by an older draftsmith or tampered with: resume from another checkpoint "
                "or start afresh with --overwrite_output_dir"
            )
        rank = accelerator.process_index
        rng = parse_rng(_read_json(path / rng_file(rank)), path / rng_file(rank))
        objective_state = load_state_tensors(path / objective_file(rank))
        try:
            accelerator.load_state(str(path), load_kwargs={"weights_only": True})
        except Exception as error:  # torch, safetensors and pickle errors share no base
            raise CheckpointError(
                f"checkpoint {path}: the model, optimizer or scheduler state could not be "
                f"restored ({type(error).__name__}: {error}); the folder is corrupt, was "
                "tampered with, or belongs to another model: resume from another checkpoint or "
                "start afresh with --overwrite_output_dir"
            ) from error
        apply_rng(rng, accelerator)
        if stateful is not None:
            try:
                stateful.load_state_dict(objective_state)
            except (KeyError, TypeError, ValueError, RuntimeError) as error:
                raise CheckpointError(
                    broken_file_message(
                        path / objective_file(rank), f"the objective refused it ({error})"
                    )
                ) from error
        return state

    def _prune(self) -> None:
        for path in self.checkpoints()[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)


# ---- random number generator states as JSON


def capture_rng(accelerator: Accelerator) -> dict[str, Any]:
    """Python, NumPy, torch CPU (and CUDA) generator states, and accelerate's step counter."""
    version, words, gauss_next = random.getstate()
    algorithm, key, pos, has_gauss, cached = np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {
        "python": {"version": version, "state": list(words), "gauss_next": gauss_next},
        "numpy": {
            "algorithm": algorithm,
            "key": [int(word) for word in key],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": _encode(torch.get_rng_state()),
        "cuda": [_encode(s) for s in cuda],
        "accelerator_step": int(accelerator.step),
    }


def parse_rng(data: Any, file: Path) -> dict[str, Any]:
    """Check and decode what ``capture_rng`` wrote, without applying anything."""
    try:
        python, numpy_state = data["python"], data["numpy"]
        words = python["state"]
        if len(words) != _PYTHON_STATE_LENGTH or not all(_is_word(w) for w in words[:-1]):
            raise ValueError("the Python generator state is not 624 32-bit words and an index")
        gauss = python["gauss_next"]
        if gauss is not None and not isinstance(gauss, float):
            raise ValueError("gauss_next is neither null nor a float")
        key = numpy_state["key"]
        if len(key) != _NUMPY_KEY_LENGTH or not all(_is_word(w) for w in key):
            raise ValueError("the NumPy key is not 624 32-bit words")
        torch_state = _decode(data["torch"])
        if torch_state.numel() != torch.get_rng_state().numel():
            raise ValueError("the torch CPU generator state has the wrong size")
        parsed = {
            "python": (int(python["version"]), tuple(int(w) for w in words), gauss),
            "numpy": (
                str(numpy_state["algorithm"]),
                np.asarray(key, dtype=np.uint32),
                int(numpy_state["pos"]),
                int(numpy_state["has_gauss"]),
                float(numpy_state["cached_gaussian"]),
            ),
            "torch": torch_state,
            "cuda": [_decode(s) for s in data["cuda"]],
            "accelerator_step": int(data["accelerator_step"]),
        }
    except (KeyError, TypeError, ValueError, IndexError, binascii.Error) as error:
        raise CheckpointError(
            broken_file_message(file, f"malformed random-generator state ({error})")
        ) from error
    return parsed


def apply_rng(parsed: dict[str, Any], accelerator: Accelerator) -> None:
    """Set every generator from ``parse_rng``'s output."""
    random.setstate(parsed["python"])
    np.random.set_state(parsed["numpy"])
    torch.set_rng_state(parsed["torch"])
    if torch.cuda.is_available() and parsed["cuda"]:
        torch.cuda.set_rng_state_all(parsed["cuda"])
    accelerator.step = parsed["accelerator_step"]


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def _is_word(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


# ---- an objective's state as safetensors


def save_state_tensors(path: Path, state: dict[str, Any]) -> None:
    """Nested dict of tensors (and JSON scalars) -> one safetensors file.

    Keys are joined with ``/``; non-tensor leaves go to the file's metadata as JSON.
    """
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    _flatten(state, "", tensors, scalars)
    save_file(tensors, str(path), metadata={_METADATA_KEY: json.dumps(scalars)})


def load_state_tensors(path: Path) -> dict[str, Any]:
    """The nested dict ``save_state_tensors`` wrote (tensors on the CPU)."""
    if not path.is_file():
        raise CheckpointError(broken_file_message(path, "the file is missing"))
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            scalars = json.loads((handle.metadata() or {}).get(_METADATA_KEY, "{}"))
            if not isinstance(scalars, dict):
                raise ValueError("its scalar metadata is not a JSON object")
            flat: dict[str, Any] = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except Exception as error:  # safetensors raises its own error type
        raise CheckpointError(broken_file_message(path, f"unreadable ({error})")) from error
    flat.update(scalars)
    nested: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def _flatten(
    state: dict[str, Any], prefix: str, tensors: dict[str, torch.Tensor], scalars: dict[str, Any]
) -> None:
    for key, value in state.items():
        name = f"{prefix}{key}"
        if "/" in str(key):
            raise ValueError(f"objective state key {name!r} contains '/'; rename it")
        if isinstance(value, dict):
            _flatten(value, f"{name}/", tensors, scalars)
        elif isinstance(value, torch.Tensor):
            tensors[name] = value.detach().cpu().contiguous()
        elif value is None or isinstance(value, (bool, int, float, str, list)):
            scalars[name] = value
        else:
            raise TypeError(
                f"objective state {name!r} is a {type(value).__name__}; checkpoints hold "
                "tensors and JSON values only: return a tensor (e.g. Generator.get_state())"
            )


def _read_json(file: Path) -> Any:
    if not file.is_file():
        raise CheckpointError(
            broken_file_message(
                file, "the file is missing (a checkpoint of an older draftsmith, or damaged)"
            )
        )
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(broken_file_message(file, f"not valid JSON ({error})")) from error


def broken_file_message(file: Path, why: str) -> str:
    """The message of a ``CheckpointError`` for ``file``: what is wrong and how to go on."""
    return (
        f"checkpoint file {file} cannot be restored: {why}; resume from another checkpoint "
        "(--resume_from_checkpoint <folder>) or start afresh with --overwrite_output_dir"
    )
