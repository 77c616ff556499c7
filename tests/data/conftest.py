"""A small byte-level BPE trained once per test session on a few stdlib files."""

from __future__ import annotations

import pytest
from draftsmith.data.corpus import load_stdlib_corpus
from draftsmith.data.tokenizer import train_byte_level_bpe
from transformers import PreTrainedTokenizerFast


@pytest.fixture(scope="session")
def chat_tokenizer() -> PreTrainedTokenizerFast:
    corpus = load_stdlib_corpus(max_files=8)
    return train_byte_level_bpe(corpus["train"]["text"], vocab_size=400)
