"""scripts/compare_policies.py: its refusals, the ratios it reports, and one short run of the
three policies on a tiny target end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from draftsmith.scripts import compare_policies


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "the policies differ only with a drafter"),
        (["--drafter-kind", "none"], "the policies differ only with a drafter"),
        (["--drafter-kind", "ngram", "--policies", "greedy"], "--policies greedy: unknown"),
        (["--drafter-kind", "ngram", "--window", "0"], "--window must be a finite number"),
        (["--drafter-kind", "ngram", "--window", "nan"], "--window must be a finite number"),
        (["--drafter-kind", "ngram", "--temperatures", "-1"], "--temperatures must be finite"),
        (["--drafter-kind", "ngram", "--temperatures", "inf"], "--temperatures must be finite"),
    ],
)
def test_bad_flags_are_refused_by_name(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        compare_policies.parse_args(["--target", "t", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


class _CountingWorker:
    """A stand-in worker whose every window runs at a given series of rates."""

    def __init__(self, rates: list[float]) -> None:
        self.rates = iter(rates)


def test_load_aware_is_compared_with_the_better_other_within_each_repeat(monkeypatch) -> None:
    """Ratios are taken per repeat (neighbouring windows), not between medians; the first
    window of every worker is untimed."""
    workers = {
        "load-aware": _CountingWorker([1.0, 90.0, 120.0]),
        "fixed": _CountingWorker([1.0, 100.0, 80.0]),
        "plain": _CountingWorker([1.0, 60.0, 150.0]),
    }
    monkeypatch.setattr(
        compare_policies, "closed_loop_window", lambda worker, *rest: next(worker.rates)
    )
    point = compare_policies.compare(workers, [[1]], 4, 0.0, 8, 1.0, repeats=2)
    assert point["tokens_per_s"] == {
        "load-aware": [90.0, 120.0], "fixed": [100.0, 80.0], "plain": [60.0, 150.0]
    }  # fmt: skip
    assert point["load_aware_over_better"] == pytest.approx([0.9, 0.8])
    assert point["median_tokens_per_s"]["plain"] == pytest.approx(105.0)
    printed = compare_policies.describe(point)
    assert "load-aware / the better other, per repeat: 0.90 0.80 (median 0.85)" in printed


def test_windows_alternate_their_order_so_a_drifting_machine_favours_no_policy(
    monkeypatch,
) -> None:
    """Two equally fast policies on a machine that speeds up by 5% per window: run in the
    same order every repeat, the later one would win both repeats (ratios 0.96 and 0.96);
    reversed every other repeat, load-aware's mean ratio is within 1% of 1."""
    calls: list[str] = []

    def window(worker: str, *rest: object) -> float:
        calls.append(worker)
        return 100.0 * (1 + 0.05 * len(calls))

    workers = {"load-aware": "load-aware", "plain": "plain"}
    monkeypatch.setattr(compare_policies, "closed_loop_window", window)
    point = compare_policies.compare(workers, [[1]], 4, 0.0, 8, 1.0, repeats=2)
    assert calls[2:] == ["load-aware", "plain", "plain", "load-aware"]
    ratios = point["load_aware_over_better"]
    assert ratios[0] < 0.97 and ratios[1] > 1.03
    assert sum(ratios) / 2 == pytest.approx(1.0, abs=0.01)


def test_a_short_run_compares_the_three_policies(target: Path, tmp_path: Path) -> None:
    """Prompt lookup as the drafter (no folder): every policy decodes in every window, and
    the record names the machine and each repeat's ratio."""
    out = tmp_path / "policies.json"
    done = subprocess.run(
        [sys.executable, "-m", "draftsmith.scripts.compare_policies", "--target", str(target),
         "--drafter-kind", "ngram", "--clients", "2", "--temperatures", "0", "1",
         "--max-tokens", "8", "--window", "0.4", "--repeats", "2", "--dtype", "float32",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["machine"]["logical_cpus"] >= 1
    assert [(p["temperature"], p["clients"]) for p in record["points"]] == [(0.0, 2), (1.0, 2)]
    for point in record["points"]:
        assert set(point["tokens_per_s"]) == {"load-aware", "fixed", "plain"}
        assert all(len(rates) == 2 and min(rates) > 0 for rates in point["tokens_per_s"].values())
        rates = point["tokens_per_s"]
        expected = [
            rates["load-aware"][i] / max(rates["fixed"][i], rates["plain"][i]) for i in range(2)
        ]
        assert point["load_aware_over_better"] == pytest.approx(expected)
    assert "load-aware / the better other, per repeat" in done.stdout


def test_the_table_gives_each_policys_median_the_ratios_and_the_machine() -> None:
    record = {
        "machine": {"cpu": "Some CPU", "logical_cpus": 2, "torch_threads": 2,
                    "cpu_kernels": ["AVX2"], "torch": "2.13.0+cpu"},
        "settings": {"num_draft_tokens": 4, "max_tokens": 128, "max_batch_size": 16,
                     "window": 8.0, "repeats": 2},
        "points": [
            {"clients": 16, "temperature": 1.0,
             "tokens_per_s": {"load-aware": [90.0, 120.0], "fixed": [100.0, 80.0],
                              "plain": [60.0, 150.0]},
             "median_tokens_per_s": {"load-aware": 105.0, "fixed": 90.0, "plain": 105.0},
             "load_aware_over_better": [0.9, 0.8]},
        ],
    }  # fmt: skip
    table = compare_policies.policy_windows_table(record)
    assert "| T | clients | load-aware tokens/s | fixed tokens/s | plain tokens/s |" in table
    assert "| 1 | 16 | 105.0 | 90.0 | 105.0 | 0.90 0.80 | 0.85 |" in table
    assert "2 windows of 8 s" in table and "Some CPU" in table and "AVX2" in table
    assert "the same order every repeat" in table  # a record from before balanced_order
    record["settings"]["order"] = "alternating"
    assert "the order reversed at every repeat" in compare_policies.policy_windows_table(record)
