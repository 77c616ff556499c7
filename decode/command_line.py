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
    """``ValueError`` when the nearest existing ancestor of ``path`` is not a folder this
    process may write into (where the path, or the folders down to it, would be created)."""
    import os

    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(
                    f"{flag} {path}: {parent} is a file, not a folder; pass a path whose "
                    "parent is a folder (or does not exist yet)"
                )
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ValueError(
                    f"{flag} {path}: this user may not write into {parent}; pass a path in a "
                    "folder you can write to"
                )
            return


def http_url_problem(url: str, flag: str, example: str) -> str | None:
    """What keeps ``url`` (the value of ``flag``) from naming an HTTP(S) server: its scheme,
    a port that is no number or out of range, no host; ``None`` when nothing does. The
    message's fix shows ``example``."""
    from urllib.parse import urlparse

    fix = f"pass the server's URL, e.g. {flag} {example}"
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https"):
        return f"{flag} {url!r} is not an http(s) URL; {fix}"
    try:
        parsed.port  # noqa: B018 - raises on a port that is no number or out of range
    except ValueError as error:
        return f"{flag} {url!r}: {error}; {fix}"
    if not parsed.hostname:
        return f"{flag} {url!r} names no host; {fix}"
    return None


def check_positive_finite(value: float, flag: str, unit: str, unset: str = "") -> None:
    """``ValueError`` unless ``value`` (of ``flag``, counted in ``unit``) is a finite number
    > 0; ``unset`` tells what leaving the flag out means, for the message."""
    import math

    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} must be a finite number of {unit} > 0{unset}, got {value}")
