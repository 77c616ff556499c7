"""Atomic writes: a file or a whole folder appears complete or not at all.

The one place for both patterns (checkpoints, exported drafters, the demo target, evaluation
reports and the offline target cache all use them). It lives in ``data/``, the bottom layer,
because it needs nothing but the standard library and every layer writes files: ``data/``
imports no other package, and ``train/`` and ``decode/`` import this module from here. A file
or folder is written under a temporary sibling name and renamed into place with
``os.replace``, which is atomic on one filesystem: a process killed at any moment leaves the
previous version or the new one, never half of one.

Temporary siblings carry the writer's process id (``.<name>.tmp-<pid>``). A writer killed
mid-way cannot remove its own; the next writer of the same target removes those whose process
is gone (``remove_stale_siblings``), so nothing piles up next to the target.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | Path, data: Any, *, indent: int | None = 2) -> Path:
    """Write ``data`` as JSON (a trailing newline) to ``path`` through a temporary sibling."""
    return write_text_atomic(path, json.dumps(data, indent=indent) + "\n")


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary sibling renamed into place."""
    with atomic_file(path) as temp:
        temp.write_text(text, encoding="utf-8")
    return Path(path)


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write; on success it is renamed to ``path``.

    For writers that take a file name (``safetensors.torch.save_file``, for example). On an
    exception the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        yield temp
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def replace_folder(temp: str | Path, folder: str | Path) -> Path:
    """Rename the finished ``temp`` to ``folder``, moving a previous ``folder`` aside first.

    The previous version is deleted only once the new one is in place.
    """
    temp, folder = Path(temp), Path(folder)
    old = folder.parent / f".{folder.name}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists() or folder.is_symlink():
        os.replace(folder, old)
    os.replace(temp, folder)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)
    return folder


@contextmanager
def atomic_folder(folder: str | Path) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``folder``; on success it replaces ``folder``.

    On an exception the temporary folder is removed and ``folder`` is left as it was. Stale
    temporary siblings of writers that were killed are removed first.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(folder)
    temp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        yield temp
        replace_folder(temp, folder)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def remove_stale_siblings(target: str | Path) -> list[Path]:
    """Remove ``.<name>.tmp-<pid>`` / ``.<name>.old-<pid>`` siblings whose process is gone."""
    target = Path(target)
    if not target.parent.is_dir():
        return []
    removed = []
    for kind in ("tmp", "old"):
        for path in target.parent.glob(f".{target.name}.{kind}-*"):
            pid = path.name.rsplit("-", 1)[1]
            if not pid.isdigit() or int(pid) == os.getpid() or process_alive(int(pid)):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists (signal 0 checks without sending anything)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists but belongs to another user
        return True
    except OSError:
        return False
    return True
