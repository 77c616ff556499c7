"""Every command, flag, recipe and link the documents name exists.

tests/test_guides.py checks the commands of the ``bash`` blocks; this file checks what the
prose names: each inline ``draftsmith-*`` invocation (its command a console script, its flags
in that command's parser, as ``--help`` prints them), each inline ``--flag`` (a flag of some
command), each ``configs/*.yaml`` path (a file of the tree), each link's ``#anchor`` (a
heading of the linked document), in README.md and every document under docs/.
"""

from __future__ import annotations

import contextlib
import re
import shlex
from pathlib import Path

from test_guides import SCRIPTS, accelerate_help, check_command, console_help

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("docs/guides/*.md")])
CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
RECIPE = re.compile(r"(?<![\w/.])configs/[\w./-]+\.yaml\b")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
LINK = re.compile(r"\]\(([^)\s#]*)#([^)\s]+)\)")
COMMAND = re.compile(r"draftsmith-[a-z][a-z-]*")
"""A command's name; ``draftsmith-*`` and ``draftsmith-<command>`` name them all."""
PLACEHOLDER = "mykind"
"""The kind architecture.md's recipe for adding a drafter kind asks you to write."""
SERVING_ENGINE_FLAGS = {"--speculative-algorithm", "--speculative-config", "--max-model-len"}
"""vLLM's and SGLang's own flags, which the serving guides name beside ours."""


def _prose(path: Path) -> str:
    """The document without its fenced blocks (tests/test_guides.py checks those)."""
    return FENCE.sub("", path.read_text())


def _spans() -> list[tuple[str, str]]:
    return [
        (path.relative_to(ROOT).as_posix(), span)
        for path in DOCUMENTS
        for span in CODE_SPAN.findall(_prose(path))
    ]


def _all_flags() -> set[str]:
    """Every flag some console script takes, ``accelerate launch``'s and the serving engines'."""
    ours = {flag for name in SCRIPTS for flag in FLAG.findall(console_help(name))}
    return ours | set(FLAG.findall(accelerate_help())) | SERVING_ENGINE_FLAGS


def test_every_inline_invocation_is_a_command_with_those_flags() -> None:
    problems = []
    for document, span in _spans():
        if not COMMAND.fullmatch(span.split()[0]):
            continue
        words = span.replace("...", "").split()
        with contextlib.suppress(ValueError):  # an unbalanced quote: the words as they stand
            words = shlex.split(" ".join(words))
        problems += [
            f"{document}: `{span}`: {problem}"
            for problem in check_command(words)
            if "configs/" not in problem  # the recipe check below names those
        ]
    assert not problems, "\n".join(problems)


def test_every_inline_flag_is_a_flag_of_some_command() -> None:
    known = _all_flags()
    unknown = sorted(
        {
            f"{document}: {flag}"
            for document, span in _spans()
            if not span.startswith("draftsmith-")
            for flag in FLAG.findall(span)
            if flag not in known
        }
    )
    assert not unknown, "\n".join(unknown)


def test_every_recipe_named_exists() -> None:
    missing = sorted(
        {
            f"{path.relative_to(ROOT)}: {recipe}"
            for path in DOCUMENTS
            for recipe in RECIPE.findall(path.read_text())
            if not (ROOT / recipe).is_file() and PLACEHOLDER not in recipe
        }
    )
    assert not missing, "\n".join(missing)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_every_link_anchor_is_a_heading() -> None:
    broken = []
    for path in DOCUMENTS:
        for target, anchor in LINK.findall(path.read_text()):
            linked = (path.parent / target) if target else path
            if linked.suffix != ".md" or not linked.is_file():
                continue  # tests/test_guides.py checks the files
            headings = re.findall(r"^#+ (.+)$", FENCE.sub("", linked.read_text()), re.MULTILINE)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(f"{path.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, "\n".join(broken)


def test_the_guides_index_names_every_command() -> None:
    index = (ROOT / "docs" / "guides" / "README.md").read_text()
    missing = [name for name in SCRIPTS if name not in index]
    assert not missing, f"docs/guides/README.md does not name {missing}"


def test_a_missing_flag_recipe_or_anchor_is_caught() -> None:
    assert check_command(["draftsmith-ablate", "--threads", "2"]) == [
        "draftsmith-ablate has no flag --threads"
    ]
    assert "--threads" in _all_flags() and "--bogus-flag" not in _all_flags()
    assert RECIPE.findall("train it with `configs/nope.yaml`") == ["configs/nope.yaml"]
    assert _slug("On an AMD EPYC (Zen 5)") == "on-an-amd-epyc-zen-5"
    assert _slug("At the main job's budget, 3 seeds") == "at-the-main-jobs-budget-3-seeds"
