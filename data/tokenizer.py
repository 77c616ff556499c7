"""Train a byte-level BPE tokenizer (Sennrich et al. 2016; GPT-2's byte-level variant).

Byte-level: text is first mapped to its UTF-8 bytes, each byte to one of 256 printable
symbols, so every string is encodable (no unknown token) and decoding inverts encoding exactly.
BPE then merges the most frequent adjacent symbol pairs, greedily, until ``vocab_size``
symbols exist (pairs seen fewer than ``min_frequency`` times are never merged).

Special tokens (never split, never produced by merges):
``<|endoftext|>`` (bos = eos, id 0), ``<|pad|>`` (pad, id 1), ``<|im_start|>`` and ``<|im_end|>``
(ChatML turn markers, ids 2 and 3). The tokenizer carries a ChatML ``chat_template``::

    <|im_start|>{role}\\n{content}<|im_end|>\\n      (one block per message)
    <|im_start|>assistant\\n                         (with add_generation_prompt=True)

A chat model trained on it ends its turn with ``<|im_end|>``: stop on that id as well as eos.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, PAD, IM_START, IM_END)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_byte_level_bpe(
    texts: Iterable[str],
    vocab_size: int = 8192,
    min_frequency: int = 2,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it as a Hugging Face fast tokenizer.

    The vocabulary holds the 4 special tokens, the 256 byte symbols and up to
    ``vocab_size - 260`` merges (fewer when the text has too few distinct frequent pairs).
    No prefix space is added, so ``decode(encode(s)) == s`` for every string. The result saves
    with ``save_pretrained`` and reloads offline with ``AutoTokenizer.from_pretrained``.
    """
    minimum = len(SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size must be >= {minimum} (4 special tokens + 256 bytes), got {vocab_size}"
        )
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    seen = 0

    def counted(stream: Iterable[str]) -> Iterable[str]:
        nonlocal seen
        for text in stream:
            seen += 1
            yield text

    tokenizer.train_from_iterator(counted(texts), trainer=trainer)
    if seen == 0:
        raise ValueError("train_byte_level_bpe got no texts; pass a non-empty iterable of strings")

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        unk_token=None,
        pad_token=PAD,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        padding_side="right",
    )
