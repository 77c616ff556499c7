"""The one decision of the dtype models compute in: ``auto`` is bfloat16 where the hardware
has bfloat16 matrix kernels, float32 elsewhere.

Why it matters for speculative decoding (docs/theory.md §1, §7): drafting pays when a verify
pass over N + 1 tokens costs about one target step. In bfloat16, oneDNN's AVX512-BF16 and AMX
kernels cost nearly the same for 1 to 17 rows, as a GPU does, while float32 products on the
same CPU (MKL) cost 2-3x more for 5 rows than for one. So a CPU with bfloat16 kernels should
decode (and train, under autocast) in bfloat16; a CPU without them would run bfloat16 through
a slow emulation, so ``auto`` gives it float32 and says so.

Every command that loads a model takes ``--dtype auto|float32|bfloat16|float16`` through
``add_dtype_argument`` and asks ``choose_dtype``; what was chosen and why is printed once
(``announce``) and recorded in every report (``DtypeChoice.record``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TextIO

import torch

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
"""The ``--dtype`` values every command accepts."""

_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,  # tests and exactness checks only; no command line offers it
}

# Accelerate's name for training under autocast in each dtype ("no": plain float32).
_MIXED_PRECISION = {"float32": "no", "bfloat16": "bf16", "float16": "fp16", "float64": "no"}


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype chosen for a run, what was asked for and why."""

    name: str  # "float32" | "bfloat16" | "float16" (or "float64" in tests)
    requested: str  # one of DTYPE_NAMES
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.name]

    @property
    def mixed_precision(self) -> str:
        """Accelerate's ``mixed_precision`` for training in this dtype (``no`` for float32)."""
        return _MIXED_PRECISION[self.name]

    def record(self) -> dict[str, str]:
        """The fields every report, summary and model card carries."""
        return {"dtype": self.name, "dtype_requested": self.requested, "dtype_reason": self.reason}

    def describe(self) -> str:
        return f"dtype {self.name} ({self.requested}: {self.reason})"


def bfloat16_kernels(device: torch.device | str = "cpu") -> tuple[bool, str]:
    """Whether ``device`` multiplies bfloat16 matrices natively, and the evidence."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return True, f"GPU {torch.cuda.get_device_name(device)} supports bfloat16"
        return False, "this GPU does not support bfloat16"
    if device.type != "cpu":
        return False, f"no bfloat16 kernel check for device type {device.type!r}"
    features = [
        name
        for name, present in (
            ("AMX", _cpu_has("_is_amx_tile_supported")),
            ("AVX512-BF16", _cpu_has("_is_avx512_bf16_supported")),
        )
        if present
    ]
    if features and torch.backends.mkldnn.is_available():
        return True, f"this CPU has {' and '.join(features)} matrix kernels (oneDNN)"
    if features:
        return False, "this torch build has no oneDNN, so bfloat16 products would be emulated"
    return False, (
        "this CPU has neither AVX512-BF16 nor AMX, so bfloat16 products would be emulated "
        "(several times slower than float32)"
    )


def choose_dtype(requested: str = "auto", device: torch.device | str = "cpu") -> DtypeChoice:
    """The dtype for ``requested`` on ``device``; ``ValueError`` naming the choices otherwise.

    ``auto``: bfloat16 where ``bfloat16_kernels`` holds, float32 elsewhere. An explicit name is
    kept as asked, with the reason saying when it will be slow here.
    """
    if requested != "auto" and requested not in _TORCH_DTYPES:
        raise ValueError(
            f"--dtype {requested!r} is not valid; choose one of {', '.join(DTYPE_NAMES)}"
        )
    native, evidence = bfloat16_kernels(device)
    if requested == "auto":
        return DtypeChoice("bfloat16" if native else "float32", "auto", evidence)
    if requested == "bfloat16" and not native:
        return DtypeChoice(requested, requested, f"asked for, though {evidence}")
    if requested == "float16" and torch.device(device).type == "cpu":
        return DtypeChoice(requested, requested, "asked for (CPU float16 products are slow)")
    return DtypeChoice(requested, requested, "asked for")


def add_dtype_argument(
    parser: argparse.ArgumentParser, *aliases: str, subject: str = "the models"
) -> None:
    """The one ``--dtype`` option of every command that loads a model (``args.dtype``)."""
    parser.add_argument(
        "--dtype",
        *aliases,
        dest="dtype",
        default="auto",
        choices=DTYPE_NAMES,
        help=f"dtype {subject} compute in; auto (default): bfloat16 where the CPU has "
        "AVX512-BF16/AMX kernels or the GPU supports it, float32 elsewhere",
    )


_announced: set[DtypeChoice] = set()


def announce(choice: DtypeChoice, stream: TextIO | None = None) -> None:
    """Print the choice once per process (a second call with the same choice prints nothing)."""
    if choice in _announced:
        return
    _announced.add(choice)
    print(choice.describe(), file=stream or sys.stderr)


def _cpu_has(probe: str) -> bool:
    check = getattr(torch.cpu, probe, None)
    return bool(check()) if check is not None else False
