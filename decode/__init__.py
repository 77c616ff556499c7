"""Speculative decoding: drafters, exact verification, the engine, evaluation and serving.

The public names are imported lazily so that ``import decode.sampling`` stays light.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "SpeculativeDecoder": "decode.engine",
    "GenerateOutput": "decode.engine",
    "DecodeStats": "decode.stats",
    "SamplingConfig": "decode.sampling",
    "DraftModelDrafter": "decode.drafters.draft_lm",
    "NgramDrafter": "decode.drafters.ngram",
    "NoDrafter": "decode.drafters.none",
    "load_drafter": "decode.drafters.registry",
    "detect_drafter_kind": "decode.drafters.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'decode' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
