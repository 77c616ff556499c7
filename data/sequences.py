"""Training and held-out token sequences from one named source, and their collation.

Rows are ``{"input_ids": [T], "loss_mask": [T]}``: ``loss_mask[t] = 1`` when token t is one
a model trained on the row should predict (every token of packed text; assistant tokens of
conversations; response tokens of prompt/response pairs).

Sources (``load_sequences``'s ``source``):

- ``stdlib``: the embedded corpus (``draftsmith.data.corpus``), packed into blocks; its validation split
  is the held-out set;
- a ``.jsonl``/``.json`` file: conversations (``messages_field``, or ShareGPT's
  ``conversations`` of ``from``/``value`` turns), prompt/response pairs
  (``prompt`` + ``response``) or text (``text_field``); ``data_format="auto"`` picks by the
  fields of the first record; a deterministic ``validation_fraction`` of rows is held out;
- a text file, or a folder of ``.txt``/``.py``/``.md``/``.rst`` files: packed like the corpus;
- anything else: a ``datasets`` name (hub or local cache), read like a JSONL file.

Field names and sizes arrive as plain arguments: this module knows no recipe and no model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from draftsmith.data.cache import collate_cached
from draftsmith.data.chat_context import with_system_prompt
from draftsmith.data.packing import collate, map_to_rows, render_and_pad, tokenize_and_pack
from draftsmith.data.sources import (
    conversation_field,
    load_conversations,
    load_jsonl,
    load_records,
    load_text_files,
)

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

Row = dict[str, Any]
TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst")
CACHE_FIELDS = ("topk_ids", "topk_logprobs", "rest_logmass")


@dataclass
class SequenceSets:
    """Tokenised training and held-out rows, and a description for the model card."""

    train: Sequence[Row]
    held_out: Sequence[Row]
    description: str


def load_sequences(
    source: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    block_size: int,
    validation_fraction: float,
    seed: int,
    data_format: str = "auto",
    text_field: str = "text",
    messages_field: str = "messages",
    max_files: int | None = None,
    max_train_sequences: int | None = None,
    system_prompt: str | None = None,
) -> SequenceSets:
    """Read, tokenise and split ``source``; raise if it yields no sequence. Conversations
    that open without a system turn get ``system_prompt`` (``draftsmith.data.chat_context``)."""
    if source == "stdlib":
        sets = _stdlib(tokenizer, block_size, max_files)
    else:
        path = Path(source).expanduser()
        if path.is_dir() or (path.is_file() and path.suffix not in (".jsonl", ".json")):
            sets = _text_files(path, tokenizer, block_size, validation_fraction, seed)
        else:
            if path.suffix in (".jsonl", ".json") and not path.is_file():
                raise FileNotFoundError(
                    f"--dataset {source}: no such file; pass an existing .jsonl/.json file, a "
                    "text file or folder, stdlib, or a datasets name"
                )
            records = path if path.suffix in (".jsonl", ".json") else source
            fields = _Fields(data_format, text_field, messages_field, system_prompt)
            sets = _records(records, fields, tokenizer, block_size, validation_fraction, seed)
    if max_train_sequences is not None:
        sets.train = take(sets.train, max_train_sequences)
    if len(sets.train) == 0:
        raise ValueError(
            f"--dataset {source} yields no training sequence (block_size={block_size}): "
            "add data, lower --block_size, or check --text_field/--messages_field"
        )
    if len(sets.held_out) == 0:
        raise ValueError(
            f"--dataset {source} leaves no held-out sequence: raise --validation_fraction or "
            "add data"
        )
    return sets


def take(rows: Sequence[Row], count: int) -> Sequence[Row]:
    """The first ``count`` rows (a ``datasets.Dataset`` stays one, without copying)."""
    if hasattr(rows, "select"):
        return rows.select(range(min(count, len(rows))))
    return list(rows)[:count]


def collate_rows(rows: list[Row], pad_token_id: int) -> dict[str, torch.Tensor]:
    """``draftsmith.data.packing.collate``, plus the offline cache's fields when rows carry them."""
    batch = collate(rows, pad_token_id)
    if CACHE_FIELDS[0] in rows[0]:
        cached = collate_cached(rows, pad_token_id)
        for key in CACHE_FIELDS:
            batch[key] = cached[key]
    return batch


def render_prompt_response(
    table: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, block_size: int
) -> datasets.Dataset:
    """``prompt + response + eos``, loss on the response (and eos) only, truncated."""
    eos = tokenizer.eos_token_id

    def render(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        ids_out, mask_out = [], []
        prompts = tokenizer(batch["prompt"], add_special_tokens=False)["input_ids"]
        responses = tokenizer(batch["response"], add_special_tokens=False)["input_ids"]
        for prompt, response in zip(prompts, responses, strict=True):
            tail = response + ([eos] if eos is not None else [])
            ids = (prompt + tail)[:block_size]
            mask = ([0] * len(prompt) + [1] * len(tail))[:block_size]
            if any(mask[1:]):
                ids_out.append(ids)
                mask_out.append(mask)
        return {"input_ids": ids_out, "loss_mask": mask_out}

    return map_to_rows(table, render, f"render prompt/response pairs (max {block_size} tokens)")


# ---------------------------------------------------------------------- sources


def _stdlib(
    tokenizer: PreTrainedTokenizerBase, block_size: int, max_files: int | None
) -> SequenceSets:
    from draftsmith.data.corpus import load_stdlib_corpus

    corpus = load_stdlib_corpus(max_files=max_files)
    train = tokenize_and_pack(corpus["train"], tokenizer, block_size)
    held_out = tokenize_and_pack(corpus["validation"], tokenizer, block_size)
    files = len(corpus["train"])
    return SequenceSets(
        train,
        held_out,
        f"the embedded corpus (Python standard library source, {files} training files, "
        f"blocks of {block_size} tokens)",
    )


def _text_files(
    path: Path,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    validation_fraction: float,
    seed: int,
) -> SequenceSets:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise ValueError(
                f"--dataset {path}: the folder holds no {', '.join(TEXT_SUFFIXES)} files"
            )
    else:
        files = [path]
    texts = load_text_files(files)
    if len(texts) > 1:
        split = texts.train_test_split(test_size=validation_fraction, seed=seed)
        train_docs, held_docs = split["train"], split["test"]
    else:
        train_docs = held_docs = texts
    train = tokenize_and_pack(train_docs, tokenizer, block_size)
    held_out = tokenize_and_pack(held_docs, tokenizer, block_size)
    if len(texts) == 1:  # one document: hold out its last blocks instead
        cut = max(1, int(len(train) * validation_fraction)) if len(train) > 1 else 0
        held_out = train.select(range(len(train) - cut, len(train))) if cut else train
        train = train.select(range(len(train) - cut))
    return SequenceSets(train, held_out, f"text files under {path} ({len(texts)} documents)")


@dataclass(frozen=True)
class _Fields:
    """Which record layout to read (auto, text, conversations, prompt_response) and the names
    of its fields."""

    data_format: str
    text_field: str
    messages_field: str
    system_prompt: str | None = None  # opens every conversation that has no system turn

    def detect(self, columns: list[str], source: str | Path) -> str:
        """The layout of records with ``columns`` (``data_format`` unless it is ``auto``)."""
        if self.data_format != "auto":
            return self.data_format
        if conversation_field(columns, self.messages_field) is not None:
            return "conversations"
        if "prompt" in columns and "response" in columns:
            return "prompt_response"
        if self.text_field in columns:
            return "text"
        raise ValueError(
            f"--dataset {source}: records have fields {sorted(columns)}, none of "
            f"{self.messages_field!r} (conversations), 'prompt'+'response', or "
            f"{self.text_field!r} (text); set --messages_field or --text_field"
        )

    def required(self, fmt: str, columns: list[str]) -> list[tuple[str, str]]:
        """(field, the argument that names it) for each field layout ``fmt`` reads."""
        if fmt == "conversations":
            return [
                (
                    conversation_field(columns, self.messages_field) or self.messages_field,
                    "messages_field",
                )
            ]
        if fmt == "prompt_response":
            return [("prompt", "data_format"), ("response", "data_format")]
        return [(self.text_field, "text_field")]


def _records(
    source: str | Path,
    fields: _Fields,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    validation_fraction: float,
    seed: int,
) -> SequenceSets:
    """JSON records (``source`` a ``Path``) or a ``datasets`` name, rendered by layout."""
    table = load_records(source)
    fmt = fields.detect(table.column_names, source)
    for column, argument in fields.required(fmt, table.column_names):
        if column not in table.column_names:
            raise ValueError(
                f"--dataset {source} has no field {column!r} (fields: "
                f"{sorted(table.column_names)}); set --{argument} to the field that holds the data"
            )
    if len(table) < 2:
        raise ValueError(
            f"--dataset {source} has {len(table)} record(s); at least 2 are needed to hold one out"
        )
    if fmt == "conversations":
        table = load_conversations(source, fields.messages_field)  # validates every message
        if fields.system_prompt:
            table = table.map(
                lambda record: {
                    "messages": with_system_prompt(record["messages"], fields.system_prompt)
                }
            )
    elif fmt == "text" and isinstance(source, Path):
        table = load_jsonl(source, fields.text_field)
    split = table.train_test_split(test_size=validation_fraction, seed=seed)
    out = {}
    for name in ("train", "test"):
        part = split[name]
        if fmt == "conversations":
            out[name] = render_and_pad(part, tokenizer, block_size)
        elif fmt == "prompt_response":
            out[name] = render_prompt_response(part, tokenizer, block_size)
        else:
            field = "text" if isinstance(source, Path) else fields.text_field
            out[name] = tokenize_and_pack(part, tokenizer, block_size, field)
    return SequenceSets(out["train"], out["test"], f"{source} ({fmt}, {len(table)} records)")
