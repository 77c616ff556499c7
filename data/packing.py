"""Turn datasets of text or conversations into fixed or padded blocks of token ids.

Convention for ``loss_mask`` (shared with ``draftsmith.data.templates`` and the trainer): ``loss_mask[t]``
is 1 when token ``t`` is a prediction target, i.e. the logits at position ``t - 1`` are scored
against ``input_ids[t]``. A causal LM loss therefore uses ``loss_mask[:, 1:]`` against
``logits[:, :-1]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import datasets
import torch
from draftsmith.data.templates import render_conversation
from transformers import PreTrainedTokenizerBase

_MAP_BATCH_SIZE = 1000


def _require_column(dataset: datasets.Dataset, column: str, argument: str) -> None:
    if column not in dataset.column_names:
        raise ValueError(
            f"dataset has no column {column!r} (columns: {dataset.column_names}); pass "
            f"{argument}= the name of the column that holds it"
        )


RowFn = Callable[[Mapping[str, list[Any]]], dict[str, list[list[int]]]]


def map_to_rows(dataset: datasets.Dataset, fn: RowFn, desc: str) -> datasets.Dataset:
    """``dataset`` mapped in batches by ``fn`` to rows of ``input_ids`` (int32) and
    ``loss_mask`` (int8); ``fn`` may return fewer or more rows than it was given."""
    return dataset.map(
        fn,
        batched=True,
        batch_size=_MAP_BATCH_SIZE,
        remove_columns=dataset.column_names,
        features=datasets.Features(
            {
                "input_ids": datasets.Sequence(datasets.Value("int32")),
                "loss_mask": datasets.Sequence(datasets.Value("int8")),
            }
        ),
        desc=desc,
    )


def tokenize_and_pack(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    text_field: str = "text",
    add_eos: bool = True,
) -> datasets.Dataset:
    """Tokenize every text, concatenate them and cut the stream into blocks of ``block_size``.

    Documents are joined in dataset order, each followed by the eos token when ``add_eos``
    (so the model learns where a document ends and the next begins). Within each map batch of
    1,000 documents the tail shorter than ``block_size`` is dropped, as in Hugging Face's
    ``run_clm``. Returns columns ``input_ids`` and ``loss_mask`` (all ones), each a list of
    exactly ``block_size`` ints. Deterministic: no shuffling, no randomness.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (an input and a target), got {block_size}")
    _require_column(dataset, text_field, "text_field")
    eos = tokenizer.eos_token_id
    if add_eos and eos is None:
        raise ValueError(
            "add_eos=True but the tokenizer has no eos_token; set one or pass add_eos=False"
        )

    def pack(batch: Mapping[str, list[Any]]) -> dict[str, list[list[int]]]:
        encoded = tokenizer(batch[text_field], add_special_tokens=False)["input_ids"]
        stream: list[int] = []
        for ids in encoded:
            stream.extend(ids)
            if add_eos:
                stream.append(eos)
        usable = len(stream) - len(stream) % block_size
        blocks = [stream[start : start + block_size] for start in range(0, usable, block_size)]
        return {"input_ids": blocks, "loss_mask": [[1] * block_size for _ in blocks]}

    return map_to_rows(dataset, pack, f"tokenize and pack into blocks of {block_size}")


def render_and_pad(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    messages_field: str = "messages",
) -> datasets.Dataset:
    """Render each conversation with the chat template, one conversation per row.

    Rows are truncated to ``block_size`` tokens and keep their own length; ``collate`` pads a
    batch on the right to its longest row (less padding than padding every row to
    ``block_size``). ``loss_mask`` is 1 on assistant tokens only (``draftsmith.data.templates``).
    Conversations whose kept tokens contain no assistant token are dropped, since they would
    contribute nothing to the loss.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (an input and a target), got {block_size}")
    _require_column(dataset, messages_field, "messages_field")

    def render(batch: Mapping[str, list[Any]]) -> dict[str, list[list[int]]]:
        input_ids: list[list[int]] = []
        loss_mask: list[list[int]] = []
        for messages in batch[messages_field]:
            rendered = render_conversation(messages, tokenizer, max_length=block_size)
            if any(rendered["loss_mask"]):
                input_ids.append(rendered["input_ids"])
                loss_mask.append(rendered["loss_mask"])
        return {"input_ids": input_ids, "loss_mask": loss_mask}

    return map_to_rows(dataset, render, f"render conversations (max {block_size} tokens)")


def collate(
    examples: Sequence[Mapping[str, Sequence[int]]],
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """Stack rows into a right-padded batch.

    Each example has ``input_ids`` and optionally ``loss_mask`` (all ones when absent) of the
    same length. Returns int64 tensors ``input_ids`` [B, T], ``attention_mask`` [B, T]
    (1 on real tokens) and ``loss_mask`` [B, T] (0 on padding), T the longest row.
    """
    if len(examples) == 0:
        raise ValueError("collate got an empty list of examples; the batch needs at least one row")
    lengths = [len(example["input_ids"]) for example in examples]
    if min(lengths) == 0:
        raise ValueError("collate got an example with no input_ids; filter out empty rows first")
    batch_size, length = len(examples), max(lengths)
    input_ids = torch.full((batch_size, length), pad_token_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((batch_size, length), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((batch_size, length), dtype=torch.long)  # [B, T]
    for row, (example, n) in enumerate(zip(examples, lengths, strict=True)):
        input_ids[row, :n] = torch.as_tensor(example["input_ids"], dtype=torch.long)
        attention_mask[row, :n] = 1
        mask = example.get("loss_mask")
        if mask is None:
            loss_mask[row, :n] = 1
        elif len(mask) != n:
            raise ValueError(
                f"example {row} has {n} input_ids but {len(mask)} loss_mask entries; they must "
                "have the same length"
            )
        else:
            loss_mask[row, :n] = torch.as_tensor(mask, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
