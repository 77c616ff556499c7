"""Every command's ending on a user's mistake: one line on stderr, exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from draftsmith.decode.command_line import run_command


class _UploadFailed(RuntimeError):
    pass


def _raises(error: BaseException):
    def main() -> int:
        raise error

    return main


@pytest.mark.parametrize(
    "error",
    [
        ValueError("--num-prompts must be >= 1, got 0"),
        FileNotFoundError("prompt file x.txt does not exist; pass a file or 'demo'"),
        FileExistsError("out/ exists: pass --force"),
    ],
)
def test_a_user_error_is_one_line_and_status_2(error, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_command(_raises(error))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: {error}\n"


def test_a_command_s_own_errors_count_as_user_errors(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_command(_raises(_UploadFailed("the Hub refused the upload")), (_UploadFailed,))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: the Hub refused the upload\n"


def test_a_bug_keeps_its_traceback_and_a_result_passes_through() -> None:
    with pytest.raises(KeyError):
        run_command(_raises(KeyError("a bug")))
    assert run_command(lambda: {"failed": 0}) == {"failed": 0}


def test_output_paths_are_checked_before_any_work(tmp_path) -> None:
    """A folder where a file goes, a file where a folder goes, a parent that is a file."""
    from draftsmith.decode.command_line import check_output_file, check_output_folder

    afile = tmp_path / "a.txt"
    afile.write_text("x")
    assert check_output_file(tmp_path / "new" / "r.json", "--json") == tmp_path / "new" / "r.json"
    with pytest.raises(ValueError, match=r"--json .* is a folder; pass a file path"):
        check_output_file(tmp_path, "--json")
    with pytest.raises(ValueError, match=r"a\.txt is a file, not a folder"):
        check_output_file(afile / "sub" / "r.json", "--json")
    with pytest.raises(ValueError, match=r"--plots .*a\.txt is a file; pass a folder"):
        check_output_folder(afile, "--plots")
    with pytest.raises(ValueError, match=r"a\.txt is a file, not a folder"):
        check_output_folder(afile / "plots", "--plots")


def test_an_output_folder_the_user_cannot_write_is_named(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A permission error at the end of a long run is a traceback after the work: refused up
    front (``os.access`` is patched: root may write anywhere, so no real folder denies it)."""
    import os

    from draftsmith.decode.command_line import check_output_file, check_output_folder

    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked)
    for check, path in (
        (check_output_file, locked / "r.json"),
        (check_output_folder, locked / "p"),
    ):
        with pytest.raises(ValueError, match=r"may not write into .*locked; pass a path"):
            check(path, "--out")
    assert check_output_file(tmp_path / "r.json", "--out") == tmp_path / "r.json"
