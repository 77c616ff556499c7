"""What a chat prompt is answered under: its system turn and, for a reasoning target, whether
it thinks.

A drafter learns the target's distribution in the contexts it is trained on (docs/theory.md
§6). A chat target answers under its system turn, so benchmark prompts sent with another
system turn, or none, measure the drafter in contexts it never saw; and a reasoning target
(Qwen3) served with thinking on writes a ``<think>`` span first, served with thinking off its
answer alone, two different distributions of text. The published recipes fix both: one
system prompt for the data and the evaluation, and data that mixes the two modes when the
target is served in both.

draftsmith keeps one value for each:

- ``data.system_prompt`` (a recipe field): ``draftsmith-regenerate --system-prompt`` sends
  it, training puts it at the head of every conversation that opens without a system turn,
  the drafter's ``provenance.json`` records it, and ``draftsmith-evaluate`` and
  ``draftsmith-benchmark`` give it to every chat prompt unless ``--system-prompt`` says
  otherwise. A conversation that opens with its own system turn keeps it.
- ``draftsmith-regenerate --no-thinking-share F``: a seeded choice of ``round(F * n)`` of the
  n chat prompts is answered with thinking off (Qwen3's ``enable_thinking=False``: through an
  engine, the request's ``chat_template_kwargs``), the rest with the template's default; the
  records say which (``"thinking": false``). Training reads either form
  (``draftsmith.data.templates``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

NO_SYSTEM_PROMPT = "none"  # --system-prompt none: send no system turn, whatever was recorded


def with_system_prompt(
    messages: Sequence[Mapping[str, str]], system_prompt: str | None
) -> list[dict[str, str]]:
    """``messages`` opened by a system turn holding ``system_prompt``; unchanged when it is
    None or empty, or when the conversation opens with a system turn of its own."""
    out = [dict(message) for message in messages]
    if not system_prompt or (out and out[0].get("role") == "system"):
        return out
    return [{"role": "system", "content": system_prompt}, *out]


def prompts_with_system_prompt(prompts: Sequence[Any], system_prompt: str | None) -> list[Any]:
    """Every chat prompt (a list of messages) of ``prompts`` with ``system_prompt``
    (:func:`with_system_prompt`); plain text prompts are continued as they are."""
    return [p if isinstance(p, str) else with_system_prompt(p, system_prompt) for p in prompts]


def system_prompt_argument(value: str) -> str:
    """``--system-prompt``'s value: the text itself, ``@FILE`` for a UTF-8 file's text, or
    ``none`` for no system turn (returned as ``""``). ``ValueError`` names what is wrong."""
    if value.strip().lower() == NO_SYSTEM_PROMPT:
        return ""
    if not value.startswith("@"):
        if not value.strip():
            raise ValueError("--system-prompt is empty; pass the text, @FILE, or none")
        return value
    path = Path(value[1:]).expanduser()
    if not path.is_file():
        raise ValueError(f"--system-prompt {value}: no such file; pass @FILE of a text file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(
            f"--system-prompt {value}: cannot be read as UTF-8 text ({error}); pass a text file"
        ) from None
    if not text.strip():
        raise ValueError(f"--system-prompt {value}: the file is empty; write the prompt in it")
    return text


def thinking_off_indices(count: int, share: float, seed: int) -> frozenset[int]:
    """The prompts (indices in ``0 .. count - 1``) answered with thinking off: a seeded
    choice of ``round(share * count)`` of them, the same for the same count, share and seed."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"--no-thinking-share must be in [0, 1], got {share}")
    return frozenset(random.Random(seed).sample(range(count), round(share * count)))
