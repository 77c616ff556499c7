"""Regenerate training data with the target: its own responses to given prompts, as JSONL.

A drafter is accepted where it agrees with the target on the target's *own* outputs, so the
best distillation data is text the target wrote (docs/theory.md §6; DistillSpec, Zhou et al.
2024). This samples one response per prompt from the target and writes one JSON object per
line, loadable with ``datasets.load_dataset("json", data_files=path)`` and by
``train/distill.py --dataset path``:

- plain prompts: ``{"prompt": p, "response": r, "text": p + r}`` (``data_format:
  prompt_response`` trains on the response tokens only);
- chat prompts (``messages``): ``{"messages": [...prompt, {"role": "assistant", "content": r}]}``
  rendered with the tokenizer's chat template (assistant-only loss).

Prompts come from a JSONL/JSON file or ``datasets`` name (``draftsmith.data.sources.load_prompts``), or
from the embedded corpus's training files: the first tokens of its training blocks
(:func:`corpus_prompts`), or the code before its ``def``/``class`` lines, the form of the demo's
evaluation prompts (:func:`corpus_definition_prompts`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from draftsmith.decode.sampling import SamplingConfig
from draftsmith.train.generation import left_pad, sample_continuations

Prompt = str | list[dict[str, str]]


def corpus_prompts(
    tokenizer: Any, prompt_tokens: int, count: int, max_files: int | None
) -> list[str]:
    """Text prompts: the first ``prompt_tokens`` tokens of the corpus's training blocks."""
    from draftsmith.data.corpus import load_stdlib_corpus
    from draftsmith.data.packing import tokenize_and_pack

    corpus = load_stdlib_corpus(max_files=max_files)
    blocks = tokenize_and_pack(corpus["train"], tokenizer, prompt_tokens)
    if len(blocks) == 0:
        raise ValueError("the corpus yields no prompt; raise max_files or lower prompt_tokens")
    step = max(1, len(blocks) // count)  # spread the prompts over the whole corpus
    picked = [blocks[i]["input_ids"] for i in range(0, len(blocks), step)][:count]
    return [tokenizer.decode(ids) for ids in picked]


def corpus_definition_prompts(
    count: int, max_files: int | None, chars: int | None = None
) -> list[str]:
    """Text prompts in the form of the demo's evaluation prompts (``draftsmith.decode.measure.prompts``: the
    ``chars`` characters of code up to a ``def``/``class`` line, so the target writes a body),
    cut from the corpus's *training* files, which the evaluation never reads. Taken in turn
    from every file (the first definition of each file, then the second, ...) so that
    ``count`` prompts spread over the whole corpus; ``chars`` defaults to the evaluation's."""
    from draftsmith.data.corpus import load_stdlib_corpus
    from draftsmith.decode.defaults import DEMO_PROMPT_CHARS
    from draftsmith.decode.measure.prompts import definition_prompts, in_turn

    chars = DEMO_PROMPT_CHARS if chars is None else chars
    if isinstance(chars, bool) or not isinstance(chars, int) or chars < 1:
        raise ValueError(f"--prompt-chars {chars!r}: pass a positive number of characters")
    corpus = load_stdlib_corpus(max_files=max_files)
    ordered = in_turn([list(definition_prompts(t, chars)) for t in corpus["train"]["text"]])
    if not ordered:
        raise ValueError(
            f"the corpus has no def/class line past {chars} characters; lower the prompt length"
        )
    return ordered[:count]


def regenerate(
    target: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    output: Path,
    max_new_tokens: int,
    sampling: SamplingConfig,
    seed: int = 0,
    batch_size: int = 8,
    progress: bool = True,
    thinking_off: frozenset[int] = frozenset(),
) -> dict[str, Any]:
    """Sample a response per prompt and write the JSONL atomically; return counts. The chat
    prompts at ``thinking_off``'s indices are answered with thinking off
    (``draftsmith.data.chat_context``)."""
    from tqdm.auto import tqdm

    chat = check_prompts(prompts)
    device = next(target.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    stops = _stop_ids(tokenizer, chat)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    temp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    records = response_tokens = 0
    with temp.open("w", encoding="utf-8") as stream:
        for start in tqdm(
            range(0, len(prompts), batch_size), disable=not progress, desc="regenerate"
        ):
            chunk = prompts[start : start + batch_size]
            thinks = [start + i not in thinking_off for i in range(len(chunk))]
            ids, mask = left_pad(
                [prompt_ids(tokenizer, p, t) for p, t in zip(chunk, thinks, strict=True)],
                tokenizer.pad_token_id,
            )
            out = sample_continuations(
                target,
                ids.to(device),
                mask.to(device),
                max_new_tokens,
                sampling,
                generator,
                eos_token_id=stops,
                pad_token_id=tokenizer.pad_token_id,
            )
            for prompt, thinking, tokens, valid in zip(
                chunk, thinks, out.tokens, out.valid, strict=True
            ):
                kept = [t for t, v in zip(tokens.tolist(), valid.tolist(), strict=True) if v]
                kept = [t for t in kept if t not in stops]
                response = tokenizer.decode(kept, skip_special_tokens=True)
                stream.write(json.dumps(make_record(prompt, response, thinking)) + "\n")
                records += 1
                response_tokens += len(kept)
    os.replace(temp, output)
    return {"records": records, "response_tokens": response_tokens, "output": str(output)}


def check_prompts(prompts: Sequence[Prompt]) -> bool:
    """Whether ``prompts`` are chat prompts; ``ValueError`` when there are none or they mix
    plain strings and chat messages (checked before the target loads, then by
    :func:`regenerate`)."""
    if not prompts:
        raise ValueError("no prompts to answer; pass a prompts file with at least one record")
    chat = isinstance(prompts[0], list)
    if any(isinstance(p, list) != chat for p in prompts):
        raise ValueError(
            "the prompts mix plain strings and chat messages; one output file holds one kind "
            "(datasets needs one schema): split the prompts file"
        )
    return chat


def prompt_ids(tokenizer: Any, prompt: Prompt, thinking: bool = True) -> list[int]:
    """The token ids the target continues for ``prompt`` (a chat prompt through the chat
    template, with the generation prompt; ``thinking=False`` renders it with
    ``enable_thinking=False``, which templates without the switch ignore); ``ValueError`` when
    it encodes to none."""
    if isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    else:
        switch = {} if thinking else {"enable_thinking": False}
        ids = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, **switch
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
    if not ids:
        raise ValueError(f"prompt {str(prompt)[:80]!r} encodes to no token; remove it")
    return list(ids)


def _stop_ids(tokenizer: Any, chat: bool) -> list[int]:
    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if chat:
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(end, int) and end != tokenizer.unk_token_id and end not in stops:
            stops.append(end)
    return stops


def make_record(prompt: Prompt, response: str, thinking: bool = True) -> dict[str, Any]:
    """The JSONL record of one answered prompt (plain or chat; see the module docstring); a
    chat prompt answered with thinking off says so (``"thinking": false``)."""
    if isinstance(prompt, str):
        return {"prompt": prompt, "response": response, "text": prompt + response}
    record: dict[str, Any] = {"messages": [*prompt, {"role": "assistant", "content": response}]}
    if not thinking:
        record["thinking"] = False
    return record
