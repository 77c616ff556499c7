"""The one dtype decision: bfloat16 where the hardware multiplies it natively, else float32."""

from __future__ import annotations

import argparse
import io

import pytest
import torch
from draftsmith.decode import precision


def _force_cpu_kernels(monkeypatch: pytest.MonkeyPatch, amx: bool, avx512_bf16: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "named"),
    [(True, True, "AMX and AVX512-BF16"), (False, True, "AVX512-BF16"), (True, False, "AMX")],
)
def test_auto_is_bfloat16_where_the_cpu_has_bfloat16_kernels(
    monkeypatch: pytest.MonkeyPatch, amx: bool, avx512_bf16: bool, named: str
) -> None:
    _force_cpu_kernels(monkeypatch, amx, avx512_bf16)
    choice = precision.choose_dtype("auto", "cpu")
    assert choice.dtype is torch.bfloat16
    assert choice.mixed_precision == "bf16"
    assert named in choice.reason
    assert choice.record() == {
        "dtype": "bfloat16",
        "dtype_requested": "auto",
        "dtype_reason": choice.reason,
    }


def test_auto_falls_back_to_float32_without_bfloat16_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _force_cpu_kernels(monkeypatch, amx=False, avx512_bf16=False)
    choice = precision.choose_dtype("auto", "cpu")
    assert choice.dtype is torch.float32
    assert choice.mixed_precision == "no"
    assert "neither AVX512-BF16 nor AMX" in choice.reason
    assert "emulated" in choice.reason


def test_an_explicit_dtype_is_kept_and_a_slow_one_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _force_cpu_kernels(monkeypatch, amx=False, avx512_bf16=False)
    forced = precision.choose_dtype("bfloat16", "cpu")
    assert forced.dtype is torch.bfloat16
    assert "emulated" in forced.reason
    assert precision.choose_dtype("float32", "cpu").reason == "asked for"
    assert "slow" in precision.choose_dtype("float16", "cpu").reason


def test_a_bad_dtype_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"--dtype 'bf16' is not valid; choose one of auto, "):
        precision.choose_dtype("bf16")


def test_every_command_gets_the_same_option_and_auto_by_default() -> None:
    parser = argparse.ArgumentParser()
    precision.add_dtype_argument(parser)
    assert parser.parse_args([]).dtype == "auto"
    assert parser.parse_args(["--dtype", "float32"]).dtype == "float32"
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int8"])


def test_the_choice_is_announced_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "_announced", set())
    stream = io.StringIO()
    choice = precision.choose_dtype("float32")
    precision.announce(choice, stream)
    precision.announce(choice, stream)
    assert stream.getvalue() == "dtype float32 (float32: asked for)\n"


def _probe_says(monkeypatch: pytest.MonkeyPatch, bfloat16_ms: float, float32_ms: float) -> None:
    monkeypatch.setattr(precision, "training_product_ms", lambda: (bfloat16_ms, float32_ms))


@pytest.mark.parametrize(
    ("bfloat16_ms", "trains_in"), [(5.0, "bfloat16"), (12.0, "bfloat16"), (18.0, "float32")]
)
def test_auto_trains_in_bfloat16_unless_it_is_clearly_slower_here(
    monkeypatch: pytest.MonkeyPatch, bfloat16_ms: float, trains_in: str
) -> None:
    _force_cpu_kernels(monkeypatch, amx=False, avx512_bf16=True)
    _probe_says(monkeypatch, bfloat16_ms, 10.0)
    choice = precision.choose_training_dtype("auto", "cpu")
    assert choice.name == trains_in
    assert choice.mixed_precision == ("bf16" if trains_in == "bfloat16" else "no")
    assert "AVX512-BF16" in choice.reason
    assert (
        f"{bfloat16_ms:.1f} ms under bfloat16 autocast against 10.0 ms in float32" in choice.reason
    )
    assert precision.choose_dtype("auto", "cpu").name == "bfloat16"  # decoding keeps the kernels


def test_an_explicit_or_kernel_less_training_dtype_is_not_probed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def probe() -> tuple[float, float]:
        raise AssertionError("probed")

    monkeypatch.setattr(precision, "training_product_ms", probe)
    _force_cpu_kernels(monkeypatch, amx=True, avx512_bf16=True)
    assert precision.choose_training_dtype("bfloat16").reason == "asked for"
    assert precision.choose_training_dtype("float32").name == "float32"
    _force_cpu_kernels(monkeypatch, amx=False, avx512_bf16=False)
    assert precision.choose_training_dtype("auto").name == "float32"


def test_the_training_probe_times_both_dtypes_once() -> None:
    precision.training_product_ms.cache_clear()
    bfloat16_ms, float32_ms = precision.training_product_ms()
    assert bfloat16_ms > 0 and float32_ms > 0
    assert precision.training_product_ms() == (bfloat16_ms, float32_ms)  # measured once
