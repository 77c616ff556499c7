"""Training and held-out sequences for distillation: the recipe's data section applied.

Reading, tokenising and splitting the source is ``draftsmith.data.sequences`` (which takes plain field
names); this module passes it the recipe's values and builds the held-out set the overlap
metric is measured on. By default that is held-out prompts continued by the target itself
(``eval_source: target_samples``): acceptance is measured on the target's own outputs
(docs/theory.md §6), so that is where the overlap must be measured too. Training data can be
the target's own text in the same way (``train_source: target_samples``): prompts cut from the
training rows, as their first tokens (:func:`block_prompts`) or in the form of the prompts
served (:func:`definition_prompts_of_rows`), continued by the target (:func:`continued_rows`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from draftsmith.data.atomic_io import write_json_atomic
from draftsmith.data.sequences import Row, SequenceSets
from draftsmith.data.sequences import load_sequences as load_source_sequences
from draftsmith.decode.sampling import SamplingConfig
from draftsmith.train.generation import left_pad, sample_continuations

if TYPE_CHECKING:
    from accelerate import Accelerator
    from draftsmith.train.config import DataConfig, DistillConfig
    from transformers import PreTrainedTokenizerBase


def load_sequences(
    config: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> SequenceSets:
    """``draftsmith.data.sequences.load_sequences`` with the recipe's data settings."""
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
        system_prompt=config.system_prompt,
    )


def block_prompts(rows: Sequence[Row], prompt_tokens: int, count: int) -> list[list[int]]:
    """The first ``prompt_tokens`` tokens of the first ``count`` rows that have that many."""
    prompts = [
        list(row["input_ids"][:prompt_tokens])
        for row in rows
        if len(row["input_ids"]) >= prompt_tokens
    ][:count]
    if not prompts:
        raise ValueError(
            f"no sequence has {prompt_tokens} tokens to use as a prompt: lower the prompt "
            "tokens (--train_prompt_tokens / --eval_prompt_tokens) or add data"
        )
    return prompts


def definition_prompts_of_rows(
    rows: Sequence[Row],
    tokenizer: PreTrainedTokenizerBase,
    count: int,
    chars: int,
    max_tokens: int,
) -> list[list[int]]:
    """Prompts in the form of the demo's evaluation prompts, cut from token rows.

    Each row is decoded to text and gives at most one prompt: the ``chars`` characters of code
    up to and including its first ``def``/``class`` line past ``chars`` characters
    (``draftsmith.decode.measure.prompts.definition_prompts``), re-encoded, kept when it has at most ``max_tokens``
    tokens. Rows are visited with a stride that spreads the ``count`` prompts over all of them
    (rows 0, s, 2s, ..., then 1, s + 1, ...), so every process builds the same list.
    """
    from draftsmith.decode.measure.prompts import definition_prompts

    stride = max(1, len(rows) // max(count, 1))
    visits = (i for offset in range(stride) for i in range(offset, len(rows), stride))
    prompts: list[list[int]] = []
    for index in visits:
        text = tokenizer.decode(rows[index]["input_ids"], skip_special_tokens=True)
        prompt = next(definition_prompts(text, chars), None)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
        if 0 < len(ids) <= max_tokens:
            prompts.append(list(ids))
            if len(prompts) == count:
                return prompts
    if not prompts:
        raise ValueError(
            f"no training sequence has a def/class line past {chars} characters within "
            f"{max_tokens} prompt tokens: lower --train_prompt_chars, raise --block_size, or "
            "use --train_prompts blocks (the only form for text that is not Python code)"
        )
    return prompts


# Rows per batch when the target regenerates a recipe's training data. A decode step's products
# cost about the same for 1 to 64 rows in bfloat16, so wider batches are cheaper per token until
# attention over the rows' KV caches dominates: on 64 demo prompts (2-core Xeon with AMX) 367
# new tokens/s at 16 rows, 564 at 64, where attention is 41% of the time. The rows depend on
# it (which samples share a batch), so it is part of the regenerated data's cache key.
REGENERATION_BATCH_SIZE = 64


@torch.no_grad()
def continued_rows(
    target: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    length: int,
    temperature: float,
    seed: int,
    eos_token_id: int | None,
    pad_token_id: int,
    device: torch.device,
    batch_size: int = 16,
    train_prompt: bool = False,
    progress: str | None = None,
) -> list[Row]:
    """Prompts (token ids, any lengths below ``length``) continued by the target to ``length``
    tokens in all, or to an eos.

    The target samples at ``temperature`` (greedy at 0) from a generator seeded by ``seed``, so
    every process builds the same set. ``loss_mask`` marks the continuation, and the prompt as
    well when ``train_prompt`` (the prompt is the data's own text, worth learning too).
    ``progress`` names a progress bar over the batches (None: no bar).
    """
    from tqdm.auto import tqdm

    if any(not 0 < len(prompt) < length for prompt in prompts):
        raise ValueError(f"every prompt needs 1 to {length - 1} tokens to leave room to continue")
    generator = torch.Generator(device).manual_seed(seed)
    sampling = SamplingConfig(temperature=temperature)
    rows: list[Row] = []
    starts = range(0, len(prompts), batch_size)
    for start in tqdm(starts, desc=progress, disable=progress is None, dynamic_ncols=True):
        chunk = prompts[start : start + batch_size]
        ids, mask = left_pad(chunk, pad_token_id)  # [B, P]
        out = sample_continuations(
            target,
            ids.to(device),
            mask.to(device),
            length - min(len(prompt) for prompt in chunk),
            sampling,
            generator,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
        for prompt, tokens, valid in zip(chunk, out.tokens, out.valid, strict=True):
            kept = min(int(valid.sum()), length - len(prompt))
            ids_row = list(prompt) + tokens[:kept].tolist()
            rows.append(
                {"input_ids": ids_row, "loss_mask": [int(train_prompt)] * len(prompt) + [1] * kept}
            )
    return rows


def held_out_rows(held_out: Sequence[Row], num_sequences: int) -> list[Row]:
    """The first ``num_sequences`` held-out rows as they are (``eval_source: data``)."""
    return [dict(held_out[i]) for i in range(min(num_sequences, len(held_out)))]


def regenerated_rows_file(target: torch.nn.Module, settings: dict[str, Any]) -> Path | None:
    """Where the target's continuations for ``settings`` are kept between runs, or None.

    Regenerating a recipe's data costs minutes (the whole target samples every row), and runs
    of one target with one recipe (the benchmark's drafters, the ablation's seeds) would
    otherwise repeat it. The file name hashes everything the rows depend on: the settings (the
    prompts' ids among them), the target's folder and the size and time of its weight files,
    and the dtype it runs in. A target without a local folder is not cached.
    """
    folder = Path(str(getattr(target, "name_or_path", "") or ""))
    weights = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not weights:
        return None
    from draftsmith.train.target.demo import user_cache_dir

    stamp = [(w.name, w.stat().st_size, w.stat().st_mtime_ns) for w in weights]
    dtype = str(next(target.parameters()).dtype)
    blob = json.dumps(
        {"target": str(folder.resolve()), "weights": stamp, "dtype": dtype, **settings},
        sort_keys=True,
    )
    key = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return user_cache_dir() / "regenerated" / f"{key}.json"


def read_regenerated_cache(cache: Path) -> list[dict[str, Any]] | None:
    """The cached continuations at ``cache``; None when absent, or unreadable (a warning
    names the file, and the rows are generated again and the file replaced)."""
    if not cache.is_file():
        return None
    try:
        rows = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        rows, problem = None, str(error)
    else:
        problem = "it does not hold a list of rows"
    if isinstance(rows, list) and all(isinstance(row, dict) for row in rows):
        return rows
    print(f"warning: ignoring the cached continuations {cache} ({problem}); generating them again")
    return None


def regenerated_rows(
    config: DistillConfig,
    target: Any,
    tokenizer: Any,
    train: Any,
    accelerator: Accelerator,
) -> list[dict[str, Any]]:
    """Training prompts continued by the target to a full block, an equal share at each
    temperature.

    Acceptance is measured on the target's own text, greedy and sampled (docs/theory.md §6):
    greedy continuations teach the drafter the target's argmax (temperature-0 acceptance),
    sampled ones its distribution. Prompts are the first tokens of training sequences
    (``train_prompts: blocks``) or the code up to a ``def``/``class`` line in them, the form of
    the prompts served and evaluated (``definitions``); either way spread over the whole
    training split, and every process builds the same rows from the same seed.
    """
    data = config.data
    if data.train_prompts == "definitions":
        prompts = definition_prompts_of_rows(
            train, tokenizer, data.train_sequences, data.train_prompt_chars, data.block_size - 1
        )
    else:
        stride = max(1, len(train) // data.train_sequences)
        spread = [train[i] for i in range(0, len(train), stride)]
        prompts = block_prompts(spread, data.train_prompt_tokens, len(spread))
    if len(prompts) < data.train_sequences and accelerator.is_main_process:
        print(
            f"warning: the training data gives {len(prompts)} {data.train_prompts} prompts of "
            f"the {data.train_sequences} asked (--train_sequences); temperatures share them"
        )
    temperatures = data.train_temperatures
    share = data.train_sequences // len(temperatures)
    seed = config.optim.seed if data.train_samples_seed is None else data.train_samples_seed
    cache = regenerated_rows_file(
        target,
        {
            "prompts": prompts,
            "temperatures": temperatures,
            "share": share,
            "seed": seed,
            "block_size": data.block_size,
            "train_prompt": data.train_prompt_loss,
            "batch_size": REGENERATION_BATCH_SIZE,
        },
    )
    cached = read_regenerated_cache(cache) if cache is not None else None
    if cached is not None:
        if accelerator.is_main_process:
            print(f"reusing the target's continuations from {cache} (same target and prompts)")
        return cached
    rows: list[dict[str, Any]] = []
    for index, temperature in enumerate(temperatures):
        rows += continued_rows(
            target,
            prompts[index * share : (index + 1) * share] or prompts[:share],
            length=data.block_size,
            temperature=temperature,
            seed=seed + 777 + index,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            device=accelerator.device,
            batch_size=REGENERATION_BATCH_SIZE,
            train_prompt=data.train_prompt_loss,
            progress=f"regenerate at T={temperature:g}"
            if accelerator.is_main_process and config.logging.progress_bar
            else None,
        )
    if cache is not None and accelerator.is_main_process:
        write_json_atomic(cache, rows, indent=None)
    return rows


def evaluation_rows(
    config: DistillConfig,
    target: Any,
    tokenizer: Any,
    held_out: Any,
    accelerator: Accelerator,
) -> list[dict[str, Any]]:
    """The held-out rows the overlap is measured on: the held-out sequences as they are
    (``eval_source: data``), or held-out prompts continued by the target."""
    data = config.data
    if data.eval_source == "data":
        return held_out_rows(held_out, data.eval_sequences)
    return continued_rows(
        target,
        block_prompts(held_out, data.eval_prompt_tokens, data.eval_sequences),
        length=data.eval_prompt_tokens + data.eval_new_tokens,
        temperature=config.loss.eval_temperature,
        seed=config.optim.seed + 12345,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        device=accelerator.device,
    )


def evaluation_description(config: DistillConfig, count: int) -> str:
    """The held-out rows in words, for the summary and the model card."""
    data = config.data
    if data.eval_source == "data":
        return f"{count} held-out sequences of the training source"
    return (
        f"{count} held-out prompts of {data.eval_prompt_tokens} tokens continued by the target "
        f"for up to {data.eval_new_tokens} tokens at temperature {config.loss.eval_temperature}"
    )
