"""The import direction of the layers (docs/architecture.md), no import cycle, no shadowing.

``ARROWS`` below is the one table of allowed imports between the project's packages; the
architecture document describes it arrow by arrow, and the tests check both that the code draws
no other arrow and that every arrow in the table is really drawn (so the table never goes
stale). Import cycles between modules are forbidden too, lazy imports inside functions included.

``accelerate launch train/distill.py`` puts ``train/`` first on ``sys.path``, so a
``train/datasets.py`` would replace the real ``datasets`` for the whole run.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("scripts", "train", "decode", "data")
"""The project's packages from the top layer down; an arrow may only point down this list."""

TRAINING_ONLY = frozenset({"accelerate", "peft", "wandb"})
"""Third-party packages that only ``train/`` may import: inference never needs them."""


@dataclass(frozen=True)
class Arrow:
    """Modules of package ``source`` may import package ``target``.

    ``only`` names the files (relative to the repository root) allowed to draw the arrow; an
    empty set means any module of ``source`` may.
    """

    source: str
    target: str
    why: str
    only: frozenset[str] = frozenset()


ARROWS: tuple[Arrow, ...] = (
    Arrow("scripts", "train", "command lines over training: demo target, data regeneration"),
    Arrow("scripts", "decode", "command lines over decoding: benchmark, load test, plots"),
    Arrow("scripts", "data", "prompt records for data regeneration"),
    Arrow("train", "decode", "drafter architectures, sampling and the decoder that training uses"),
    Arrow("train", "data", "corpora, records, templates, packing and the offline target cache"),
    Arrow(
        "decode",
        "data",
        "evaluation prompts (the demo set is cut from the corpus, prompt files are records) and "
        "the atomic write of evaluate's JSON report (draftsmith.data.atomic_io, the one atomic writer)",
        only=frozenset({"decode/measure/prompts.py", "decode/measure/evaluate.py"}),
    ),
)


def _package_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the layered packages."""
    files: dict[str, Path] = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def _test_files() -> dict[str, Path]:
    """Module name -> file for tests/: the shared helpers at its top under the names the tests
    import them by (``tests/`` is on ``sys.path``), the test modules under ``tests.<path>``."""
    files: dict[str, Path] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        relative = path.relative_to(ROOT / "tests").with_suffix("")
        name = relative.name if len(relative.parts) == 1 else ".".join(("tests", *relative.parts))
        files[name] = path
    return files


FILES = _package_files()
TEST_FILES = _test_files()
GRAPH_FILES = {**FILES, **TEST_FILES}
"""Every project .py file: the layered packages and the tests (for the cycle check)."""


def _is_type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str, *, runtime_only: bool) -> list[str]:
    """Dotted names ``path`` imports anywhere in its body (functions included).

    ``from a.b import c`` yields ``a.b.c`` where that is a module of the project, else ``a.b``;
    relative imports are resolved against ``module``. With ``runtime_only``, imports under
    ``if TYPE_CHECKING:`` are left out: they exist for annotations and never run.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped: set[int] = set()
    if runtime_only:
        for node in ast.walk(tree):
            if _is_type_checking_block(node):
                skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names: list[str] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                names.append(submodule if submodule in GRAPH_FILES else source)
    # The layered packages install as draftsmith.<layer>; the graph names them by their folder.
    return [name.removeprefix("draftsmith.") for name in names]


def _project_module(name: str) -> str | None:
    """The longest prefix of ``name`` that is a module of the project, if any."""
    while name and name not in GRAPH_FILES:
        name = name.rpartition(".")[0]
    return name or None


def _arrows_drawn() -> dict[tuple[str, str], set[str]]:
    """(source package, target package) -> files that import across it."""
    drawn: dict[tuple[str, str], set[str]] = {}
    for module, path in FILES.items():
        source = module.split(".")[0]
        for name in _imports(path, module, runtime_only=False):
            # A test helper is imported by its bare name (``tiny_models``): still tests/.
            target = "tests" if _project_module(name) in TEST_FILES else name.split(".")[0]
            if target in (*LAYERS, "tests") and target != source:
                drawn.setdefault((source, target), set()).add(str(path.relative_to(ROOT)))
    return drawn


def test_arrows_point_down_the_layers() -> None:
    for arrow in ARROWS:
        assert LAYERS.index(arrow.source) < LAYERS.index(arrow.target), (
            f"{arrow.source}/ -> {arrow.target}/ points up the layers {' -> '.join(LAYERS)}"
        )


def test_every_import_follows_an_allowed_arrow() -> None:
    allowed = {(arrow.source, arrow.target): arrow.only for arrow in ARROWS}
    offenders = []
    for (source, target), files in sorted(_arrows_drawn().items()):
        if (source, target) not in allowed:
            offenders.append(f"{source}/ -> {target}/ is no allowed arrow: {sorted(files)}")
        elif allowed[source, target] and files - allowed[source, target]:
            outside = sorted(files - allowed[source, target])
            offenders.append(
                f"{source}/ -> {target}/ is allowed only from "
                f"{sorted(allowed[source, target])}, not from {outside}"
            )
    assert not offenders, "\n".join(offenders)


def test_every_allowed_arrow_is_drawn() -> None:
    """A stale table would allow imports nobody needs: drop an arrow once nothing draws it."""
    drawn = _arrows_drawn()
    for arrow in ARROWS:
        files = drawn.get((arrow.source, arrow.target), set())
        assert files, f"nothing imports across {arrow.source}/ -> {arrow.target}/: remove it"
        missing = arrow.only - files
        assert not missing, f"{sorted(missing)} no longer import {arrow.target}/: update ARROWS"


def test_architecture_doc_describes_every_arrow() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = [
        f"{a.source}/ -> {a.target}/" for a in ARROWS if f"{a.source}/ -> {a.target}/" not in doc
    ]
    assert not missing, f"docs/architecture.md does not describe the arrows {missing}"


def test_training_stack_stays_in_train() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(found)
        for module, path in FILES.items()
        if not module.startswith("train")
        and (
            found := {n.split(".")[0] for n in _imports(path, module, runtime_only=False)}
            & TRAINING_ONLY
        )
    }
    assert not offenders, f"only train/ may import {sorted(TRAINING_ONLY)}: {offenders}"


def _import_graph() -> dict[str, set[str]]:
    """Module -> project modules it imports at run time (module level or inside functions),
    over every project file, tests included."""
    graph: dict[str, set[str]] = {}
    for module, path in GRAPH_FILES.items():
        targets = {_project_module(name) for name in _imports(path, module, runtime_only=True)}
        graph[module] = {target for target in targets if target and target != module}
    return graph


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: every node lands in exactly one component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def test_scc_finder_reports_cycles_and_only_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set(), "f": {"f"}}
    components = sorted(strongly_connected_components(graph))
    assert components == [["a", "b", "c"], ["d"], ["e"], ["f"]]


def test_no_import_cycles() -> None:
    cycles = [c for c in strongly_connected_components(_import_graph()) if len(c) > 1]
    assert not cycles, "import cycles between modules (break each one): " + "; ".join(
        " <-> ".join(cycle) for cycle in cycles
    )


@pytest.mark.parametrize("package", ["train", "decode", "data"])
def test_no_module_shadows_an_installed_package(package: str) -> None:
    shadowing = []
    for path in (ROOT / package).rglob("*.py"):
        name = path.stem
        if name == "__init__" or path.parent != ROOT / package:
            continue
        known = name in sys.stdlib_module_names or importlib.util.find_spec(name) is not None
        if known and name not in {package}:
            spec = importlib.util.find_spec(name)
            origin = getattr(spec, "origin", "") or ""
            if not origin.startswith(str(ROOT)):
                shadowing.append(f"{package}/{name}.py shadows {name}")
    assert not shadowing, shadowing


def test_the_decoder_loads_nothing_of_data() -> None:
    """Only ``decode/measure/prompts.py`` and ``decode/measure/evaluate.py``'s report writer draw
    ``decode/ -> data/``, and nothing the decoder, the evaluation loop or the server need at
    import time imports ``data/``."""
    import subprocess

    code = (
        "import sys, decode, draftsmith.decode.engine, draftsmith.decode.measure.evaluate, draftsmith.decode.drafters.registry\n"
        "print(sorted(m for m in sys.modules if m == 'data' or m.startswith('data.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
