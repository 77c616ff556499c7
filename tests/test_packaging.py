"""The installed package: one top-level name, ``draftsmith``, and every command runs from a wheel.

The wheel is built from this checkout and installed without its dependencies into a fresh
virtual environment that sees this environment's third-party packages (torch, transformers,
...) through a plain path entry, but not the editable install of the checkout: every
``draftsmith`` module the commands import comes from the wheel. The commands run from a
folder outside the checkout, so the repository's own folders cannot stand in for the package.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYER_FOLDERS = ("decode", "train", "data", "scripts")


def _console_commands() -> list[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return sorted(project["scripts"])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
    )
    (built,) = out.glob("draftsmith-*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = ["install", "--quiet", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), *install],
        check=True,
        capture_output=True,
        text=True,
    )
    # The dependencies from this environment, as a bare path: its .pth files (the checkout's
    # editable finder among them) are not run, so draftsmith comes from the wheel alone.
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_wheel_installs_one_top_level_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"draftsmith"}
    packaged = {Path(name).parent.as_posix() for name in names if name.endswith("__init__.py")}
    in_tree = {
        "draftsmith/" + init.parent.relative_to(ROOT).as_posix()
        for folder in LAYER_FOLDERS
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert in_tree - packaged == set(), "packages missing from pyproject.toml's packages list"


def test_every_command_runs_from_the_wheel(fresh_venv: Path, tmp_path: Path) -> None:
    python = fresh_venv / "bin" / "python"
    where = subprocess.run(
        [str(python), "-c", "import draftsmith.decode.engine as m; print(m.__file__)"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(fresh_venv), where
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    running = {
        command: subprocess.Popen(
            [str(fresh_venv / "bin" / command), "--help"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for command in _console_commands()
    }
    failed = {}
    for command, process in running.items():
        output, _ = process.communicate(timeout=300)
        if process.returncode != 0 or "usage:" not in output:
            failed[command] = output[-2000:]
    assert not failed, failed
