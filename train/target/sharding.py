"""A frozen target split over the processes (``--target_sharding fsdp``) and what each holds.

With ``--target_sharding none`` every process holds the whole frozen target, so the target must
fit on one device: 70 B parameters in bfloat16 are 140 GB, more than an 80 GB GPU. With
``fsdp`` the target goes through PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``;
Zhao et al. 2023), the engine the drafter's own ``configs/accelerate/fsdp.yaml`` runs on: every
decoder layer is one unit, the input embedding and the output head one more (one unit, so a
tied matrix stays one parameter), the rest (final norm) the root. Each process stores dim 0 of
every parameter split ``N`` ways, ``~1/N`` of the bytes; a unit's full weights are gathered
only while it runs and freed right after (``reshard_after_forward``). No gradient ever flows
into the target (``requires_grad`` off, forwards under ``no_grad``), so FSDP keeps no gradient
or optimizer state for it.

Why FSDP2 and not tensor parallelism (transformers' ``tp_plan="auto"``), measured on a 2 x 64
Llama over 2 CPU ranks (gloo, float32): both hold half the weights per rank, but FSDP gathers
the exact weights and runs the unchanged forward, so logits and hidden states are *bitwise*
those of the unsharded target, while the tensor-parallel forward sums partial products across
ranks in another order (logits off by 1.9e-7, hidden states by 5.1e-7). The objectives are
meant to see the target's outputs exactly; FSDP also needs no divisibility of heads or vocabulary
by the world size and shards a tied embedding. Its price is an all-gather of every layer per
forward (the whole target's bytes per step over the interconnect), cheap on NVLink, and the
reason the offline cache (``draftsmith.train.target.cache``) is the path for slow links.

:func:`load_sharded_target` never holds the whole target anywhere: it builds the model on the
meta device (no memory), shards it, allocates each process's pieces on its device and reads
from the safetensors files only the rows of every tensor that process keeps (dim 0 split in
``ceil(n / N)`` rows, as ``fully_shard`` splits it). A process reads ``1/N`` of the files'
bytes and holds ``1/N`` of the weights from the start. The non-persistent buffers a model
computes at construction (rotary frequencies) come from a copy of the model with no layer.
Generation (``--train_source/--eval_source target_samples``) runs the hand-written lean
forward on whole weights, so a sharded run takes its rows from data (``draftsmith.train.config``).
"""

from __future__ import annotations

from typing import Any

import torch


def shard_target(target: torch.nn.Module, accelerator: Any) -> torch.nn.Module:
    """Shard the frozen ``target`` over the run's processes with FSDP2, in place; return it.

    Raises ``ValueError`` naming the fix for a single process or a model without a list of
    decoder layers. Outputs stay bitwise those of the unsharded model (module docstring).
    """
    world = accelerator.num_processes
    if world < 2:
        raise ValueError(
            "--target_sharding fsdp splits the target over processes, but this run has one: "
            "launch 2 or more (`accelerate launch --num_processes N train/distill.py ...`, or "
            "`torchrun --nproc_per_node N`; on CPU add ACCELERATE_USE_CPU=true --multi_gpu), or "
            "use --target_sharding none"
        )
    layers = _decoder_layers(target)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    target.eval().requires_grad_(False)
    mesh = init_device_mesh(accelerator.device.type, (world,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    ends = [target.get_input_embeddings(), target.get_output_embeddings()]
    ends = [
        module for i, module in enumerate(ends) if module is not None and module not in ends[:i]
    ]
    fully_shard(ends, mesh=mesh, reshard_after_forward=True)
    fully_shard(target, mesh=mesh, reshard_after_forward=True)
    _reshard_after_direct_calls(target, ends)
    return target


def load_sharded_target(
    location: str, dtype: str | torch.dtype, accelerator: Any, trust_remote_code: bool = False
) -> torch.nn.Module:
    """The frozen target at ``location`` sharded over the processes, each reading only its rows
    (module docstring); its outputs are bitwise those of the whole model."""
    import copy
    import math
    from pathlib import Path

    from draftsmith.decode.loading import resolve_dtype
    from draftsmith.train.target.model import weights_folder
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig, AutoModelForCausalLM

    location = str(weights_folder(location))
    config = AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code)
    torch_dtype = resolve_dtype(dtype, None)
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(
            config, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
    shard_target(target, accelerator)
    target.to_empty(device=accelerator.device)
    rank, world = accelerator.process_index, accelerator.num_processes
    parameters = dict(target.named_parameters())
    read: set[str] = set()
    files = sorted(Path(location).glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name not in parameters:
                    continue
                parameter = parameters[name]
                local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
                rows = parameter.shape[0]
                start = min(rank * math.ceil(rows / world), rows)
                piece = handle.get_slice(name)[start : start + local.shape[0]]
                with torch.no_grad():
                    local.copy_(piece.to(local.dtype))
                read.add(name)
    missing = sorted(set(parameters) - read)
    if missing:
        raise FileNotFoundError(
            f"--target {location}: its safetensors files ({len(files)}) lack {missing[:5]}; "
            "--target_sharding fsdp reads a model folder saved with save_pretrained"
        )
    hollow_config = copy.deepcopy(config)
    hollow_config.num_hidden_layers = 0
    if isinstance(getattr(hollow_config, "layer_types", None), list):
        hollow_config.layer_types = []
    hollow = AutoModelForCausalLM.from_config(
        hollow_config, dtype=torch_dtype, trust_remote_code=trust_remote_code
    )
    computed = dict(hollow.named_buffers())
    for name, buffer in target.named_buffers():
        if name not in computed:
            raise ValueError(
                f"--target_sharding fsdp cannot rebuild the buffer {name} of "
                f"{type(target).__name__} (it lives in a decoder layer); use "
                "--target_sharding none or --target_outputs cache"
            )
        with torch.no_grad():
            buffer.copy_(computed[name])
    return target.eval().requires_grad_(False)


def _decoder_layers(target: torch.nn.Module) -> torch.nn.ModuleList:
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"--target_sharding fsdp shards a causal LM by its decoder layers "
            f"(model.get_decoder().layers), which {type(target).__name__} does not have; use "
            "--target_sharding none, or --target_outputs cache to score the data once and train "
            "without the target"
        )
    return layers


def _reshard_after_direct_calls(target: torch.nn.Module, ends: list[torch.nn.Module]) -> None:
    """Free the gathered embedding after a call outside the target's forward.

    EAGLE-3 embeds the next tokens itself (``target.get_input_embeddings()(ids)``); FSDP gathers
    the unit for that call but leaves it gathered, since only the root's forward ends a unit's
    use. Inside the root's forward FSDP reshards on its own.
    """
    inside = [False]

    def enter(*_: Any) -> None:
        inside[0] = True

    def leave(*_: Any) -> None:
        inside[0] = False

    def after_direct_call(module: torch.nn.Module, *_: Any) -> None:
        if not inside[0]:
            module.reshard()  # type: ignore[operator]

    target.register_forward_pre_hook(enter)
    target.register_forward_hook(leave)
    for module in ends:
        module.register_forward_hook(after_direct_call)


def target_memory_report(
    target: torch.nn.Module, accelerator: Any, sharding: str
) -> dict[str, Any]:
    """The frozen target's bytes: one full copy, and what each process holds (a collective).

    Counts parameters (their local shard under FSDP) and buffers, each storage once (a tied
    matrix counts once). ``ratio`` is the largest process's bytes over one full copy: 1.0
    without sharding, about ``1/N`` (plus the replicated buffers) with it.
    """
    from accelerate.utils import gather_object
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    for part in target.modules():
        if isinstance(part, FSDPModule):
            part.reshard()
    full = local = 0
    seen: set[int] = set()
    for tensor in [*target.parameters(), *target.buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        held = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        full += tensor.numel() * tensor.element_size()
        local += held.numel() * held.element_size()
    world = accelerator.num_processes
    per_rank = [int(n) for n in (gather_object([local]) if world > 1 else [local])]
    return {
        "sharding": sharding,
        "full_bytes": int(full),
        "bytes_per_rank": per_rank,
        "ratio": max(per_rank) / max(full, 1),
    }


def format_target_memory(report: dict[str, Any]) -> str:
    """One line for the log: the target's full size and each process's share."""
    shares = ", ".join(
        f"rank {r} {n / 2**20:,.2f} MiB" for r, n in enumerate(report["bytes_per_rank"])
    )
    return (
        f"frozen target ({report['sharding']}): {report['full_bytes'] / 2**20:,.2f} MiB in full; "
        f"held per rank: {shares} (largest {report['ratio']:.3f} of a full copy)"
    )
