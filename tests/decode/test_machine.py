"""The machine record every benchmark, evaluation and main-job report carries."""

from __future__ import annotations

import pytest
import torch
from draftsmith.decode.measure.machine import (
    bfloat16_matrix_kernels,
    cpu_kernels,
    cpu_model_name,
    describe_machine,
    machine_record,
)
from draftsmith.decode.precision import bfloat16_kernels


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "expected"),
    [
        (True, True, ["AVX512-BF16", "AMX"]),
        (True, False, ["AVX512-BF16"]),
        (False, False, []),
    ],
)
def test_bfloat16_matrix_kernels_follow_torchs_probes(monkeypatch, avx512_bf16, amx, expected):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert bfloat16_matrix_kernels() == expected
    kernels = cpu_kernels()  # the vector capability, then the matrix kernels
    assert kernels[len(kernels) - len(expected) :] == expected
    # The dtype choice reads the same detection (one place for it).
    native, reason = bfloat16_kernels("cpu")
    assert native == (bool(expected) and torch.backends.mkldnn.is_available())
    if amx:
        assert "AMX and AVX512-BF16" in reason


def test_a_torch_without_the_probes_reports_no_bfloat16_kernels(monkeypatch) -> None:
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert bfloat16_matrix_kernels() == []


def test_cpu_model_name_reads_cpuinfo(tmp_path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Gold 6430\n"
    )
    assert cpu_model_name(cpuinfo) == "Intel(R) Xeon(R) Gold 6430"


@pytest.mark.parametrize("content", [None, "processor\t: 0\nmodel name\t:\n", "\x00\xff garbage"])
def test_cpu_model_name_falls_back_without_a_usable_cpuinfo(tmp_path, content) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    if content is not None:
        cpuinfo.write_text(content)
    name = cpu_model_name(cpuinfo)
    assert isinstance(name, str) and name  # platform's answer, never an empty field


def test_the_record_is_json_ready_and_describes_this_process() -> None:
    import json

    record = machine_record("cpu")
    assert json.loads(json.dumps(record)) == record
    assert record["torch_threads"] == torch.get_num_threads()
    assert record["torch"] == torch.__version__
    assert record["cpu_kernels"] == cpu_kernels()
    assert "accelerator" not in record  # CPU measurements name no accelerator


def test_description_says_when_amx_is_missing() -> None:
    base = {"cpu": "Xeon", "logical_cpus": 2, "torch_threads": 2, "torch": "2.13.0"}
    without = describe_machine(base | {"cpu_kernels": ["AVX512", "AVX512-BF16"]})
    assert without == (
        "Xeon, 2 logical CPUs, 2 torch threads, CPU kernels AVX512 + AVX512-BF16 (no AMX), "
        "torch 2.13.0"
    )
    with_amx = describe_machine(base | {"cpu_kernels": ["AVX512", "AVX512-BF16", "AMX"]})
    assert "(no AMX)" not in with_amx and "AVX512-BF16 + AMX" in with_amx
    plain = describe_machine(base | {"cpu_kernels": ["AVX2"]})
    assert "AVX2" in plain and "AMX" not in plain  # no bfloat16 kernels: nothing to miss
    gpu = describe_machine(base | {"cpu_kernels": [], "accelerator": "NVIDIA H200"})
    assert gpu.startswith("NVIDIA H200, Xeon") and "none detected" in gpu
    assert describe_machine({}).startswith("unknown CPU")  # an old report without the fields
