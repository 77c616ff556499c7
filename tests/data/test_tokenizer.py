"""Byte-level BPE: exact round trip, special tokens, chat template, save -> load offline."""

from __future__ import annotations

from pathlib import Path

import pytest
from draftsmith.data.tokenizer import IM_END, IM_START, train_byte_level_bpe
from transformers import AutoTokenizer

TRICKY = "def f(x):\n    return x  # caf\u00e9 \u65e5\u672c\t\r\n\n  \x00end"


@pytest.fixture
def small_tokenizer(chat_tokenizer):
    return chat_tokenizer


def test_vocab_and_special_tokens(small_tokenizer) -> None:
    tok = small_tokenizer
    assert len(tok) == 400
    assert tok.bos_token == tok.eos_token == "<|endoftext|>"
    assert tok.pad_token == "<|pad|>"
    assert tok.pad_token_id != tok.eos_token_id
    specials = tok.convert_tokens_to_ids([IM_START, IM_END])
    assert set(specials) <= set(tok.all_special_ids)
    assert tok(f"{IM_START}user", add_special_tokens=False)["input_ids"][0] == specials[0]


def test_exact_round_trip(small_tokenizer) -> None:
    ids = small_tokenizer(TRICKY, add_special_tokens=False)["input_ids"]
    assert small_tokenizer.decode(ids) == TRICKY
    # No prefix space and no bos/eos added on plain encoding.
    assert small_tokenizer.decode(small_tokenizer("x")["input_ids"]) == "x"


def test_chat_template(small_tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    text = small_tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    prompt = small_tokenizer.apply_chat_template(
        messages[:1], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")


def test_save_load_round_trip(small_tokenizer, tmp_path: Path) -> None:
    small_tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = small_tokenizer(TRICKY)["input_ids"]
    assert loaded(TRICKY)["input_ids"] == ids
    assert loaded.decode(ids) == TRICKY
    assert loaded.get_vocab() == small_tokenizer.get_vocab()
    assert loaded.chat_template == small_tokenizer.chat_template
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (
        small_tokenizer.bos_token_id,
        small_tokenizer.eos_token_id,
        small_tokenizer.pad_token_id,
    )
    assert loaded.all_special_ids == small_tokenizer.all_special_ids


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_byte_level_bpe(["x"], vocab_size=100)
    with pytest.raises(ValueError, match="no texts"):
        train_byte_level_bpe([], vocab_size=300)
