"""A small byte-level BPE trained once per test session on a few stdlib files."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from data.corpus import load_stdlib_corpus
from data.tokenizer import train_byte_level_bpe


@pytest.fixture(scope="session")
def chat_tokenizer() -> PreTrainedTokenizerFast:
    corpus = load_stdlib_corpus(max_files=8)
    return train_byte_level_bpe(corpus["train"]["text"], vocab_size=400)
