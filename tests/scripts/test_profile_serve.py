"""scripts/profile_serve.py: the /metrics arithmetic of a round's parts, its JSON record and
table, its refusals, and one short run on a tiny target end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from draftsmith.scripts import profile_serve

METRICS_BEFORE = """# HELP draftsmith_rounds_total rounds
draftsmith_rounds_total{batch="1",drafted="4"} 10
draftsmith_round_seconds_total{batch="1",phase="draft"} 0.05
draftsmith_round_seconds_total{batch="1",phase="verify"} 0.10
"""
METRICS_AFTER = """# HELP draftsmith_rounds_total rounds
draftsmith_rounds_total{batch="1",drafted="4"} 30
draftsmith_rounds_total{batch="1",drafted="0"} 10
draftsmith_rounds_total{batch="5-8",drafted="2"} 4
draftsmith_round_seconds_total{batch="1",phase="draft"} 0.25
draftsmith_round_seconds_total{batch="1",phase="verify"} 0.50
draftsmith_round_seconds_total{batch="1",phase="commit"} 0.03
draftsmith_round_seconds_total{batch="5-8",phase="verify"} 0.08
"""


def test_round_parts_are_the_deltas_between_two_scrapes_per_round() -> None:
    """30 rounds ran at batch 1 between the scrapes (20 drafting 4, 10 drafting none): 0.2 s
    of drafting is 6.67 ms a round, 2.67 drafts per row; the bucket of 4 rounds is second."""
    breakdown = profile_serve.round_breakdown(
        profile_serve.parse_metrics(METRICS_BEFORE), profile_serve.parse_metrics(METRICS_AFTER)
    )
    parts = profile_serve.round_parts(breakdown, wall=2.0)
    assert list(parts) == ["1", "5-8"]
    one = parts["1"]
    assert one["rounds"] == 30
    assert one["drafts_per_row"] == pytest.approx(80 / 30)
    assert one["ms"]["draft"] == pytest.approx(200 / 30)
    assert one["ms"]["verify"] == pytest.approx(400 / 30)
    assert one["ms"]["commit"] == pytest.approx(30 / 30)
    assert one["ms"]["handoff"] == 0.0
    assert one["ms"]["total"] == pytest.approx(630 / 30)
    assert one["wall_share"] == pytest.approx(0.63 / 2.0)
    assert parts["5-8"]["ms"]["verify"] == pytest.approx(20.0)


def test_the_table_names_speed_against_offline_the_phases_and_the_machine() -> None:
    record = {
        "machine": {"cpu": "Some CPU", "logical_cpus": 2, "torch_threads": 2,
                    "cpu_kernels": ["AVX2"], "torch": "2.13.0+cpu"},
        "settings": {"num_draft_tokens": 4, "max_tokens": 128, "temperature": 0.0,
                     "seconds": 20.0, "dtype": "bfloat16", "drafter": True,
                     "drafter_kind": None},
        "offline_tokens_per_s": 200.0,
        "runs": [
            {"policy": "fixed", "clients": 1, "tokens_per_s": 150.0, "wall_s": 20.0,
             "batches": {
                 "1": {"rounds": 99, "drafts_per_row": 4.0, "wall_share": 0.9,
                       "ms": {"draft": 5.0, "verify": 12.0, "commit": 0.5, "handoff": 0.1,
                              "other": 0.4, "total": 18.0}},
                 "2": {"rounds": 1, "drafts_per_row": 4.0, "wall_share": 0.01,
                       "ms": {"draft": 5.0, "verify": 12.0, "commit": 0.5, "handoff": 0.1,
                              "other": 0.4, "total": 18.0}},
             }},
        ],
    }  # fmt: skip
    table = profile_serve.round_parts_table(record)
    rows = [line for line in table.splitlines() if line.startswith("| fixed")]
    assert rows == [
        "| fixed | 1 | 150.0 (0.75) | 1 | 99 | 4.00 | 5.00 | 12.00 | 0.50 | 0.10 | 0.40 | "
        "18.00 | 90% | – / – |"
    ]  # the bucket of 1 round in 100 is left out; a record without CPU times shows dashes
    assert "Some CPU, 2 logical CPUs" in table and "bfloat16" in table


def test_cpu_seconds_read_this_process_and_a_child() -> None:
    ours = profile_serve.cpu_seconds(None)
    child = subprocess.Popen([sys.executable, "-c", "sum(range(10**7)); input()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while (profile_serve.cpu_seconds(child.pid) or 0.0) < 0.05:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        child.communicate(b"\n", timeout=60)
    assert ours is not None and ours > 0
    assert profile_serve.cpu_seconds(child.pid) is None  # gone
    assert (
        profile_serve.cores_cell({"front_end_and_clients": 2.0, "decoder_process": None}, 4.0)
        == "0.50 / –"
    )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--seconds", "0"], "--seconds must be a finite number > 0"),
        (["--seconds", "nan"], "--seconds must be a finite number > 0"),
        (["--seconds", "inf"], "--seconds must be a finite number > 0"),
        (["--draft-policy", "greedy"], "--draft-policy greedy: unknown"),
        (["--decoder", "gpu"], "--decoder gpu: unknown"),
    ],
)
def test_bad_flags_are_refused_by_name(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        profile_serve.parse_args(["--target", "t", *flags])
    assert stopped.value.code == 2
    assert named in capsys.readouterr().err


def test_a_short_run_records_the_offline_and_the_served_speed(target: Path, tmp_path: Path) -> None:
    """Plain decoding of the tiny target behind the in-process server: every run is
    recorded, its rounds sum to no more than its wall time, and the table renders it."""
    out = tmp_path / "rounds.json"
    # In a process of its own: the script imports scripts/load_test.py, a name pytest's
    # assertion rewriter would claim in this process (and break running it as __main__ later).
    done = subprocess.run(
        [sys.executable, "-m", "draftsmith.scripts.profile_serve", "--target", str(target),
         "--clients", "1", "2", "--max-tokens", "8", "--seconds", "1",
         "--draft-policy", "fixed", "--decoder", "process", "thread", "--dtype", "float32",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["offline_tokens_per_s"] > 0
    assert [(run["decoder"], run["clients"]) for run in record["runs"]] == [
        ("process", 1),
        ("process", 2),
        ("thread", 1),
        ("thread", 2),
    ]
    for run in record["runs"]:
        assert run["tokens_per_s"] > 0 and run["batches"]
        assert 0 < sum(parts["wall_share"] for parts in run["batches"].values()) <= 1.0
        assert all(parts["drafts_per_row"] == 0 for parts in run["batches"].values())
        cpu = run["cpu_s"]
        assert cpu["front_end_and_clients"] > 0
        if run["decoder"] == "process":  # its own process did the decoding
            assert cpu["decoder_process"] > 0
        else:
            assert cpu["decoder_process"] is None
    table = profile_serve.round_parts_table(record, min_share=0.0)
    assert "| fixed, process | 2 |" in table and "| fixed, thread | 1 |" in table
