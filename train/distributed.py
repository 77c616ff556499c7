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
