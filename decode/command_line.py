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
