"""Speculative decoding: drafters, exact verification, the engine, evaluation and serving.

The public names are imported lazily so that ``import draftsmith.decode.sampling`` stays light.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "SpeculativeDecoder": "draftsmith.decode.engine",
    "GenerateOutput": "draftsmith.decode.engine",
    "DecodeStats": "draftsmith.decode.stats",
    "SamplingConfig": "draftsmith.decode.sampling",
    "DraftModelDrafter": "draftsmith.decode.drafters.draft_lm",
    "NgramDrafter": "draftsmith.decode.drafters.ngram",
    "NoDrafter": "draftsmith.decode.drafters.none",
    "load_drafter": "draftsmith.decode.drafters.registry",
    "detect_drafter_kind": "draftsmith.decode.drafters.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'decode' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
