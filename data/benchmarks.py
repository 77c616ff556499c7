"""Prompt files in the shapes of the benchmarks speculative decoding is reported on.

Users report acceptance on MT-Bench, GSM8K and HumanEval (the EAGLE papers, SpecForge's and
speculators' evaluations); they bring the files, we read them in their published shapes, one
JSON record per line (or a JSON list):

- MT-Bench (``question.jsonl`` of FastChat's llm_judge; EAGLE's ``mt_bench`` file):
  ``{"question_id", "category", "turns": [first, second]}``; the prompt is the first turn;
- GSM8K (``test.jsonl`` of openai/grade-school-math): ``{"question", "answer"}``; the
  prompt is the question;
- HumanEval (``HumanEval.jsonl`` of openai/human-eval): ``{"task_id", "prompt",
  "canonical_solution", "test", "entry_point"}``; the prompt is the function to complete;
- anything ``draftsmith.data.sources.load_prompts`` reads: ``{"prompt"}`` (text, continued as is) or
  ``{"messages"}`` / ShareGPT ``{"conversations"}`` (chat, minus a final assistant turn).

Benchmark questions become one-turn chat prompts ``[{"role": "user", "content": ...}]``, which
the target's chat template renders: the served setting of an instruct model, as SpecForge and
speculators run them. Only the first MT-Bench turn is asked: its second turn needs the
target's answer to the first (this reader sees none), so the file's second turns are not used.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from draftsmith.data.sources import json_records, load_prompts

Prompt = str | list[dict[str, str]]
# name -> (fields that identify the shape, the field that holds the question)
SHAPES: dict[str, tuple[tuple[str, ...], str]] = {
    "mtbench": (("turns",), "turns"),
    "humaneval": (("task_id", "prompt", "entry_point"), "prompt"),
    "gsm8k": (("question", "answer"), "question"),
}


def benchmark_shape(record: Mapping[str, Any]) -> str | None:
    """``mtbench``, ``humaneval`` or ``gsm8k`` when ``record`` has that benchmark's fields."""
    for name, (fields, _) in SHAPES.items():
        if all(field in record for field in fields):
            return name
    return None


def _question(record: Mapping[str, Any], shape: str, where: str) -> str:
    value = record[SHAPES[shape][1]]
    if shape == "mtbench":
        if not isinstance(value, list) or not value:
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings (MT-Bench)")
        value = value[0]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"{where}: the {shape} question ({SHAPES[shape][1]!r}) must be a non-empty string"
        )
    return value


def load_benchmark_prompts(path: str | Path, num_prompts: int | None = None) -> list[Prompt]:
    """The prompts of a benchmark file, in file order, at most ``num_prompts``.

    The shape is read from the first record (MT-Bench, GSM8K, HumanEval, else prompts or
    conversations); every record must have it.
    """
    path = Path(path).expanduser()
    records = json_records(path)
    if not records:
        raise ValueError(f"benchmark file {path} holds no records")
    shape = benchmark_shape(records[0][1]) if isinstance(records[0][1], Mapping) else None
    if shape is None:
        return load_prompts(path)[:num_prompts]
    prompts: list[Prompt] = []
    for where, record in records[:num_prompts]:
        if not isinstance(record, Mapping) or benchmark_shape(record) != shape:
            fields = sorted(record) if isinstance(record, Mapping) else type(record).__name__
            raise ValueError(
                f"{where}: not a {shape} record like the file's first (fields {fields}); "
                "keep one benchmark per file"
            )
        prompts.append([{"role": "user", "content": _question(record, shape, where)}])
    return prompts
