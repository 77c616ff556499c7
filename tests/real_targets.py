"""The targets people deploy, scaled down: their real config.json facts, fewer and narrower layers.

``tests/fixtures/<family>/`` holds each family's public facts: ``config.json`` (layer count,
widths, vocabulary, rope settings, special token ids), ``chat_template.jinja`` and
``tokens.json`` (the tokenizer's special and added tokens, at their real ids). A scaled target
keeps the vocabulary size, the rope settings, the context length and the token ids, and shrinks
depth and width so a recipe runs a few steps on one CPU core.

The tokenizer is byte-level BPE built in code with the family's vocabulary size: bytes, then
two-character merges, then filler tokens up to ``base_vocab_size``, then the added tokens at
their real ids. It is not the family's BPE, only the same shape: ids spread over the whole
vocabulary, the same pre-tokenizer split (``pretokenizer_regex``: where words, digits and
newlines part), the same special tokens, the same chat template.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"
LLAMA31 = "llama-3.1-8b-instruct"
LLAMA33_70B = "llama-3.3-70b-instruct"
LLAMA32_1B = "llama-3.2-1b-instruct"  # the draft LM of configs/llama3.1-8b-draft.yaml
QWEN3 = "qwen3-8b"
# Families sharing another's tokenizer and chat template.
_TOKENIZER_OF = {LLAMA33_70B: LLAMA31, LLAMA32_1B: LLAMA31}


def real_config(family: str) -> dict[str, Any]:
    """The family's config.json as published."""
    return json.loads((FIXTURES / family / "config.json").read_text())


def scaled_config(
    family: str,
    num_layers: int = 4,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
) -> dict[str, Any]:
    """The real config with depth and width scaled down; vocabulary, rope and ids kept."""
    config = real_config(family)
    config.update(
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        torch_dtype="float32",
    )
    if "head_dim" in config:
        config["head_dim"] = hidden_size // num_heads
    if "max_window_layers" in config:
        config["max_window_layers"] = num_layers
    return config


def family_tokenizer(family: str) -> Any:
    """A byte-level BPE tokenizer with the family's vocabulary layout and chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    family = _TOKENIZER_OF.get(family, family)
    facts = json.loads((FIXTURES / family / "tokens.json").read_text())
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    merges = []
    for a, b in itertools.product(alphabet, repeat=2):  # every byte pair: 65,536 tokens
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    for a, b, c in itertools.product(alphabet, repeat=3):  # unmerged filler up to the base
        if len(vocab) >= facts["base_vocab_size"]:
            break
        vocab[a + b + c] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(  # the family's split, then bytes
        [
            pre_tokenizers.Split(Regex(facts["pretokenizer_regex"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    named = {int(k): v for k, v in facts["named_added_tokens"].items()}
    reserved = itertools.count()
    for offset in range(facts["added_vocab_size"]):
        token_id = facts["base_vocab_size"] + offset
        content = named.get(token_id) or facts["reserved_pattern"].format(next(reserved))
        special = content not in facts["non_special"]
        tokenizer.add_tokens([AddedToken(content, special=special, normalized=False)])
        assert tokenizer.token_to_id(content) == token_id, content
    specials = [v for k, v in sorted(named.items()) if v not in facts["non_special"]] + [
        facts["reserved_pattern"].format(i) for i in range(next(reserved))
    ]
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=facts["bos_token"],
        eos_token=facts["eos_token"],
        pad_token=facts["pad_token"],
        unk_token=None,
        extra_special_tokens=[
            s for s in specials if s not in (facts["bos_token"], facts["eos_token"])
        ],
        chat_template=(FIXTURES / family / "chat_template.jinja").read_text(),
        clean_up_tokenization_spaces=False,
    )


def save_scaled_target(family: str, folder: Path, seed: int = 0, **scale: int) -> Path:
    """A random-init scaled target of ``family`` with its tokenizer, saved to ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    values = scaled_config(family, **scale)
    config = AutoConfig.for_model(**values)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=values["bos_token_id"], eos_token_id=values["eos_token_id"]
    )
    model.save_pretrained(folder)
    family_tokenizer(family).save_pretrained(folder)
    return folder
