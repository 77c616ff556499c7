"""Training and held-out sequences for distillation: the recipe's data section applied.

Reading, tokenising and splitting the source is ``data.sequences`` (which takes plain field
names); this module passes it the recipe's values and builds the held-out set the overlap
metric is measured on. By default that is held-out prompts continued by the target itself
(``eval_source: target_samples``): acceptance is measured on the target's own outputs
(docs/theory.md §6), so that is where the overlap must be measured too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from data.sequences import Row, SequenceSets
from data.sequences import load_sequences as load_source_sequences
from decode.sampling import SamplingConfig
from train.generation import sample_continuations

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from train.config import DataConfig


def load_sequences(
    config: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> SequenceSets:
    """``data.sequences.load_sequences`` with the recipe's data settings."""
    return load_source_sequences(
        config.dataset,
        tokenizer,
        block_size=config.block_size,
        validation_fraction=config.validation_fraction,
        seed=seed,
        data_format=config.data_format,
        text_field=config.text_field,
        messages_field=config.messages_field,
        max_files=config.max_files,
        max_train_sequences=config.max_train_sequences,
    )


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
