"""The machine a figure was measured on, recorded beside it.

Speculative decoding's speedup is a ratio of two costs that different hardware moves apart: on
a CPU whose bfloat16 products run on AMX tiles a verify pass of 5-17 tokens costs about one
target step, while with AVX512-BF16 alone its cost grows with the rows, so trees and long
chains pay on the first and not on the second (docs/guides/benchmarks-and-results.md). A
figure without its machine cannot be compared, so every benchmark, evaluation and main-job
report carries ``machine_record``: the processor, its cores and the threads torch used, the
matrix kernels torch detects, the torch build, and the accelerator when one ran the
measurement. Importing this module imports nothing heavy (``describe_machine`` serves the
report tool); the functions that ask torch import it.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CPUINFO = Path("/proc/cpuinfo")


def machine_record(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What ``describe_machine`` prints, as JSON-ready fields."""
    import torch

    device = torch.device(device)
    record: dict[str, Any] = {
        "cpu": cpu_model_name(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_kernels": cpu_kernels(),
        "torch": torch.__version__,
    }
    if device.type == "cuda" and torch.cuda.is_available():
        record["accelerator"] = torch.cuda.get_device_name(device)
    return record


def describe_machine(record: dict[str, Any]) -> str:
    """One line, e.g. ``Intel(R) Xeon(R) Processor, 2 logical CPUs, 2 torch threads, CPU
    kernels AVX512 + AVX512-BF16 (no AMX), torch 2.13.0+cpu``."""
    kernels = record.get("cpu_kernels") or []
    amx = " (no AMX)" if "AVX512-BF16" in kernels and "AMX" not in kernels else ""
    parts = [
        record.get("cpu") or "unknown CPU",
        f"{record.get('logical_cpus')} logical CPUs",
        f"{record.get('torch_threads')} torch threads",
        f"CPU kernels {' + '.join(kernels) or 'none detected'}{amx}",
        f"torch {record.get('torch')}",
    ]
    if record.get("accelerator"):
        parts.insert(0, str(record["accelerator"]))
    return ", ".join(parts)


def cpu_model_name(cpuinfo: Path = CPUINFO) -> str:
    """The processor's marketing name (``model name`` of /proc/cpuinfo on Linux), else what
    ``platform`` knows."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_kernels() -> list[str]:
    """The instruction sets torch dispatches to on this CPU: its ATen vector capability
    (``AVX512``, ``AVX2``; nothing for the generic build) and ``bfloat16_matrix_kernels``."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    vector = [capability] if capability and capability not in ("DEFAULT", "NO AVX") else []
    return vector + bfloat16_matrix_kernels()


def bfloat16_matrix_kernels() -> list[str]:
    """The bfloat16 matrix instructions oneDNN can use here: ``AVX512-BF16`` (dot products in
    vector registers) and ``AMX`` (tile products, whose cost is flat in the row count)."""
    return [
        name
        for name, probe in (
            ("AVX512-BF16", "_is_avx512_bf16_supported"),
            ("AMX", "_is_amx_tile_supported"),
        )
        if _cpu_has(probe)
    ]


def _cpu_has(probe: str) -> bool:
    import torch

    check = getattr(torch.cpu, probe, None)
    return bool(check()) if check is not None else False
