"""Training and held-out sequences for distillation, from the embedded corpus or user data.

Rows are ``{"input_ids": [T], "loss_mask": [T]}``: ``loss_mask[t] = 1`` when token t is one
the drafter should predict (every token of packed text; assistant tokens of conversations;
response tokens of prompt/response pairs written by ``scripts/regenerate_data.py``).

Sources (``DataConfig.dataset``):

- ``stdlib``: the embedded corpus (``data.corpus``), packed into blocks; its validation split
  is the held-out set;
- a ``.jsonl``/``.json`` file: conversations (``messages``), prompt/response pairs
  (``prompt`` + ``response``) or text (``text``); ``data_format: auto`` picks by the fields of
  the first record; a deterministic ``validation_fraction`` of rows is held out;
- a text file, or a folder of ``.txt``/``.py``/``.md`` files: packed like the corpus;
- anything else: a ``datasets`` name (hub or local cache), read like a JSONL file.

The held-out set used for the overlap metric is, by default, held-out prompts continued by the
target itself (``eval_source: target_samples``): acceptance is measured on the target's own
outputs (docs/theory.md §6), so that is where the overlap must be measured too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from decode.sampling import SamplingConfig
from train.generation import sample_continuations

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

    from train.config import DataConfig

Row = dict[str, Any]
TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst")


@dataclass
class SequenceSets:
    """Tokenised training and held-out rows, and a description for the model card."""

    train: Sequence[Row]
    held_out: Sequence[Row]
    description: str


def load_sequences(
    config: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> SequenceSets:
    """Read, tokenise and split the configured source; raise if it yields no sequence."""
    source = config.dataset
    if source == "stdlib":
        sets = _stdlib(config, tokenizer)
    else:
        path = Path(source).expanduser()
        if path.is_dir() or (path.is_file() and path.suffix not in (".jsonl", ".json")):
            sets = _text_files(path, config, tokenizer, seed)
        elif path.suffix in (".jsonl", ".json"):
            if not path.is_file():
                raise FileNotFoundError(
                    f"--dataset {source}: no such file; pass an existing .jsonl/.json file, a "
                    "text file or folder, stdlib, or a datasets name"
                )
            sets = _records(path, config, tokenizer, seed)
        else:
            sets = _records(source, config, tokenizer, seed)
    if config.max_train_sequences is not None:
        sets.train = _take(sets.train, config.max_train_sequences)
    if len(sets.train) == 0:
        raise ValueError(
            f"--dataset {source} yields no training sequence (block_size={config.block_size}): "
            "add data, lower --block_size, or check --text_field/--messages_field"
        )
    if len(sets.held_out) == 0:
        raise ValueError(
            f"--dataset {source} leaves no held-out sequence: raise --validation_fraction or "
            "add data"
        )
    return sets


def collate_rows(rows: list[Row], pad_token_id: int) -> dict[str, torch.Tensor]:
    """``data.packing.collate``, plus the cache fields when rows carry them."""
    from data.cache import collate_cached
    from data.packing import collate

    batch = collate(rows, pad_token_id)
    if "topk_ids" in rows[0]:
        cached = collate_cached(rows, pad_token_id)
        for key in ("topk_ids", "topk_logprobs", "rest_logmass"):
            batch[key] = cached[key]
    return batch


@torch.no_grad()
def target_continued_rows(
    target: torch.nn.Module,
    held_out: Sequence[Row],
    num_sequences: int,
    prompt_tokens: int,
    new_tokens: int,
    temperature: float,
    seed: int,
    eos_token_id: int | None,
    pad_token_id: int,
    device: torch.device,
    batch_size: int = 16,
) -> list[Row]:
    """Held-out prompts continued by the target: ``loss_mask`` marks the continuation.

    Prompts are the first ``prompt_tokens`` tokens of held-out rows with at least that many
    tokens; the target samples ``new_tokens`` tokens at ``temperature`` (greedy at 0) from a
    generator seeded by ``seed``, so every process builds the same set.
    """
    prompts = [
        list(row["input_ids"][:prompt_tokens])
        for row in held_out
        if len(row["input_ids"]) >= prompt_tokens
    ][:num_sequences]
    if not prompts:
        raise ValueError(
            f"no held-out sequence has {prompt_tokens} tokens to use as a prompt: lower "
            "--eval_prompt_tokens or add held-out data"
        )
    generator = torch.Generator(device).manual_seed(seed)
    sampling = SamplingConfig(temperature=temperature)
    rows: list[Row] = []
    for start in range(0, len(prompts), batch_size):
        chunk = torch.tensor(prompts[start : start + batch_size], device=device)
        out = sample_continuations(
            target,
            chunk,
            torch.ones_like(chunk),
            new_tokens,
            sampling,
            generator,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
        for prompt, tokens, valid in zip(chunk, out.tokens, out.valid, strict=True):
            kept = int(valid.sum())
            ids = prompt.tolist() + tokens[:kept].tolist()
            rows.append({"input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * kept})
    return rows


def held_out_rows(held_out: Sequence[Row], num_sequences: int) -> list[Row]:
    """The first ``num_sequences`` held-out rows as they are (``eval_source: data``)."""
    return [dict(held_out[i]) for i in range(min(num_sequences, len(held_out)))]


# ---------------------------------------------------------------------- sources


def _stdlib(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> SequenceSets:
    from data.corpus import load_stdlib_corpus
    from data.packing import tokenize_and_pack

    corpus = load_stdlib_corpus(max_files=config.max_files)
    train = tokenize_and_pack(corpus["train"], tokenizer, config.block_size)
    held_out = tokenize_and_pack(corpus["validation"], tokenizer, config.block_size)
    files = len(corpus["train"])
    return SequenceSets(
        train,
        held_out,
        f"the embedded corpus (Python standard library source, {files} training files, "
        f"blocks of {config.block_size} tokens)",
    )


def _text_files(
    path: Path, config: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> SequenceSets:
    from data.packing import tokenize_and_pack
    from data.sources import load_text_files

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
        split = texts.train_test_split(test_size=config.validation_fraction, seed=seed)
        train_docs, held_docs = split["train"], split["test"]
    else:
        train_docs = held_docs = texts
    train = tokenize_and_pack(train_docs, tokenizer, config.block_size)
    held_out = tokenize_and_pack(held_docs, tokenizer, config.block_size)
    if len(texts) == 1:  # one document: hold out its last blocks instead
        cut = max(1, int(len(train) * config.validation_fraction)) if len(train) > 1 else 0
        held_out = train.select(range(len(train) - cut, len(train))) if cut else train
        train = train.select(range(len(train) - cut))
    return SequenceSets(train, held_out, f"text files under {path} ({len(texts)} documents)")


def _records(
    source: str | Path, config: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> SequenceSets:
    from data.packing import render_and_pad, tokenize_and_pack

    table = _load_table(source)
    fmt = config.data_format
    if fmt == "auto":
        fmt = _detect_format(table.column_names, config, source)
    if fmt == "conversations":
        _require(table, config.messages_field, source, "messages_field")
    elif fmt == "prompt_response":
        _require(table, "prompt", source, "data_format")
        _require(table, "response", source, "data_format")
    else:
        _require(table, config.text_field, source, "text_field")
    if len(table) < 2:
        raise ValueError(
            f"--dataset {source} has {len(table)} record(s); at least 2 are needed to hold one out"
        )
    if fmt == "conversations":
        from data.sources import load_conversations

        table = load_conversations(source, config.messages_field)  # validates every message
    elif fmt == "text" and isinstance(source, Path):
        from data.sources import load_jsonl

        table = load_jsonl(source, config.text_field)
    split = table.train_test_split(test_size=config.validation_fraction, seed=seed)
    out = {}
    for name in ("train", "test"):
        part = split[name]
        if fmt == "conversations":
            out[name] = render_and_pad(part, tokenizer, config.block_size)
        elif fmt == "prompt_response":
            out[name] = _render_prompt_response(part, tokenizer, config.block_size)
        else:
            field = "text" if isinstance(source, Path) else config.text_field
            out[name] = tokenize_and_pack(part, tokenizer, config.block_size, field)
    return SequenceSets(out["train"], out["test"], f"{source} ({fmt}, {len(table)} records)")


def _load_table(source: str | Path) -> datasets.Dataset:
    import datasets

    if isinstance(source, Path):
        return datasets.Dataset.from_list(list(_json_records(source)))
    try:
        return datasets.load_dataset(source, split="train")
    except Exception as error:
        raise FileNotFoundError(
            f"--dataset {source}: not a file or folder here, and datasets.load_dataset could not "
            f"load it ({type(error).__name__}: {error}); pass a local .jsonl file, a text "
            "folder, stdlib, or a dataset name available offline"
        ) from error


def _json_records(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
        records = data.get("data") if isinstance(data, dict) else data
        if not isinstance(records, list):
            raise ValueError(f"{path}: expected a JSON list of records or {{'data': [...]}}")
        return records
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON ({error})") from error
    if not records:
        raise ValueError(f"--dataset {path} holds no records; the file is empty")
    return records


def _detect_format(columns: list[str], config: DataConfig, source: str | Path) -> str:
    if config.messages_field in columns:
        return "conversations"
    if "prompt" in columns and "response" in columns:
        return "prompt_response"
    if config.text_field in columns:
        return "text"
    raise ValueError(
        f"--dataset {source}: records have fields {sorted(columns)}, none of "
        f"{config.messages_field!r} (conversations), 'prompt'+'response', or "
        f"{config.text_field!r} (text); set --messages_field or --text_field"
    )


def _require(table: datasets.Dataset, column: str, source: str | Path, flag: str) -> None:
    if column not in table.column_names:
        raise ValueError(
            f"--dataset {source} has no field {column!r} (fields: {sorted(table.column_names)}); "
            f"set --{flag} to the field that holds the data"
        )


def _render_prompt_response(
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

    return table.map(render, batched=True, remove_columns=table.column_names)


def _take(rows: Sequence[Row], count: int) -> Sequence[Row]:
    if hasattr(rows, "select"):
        return rows.select(range(min(count, len(rows))))
    return list(rows)[:count]
