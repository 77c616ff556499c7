"""The front door's figures and records: every figure in README.md and docs/ comes from a record
through ``draftsmith-report``, every record names its machine and is cited, every guide is
short enough to read. The checks themselves are ``draftsmith-report --check``'s
(scripts/report.py); these tests run them on the repository and on made-up documents."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from script_helpers import load_script

report = load_script("report", "draftsmith_report")
ROOT = Path(__file__).resolve().parents[1]
GUIDE_LINES, README_LINES = 300, 250


def test_every_document_of_docs_is_checked() -> None:
    checked = {path.relative_to(ROOT).as_posix() for path in report.documents()}
    wanted = {"README.md", *(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/**/*.md"))}
    wanted -= {p for p in wanted if p.startswith("docs/results/")}  # the tools' own output
    assert checked == wanted


def test_no_figure_is_typed_outside_a_generated_section() -> None:
    problems = [
        f"{path.relative_to(ROOT)}: {line}"
        for path in report.documents()
        for line in report.unmarked_figures(path.read_text())
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "line",
    [
        "the chain paid 1.54x / 1.30x there",
        "it runs 3x faster",
        "P-EAGLE loses 16% when sampling",
        "a round drafts in 7.85 ms",
        "one-row products cost 70-170 microseconds",
        "greedy tau 3.35 against 2.98",
        "3.88 tau per round",
        "plain decoding reaches 141.6 tokens/s",
        "| 8 x 512 (the demo's shape) | 14.3 | 0.20 |",
    ],
)
def test_a_hand_typed_figure_is_caught(line: str) -> None:
    assert report.unmarked_figures(f"intro\n{line}\n") == [line]


@pytest.mark.parametrize(
    "line",
    ["an 8 x 512 target", "N = 4 draft tokens", "the top 256 log-probabilities", "§7"],
)
def test_a_setting_is_no_figure(line: str) -> None:
    assert report.unmarked_figures(line) == []


def test_an_arithmetic_example_on_the_allow_list_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    text = "a worked example: 1.65 / 1.2 = 1.4x the chain, and a real 2.3x\n"
    monkeypatch.setattr(report, "ARITHMETIC", ("1.65 / 1.2 = 1.4x",))
    assert len(report.unmarked_figures(text)) == 1  # the other figure on the line still counts
    assert report.unmarked_figures("a worked example: 1.65 / 1.2 = 1.4x the chain\n") == []


def test_a_stale_allow_list_entry_is_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report, "ARITHMETIC", ("no document says 9.9x",))
    assert any("9.9x" in problem for problem in report.check([]))


def test_every_record_names_its_machine_and_is_cited() -> None:
    texts = [path.read_text() for path in report.documents()]
    problems = report.record_problems(texts)
    assert not problems, "\n".join(problems)


def test_a_record_without_a_machine_or_a_citation_is_a_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = tmp_path / "docs" / "results"
    (results / "grid").mkdir(parents=True)
    (results / "grid" / "ablation.json").write_text(json.dumps({"runs": {}}))
    (results / "bench.json").write_text(json.dumps({"machine": {"cpu": "Xeon"}}))
    (results / "old.png").write_bytes(b"")
    monkeypatch.setattr(report, "REPO", tmp_path)
    monkeypatch.setattr(report, "RECORDS", ())
    problems = report.record_problems(["see `docs/results/grid/` and results/bench.json"])
    assert problems == [
        "docs/results/grid/ablation.json: names no machine; add the `machine` of the computer "
        "it was measured on (draftsmith.decode.measure.machine.machine_record), or remove the "
        "record",
        "docs/results/old.png: no document cites it; git rm it (history keeps it)",
    ]


def test_the_generated_sections_name_the_machine_of_their_record() -> None:
    """Every section that reads a record states its machine, so no figure lacks one."""
    for name in ("bench-demo", "main-job-run", "bench-no-amx", "ablation-steps-amx"):
        assert "Machine: " in report.SECTIONS[name](), name
    table = report.machines_table()
    for path in report.RECORDS:
        assert f"`{path.relative_to(report.RESULTS)}`" in table


HEADING = re.compile(r"^(#{2,4}) (.+)$", re.MULTILINE)
MACHINE_WORDS = re.compile(r"AMX|EPYC|Xeon|GPU|machines?\b", re.IGNORECASE)


def test_every_results_heading_of_the_benchmarks_guide_names_its_machine() -> None:
    text = (ROOT / "docs" / "guides" / "benchmarks-and-results.md").read_text()
    general = {"Run the benchmark", "Regenerating the tables"}
    unnamed = [
        title
        for _, title in HEADING.findall(text)
        if title not in general and not MACHINE_WORDS.search(title)
    ]
    assert not unnamed, unnamed


def test_guides_and_readme_are_short_enough_to_read() -> None:
    long = {
        path.name: n
        for path in sorted((ROOT / "docs" / "guides").glob("*.md"))
        if (n := len(path.read_text().splitlines())) > GUIDE_LINES
    }
    assert not long, f"guides over {GUIDE_LINES} lines: {long}"
    readme = len((ROOT / "README.md").read_text().splitlines())
    assert readme <= README_LINES, f"README.md has {readme} lines (at most {README_LINES})"
