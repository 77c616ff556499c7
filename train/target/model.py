"""Finding and loading the frozen target: a demo preset, a local folder or a hub id.

Loading itself is ``draftsmith.decode.loading``'s (safetensors only; remote code only with
``--trust_remote_code``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from draftsmith.decode import loading
from draftsmith.train.config import DEMO_TARGET_PRESETS

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class TargetRef(str):
    """A resolved ``--target``: a preset name, an existing folder, or a hub id."""

    kind: str

    def __new__(cls, value: str, kind: str) -> TargetRef:
        ref = super().__new__(cls, value)
        ref.kind = kind
        return ref


def add_target_arguments(parser: Any) -> None:
    """``--target`` (what :func:`resolve_target` reads) and its ``--dtype``/``--target-dtype``,
    for the scripts that load a target alone."""
    from draftsmith.decode.precision import add_dtype_argument

    parser.add_argument("--target", default="demo", help="demo/bench/tiny, a folder or a hub id")
    add_dtype_argument(parser, "--target-dtype", subject="the target")


def resolve_target(spec: str) -> TargetRef:
    """Classify ``--target`` without loading anything; raise if it cannot be a model."""
    if spec in DEMO_TARGET_PRESETS:
        return TargetRef(spec, "preset")
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"--target {spec}: {path} has no config.json, so it is not a model folder; "
                "pass a folder saved with save_pretrained, a hub id, or one of "
                f"{', '.join(DEMO_TARGET_PRESETS)}"
            )
        return TargetRef(str(path), "folder")
    if _HUB_ID.match(spec) and not spec.startswith((".", "/", "~")):
        return TargetRef(spec, "hub")
    raise FileNotFoundError(
        f"--target {spec}: no such folder; pass an existing model folder, a hub id (org/name), "
        f"or one of the demo targets {', '.join(DEMO_TARGET_PRESETS)}"
    )


def target_location(ref: TargetRef, allow_build: bool = True) -> tuple[str, str]:
    """``(where to load from, display name)``; builds a missing demo target when allowed."""
    if ref.kind == "preset":
        from draftsmith.train.target.demo import build_demo_target, default_target_path, is_complete

        folder = default_target_path(str(ref))
        if not is_complete(folder) and not allow_build:
            raise FileNotFoundError(
                f"--target {ref}: the demo target is not built yet ({folder}) and a "
                "multi-process run cannot build it; build it once first with "
                f"`python scripts/build_demo_target.py --preset {ref}`"
            )
        location = str(build_demo_target(preset=str(ref)))
        return location, f"demo target '{ref}' ({location})"
    return str(ref), str(ref)


def load_tokenizer(location: str, trust_remote_code: bool = False) -> Any:
    """The target's tokenizer; one without a pad token gets eos as pad."""
    tokenizer = loading.load_tokenizer(location, trust_remote_code, flag="--target")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(location: str, dtype: str = "float32", trust_remote_code: bool = False) -> Any:
    """The frozen target in eval mode, without gradients."""
    return loading.load_causal_lm(
        location, dtype, trust_remote_code=trust_remote_code, frozen=True, flag="--target"
    )


def load_target(
    ref: TargetRef, dtype: str = "float32", trust_remote_code: bool = False
) -> tuple[Any, Any, str]:
    """``(model, tokenizer, name)`` in one call (scripts); see the functions above."""
    location, name = target_location(ref)
    tokenizer = load_tokenizer(location, trust_remote_code)
    return load_model(location, dtype, trust_remote_code), tokenizer, name


# ---- a launched run: the main process builds a missing demo target, the others wait

_LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",  # the launcher's 1 thread per rank; the build has the machine to itself
)
_LAUNCH_PREFIXES = ("TORCHELASTIC_", "ACCELERATE_", "FSDP_", "TORCH_NCCL_")


def target_on_main_first(
    ref: TargetRef, accelerator: Any, wait_minutes: float = 120.0, poll_s: float = 1.0
) -> tuple[str, str]:
    """``target_location(ref)`` for every rank; a missing demo target is built by the main one.

    The main process builds it in a child process with the launch's variables removed (the
    build trains through its own Accelerator, which must not join this run's process group);
    the others wait for the finished folder (its marker file), polling rather than sitting in
    a collective, whose timeout (10 minutes for NCCL) is shorter than a demo build may take.
    Processes on another machine need the same folder: ``XDG_CACHE_HOME`` on a shared
    filesystem, or the target built on every machine first.
    """
    from draftsmith.train.target.demo import default_target_path, is_complete

    if ref.kind != "preset" or accelerator.num_processes == 1:
        return target_location(ref)
    folder = default_target_path(str(ref))
    if accelerator.is_main_process and not is_complete(folder):
        print(
            f"building the demo target '{ref}' at {folder} on the main process; the other "
            f"{accelerator.num_processes - 1} process(es) wait for it",
            flush=True,
        )
        build_demo_target_isolated(str(ref))
    elif not accelerator.is_main_process:
        _wait_for_build(folder, wait_minutes, poll_s)
    accelerator.wait_for_everyone()
    return target_location(ref, allow_build=False)


def build_demo_target_isolated(preset: str) -> None:
    """Build the demo target ``preset`` (default folder) in a child process outside the launch."""
    import subprocess
    import sys

    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _LAUNCH_VARIABLES and not key.startswith(_LAUNCH_PREFIXES)
    }
    code = (
        "from draftsmith.train.target.demo import build_demo_target; "
        f"build_demo_target(preset={preset!r}, progress_bar=False)"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"building the demo target '{preset}' on the main process failed (exit code "
            f"{done.returncode}, its output is above); build it alone first with "
            f"`python scripts/build_demo_target.py --preset {preset}`"
        )


def _wait_for_build(folder: Any, wait_minutes: float, poll_s: float) -> None:
    import time

    from draftsmith.train.target.demo import is_complete

    deadline = time.monotonic() + wait_minutes * 60
    while not is_complete(folder):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {wait_minutes:g} minutes for the main process to build the demo target "
                f"at {folder}; if this process runs on another machine it cannot see that "
                "folder: put XDG_CACHE_HOME on a shared filesystem, or build the target on every "
                "machine first (`python scripts/build_demo_target.py --preset <name>`)"
            )
        time.sleep(poll_s)


# ---- large targets: reading parts of the weights (draftsmith.train.target.sharding, cache_only runs)


def weights_folder(location: str) -> Path:
    """The local folder holding ``location``'s config and safetensors files: the folder itself,
    or a hub id's snapshot (downloaded unless ``HF_HUB_OFFLINE=1``, then the cache's)."""
    folder = Path(location).expanduser()
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(location, allow_patterns=["*.json", "*.safetensors"]))


def has_decoder_layers(model: Any) -> bool:
    """False for a target loaded by :func:`load_model_without_layers`."""
    return len(getattr(model.get_decoder(), "layers", ())) > 0


def load_model_without_layers(
    location: str, dtype: str = "float32", trust_remote_code: bool = False
) -> Any:
    """The frozen target's config, embeddings, final norm and output head; no decoder layer.

    What a drafter trained from the offline cache (``--target_outputs cache_only``) still reads
    of the target: its config (depth, widths), its input embedding (EAGLE-3 embeds the next
    tokens) and its output head and norm (copied into a new head). The model is built with
    zero layers (its ``config.num_hidden_layers`` then restored, for the objectives' checks)
    and only those tensors are read from the safetensors files; calling it raises, since it
    cannot score anything.
    """
    import copy

    import torch
    from draftsmith.decode.loading import resolve_dtype
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    location = str(weights_folder(location))
    config = AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code)
    depth = config.num_hidden_layers
    hollow = copy.deepcopy(config)
    hollow.num_hidden_layers = 0
    if isinstance(getattr(hollow, "layer_types", None), list):
        hollow.layer_types = []
    model = AutoModelForCausalLM.from_config(
        hollow, dtype=resolve_dtype(dtype, None), trust_remote_code=trust_remote_code
    )
    model.config.num_hidden_layers = depth
    if isinstance(getattr(config, "layer_types", None), list):
        model.config.layer_types = config.layer_types
    wanted = model.state_dict()
    found: set[str] = set()
    for file in sorted(Path(location).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name in wanted:
                    with torch.no_grad():
                        wanted[name].copy_(handle.get_tensor(name))
                    found.add(name)
    tied = {n for n, p in model.named_parameters(remove_duplicate=False)} - {
        n for n, p in model.named_parameters()
    }
    missing = sorted(set(wanted) - found - tied - {n for n, _ in model.named_buffers()})
    if missing:
        raise FileNotFoundError(
            f"--target {location}: the safetensors files lack {missing}, which a drafter "
            "trained from the cache reads (embeddings, final norm, output head)"
        )
    model.eval().requires_grad_(False)

    def refuse(*_: Any) -> None:
        raise RuntimeError(
            "the target was loaded without its decoder layers (--target_outputs cache_only) "
            "and cannot score a batch; every batch must come from the offline cache"
        )

    model.register_forward_pre_hook(refuse)
    return model


def checkpoint_bytes(location: str) -> int:
    """Bytes of the target's weights as stored in its safetensors files (headers excluded)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(weights_folder(location).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                piece = handle.get_slice(name)
                count = 1
                for size in piece.get_shape():
                    count *= size
                total += count * _DTYPE_BYTES.get(piece.get_dtype(), 4)
    return total


_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1}
