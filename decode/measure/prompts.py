"""Evaluation prompts: the embedded demo set (held-out stdlib code), third-party code the demo
target never saw (``ood``), or a user file.

The one module of ``decode/`` that imports ``data/`` (docs/architecture.md, the arrow
``decode/ -> data/``): the demo set is cut from ``draftsmith.data.corpus``, prompt files are records read by
``draftsmith.data.sources``. Evaluation imports this module where it needs prompts, so the decoder and
``import decode`` load nothing of ``data/``.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from draftsmith.data.benchmarks import load_benchmark_prompts
from draftsmith.data.chat_context import prompts_with_system_prompt, system_prompt_argument
from draftsmith.data.corpus import load_stdlib_corpus
from draftsmith.data.sources import utf8_text
from draftsmith.decode.defaults import DEMO_PROMPT_CHARS
from draftsmith.decode.drafters.folder import trained_config

T = TypeVar("T")

# Installed with draftsmith on every machine, and not the standard library the demo target
# trained on: their source is real code of another style (type hints, long docstrings,
# tensor code) for out-of-distribution prompts.
OOD_PACKAGES = ("transformers", "torch", "accelerate", "safetensors", "huggingface_hub")


def definition_prompts(text: str, chars: int = DEMO_PROMPT_CHARS) -> Iterator[str]:
    """The code just before each ``def``/``class`` line of ``text``: the ``chars`` characters up
    to and including the line, its line break left out (lines closer than ``chars`` to the
    start give none).

    A prompt ends where a token ends in the text it was cut from. Byte-level BPE and
    SentencePiece vocabularies attach whitespace to the token after it (``"\n   "``,
    ``" return"``), so a prompt ending in the line break would end in a lone ``"\n"`` token,
    which in real code comes before a blank line or a top-level statement, never a body: the
    model would answer with blank lines. Ending at the colon, the model writes the body.
    """
    offset = 0
    for line in text.splitlines(keepends=True):
        offset += len(line)
        end = offset - (len(line) - len(line.rstrip()))  # after the line's last visible char
        if line.lstrip().startswith(("def ", "class ")) and end > chars:
            yield text[end - chars : end]


def in_turn(lists: Sequence[Sequence[T]]) -> list[T]:
    """The items of ``lists`` taken in turn: every list's first, then every list's second, ..."""
    depth = max(map(len, lists), default=0)
    return [items[i] for i in range(depth) for items in lists if i < len(items)]


def _prompts_from_texts(texts: Iterable[str], num_prompts: int, per_file: int) -> list[str]:
    """At most ``per_file`` :func:`definition_prompts` per text, until ``num_prompts``."""
    prompts: list[str] = []
    for text in texts:
        prompts += itertools.islice(
            definition_prompts(text), min(per_file, num_prompts - len(prompts))
        )
        if len(prompts) >= num_prompts:
            break
    return prompts


def ood_prompts(num_prompts: int) -> list[str]:
    """Prompts from the installed source of ``OOD_PACKAGES`` (one per file, files spread
    evenly over each package's sorted file list, packages taken in turn), so the same
    installation always gives the same prompts."""
    file_lists = []
    for package in OOD_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        files = sorted(p for p in root.rglob("*.py") if p.stat().st_size > 4 * DEMO_PROMPT_CHARS)
        if files:
            stride = max(1, len(files) // max(num_prompts, 1))
            file_lists.append(files[::stride])
    interleaved = in_turn(file_lists)

    def texts():
        for path in interleaved:
            try:
                yield path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue

    prompts = _prompts_from_texts(texts(), num_prompts, per_file=1)
    if not prompts:
        raise ValueError(
            f"none of {', '.join(OOD_PACKAGES)} is installed with readable source; pass "
            "--prompts FILE instead"
        )
    return prompts


def demo_prompts(num_prompts: int) -> list[str]:
    """Prompts cut from the corpus's *test* split (files the demo target never trained on).

    Each prompt is the code just before a ``def``/``class`` line, up to and including that
    line, so the model continues a function or class body: text of the kind it was trained on.
    """
    test_split = load_stdlib_corpus()["test"]
    prompts = _prompts_from_texts(test_split["text"], num_prompts, per_file=2)
    if not prompts:
        raise ValueError("the stdlib test split gave no prompts; pass --prompts FILE instead")
    return prompts


def file_prompts(
    path: str, num_prompts: int, system_prompt: str | None = None
) -> list[str | list[dict[str, str]]]:
    """Prompts from a JSONL/JSON file (``prompt`` or ``messages`` field, or a benchmark's own
    shape: MT-Bench, GSM8K, HumanEval; ``draftsmith.data.benchmarks``) or a text file. Chat
    prompts open with ``system_prompt`` unless they hold a system turn of their own
    (``draftsmith.data.chat_context``).

    Every problem with the file (a folder, unreadable, not UTF-8, JSON nested too deep to
    parse, a wrong shape) is a ``ValueError`` or ``FileNotFoundError`` naming it."""
    _check_count(num_prompts)
    file = Path(path).expanduser()
    if file.is_dir():
        raise ValueError(f"prompt file {file} is a folder; pass a file in it, or 'demo'")
    try:
        if path.endswith((".jsonl", ".json")):
            prompts = load_benchmark_prompts(path, num_prompts)
            return prompts_with_system_prompt(prompts, system_prompt)
        return _text_prompts(file, num_prompts)
    except RecursionError:
        raise ValueError(
            f"prompt file {file} nests JSON too deeply to read; pass flat records such as "
            '{"prompt": "..."}'
        ) from None
    except (FileNotFoundError, ValueError):
        raise
    except OSError as error:  # unreadable: permissions, a device, a broken mount
        raise ValueError(
            f"prompt file {file} cannot be read ({error.strerror or error}); pass a readable file"
        ) from None


def _check_count(num_prompts: int) -> None:
    """``ValueError`` unless ``num_prompts`` >= 1 (a negative count would slice prompts off
    the end)."""
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"--num-prompts must be an integer >= 1, got {num_prompts!r}")


def _text_prompts(file: Path, num_prompts: int) -> list[str | list[dict[str, str]]]:
    """The non-empty lines of a UTF-8 text file (a leading byte-order mark dropped)."""
    if not file.is_file():
        raise FileNotFoundError(f"prompt file {file} does not exist; pass a file or 'demo'")
    text = utf8_text(file, "a text file of one prompt a line, a .jsonl file or 'demo'")
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompt file {file} has no non-empty line")
    return prompts[:num_prompts]


PROMPT_SETS = ("demo", "ood")


def load_eval_prompts(
    spec: str, num_prompts: int, system_prompt: str | None = None
) -> list[str | list[dict[str, str]]]:
    """``demo`` (held-out stdlib code), ``ood`` (installed third-party code), or a file (its
    chat prompts opened by ``system_prompt``: :func:`file_prompts`)."""
    _check_count(num_prompts)
    if spec == "demo":
        return list(demo_prompts(num_prompts))
    if spec == "ood":
        return list(ood_prompts(num_prompts))
    return file_prompts(spec, num_prompts, system_prompt)


def drafters_system_prompt(given: str | None, drafter_dirs: Sequence[str | Path]) -> str | None:
    """The system prompt an evaluation gives its chat prompts: ``--system-prompt`` when given
    (``""``: none), else the one the drafters were trained with (``data.system_prompt`` of
    their ``provenance.json``), so that a drafter is measured in the context it learned.
    Drafters trained with different ones are refused: one run measures every method on the
    same prompts."""
    if given is not None:
        return given or None
    recorded = {}
    for folder in drafter_dirs:
        config = trained_config(folder) if Path(folder).is_dir() else None
        data = (config or {}).get("data")
        value = data.get("system_prompt") if isinstance(data, dict) else None
        recorded[str(folder)] = value if isinstance(value, str) and value else None
    if len(set(recorded.values())) > 1:
        listing = "; ".join(f"{folder}: {value!r}" for folder, value in recorded.items())
        raise ValueError(
            f"the drafters were trained with different system prompts ({listing}); pass "
            "--system-prompt TEXT (or none) to measure them on the same prompts"
        )
    return next(iter(recorded.values()), None)


def add_system_prompt_argument(parser: argparse.ArgumentParser, default_help: str) -> None:
    """``--system-prompt TEXT | @FILE | none`` (``draftsmith.data.chat_context``); its value
    is None when not given, ``""`` for none."""

    def value(text: str) -> str:
        try:
            return system_prompt_argument(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parser.add_argument(
        "--system-prompt",
        type=value,
        default=None,
        metavar="TEXT|@FILE|none",
        help="system turn opening every chat prompt that has none (@FILE: a text file's "
        f"contents; none: no system turn); default: {default_help}",
    )
