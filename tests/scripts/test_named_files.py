"""Every command that reads a JSON or YAML file names the file when it cannot parse it.

Through the console entry points (``draftsmith-<command>``), as a user runs them: exit status 2,
one ``error:`` line naming the file, no traceback. The readers are one per format:
``draftsmith.decode.loading.read_json_object`` and ``draftsmith.decode.yaml_values.load_plain_yaml``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_helpers import load_script

BAD_JSON = '{"speed": '  # cut short
BAD_YAML = "recipe: [1\n"  # an open flow sequence


@pytest.fixture(scope="module")
def broken_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder whose config.json does not parse (the weights are never reached)."""
    folder = tmp_path_factory.mktemp("broken_target")
    (folder / "config.json").write_text(BAD_JSON)
    return folder


def _command(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    entry = Path(sys.executable).with_name(f"draftsmith-{name}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [str(entry), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    ("command", "named"),
    [
        ("report", "run/summary.json is not valid JSON"),
        ("ablate-merge", "bad.json is not a results file"),
        ("ablate-recipe", "bad.yaml is not a valid plain YAML file"),
        ("benchmark", "{target}/config.json' is not a valid JSON file"),
        ("evaluate", "{target}/config.json' is not a valid JSON file"),
        ("serve-config", "bad.yaml is not a valid plain YAML file"),
        ("serve-target", "{target}/config.json' is not a valid JSON file"),
    ],
)
def test_a_malformed_file_is_named_without_a_traceback(
    tmp_path: Path, broken_target: Path, command: str, named: str
) -> None:
    (tmp_path / "bad.json").write_text(BAD_JSON)
    (tmp_path / "bad.yaml").write_text(BAD_YAML)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text(BAD_JSON)
    target = str(broken_target)
    argv = {
        "report": ("report", "--main-job", "run", "--into", "main_job_amd.json"),
        "ablate-merge": ("ablate", "--merge", "bad.json", "bad.json", "--output", "merged"),
        "ablate-recipe": ("ablate", "--recipe", "draft_lm=bad.yaml", "--output", "grid"),
        "benchmark": ("benchmark", "--target", target, "--json", "b.json", "--plots", "p"),
        "evaluate": ("evaluate", "--target", target, "--drafter", target, "--json", "e.json"),
        "serve-config": ("serve", "--config", "bad.yaml"),
        "serve-target": ("serve", "--target", target, "--drafter", target),
    }[command]
    result = _command(*argv, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    error = result.stderr.strip().splitlines()[-1]  # after the commands' own notes
    assert error.startswith("error: ") and named.format(target=target) in error


def test_report_names_a_results_record_that_does_not_parse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's case: a record under docs/results/ cut short is named, not just parsed."""
    report = load_script("report", "report_named_files")
    monkeypatch.setattr(report, "REPO", tmp_path)
    record = tmp_path / report.MAIN_JOB
    record.parent.mkdir(parents=True)
    record.write_text(BAD_JSON)
    with pytest.raises(ValueError, match=rf"{record} is not valid JSON .*restore it from git"):
        report._read(report.MAIN_JOB)
