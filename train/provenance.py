"""Where a trained artifact came from: the one record the export and every checkpoint carry.

``provenance.json`` (``draftsmith.decode.drafters.folder.PROVENANCE_FILE``) holds the resolved
training config (every section, and the recipe file it came from), the git revision of the code
(``{"commit", "dirty"}``, or null outside a checkout), the versions of the packages that shape
the result, the Python version and platform, and the time it was written (UTC).
"""

from __future__ import annotations

import platform
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = (
    "draftsmith",
    "torch",
    "transformers",
    "accelerate",
    "peft",
    "datasets",
    "tokenizers",
    "safetensors",
    "huggingface_hub",
    "wandb",
)


def build_provenance(resolved_config: dict[str, Any]) -> dict[str, Any]:
    """Resolved config, git revision of the code, package versions, platform, time."""
    return {
        "config": resolved_config,
        "git": git_revision(),
        "packages": package_versions(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def git_revision(start: Path | None = None) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the checkout holding this package, or None outside git."""
    root = start or Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        if commit.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def package_versions() -> dict[str, str | None]:
    """Installed version of each of ``PACKAGES`` (None where it is not installed)."""
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions
