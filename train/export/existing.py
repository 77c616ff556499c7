"""Engine layouts for a drafter folder that is already trained (``draftsmith-export``).

A drafter folder written by ``train/distill.py`` (``drafter.json``, ``config.json``,
``model.safetensors``, ``provenance.json``) is read back by its declared kind
(``draftsmith.decode.drafters.registry.detect_drafter_kind``) and written in each asked layout
by the same writers training uses (``draftsmith.train.export.formats``, ``.dflash``), as
``EXPORT_FORMATS_BY_KIND`` allows. What the folder cannot say is read from its
``provenance.json`` (the resolved training config): the EAGLE-3 unroll steps (the trained draft
length, written as the speculators ``speculative_tokens`` and used in the launch lines) and the
target (the speculators verifier, P-EAGLE's embedding table, the launch lines). Every output
folder is checked before any is written, and each is written atomically.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from draftsmith.decode.drafters.folder import trained_config
from draftsmith.train.config import DEMO_TARGET_PRESETS, EXPORT_FORMATS_BY_KIND

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TrainedFacts:
    """What a drafter folder's training said: the draft length and the target."""

    num_speculative_tokens: int
    target: str  # the target's folder or hub id, as the engines are given it


@dataclass(frozen=True)
class WrittenExport:
    """One written layout and the lines that serve it (engine name -> command line)."""

    fmt: str
    folder: Path
    lines: dict[str, str]


def allowed_formats(kind: str) -> tuple[str, ...]:
    """The layouts a ``kind`` drafter exports to; ``ValueError`` naming the kinds that export."""
    formats = EXPORT_FORMATS_BY_KIND.get(kind)
    if not formats:
        kinds = ", ".join(sorted(EXPORT_FORMATS_BY_KIND))
        raise ValueError(
            f"a {kind} drafter has no engine layout this code writes (kinds that export: "
            f"{kinds}); serve it with draftsmith-serve"
        )
    return formats


def check_formats(kind: str, formats: list[str]) -> list[str]:
    """``formats`` if a ``kind`` drafter writes each of them, else ``ValueError`` naming them."""
    allowed = allowed_formats(kind)
    if not formats:
        raise ValueError(f"--format names no layout; a {kind} drafter writes {', '.join(allowed)}")
    bad = [fmt for fmt in formats if fmt not in allowed]
    if bad:
        raise ValueError(
            f"--format {','.join(bad)}: a {kind} drafter exports as {', '.join(allowed)} only"
        )
    return list(dict.fromkeys(formats))


def output_folders(out_root: Path, formats: list[str], overwrite: bool) -> dict[str, Path]:
    """``<out_root>/<fmt>`` per format, refused together before anything is written when one
    exists and ``overwrite`` is off."""
    folders = {fmt: Path(out_root) / fmt for fmt in formats}
    existing = [str(path) for path in folders.values() if path.exists()]
    if existing and not overwrite:
        raise FileExistsError(
            f"{', '.join(existing)} already exist(s): pass --overwrite to replace, or --out "
            "another folder"
        )
    return folders


def trained_facts(
    kind: str,
    drafter: Any,
    provenance: dict[str, Any] | None,
    target: str | None,
    num_speculative_tokens: int | None,
) -> TrainedFacts:
    """The draft length (given, else trained) and the target (given, else trained)."""
    length = num_speculative_tokens or trained_draft_length(kind, drafter, provenance)
    if length < 1:
        raise ValueError(f"--num-speculative-tokens must be >= 1, got {length}")
    return TrainedFacts(length, target or trained_target(provenance))


def trained_draft_length(kind: str, drafter: Any, provenance: dict[str, Any] | None) -> int:
    """The draft length a ``kind`` drafter was trained for: P-EAGLE's depths, Medusa's heads
    and DFlash's block are in its config; EAGLE-3's unroll steps only in the provenance."""
    if kind == "peagle":
        return drafter.config.num_depths
    if kind == "medusa":
        return drafter.config.num_heads
    if kind == "dflash":
        return drafter.config.draft_tokens
    steps = ((provenance or {}).get("loss") or {}).get("unroll_steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(
            "this eagle3 folder has no provenance.json naming loss.unroll_steps (the draft "
            "length it was trained for): pass --num-speculative-tokens N"
        )
    return steps


def trained_target(provenance: dict[str, Any] | None) -> str:
    """The trained target as engines are given it: a demo preset's built folder, a folder or
    hub id; ``ValueError`` asking for ``--target`` when the provenance names none."""
    spec = ((provenance or {}).get("target") or {}).get("target")
    if not isinstance(spec, str) or not spec:
        raise ValueError(
            "this drafter folder has no provenance.json naming its target: pass --target (the "
            "target's folder or hub id, as the engine will be given it)"
        )
    if spec in DEMO_TARGET_PRESETS:
        from draftsmith.train.target.demo import default_target_path

        return str(default_target_path(spec))
    return spec


def load_head(kind: str, folder: Path) -> Any:
    """The trained module of a ``kind`` drafter folder (no target needed)."""
    if kind == "eagle3":
        from draftsmith.decode.drafters.eagle.head import Eagle3Head

        return Eagle3Head.from_pretrained(folder)
    if kind == "peagle":
        from draftsmith.decode.drafters.eagle.peagle import PEagleHead

        return PEagleHead.from_pretrained(folder)
    if kind == "medusa":
        from draftsmith.decode.drafters.medusa import MedusaHeads

        return MedusaHeads.from_pretrained(folder)
    if kind == "dflash":
        from draftsmith.decode.drafters.dflash.head import DFlashHead

        return DFlashHead.from_pretrained(folder)
    allowed_formats(kind)  # raises, naming the kinds that export
    raise AssertionError(kind)


def target_embeddings(target: str) -> torch.Tensor:  # [V, H]
    """The target's input embeddings (P-EAGLE's folder carries them), read without its layers."""
    from draftsmith.train.target.model import load_model_without_layers

    path = Path(target).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"--target {target}: a P-EAGLE export carries the target's embeddings, so the "
            "target must be a local model folder; pass --target PATH"
        )
    return load_model_without_layers(str(path)).get_input_embeddings().weight


def write_layout(
    kind: str,
    head: Any,
    fmt: str,
    out: Path,
    facts: TrainedFacts,
    dtype: torch.dtype | None,
    overwrite: bool,
) -> Path:
    """Write ``head`` in the ``fmt`` layout at ``out`` with the writer training uses."""
    from draftsmith.train.export.formats import export_eagle3, export_medusa, export_peagle

    if kind == "eagle3":
        return export_eagle3(
            head,
            out,
            fmt,  # type: ignore[arg-type]
            dtype=dtype,
            overwrite=overwrite,
            verifier=facts.target,
            num_speculative_tokens=facts.num_speculative_tokens,
        )
    if kind == "peagle":
        embeddings = target_embeddings(facts.target)
        return export_peagle(
            head, embeddings, out, dtype=dtype, overwrite=overwrite, verifier=facts.target
        )
    if kind == "medusa":
        return export_medusa(head, out, dtype=dtype, overwrite=overwrite)
    from draftsmith.train.export.dflash import export_dflash

    return export_dflash(head, out, fmt, dtype=dtype, overwrite=overwrite, verifier=facts.target)


def export_existing(
    folder: str | Path,
    formats: list[str],
    *,
    out_root: str | Path | None = None,
    target: str | None = None,
    num_speculative_tokens: int | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
) -> list[WrittenExport]:
    """Write each of ``formats`` for the trained drafter at ``folder`` (under ``out_root``,
    default the drafter folder itself, as training does) and return the launch lines."""
    from draftsmith.decode.drafters.registry import detect_drafter_kind
    from draftsmith.train.export.launch import serve_lines

    folder = Path(folder).expanduser()
    kind = detect_drafter_kind(folder)  # a missing folder or unknown kind is named there
    formats = check_formats(kind, formats)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    outputs = output_folders(Path(out_root) if out_root else folder, formats, overwrite)
    head = load_head(kind, folder)
    facts = trained_facts(kind, head, trained_config(folder), target, num_speculative_tokens)
    written = []
    for fmt, out in outputs.items():
        path = write_layout(kind, head, fmt, out, facts, DTYPES.get(dtype or ""), overwrite)
        lines = serve_lines(kind, fmt, facts.target, path, facts.num_speculative_tokens)
        written.append(WrittenExport(fmt, path, lines))
    return written
