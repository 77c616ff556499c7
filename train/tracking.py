"""Experiment tracking: accelerate's trackers plus a JSONL log that is always written.

``report_to`` picks the trackers: ``wandb`` (the default), ``tensorboard``, ``none``, or a comma
list. W&B switches itself to offline mode (``WANDB_MODE=offline``: the run is written under
``<output_dir>/wandb/offline-run-*`` and can be uploaded later with ``wandb sync``) when no API
key is configured or its server cannot be reached; an explicit ``WANDB_MODE`` is respected.
Whatever the trackers, ``<output_dir>/logs/metrics.jsonl`` receives one JSON object per logged
step (appended, so a resumed run continues the same file; on resume the rows after the
checkpoint's step are dropped first, since those steps run again).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from draftsmith.data.atomic_io import write_text_atomic

logger = logging.getLogger(__name__)

WANDB_HOST = "api.wandb.ai"
METRICS_FILE = "metrics.jsonl"


def wandb_api_key_configured(environ: Mapping[str, str] | None = None) -> bool:
    """Whether W&B would find credentials: ``WANDB_API_KEY`` or a netrc entry for its host.

    Only the presence of an entry is checked; nothing is read from it.
    """
    environ = os.environ if environ is None else environ
    if environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        return netrc.netrc().authenticators(WANDB_HOST) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def can_reach(host: str = WANDB_HOST, port: int = 443, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def resolve_wandb_mode(
    environ: Mapping[str, str],
    has_api_key: Callable[[], bool],
    network_ok: Callable[[], bool],
) -> str:
    """``WANDB_MODE`` if set; else offline without a key or without network; else online."""
    explicit = environ.get("WANDB_MODE")
    if explicit:
        return explicit
    if environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "disabled"
    if not has_api_key():
        return "offline"
    if not network_ok():
        return "offline"
    return "online"


class RunTracker:
    """Logs metrics to the chosen trackers (main process) and to metrics.jsonl."""

    def __init__(
        self,
        accelerator: Accelerator,
        reporters: list[str],
        project: str,
        run_name: str,
        config: dict[str, Any],
        output_dir: Path,
        resume_step: int | None = None,
    ) -> None:
        self.accelerator = accelerator
        self.reporters = [name for name in reporters if name != "none"]
        self.log_path = Path(output_dir) / "logs" / METRICS_FILE
        self.wandb_mode: str | None = None
        if not accelerator.is_main_process:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            truncate_metrics_log(self.log_path, resume_step)
        if not self.reporters:
            return
        init_kwargs: dict[str, Any] = {}
        if "wandb" in self.reporters:
            self.wandb_mode = resolve_wandb_mode(os.environ, wandb_api_key_configured, can_reach)
            os.environ["WANDB_MODE"] = self.wandb_mode
            if self.wandb_mode == "offline":
                logger.warning(
                    "W&B runs offline (no API key or no network): the run is kept under %s/wandb;"
                    " upload it later with `wandb sync`",
                    output_dir,
                )
            init_kwargs["wandb"] = {"name": run_name, "dir": str(output_dir)}
        accelerator.init_trackers(project, config=_flat_scalars(config), init_kwargs=init_kwargs)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` at ``step`` (call on any process; only the main one writes)."""
        if not self.accelerator.is_main_process:
            return
        clean = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        with self.log_path.open("a") as stream:
            stream.write(json.dumps({"step": step, **clean}) + "\n")
        if self.reporters:
            self.accelerator.log(clean, step=step)

    def finish(self) -> None:
        if self.reporters:
            self.accelerator.end_training()


def truncate_metrics_log(path: Path, last_step: int) -> int:
    """Keep the records up to ``last_step`` (a resumed run logs later steps again).

    A line that does not parse (a write cut short by a kill) is dropped too. Returns the
    number of records removed.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    kept, removed = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            keep = isinstance(record, dict) and int(record["step"]) <= last_step
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            keep = False
        if keep:
            kept.append(line)
        elif line.strip():
            removed += 1
    if removed:
        write_text_atomic(path, "".join(f"{line}\n" for line in kept))
    return removed


def read_metrics_log(path: Path) -> list[dict[str, float]]:
    """The records of a metrics.jsonl file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _flat_scalars(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config -> ``section/key: scalar`` (trackers such as TensorBoard need scalars)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flat_scalars(value, f"{name}/"))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
