"""Exports: the drafter folder draftsmith decodes, and the layouts vLLM, SGLang and speculators read."""
