"""The embedded default corpus: the source code of the running Python's standard library.

Nothing is downloaded: the text is the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``
(or any other ``root`` with the same layout).

What is included, exactly:

- every regular file whose name ends in ``.py``, found recursively under the root, read as
  UTF-8 (a byte-order mark is removed, line endings are kept as they are on disk);
- a file that is not valid UTF-8 is skipped and counted (``CorpusScan.skipped_non_utf8``; a
  warning names them).

What is excluded:

- any file below a folder named ``site-packages``, ``dist-packages`` or ``__pycache__``
  (installed third-party packages and byte-code);
- unless ``include_tests`` is set, any file below a test folder: a folder named ``test``,
  ``tests``, ``idle_test``, ``testmock``, or whose name starts with ``test_`` or ends with
  ``_test`` or ``_tests``. They are half of the standard library by bytes and teach a small model
  to babble ``self.assertEqual``;
- ``_sysconfigdata_*.py``: generated at build time, machine-specific build flags, not code.

On CPython 3.11.7 this leaves 733 files (12.1 MB) of the 1,790 outside ``site-packages``.

Splits are by file: the split of a file is a pure function of its relative POSIX path (a
SHA-256 hash mapped to [0, 1)), so no file is in two splits and the split is the same on every
machine and every run, whatever else is in the folder.
"""

from __future__ import annotations

import hashlib
import logging
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import datasets

logger = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
EXCLUDED_FOLDERS = frozenset({"site-packages", "dist-packages", "__pycache__"})
TEST_FOLDERS = frozenset({"test", "tests", "idle_test", "testmock"})
_HASH_SCALE = float(1 << 64)


@dataclass
class CorpusScan:
    """The documents found under ``root`` (sorted by path) and the files that were skipped."""

    root: Path
    paths: list[str] = field(default_factory=list)  # relative POSIX paths
    texts: list[str] = field(default_factory=list)
    skipped_non_utf8: list[str] = field(default_factory=list)

    @property
    def num_bytes(self) -> int:
        return sum(len(text.encode("utf-8")) for text in self.texts)


def stdlib_root() -> Path:
    """The folder of the running interpreter's standard library (``sysconfig`` ``stdlib``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_test_folder(name: str) -> bool:
    """True for folder names that hold tests (see the module docstring for the rule)."""
    return (
        name in TEST_FOLDERS
        or name.startswith("test_")
        or name.endswith("_test")
        or name.endswith("_tests")
    )


def is_included(relative_path: str, include_tests: bool = False) -> bool:
    """Whether a relative POSIX path belongs to the corpus (see the module docstring)."""
    *folders, name = relative_path.split("/")
    if not name.endswith(".py") or name.startswith("_sysconfigdata_"):
        return False
    if any(folder in EXCLUDED_FOLDERS for folder in folders):
        return False
    return include_tests or not any(is_test_folder(folder) for folder in folders)


def _unit_hash(text: str, salt: str) -> float:
    """A stable hash of ``text`` mapped to [0, 1); identical on every machine and run."""
    digest = hashlib.sha256(f"{salt}:{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / _HASH_SCALE


def split_of(relative_path: str, validation_fraction: float, test_fraction: float) -> str:
    """The split of one file: ``test`` if u < test_fraction, then ``validation``, else ``train``.

    ``u`` is the SHA-256 of the relative POSIX path mapped to [0, 1), so a file's split never
    depends on which other files exist.
    """
    u = _unit_hash(relative_path, "split")
    if u < test_fraction:
        return "test"
    if u < test_fraction + validation_fraction:
        return "validation"
    return "train"


def scan_corpus(
    root: Path,
    include_tests: bool = False,
    max_files: int | None = None,
) -> CorpusScan:
    """Read the corpus files under ``root``.

    With ``max_files`` the files are taken in a fixed pseudo-random order (a second stable hash
    of the path, independent of the split hash), so a capped corpus samples the whole tree and
    still has files in every split; the result is sorted by path either way.
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"corpus root {root} is not a folder; pass root= an existing folder")
    if max_files is not None and max_files < 1:
        raise ValueError(f"max_files must be >= 1 or None (no cap), got {max_files}")
    candidates = [
        relative
        for relative in (path.relative_to(root).as_posix() for path in root.rglob("*.py"))
        if is_included(relative, include_tests)
    ]
    if max_files is not None:
        candidates.sort(key=lambda relative: _unit_hash(relative, "sample"))
    else:
        candidates.sort()
    scan = CorpusScan(root=root)
    documents: list[tuple[str, str]] = []
    for relative in candidates:
        if max_files is not None and len(documents) >= max_files:
            break
        path = root / relative
        if not path.is_file():
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            scan.skipped_non_utf8.append(relative)
            continue
        documents.append((relative, text.removeprefix("\ufeff")))
    documents.sort()
    scan.paths = [relative for relative, _ in documents]
    scan.texts = [text for _, text in documents]
    scan.skipped_non_utf8.sort()
    return scan


def load_stdlib_corpus(
    include_tests: bool = False,
    validation_fraction: float = 0.01,
    test_fraction: float = 0.01,
    root: Path | None = None,
    max_files: int | None = None,
) -> datasets.DatasetDict:
    """The standard library's source as a ``DatasetDict`` with splits train/validation/test.

    Each row has ``path`` (relative POSIX path) and ``text``. A split may be empty when the
    corpus is capped hard with ``max_files``; the whole corpus may not.
    """
    for name, value in (
        ("validation_fraction", validation_fraction),
        ("test_fraction", test_fraction),
    ):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must lie in [0, 1), got {value}")
    if validation_fraction + test_fraction >= 1.0:
        raise ValueError(
            f"validation_fraction + test_fraction must be < 1 to leave a train split, got "
            f"{validation_fraction} + {test_fraction}"
        )
    root = stdlib_root() if root is None else Path(root)
    scan = scan_corpus(root, include_tests=include_tests, max_files=max_files)
    if scan.skipped_non_utf8:
        logger.warning(
            "skipped %d files under %s that are not valid UTF-8: %s",
            len(scan.skipped_non_utf8),
            root,
            ", ".join(scan.skipped_non_utf8),
        )
    if not scan.paths:
        raise ValueError(
            f"no corpus files under {root} (include_tests={include_tests}): expected .py files "
            "outside site-packages and test folders; pass root= the folder of a Python "
            "standard library or another tree of .py files"
        )
    columns: dict[str, dict[str, list[str]]] = {split: {"path": [], "text": []} for split in SPLITS}
    for relative, text in zip(scan.paths, scan.texts, strict=True):
        split = split_of(relative, validation_fraction, test_fraction)
        columns[split]["path"].append(relative)
        columns[split]["text"].append(text)
    features = datasets.Features(
        {"path": datasets.Value("string"), "text": datasets.Value("string")}
    )
    return datasets.DatasetDict(
        {split: datasets.Dataset.from_dict(columns[split], features=features) for split in SPLITS}
    )
