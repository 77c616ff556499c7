"""Every command in the README's and the guides' ``bash`` blocks runs as written.

Each command is read as the shell would (``\\`` continuations joined, comments dropped, ``&&``
chains split, leading ``VAR=value`` assignments skipped) and checked by what it calls:

- ``draftsmith-<cmd>``: a console script of pyproject.toml whose ``--help`` (run in this
  process through ``scripts/console.py``, as the installed script runs it) shows an example
  line and every flag the command passes;
- ``accelerate launch ... train/distill.py ...``: accelerate's flags against ``accelerate
  launch --help``, the script's against ``draftsmith-distill --help``;
- every ``configs/`` file a command names exists;
- anything else must be one of the few outside tools the guides use (pip, vllm, curl, ...).

``python`` blocks must compile and their imports resolve. The ``slow`` tests run each
document's cheap commands for real, in order, in a scratch folder of its own: every
draftsmith command at tiny scale (one that names ``tiny``) but the server, the load test and
the engine check, and ``draftsmith-report --check``; then the document's ``python`` blocks.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.DOTALL | re.MULTILINE)
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
OUTSIDE_TOOLS = {"pip", "python3", "vllm", "curl", "sleep", "kill"}
"""Programs the guides call that are not draftsmith's: checked by name only."""


def _console_scripts() -> dict[str, str]:
    """pyproject.toml's ``[project.scripts]``: name -> ``module:function``."""
    text = (ROOT / "pyproject.toml").read_text()
    table = text.split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+) = "([\w.:]+)"$', table, re.MULTILINE))


SCRIPTS = _console_scripts()


def blocks(language: str) -> list[tuple[str, str]]:
    """``(document, block text)`` for every fenced block of ``language``."""
    return [
        (path.relative_to(ROOT).as_posix(), m.group(2))
        for path in DOCUMENTS
        for m in BLOCK.finditer(path.read_text())
        if m.group(1) == language
    ]


def commands() -> list[tuple[str, list[str]]]:
    """``(document, argv)`` for every command of every bash block."""
    return [(document, argv) for document, _, argv in shell_commands()]


def shell_commands() -> list[tuple[str, dict[str, str], list[str]]]:
    """``(document, environment assignments, argv)`` for every command of every bash block."""
    found = []
    for document, text in blocks("bash"):
        for line in text.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                end = words.index("&&") if "&&" in words else len(words)
                argv, words = words[:end], words[end + 1 :]
                env = {}
                while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
                    name, _, value = argv.pop(0).partition("=")
                    env[name] = value
                if argv and argv[-1] == "&":
                    argv = argv[:-1]
                if argv:
                    found.append((document, env, argv))
    return found


_HELP: dict[str, str] = {}


def console_help(name: str) -> str:
    """``<name> --help`` as the installed console script prints it, run in this process."""
    if name not in _HELP:
        module, _, function = SCRIPTS[name].partition(":")
        entry = getattr(__import__(module, fromlist=[function]), function)
        out = io.StringIO()
        argv = sys.argv
        sys.argv = [name, "--help"]
        # pytest claims modules named like tests (scripts/load_test.py) to rewrite their
        # asserts, and runpy cannot run a module through that hook: step it aside meanwhile.
        hooks = [f for f in sys.meta_path if type(f).__module__.startswith("_pytest")]
        try:
            for hook in hooks:
                sys.meta_path.remove(hook)
            with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
                entry()
        finally:
            sys.argv = argv
            sys.meta_path[:0] = hooks
        assert exit_info.value.code in (0, None), f"{name} --help exited {exit_info.value.code}"
        _HELP[name] = out.getvalue()
    return _HELP[name]


def accelerate_help() -> str:
    if "accelerate" not in _HELP:
        accelerate = Path(sys.executable).parent / "accelerate"
        out = subprocess.run(
            [str(accelerate), "launch", "--help"], capture_output=True, text=True, check=True
        )
        _HELP["accelerate"] = out.stdout
    return _HELP["accelerate"]


def unknown_flags(argv: list[str], help_text: str) -> list[str]:
    known = set(FLAG.findall(help_text))
    return [f for a in argv if (f := a.split("=")[0]).startswith("--") and f not in known]


def check_command(argv: list[str]) -> list[str]:
    """Problems with one command; empty when it is well formed."""
    problems = [
        f"no file {a}" for a in argv if a.startswith("configs/") and not (ROOT / a).is_file()
    ]
    program = Path(argv[0]).name
    if program.startswith("draftsmith-"):
        if program not in SCRIPTS:
            return [*problems, f"{program} is no console script of pyproject.toml"]
        text = console_help(program)
        if f"example: {program}" not in text:
            problems.append(f"{program} --help shows no 'example: {program} ...' line")
        problems += [f"{program} has no flag {f}" for f in unknown_flags(argv[1:], text)]
    elif program == "accelerate":
        assert argv[1] == "launch", argv
        script = argv.index("train/distill.py")
        problems += [
            f"accelerate launch has no {f}"
            for f in unknown_flags(argv[2:script], accelerate_help())
        ]
        text = console_help("draftsmith-distill")
        problems += [f"distill has no flag {f}" for f in unknown_flags(argv[script + 1 :], text)]
    elif program == "bash":
        problems += [] if (ROOT / argv[1]).is_file() else [f"no script {argv[1]}"]
    elif program == "python" and argv[1:3] == ["-m", "pytest"]:
        pass
    elif program not in OUTSIDE_TOOLS:
        problems.append(f"{program}: not a draftsmith command nor a known outside tool")
    return problems


def test_the_documents_have_commands() -> None:
    names = {Path(argv[0]).name for _, argv in commands()}
    assert {"accelerate", "draftsmith-distill", "draftsmith-evaluate", "draftsmith-serve"} <= names


def test_every_console_script_runs_a_module_and_shows_an_example() -> None:
    for name in SCRIPTS:
        assert f"example: {name}" in console_help(name), f"{name} --help has no example line"


def test_every_command_is_well_formed() -> None:
    problems = [
        f"{document}: {shlex.join(argv)}: {problem}"
        for document, argv in commands()
        for problem in check_command(argv)
    ]
    assert not problems, "\n".join(problems)


def test_python_blocks_compile_and_import() -> None:
    import ast
    import importlib

    for document, text in blocks("python"):
        tree = ast.parse(text, filename=document)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                module = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert not missing, f"{document}: {node.module} has no {missing}"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_every_relative_link_resolves() -> None:
    """Links and images between the documents point at files that exist."""
    broken = [
        f"{path.relative_to(ROOT)}: {target}"
        for path in DOCUMENTS
        for target in LINK.findall(path.read_text())
        if "://" not in target and not (path.parent / target).exists()
    ]
    assert not broken, broken


NOT_RUN = {"draftsmith-serve", "draftsmith-load-test", "draftsmith-check-engine"}
"""Commands the slow tests leave to their ``--help`` check: a server, its client, vLLM."""


def cheap(argv: list[str]) -> bool:
    """Whether a command runs in seconds to a minute: tiny scale, nothing served."""
    name = Path(argv[0]).name
    if name == "draftsmith-report":
        return argv[1:] == ["--check"]
    drafts = name == "accelerate" or (name.startswith("draftsmith-") and name not in NOT_RUN)
    return drafts and "tiny" in " ".join(argv)


@pytest.mark.slow
@pytest.mark.parametrize("document", [p.relative_to(ROOT).as_posix() for p in DOCUMENTS])
def test_the_document_runs_at_tiny_scale(document: str, tmp_path: Path) -> None:
    """Its cheap commands in a scratch folder (``configs/`` and ``train/`` linked in, a user
    cache of its own), then its Python blocks."""
    import os

    for folder in ("configs", "train"):  # recipes, and accelerate's train/distill.py
        (tmp_path / folder).symlink_to(ROOT / folder)
    bin_dir = Path(sys.executable).parent
    base = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    for source, env, argv in shell_commands():
        if source == document and cheap(argv):
            run = subprocess.run(
                [str(bin_dir / argv[0]), *argv[1:]],
                cwd=tmp_path,
                env={**base, **env},
                capture_output=True,
                text=True,
            )
            assert run.returncode == 0, (
                f"{shlex.join(argv)}:\n{run.stdout[-2000:]}{run.stderr[-3000:]}"
            )
    for source, text in blocks("python"):
        if source == document:
            run = subprocess.run(
                [sys.executable, "-c", text], cwd=tmp_path, env=base, capture_output=True, text=True
            )
            assert run.returncode == 0, run.stderr[-3000:]


def test_a_flag_the_command_lacks_is_caught() -> None:
    argv = ["draftsmith-load-test", "--clients", "4", "--bogus", "1"]
    assert check_command(argv) == ["draftsmith-load-test has no flag --bogus"]
    assert check_command(["draftsmith-nope"]) == [
        "draftsmith-nope is no console script of pyproject.toml"
    ]
    assert check_command(["rm", "-rf", "x"]) == [
        "rm: not a draftsmith command nor a known outside tool"
    ]
