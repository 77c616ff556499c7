"""One named source read into training and held-out rows, with plain field names."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from draftsmith.data.sequences import collate_rows, load_sequences, take

SPLIT = {"block_size": 32, "validation_fraction": 0.25, "seed": 0}


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_prompt_response_records_mask_the_prompt(tmp_path: Path, chat_tokenizer) -> None:
    records = [{"prompt": f"def f{i}(x):", "response": f" return x + {i}"} for i in range(8)]
    sets = load_sequences(str(_jsonl(tmp_path / "pr.jsonl", records)), chat_tokenizer, **SPLIT)
    assert (len(sets.train), len(sets.held_out)) == (6, 2)
    assert "prompt_response, 8 records" in sets.description
    for row in [*sets.train, *sets.held_out]:
        prompt = [
            r for r in records if chat_tokenizer.decode(row["input_ids"]).startswith(r["prompt"])
        ]
        assert len(prompt) == 1
        n = len(chat_tokenizer(prompt[0]["prompt"], add_special_tokens=False)["input_ids"])
        assert row["loss_mask"][:n] == [0] * n and all(row["loss_mask"][n:])
        assert row["input_ids"][-1] == chat_tokenizer.eos_token_id


def test_text_records_use_the_named_field(tmp_path: Path, chat_tokenizer) -> None:
    records = [{"body": "import os\n" * 20, "other": 1} for _ in range(4)]
    path = str(_jsonl(tmp_path / "t.jsonl", records))
    with pytest.raises(ValueError, match=r"none of 'messages'.*set --messages_field"):
        load_sequences(path, chat_tokenizer, **SPLIT)
    sets = load_sequences(path, chat_tokenizer, **SPLIT, text_field="body", max_train_sequences=2)
    assert len(sets.train) == 2 and len(sets.held_out) >= 1
    assert all(len(row["input_ids"]) == 32 and all(row["loss_mask"]) for row in sets.train)


def test_conversations_are_read_by_their_field(tmp_path: Path, chat_tokenizer) -> None:
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    path = str(_jsonl(tmp_path / "c.jsonl", [{"turns": chat}] * 4))
    sets = load_sequences(path, chat_tokenizer, **SPLIT, messages_field="turns")
    assert "conversations" in sets.description
    for row in sets.train:  # loss on the assistant's tokens only
        assert any(row["loss_mask"]) and not all(row["loss_mask"])
    with pytest.raises(ValueError, match=r"has no field 'messages'.*set --messages_field"):
        load_sequences(path, chat_tokenizer, **SPLIT, data_format="conversations")


def test_bad_sources_name_the_fix(tmp_path: Path, chat_tokenizer) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no records"):
        load_sequences(str(tmp_path / "empty.jsonl"), chat_tokenizer, **SPLIT)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_sequences(str(tmp_path / "absent.jsonl"), chat_tokenizer, **SPLIT)
    one = _jsonl(tmp_path / "one.jsonl", [{"text": "x = 1"}])
    with pytest.raises(ValueError, match="at least 2 are needed"):
        load_sequences(str(one), chat_tokenizer, **SPLIT)
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="the folder holds no"):
        load_sequences(str(tmp_path / "folder"), chat_tokenizer, **SPLIT)


def test_one_text_file_holds_out_its_last_blocks(tmp_path: Path, chat_tokenizer) -> None:
    (tmp_path / "a.py").write_text("value = compute(value)\n" * 200)
    sets = load_sequences(str(tmp_path / "a.py"), chat_tokenizer, **SPLIT)
    blocks = len(sets.train) + len(sets.held_out)
    assert len(sets.held_out) == max(1, int(blocks * 0.25))


def test_take_and_collate() -> None:
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4], "loss_mask": [1]}]
    assert take(rows, 1) == rows[:1] and take(rows, 5) == rows
    table = datasets.Dataset.from_list(rows)
    assert isinstance(take(table, 1), datasets.Dataset) and len(take(table, 1)) == 1
    batch = collate_rows(rows, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert "topk_ids" not in batch
    cached = [
        {
            "input_ids": torch.tensor(r["input_ids"]),
            "loss_mask": torch.tensor(r["loss_mask"]),
            "topk_ids": torch.ones(len(r["input_ids"]), 2, dtype=torch.long),
            "topk_logprobs": torch.zeros(len(r["input_ids"]), 2),
            "rest_logmass": torch.zeros(len(r["input_ids"])),
        }
        for r in rows
    ]
    batch = collate_rows(cached, pad_token_id=0)
    assert batch["topk_ids"].shape == (2, 3, 2) and batch["topk_ids"][1, 1:].eq(0).all()
