"""Evaluation prompts: the embedded demo set (held-out stdlib code) or a user file."""

from __future__ import annotations

from pathlib import Path

DEMO_PROMPT_CHARS = 400


def demo_prompts(num_prompts: int) -> list[str]:
    """Prompts cut from the corpus's *test* split (files the demo target never trained on).

    Each prompt is the code just before a ``def``/``class`` line, up to and including that
    line, so the model continues a function or class body: text of the kind it was trained on.
    """
    from data.corpus import load_stdlib_corpus

    test_split = load_stdlib_corpus()["test"]
    prompts: list[str] = []
    for text in test_split["text"]:
        lines = text.splitlines(keepends=True)
        offset, taken = 0, 0
        for line in lines:
            offset += len(line)
            stripped = line.lstrip()
            if stripped.startswith(("def ", "class ")) and offset > DEMO_PROMPT_CHARS:
                prompts.append(text[offset - DEMO_PROMPT_CHARS : offset])
                taken += 1
                if taken == 2:  # at most two prompts per file: spread over many files
                    break
            if len(prompts) >= num_prompts:
                return prompts
    if not prompts:
        raise ValueError("the stdlib test split gave no prompts; pass --prompts FILE instead")
    return prompts


def file_prompts(path: str, num_prompts: int) -> list[str | list[dict[str, str]]]:
    """Prompts from a JSONL/JSON file (``prompt`` or ``messages`` field) or a text file."""
    if path.endswith((".jsonl", ".json")):
        from data.sources import load_prompts

        return load_prompts(path)[:num_prompts]
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"prompt file {file} does not exist; pass a file or 'demo'")
    prompts = [line for line in file.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompt file {file} has no non-empty line")
    return prompts[:num_prompts]


def load_eval_prompts(spec: str, num_prompts: int) -> list[str | list[dict[str, str]]]:
    return list(demo_prompts(num_prompts)) if spec == "demo" else file_prompts(spec, num_prompts)
