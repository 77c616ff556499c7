"""The one decision of the dtype models compute in: ``auto`` is bfloat16 where the hardware
has bfloat16 matrix kernels, float32 elsewhere.

Why it matters for speculative decoding (docs/theory.md §1, §7): drafting pays when a verify
pass over N + 1 tokens costs about one target step. In bfloat16, oneDNN's AVX512-BF16 and AMX
kernels cost nearly the same for 1 to 17 rows, as a GPU does, while float32 products on the
same CPU (MKL) cost 2-3x more for 5 rows than for one. So a CPU with bfloat16 kernels should
decode (and train, under autocast) in bfloat16; a CPU without them would run bfloat16 through
a slow emulation, so ``auto`` gives it float32 and says so.

Training asks ``choose_training_dtype``, which measures before it trusts the flags. A CPU
can report AVX512-BF16 and still multiply training-sized matrices faster in float32: on an
Intel Xeon whose hypervisor hides its AMX units (flags ``avx512_bf16 avx512_vnni``, no
``amx_*``; 2 threads), a [2048, 512] x [512, 1408] product forward and backward ran at 195
GFLOP/s in float32 (MKL) against 132 under bfloat16 autocast (oneDNN), and a training step of
the 8 x 512 demo target took 3.2 s against 4.2. On an AMD EPYC with AVX512-BF16 autocast was
about 2x faster per step, and AMX CPUs are faster still, so ``auto`` times one such product
in both dtypes (about a tenth of a second, once per process) and trains in bfloat16 unless it
is clearly the slower (``BFLOAT16_TRAINING_SLOWDOWN``). Decoding keeps ``choose_dtype``'s
answer: its products have a few rows, where the kernels rank differently (draftsmith.decode.forward.projection).

Every command that loads a model takes ``--dtype auto|float32|bfloat16|float16`` through
``add_dtype_argument`` and asks ``choose_dtype`` (or ``choose_training_dtype``); what was
chosen and why is printed once (``announce``) and recorded in every report
(``DtypeChoice.record``).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass
from typing import TextIO

import torch
from draftsmith.decode.measure.machine import bfloat16_matrix_kernels

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
"""The ``--dtype`` values every command accepts."""

# ``auto`` trains in bfloat16 unless its probe product is this many times slower than float32's.
# A margin, not 1.0: where the two are close, a choice that flipped between processes would
# key the demo target and regenerated data to another dtype and rebuild them.
BFLOAT16_TRAINING_SLOWDOWN = 1.25
# The probe: rows x width times width x out, forward and backward (a Llama MLP's product at
# the demo's width), each dtype timed PROBE_REPEATS times interleaved, the fastest kept.
PROBE_SHAPE = (512, 512, 1408)
PROBE_REPEATS = 3

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
    features = bfloat16_matrix_kernels()[::-1]  # AMX first where present
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


def choose_training_dtype(
    requested: str = "auto", device: torch.device | str = "cpu"
) -> DtypeChoice:
    """The dtype to train in: ``choose_dtype``'s, except that ``auto`` on a CPU with bfloat16
    kernels keeps float32 when a training-sized product runs clearly faster in it
    (``training_product_ms``; see the module docstring)."""
    choice = choose_dtype(requested, device)
    if requested != "auto" or choice.name != "bfloat16" or torch.device(device).type != "cpu":
        return choice
    bfloat16_ms, float32_ms = training_product_ms()
    timing = (
        f"a training product (forward and backward) took {bfloat16_ms:.1f} ms under bfloat16 "
        f"autocast against {float32_ms:.1f} ms in float32"
    )
    if bfloat16_ms > BFLOAT16_TRAINING_SLOWDOWN * float32_ms:
        return DtypeChoice("float32", "auto", f"{choice.reason}, but {timing}")
    return DtypeChoice("bfloat16", "auto", f"{choice.reason}; {timing}")


@functools.cache
def training_product_ms() -> tuple[float, float]:
    """Milliseconds of one ``PROBE_SHAPE`` product forward and backward on the CPU, under
    bfloat16 autocast and in float32 (the fastest of ``PROBE_REPEATS``, interleaved), with the
    threads the process uses. Measured once per process."""
    rows, width, out = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=generator, requires_grad=True)  # [R, in]
    weight = torch.randn(out, width, generator=generator, requires_grad=True)  # [out, in]

    def step(autocast: bool) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = x @ weight.T  # [R, out]
        y.float().sum().backward()
        return 1e3 * (time.perf_counter() - start)

    step(True), step(False)  # first calls build oneDNN's and MKL's kernels
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(PROBE_REPEATS):
        for autocast in (True, False):
            times[autocast].append(step(autocast))
    return min(times[True]), min(times[False])


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
