"""draftsmith.data.atomic_io's file writer: the target appears whole or keeps its previous content."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from draftsmith.data.atomic_io import atomic_file, write_json_atomic


def test_atomic_file_renames_the_finished_sibling_into_place(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "shard.bin"
    with atomic_file(target) as temp:
        assert temp.parent == target.parent and temp.name.startswith(".shard.bin.tmp-")
        temp.write_bytes(b"new")
        assert not target.exists()  # nothing at the final name until the writer is done
    assert target.read_bytes() == b"new"
    assert [p.name for p in target.parent.iterdir()] == ["shard.bin"]


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_sibling(tmp_path: Path) -> None:
    target = write_json_atomic(tmp_path / "cache.json", {"version": 1})
    with pytest.raises(RuntimeError, match="killed"), atomic_file(target) as temp:
        temp.write_text("half a fi", encoding="utf-8")
        raise RuntimeError("killed mid-write")
    assert json.loads(target.read_text()) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["cache.json"]
