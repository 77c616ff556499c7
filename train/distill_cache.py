"""The offline target cache (``target_outputs: cache`` or ``cache_only``) joined to a run's rows.

``draftsmith.train.target.cache`` builds and reads a cache of the target's top-k log-probs (and the
hidden states a head reads) for a list of rows; this module applies the recipe to it: which
training rows the run will read (no more than its steps take), where the cache lives
(``cache_dir``, else ``<output_dir>/target_cache``), the held-out rows scored beside them so
that a ``cache_only`` run evaluates without the target, and the statistics the summary reports.

The cache's key is the target (its name and dtype), the tokenizer's vocabulary and the layout
(k, hidden layers, cache dtype); the rows are found in it by their tokens. So a run with other
steps, batch size, learning rate, loss or drafter settings reads the same cache: it scores only
the sequences the cache lacks (``cache``) or refuses to start without them (``cache_only``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accelerate import Accelerator
    from draftsmith.train.config import DistillConfig


def cached_training_rows(
    config: DistillConfig,
    accelerator: Accelerator,
    objective: Any,
    target: Any,
    target_name: str,
    train_rows: Any,
    tokenizer: Any,
    output_dir: Path,
) -> tuple[Any, Any]:
    """Limit the rows to what the run will read, cache the target on them, join the two."""
    from draftsmith.data.sequences import take

    needed = (
        config.optim.max_steps
        * config.optim.per_device_batch_size
        * config.optim.gradient_accumulation_steps
        * accelerator.num_processes
    )
    rows = take(train_rows, needed) if len(train_rows) > needed else train_rows
    folder = _cache_folder(config, output_dir)
    hidden = objective.target_cache_hidden_layers()
    return _cache_rows(config, accelerator, target, target_name, rows, folder, hidden, tokenizer)


def _cache_folder(config: DistillConfig, output_dir: Path) -> Path:
    return Path(config.data.cache_dir or output_dir / "target_cache").expanduser()


def _cache_rows(
    config: DistillConfig,
    accelerator: Accelerator,
    target: Any,
    target_name: str,
    rows: Any,
    folder: Path,
    hidden: list[int] | None,
    tokenizer: Any,
) -> tuple[Any, Any]:
    """Build (every process its share), extend, repair or reuse the cache of ``rows`` in
    ``folder``; with ``cache_only`` open it, refusing a missing cache, one of another key,
    missing sequences and damaged shards."""
    from draftsmith.train.target.cache import (
        build_or_reuse_cache,
        cache_key,
        cache_stats,
        open_cached_rows,
        tokenizer_digest,
    )

    data = config.data
    target_dtype = str(next(target.parameters()).dtype).removeprefix("torch.")
    key = {"target": target_name, "target_dtype": target_dtype}
    key["tokenizer"] = tokenizer_digest(tokenizer)  # rows are found by their tokens, not keyed
    if data.target_outputs == "cache_only":
        wanted = cache_key(key, data.cache_top_k, hidden, data.cache_dtype)
        cached = open_cached_rows(rows, folder, wanted)
        stats = cache_stats(folder)
        stats.run_sequences = len(set(cached.positions))
        return cached, stats
    stats = build_or_reuse_cache(
        target,
        rows,
        folder,
        data.cache_top_k,
        key,
        tokenizer.pad_token_id,
        accelerator.device,
        batch_size=config.optim.per_device_batch_size,
        hidden_layer_ids=hidden,
        progress=accelerator.is_local_main_process and config.logging.progress_bar,
        accelerator=accelerator,
        dtype=data.cache_dtype,
    )
    return open_cached_rows(rows, folder), stats


def cached_eval_rows(
    config: DistillConfig,
    accelerator: Accelerator,
    target: Any,
    target_name: str,
    eval_rows: list[dict[str, Any]],
    objective: Any,
    tokenizer: Any,
    output_dir: Path,
) -> Any:
    """Held-out rows of data are scored into ``<cache>/held_out`` too, so that a ``cache_only``
    run can evaluate without the target; it reads them from there, a ``cache`` run evaluates
    online (the exact ``p``, not its top-k)."""
    if config.data.eval_source != "data":
        return eval_rows
    folder = _cache_folder(config, output_dir) / "held_out"
    hidden = objective.target_cache_hidden_layers()
    cached, _ = _cache_rows(
        config, accelerator, target, target_name, eval_rows, folder, hidden, tokenizer
    )
    return list(cached) if config.data.target_outputs == "cache_only" else eval_rows


def cache_summary(stats: Any) -> dict[str, Any]:
    """The cache's statistics as the run's summary reports them."""
    return {
        "folder": stats.folder,
        "k": stats.k,
        "num_sequences": stats.num_sequences,
        "num_tokens": stats.num_tokens,
        "bytes_per_token": stats.bytes_per_token,
        "full_fp16_bytes_per_token": stats.full_fp16_bytes_per_token,
        "compression": stats.compression,
        "parts_written": stats.parts_written,
        "run_sequences": stats.run_sequences,
        "sequences_scored": stats.sequences_scored,
        "shards_rebuilt": stats.shards_rebuilt,
        "bytes_per_token_at_scale": stats.at_scale,
    }
