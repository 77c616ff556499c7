"""How a run is distributed: FSDP on CPU ranks, what each rank holds, and a report of both.

accelerate 1.15 decides the distributed type from the device: a CPU launch (``use_cpu: true``
or ``ACCELERATE_USE_CPU=true``) always becomes ``MULTI_CPU`` (DDP over gloo), and the FSDP
plugin that ``--config_file configs/accelerate/fsdp.yaml`` sets up is dropped without a word
(``AcceleratorState`` turns on FSDP only for GPU-like device types). PyTorch's FSDP2
(``torch.distributed.fsdp.fully_shard``, per-parameter sharding with DTensor; Zhao et al.
2023) itself runs on CPU tensors over gloo. ``enable_cpu_fsdp`` therefore gives an
FSDP-configured CPU launch what it asked for: it sets the shared accelerator state to FSDP with
the launch's plugin, so that ``Accelerator.prepare`` takes accelerate's own FSDP2 path
(``fully_shard`` per decoder layer and on the root), the same code GPU runs take. FSDP
version 1 on CPU is refused with a message (its flat parameters need a device id).

``parallel_report`` says what actually happened: the distributed type, the world size, and
how many elements of the trainable parameters each rank stores. Under DDP every rank stores
all of them; under FSDP each stores about ``1 / world_size`` (``fully_shard`` splits dim 0 of
every parameter, padding the last rank's piece).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, gather_object


def fsdp_requested() -> bool:
    """Whether the launch asked for FSDP (``accelerate launch`` with an FSDP config)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true", "yes")


def enable_cpu_fsdp(accelerator: Accelerator) -> bool:
    """Turn a CPU launch that asked for FSDP from DDP into FSDP2; True if it did.

    Must run before ``accelerator.prepare``. Does nothing on GPUs (accelerate honours FSDP
    there) or when FSDP was not requested.
    """
    state = accelerator.state
    if not fsdp_requested() or state.distributed_type != DistributedType.MULTI_CPU:
        return False
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # reads the launch's FSDP_* settings
    if plugin.fsdp_version != 2:
        raise ValueError(
            f"FSDP version {plugin.fsdp_version} was requested on CPU ranks; only FSDP2 "
            "(fully_shard) runs on CPU: set fsdp_version: 2 in the accelerate config "
            "(configs/accelerate/fsdp.yaml does)"
        )
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    # Every later AcceleratorState() copies PartialState's type over its own: set both.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True


def parallel_report(module: torch.nn.Module, accelerator: Accelerator) -> dict[str, Any]:
    """Distributed type, world size and the trainable elements each rank stores (a collective).

    ``trainable_elements`` counts the full parameters; ``local_elements[r]`` what rank ``r``
    holds of them (its local shard under FSDP, everything under DDP); ``sharded`` is True when
    the ranks together store each element about once rather than once per rank.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    for part in module.modules():  # the root keeps its parameters gathered after a forward
        if isinstance(part, FSDPModule):
            part.reshard()
    full = local = 0
    for parameter in module.parameters():
        if not parameter.requires_grad:
            continue
        full += parameter.numel()
        held = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        local += held.numel()
    world = accelerator.num_processes
    per_rank = gather_object([local]) if world > 1 else [local]
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    plugin = accelerator.state.fsdp_plugin if fsdp else None
    return {
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "world_size": world,
        "fsdp_version": getattr(plugin, "fsdp_version", None),
        "trainable_elements": full,
        "local_elements": [int(n) for n in per_rank],
        "sharded": world > 1 and max(per_rank) < full,
    }


def format_report(report: dict[str, Any]) -> str:
    """One line for the log: type, world size and each rank's share of the parameters."""
    full = report["trainable_elements"]
    shares = ", ".join(
        f"rank {r} {n:,} ({n / max(full, 1):.1%})" for r, n in enumerate(report["local_elements"])
    )
    kind = report["distributed_type"]
    if report["fsdp_version"]:
        kind += f"{report['fsdp_version']}" if kind == "FSDP" else ""
    layout = "sharded" if report["sharded"] else "replicated"
    return (
        f"{kind} over {report['world_size']} process(es): {full:,} trainable parameters, "
        f"{layout}; stored per rank: {shares}"
    )


def whole_peft_copy(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """An unsharded copy of a peft ``model`` holding ``state_dict`` (the gathered weights).

    Under FSDP the local model holds shards (``fully_shard`` changes it in place), so it cannot
    be copied and merged; this rebuilds the same base architecture and adapter from their
    configs and loads the full state, so ``merge_and_unload`` runs the very arithmetic a single
    process runs (``W + (B @ A) * scaling``).
    """
    import copy

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base_config = model.get_base_model().config
    dtype = next(iter(state_dict.values())).dtype
    base = AutoModelForCausalLM.from_config(base_config, dtype=dtype)
    adapter = copy.deepcopy(model.peft_config[model.active_adapter])
    whole = get_peft_model(base, adapter)
    whole.load_state_dict(state_dict, strict=True)
    return whole


# Variables through which a launcher tells a process it is one rank of many; a build started
# from a rank must not see them, or its own Accelerator would join (and hang) the run's group.
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
    ref: Any, accelerator: Accelerator, wait_minutes: float = 120.0, poll_s: float = 1.0
) -> tuple[str, str]:
    """``target_location(ref)`` for every rank; a missing demo target is built by the main one.

    The main process builds it in a child process with the launch's variables removed (the
    build trains through its own Accelerator, which must not join this run's process group);
    the others wait for the finished folder (its marker file), polling rather than sitting in
    a collective, whose timeout (10 minutes for NCCL) is shorter than a demo build may take.
    Processes on another machine need the same folder: ``XDG_CACHE_HOME`` on a shared
    filesystem, or the target built on every machine first.
    """
    from train.demo_target import default_target_path, is_complete
    from train.target_model import target_location

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
        "from train.demo_target import build_demo_target; "
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

    from train.demo_target import is_complete

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


def without_tied_copies(
    model: torch.nn.Module, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``state_dict`` less the second name of each tied parameter (``lm_head`` = embeddings).

    A gathered state (FSDP) holds a separate copy under every name, which ``save_pretrained``
    would write twice; a local state shares storage and is written once. Dropping the tied
    names makes both exports the same files.
    """
    seen: set[int] = set()
    tied: list[str] = []
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            tied.append(name)
        seen.add(id(parameter))
    return {key: value for key, value in state_dict.items() if key not in tied}
