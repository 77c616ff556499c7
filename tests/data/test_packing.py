"""Packing into fixed blocks, one-conversation-per-row rendering and right-padded collation."""

from __future__ import annotations

import datasets
import pytest
import torch
from draftsmith.data.packing import collate, render_and_pad, tokenize_and_pack
from draftsmith.data.templates import render_conversation


def test_pack_shapes_and_content(chat_tokenizer) -> None:
    texts = [f"def f{i}():\n    return {i * 7}\n" * (i + 1) for i in range(20)]
    dataset = datasets.Dataset.from_dict({"text": texts, "path": [str(i) for i in range(20)]})
    packed = tokenize_and_pack(dataset, chat_tokenizer, block_size=16)
    assert packed.column_names == ["input_ids", "loss_mask"]
    stream: list[int] = []
    for text in texts:
        stream += chat_tokenizer(text, add_special_tokens=False)["input_ids"]
        stream.append(chat_tokenizer.eos_token_id)
    assert len(packed) == len(stream) // 16
    assert all(len(row) == 16 for row in packed["input_ids"])
    assert all(row == [1] * 16 for row in packed["loss_mask"])
    flat = [token for row in packed["input_ids"] for token in row]
    assert flat == stream[: len(flat)]
    again = tokenize_and_pack(dataset, chat_tokenizer, block_size=16)
    assert again["input_ids"] == packed["input_ids"]
    no_eos = tokenize_and_pack(dataset, chat_tokenizer, block_size=16, add_eos=False)
    assert chat_tokenizer.eos_token_id not in {t for row in no_eos["input_ids"] for t in row}


def test_pack_errors(chat_tokenizer) -> None:
    dataset = datasets.Dataset.from_dict({"content": ["x"]})
    with pytest.raises(ValueError, match=r"'text'.*content.*text_field"):
        tokenize_and_pack(dataset, chat_tokenizer, block_size=8)
    with pytest.raises(ValueError, match="block_size"):
        tokenize_and_pack(dataset, chat_tokenizer, block_size=1, text_field="content")


def test_render_and_pad_then_collate(chat_tokenizer) -> None:
    conversations = [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
        [
            {"role": "user", "content": "a much longer question " * 5},
            {"role": "assistant", "content": "ok"},
        ],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a long answer " * 9}],
        [{"role": "user", "content": "prompt only"}],
    ]
    dataset = datasets.Dataset.from_dict({"messages": conversations})
    rows = render_and_pad(dataset, chat_tokenizer, block_size=24)
    # Dropped: the prompt-only conversation and the one whose answer lies past block_size.
    assert len(rows) == 2
    assert rows[0] == render_conversation(conversations[0], chat_tokenizer)
    assert rows[1] == render_conversation(conversations[2], chat_tokenizer, max_length=24)
    assert max(len(row) for row in rows["input_ids"]) == 24
    batch = collate(list(rows), pad_token_id=chat_tokenizer.pad_token_id)
    lengths = [len(row) for row in rows["input_ids"]]
    assert batch["input_ids"].shape == (2, max(lengths))
    for key in ("input_ids", "attention_mask", "loss_mask"):
        assert batch[key].dtype == torch.long
    for row, n in enumerate(lengths):
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (max(lengths) - n)
        assert batch["input_ids"][row, n:].eq(chat_tokenizer.pad_token_id).all()
        assert batch["loss_mask"][row, :n].tolist() == rows[row]["loss_mask"]
        assert batch["loss_mask"][row, n:].eq(0).all()


def test_collate_defaults_and_errors() -> None:
    batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["loss_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    with pytest.raises(ValueError, match="empty list"):
        collate([], pad_token_id=0)
    with pytest.raises(ValueError, match="same length"):
        collate([{"input_ids": [1, 2], "loss_mask": [1]}], pad_token_id=0)
