"""The embedded stdlib corpus: split by file, deterministic, the excluded folders, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from draftsmith.data.corpus import (
    is_included,
    load_stdlib_corpus,
    scan_corpus,
    split_of,
    stdlib_root,
)


def _write(root: Path, relative: str, content: bytes) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)


@pytest.fixture
def fake_stdlib(tmp_path: Path) -> Path:
    for i in range(60):
        _write(tmp_path, f"pkg{i % 3}/mod_{i}.py", f"x = {i}\n".encode())
    _write(tmp_path, "os.py", b"import sys\n")
    _write(tmp_path, "test/test_os.py", b"assertEqual\n")
    _write(tmp_path, "pkg0/tests/test_a.py", b"assertEqual\n")
    _write(tmp_path, "idlelib/idle_test/test_b.py", b"assertEqual\n")
    _write(tmp_path, "test/test_asyncio/test_c.py", b"assertEqual\n")
    _write(tmp_path, "site-packages/numpy/core.py", b"third party\n")
    _write(tmp_path, "__pycache__/os.py", b"cached\n")
    _write(tmp_path, "_sysconfigdata__linux.py", b"build_time_vars = {}\n")
    _write(tmp_path, "notes.txt", b"not python\n")
    _write(tmp_path, "latin1.py", "caf\u00e9 = 1\n".encode("latin-1"))
    return tmp_path


def test_excluded_folders_and_non_utf8(fake_stdlib: Path) -> None:
    scan = scan_corpus(fake_stdlib)
    assert len(scan.paths) == 61
    assert "os.py" in scan.paths
    assert scan.skipped_non_utf8 == ["latin1.py"]
    assert not any("test" in p or "site-packages" in p or "__pycache__" in p for p in scan.paths)
    assert "_sysconfigdata__linux.py" not in scan.paths
    with_tests = scan_corpus(fake_stdlib, include_tests=True)
    assert set(with_tests.paths) - set(scan.paths) == {
        "test/test_os.py",
        "pkg0/tests/test_a.py",
        "idlelib/idle_test/test_b.py",
        "test/test_asyncio/test_c.py",
    }


def test_is_included_rules() -> None:
    assert is_included("unittest/case.py")
    assert not is_included("unittest/test/test_case.py")
    assert is_included("unittest/test/test_case.py", include_tests=True)
    assert not is_included("lib2to3/tests/data/bom.py", include_tests=False)
    assert not is_included("site-packages/x.py", include_tests=True)
    assert not is_included("README.txt")


def test_split_is_by_file_disjoint_and_deterministic(fake_stdlib: Path) -> None:
    first = load_stdlib_corpus(root=fake_stdlib, validation_fraction=0.2, test_fraction=0.2)
    second = load_stdlib_corpus(root=fake_stdlib, validation_fraction=0.2, test_fraction=0.2)
    assert set(first) == {"train", "validation", "test"}
    paths = {split: first[split]["path"] for split in first}
    assert paths == {split: second[split]["path"] for split in second}
    assert all(len(paths[split]) > 0 for split in paths)
    seen = [p for split in paths for p in paths[split]]
    assert len(seen) == len(set(seen)) == 61
    # The split of a file depends on its path only, not on which other files exist.
    for split, split_paths in paths.items():
        for relative in split_paths:
            assert split_of(relative, 0.2, 0.2) == split
    text_of = dict(zip(first["train"]["path"], first["train"]["text"], strict=True))
    assert text_of["os.py"] == "import sys\n"


def test_max_files_caps_and_is_stable(fake_stdlib: Path) -> None:
    capped = load_stdlib_corpus(root=fake_stdlib, max_files=10, validation_fraction=0.3)
    assert sum(len(capped[split]) for split in capped) == 10
    again = load_stdlib_corpus(root=fake_stdlib, max_files=10, validation_fraction=0.3)
    assert capped["train"]["path"] == again["train"]["path"]


def test_empty_corpus_names_the_root(tmp_path: Path) -> None:
    _write(tmp_path, "test/test_only.py", b"x\n")
    with pytest.raises(ValueError, match=str(tmp_path)):
        load_stdlib_corpus(root=tmp_path)


def test_bad_fractions_and_missing_root(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="validation_fraction"):
        load_stdlib_corpus(root=tmp_path, validation_fraction=1.5)
    with pytest.raises(ValueError, match="< 1"):
        load_stdlib_corpus(root=tmp_path, validation_fraction=0.5, test_fraction=0.5)
    with pytest.raises(ValueError, match="not a folder"):
        load_stdlib_corpus(root=tmp_path / "missing")


def test_real_stdlib_sample() -> None:
    corpus = load_stdlib_corpus(max_files=40, validation_fraction=0.1, test_fraction=0.1)
    paths = [p for split in corpus for p in corpus[split]["path"]]
    assert len(paths) == 40
    assert all(not p.startswith(("test/", "idlelib/idle_test/")) for p in paths)
    assert all((stdlib_root() / p).is_file() for p in paths)
