"""Drafter kinds (draft_lm, ngram, medusa, eagle3, peagle), the runtime protocol and the registry."""

from draftsmith.decode.drafters.registry import DRAFTER_LOADERS, detect_drafter_kind, load_drafter

__all__ = ["DRAFTER_LOADERS", "detect_drafter_kind", "load_drafter"]
