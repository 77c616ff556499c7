"""How every draftsmith command ends on a user's mistake: one line and exit status 2.

A bad flag, a missing or malformed file, a folder that would be overwritten: the command's
``main`` raises one of :data:`USER_ERRORS` (or a command's own errors) with a message that names
the problem and the fix. :func:`run_command` prints that message as ``error: ...`` on stderr
and exits with status 2, as argparse does for a bad flag, instead of a traceback. Anything
else is a bug and keeps its traceback. Standard library only: commands call it from their
``__main__`` blocks, where nothing may load torch before the environment defaults are set.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, FileExistsError)
"""What a command raises for its user's mistake (a ValueError names a bad value or file)."""

Result = TypeVar("Result")


def run_command(main: Callable[[], Result], errors: tuple[type[BaseException], ...] = ()) -> Result:
    """``main()``'s result; on one of :data:`USER_ERRORS` or ``errors``, its message on stderr
    and ``SystemExit(2)``."""
    try:
        return main()
    except (*USER_ERRORS, *errors) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def check_output_file(path: str | Path, flag: str) -> Path:
    """``path`` as a file a command may write at its end; ``ValueError`` naming ``flag`` when
    it is a folder or lies under a file, checked before any work so a long run is not lost."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; pass a file path, e.g. {path / 'out.json'}")
    _check_parents(path, flag)
    return path


def check_output_folder(path: str | Path, flag: str) -> Path:
    """``path`` as a folder a command may fill; ``ValueError`` naming ``flag`` when it is a
    file or lies under a file."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file; pass a folder (it is created if missing)")
    _check_parents(path, flag)
    return path


def _check_parents(path: Path, flag: str) -> None:
    """``ValueError`` when the nearest existing ancestor of ``path`` is not a folder."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(
                    f"{flag} {path}: {parent} is a file, not a folder; pass a path whose "
                    "parent is a folder (or does not exist yet)"
                )
            return
