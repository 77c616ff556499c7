"""Score the training sequences with the target once, into the offline top-k cache.

Online distillation runs the target on every batch of every epoch; the offline cache
(``draftsmith.data.cache``) runs it once and keeps, per token, the top-k log-probabilities, their ids and
the log of the remaining mass (about ``6k + 12`` bytes per token against ``2V`` for full fp16
logits), plus the hidden states a head drafter reads. Training rows then carry those fields
and the objective rebuilds ``p`` from them.

Every process of a launch writes its share into one folder: the sequences fall into parts of
``part_sequences``, part ``p`` goes to process ``p mod N`` and is written atomically as
``shard-p`` (``draftsmith.data.cache.save_shard``). A build killed at any moment leaves whole parts and
no half-written one; run again, it keeps the finished parts and scores only the missing ones,
so no sequence is lost or written twice. When every part exists the main process writes
``cache.json``, which carries the run's key (target, k, the number of sequences and a digest
of their tokens, hidden layers, dtype). A folder whose key differs from the run's is refused
by name (:class:`CacheKeyError`), never reused or silently overwritten. A sharded target
(``draftsmith.train.target.sharding``) takes part in collective forwards, so every process runs the same
number of them (a process with fewer sequences runs one-token passes).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

BUILD_FILE = "cache_build.json"  # the key of a build under way, written before any part
PART_SEQUENCES = 64  # sequences per part (one shard file each)

# (hidden size, vocabulary) of the shapes the cache states its cost for (bf16 hidden states).
SCALE_SHAPES = {"llama-3-8b": (4096, 128_256), "llama-3-70b": (8192, 128_256)}


class CacheKeyError(ValueError):
    """The cache folder holds outputs of another run (its key differs)."""


@dataclass
class CacheStats:
    """What the cache costs, for the run summary and the model card."""

    folder: str
    k: int
    num_sequences: int
    num_tokens: int
    bytes_per_token: float
    full_fp16_bytes_per_token: int
    parts_written: int = 0  # parts this process scored in this run (0: all reused)
    at_scale: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def compression(self) -> float:
        return self.full_fp16_bytes_per_token / self.bytes_per_token


class CachedRows(Sequence):
    """Training rows joined with their cached target outputs (same order, same tokens)."""

    def __init__(self, rows: Sequence[dict[str, Any]], cache: Any) -> None:
        if len(rows) != len(cache):
            raise ValueError(
                f"the target cache in {cache.folder} holds {len(cache)} sequences but the "
                f"training set has {len(rows)}; delete the cache folder to rebuild it"
            )
        self.rows = rows
        self.cache = cache

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]
        row = self.rows[index]
        cached = self.cache[index]
        if cached["input_ids"].shape[0] != len(row["input_ids"]):
            raise ValueError(
                f"cached sequence {index} has {cached['input_ids'].shape[0]} tokens but the "
                f"training row has {len(row['input_ids'])}; delete {self.cache.folder} to rebuild"
            )
        return {**cached, "loss_mask": row["loss_mask"]}


def cache_key(
    key: dict[str, Any],
    k: int,
    rows: Sequence[dict[str, Any]],
    hidden_layer_ids: list[int] | None,
    dtype: str,
) -> dict[str, Any]:
    """The full key a cache folder must carry to serve a run: the caller's fields (the target),
    the settings, and the rows themselves (:func:`rows_digest`), so a cache serves exactly the
    token sequences it scored, whatever recipe made them."""
    return {
        **key,
        "k": k,
        "num_sequences": len(rows),
        "tokens": rows_digest(rows),
        "hidden_layer_ids": hidden_layer_ids,
        "dtype": dtype,
    }


def rows_digest(rows: Sequence[dict[str, Any]]) -> str:
    """SHA-256 (first 16 hex digits) of the rows' token ids in order, each row's length first.

    Two row sets share a digest only when every sequence is the same, so a cache is reused
    across seeds and recipes that produce the same tokens, and refused (not silently reused)
    for rows of the same count and length but other tokens. Loss masks are not part of it: they
    come from the run's rows, never from the cache."""
    digest = hashlib.sha256()
    for row in rows:
        ids = torch.as_tensor(row["input_ids"], dtype=torch.int64).reshape(-1)
        digest.update(ids.numel().to_bytes(8, "little"))
        digest.update(ids.numpy().tobytes())
    return digest.hexdigest()[:16]


def check_key(folder: Path, found: dict[str, Any] | None, wanted: dict[str, Any]) -> None:
    """Raise :class:`CacheKeyError` naming every field where ``found`` differs from ``wanted``."""
    found = found or {}
    fields = sorted(set(found) | set(wanted))
    differ = [f"{name}: cache {found.get(name)!r}, run {wanted.get(name)!r}" for name in fields]
    differ = [
        d for d, name in zip(differ, fields, strict=True) if found.get(name) != wanted.get(name)
    ]
    if differ:
        raise CacheKeyError(
            f"the target cache in {folder} was built for another run ({'; '.join(differ)}); it "
            "is not reused: delete that folder to rebuild it, or pass another --cache_dir"
        )


def cache_state(folder: Path, wanted: dict[str, Any]) -> str:
    """``complete`` (cache.json with this key), ``partial`` (a build of this key under way) or
    ``empty``; raise :class:`CacheKeyError` for a folder of another key."""
    from draftsmith.data.cache import CACHE_FILE

    manifest, build = folder / CACHE_FILE, folder / BUILD_FILE
    if manifest.is_file():
        check_key(folder, json.loads(manifest.read_text()).get("key"), wanted)
        return "complete"
    if build.is_file():
        check_key(folder, json.loads(build.read_text()), wanted)
        return "partial"
    return "empty"


@torch.no_grad()
def build_or_reuse_cache(
    target: torch.nn.Module,
    rows: Sequence[dict[str, Any]],
    folder: Path,
    k: int,
    key: dict[str, Any],
    pad_token_id: int,
    device: torch.device,
    batch_size: int = 8,
    hidden_layer_ids: list[int] | None = None,
    progress: bool = True,
    accelerator: Any = None,
    dtype: str = "float16",
    part_sequences: int = PART_SEQUENCES,
) -> CacheStats:
    """Write (or reuse, or finish) the cache of ``target``'s outputs on ``rows`` in ``folder``.

    Every process of ``accelerator`` calls it with the same rows; each scores its parts (module
    docstring). Without an accelerator one process writes them all.
    """
    from draftsmith.data.atomic_io import write_json_atomic

    folder = Path(folder)
    wanted = cache_key(key, k, rows, hidden_layer_ids, dtype)
    rank, world = _rank_world(accelerator)
    state = cache_state(folder, wanted)
    written = 0
    if state != "complete":
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            if state == "empty":
                _remove_stray_parts(folder)
                write_json_atomic(folder / BUILD_FILE, wanted)
        _barrier(accelerator)
        parts = _parts(len(rows), part_sequences)
        mine = [p for p in range(len(parts)) if p % world == rank]
        written = _score_parts(
            target,
            rows,
            folder,
            parts,
            mine,
            k,
            pad_token_id,
            device,
            batch_size,
            hidden_layer_ids,
            dtype,
            accelerator,
            progress,
        )
        _barrier(accelerator)
        if rank == 0:
            _finish(folder, parts, k, dtype, hidden_layer_ids, target, wanted)
        _barrier(accelerator)
    return cache_stats(folder, written)


def cache_stats(folder: Path, written: int = 0) -> CacheStats:
    """Sizes of the complete cache in ``folder``, and its cost per token at 8 B and 70 B."""
    from draftsmith.data.cache import (
        TargetCache,
        cache_bytes_per_token,
        full_logits_bytes_per_token,
    )

    cache = TargetCache(folder)
    meta = cache.meta
    value_bytes = 4 if meta.get("dtype") == "float32" else 2
    layers = int(meta["num_hidden_layers"] or 0)
    at_scale = {
        name: {
            "hidden_size": hidden,
            "cache_bytes_per_token": cache_bytes_per_token(cache.k, hidden, layers, value_bytes),
            "full_fp16_logits_bytes_per_token": full_logits_bytes_per_token(vocab),
        }
        for name, (hidden, vocab) in SCALE_SHAPES.items()
    }
    return CacheStats(
        folder=str(folder),
        k=cache.k,
        num_sequences=len(cache),
        num_tokens=int(meta["num_tokens"]),
        bytes_per_token=cache.bytes_per_token,
        full_fp16_bytes_per_token=cache.full_logits_bytes_per_token(),
        parts_written=written,
        at_scale=at_scale,
    )


def open_cached_rows(
    rows: Sequence[dict[str, Any]], folder: Path, wanted: dict[str, Any] | None = None
) -> CachedRows:
    """The training rows joined with the cache in ``folder`` (its key checked when given)."""
    from draftsmith.data.cache import CACHE_FILE, TargetCache

    folder = Path(folder)
    if wanted is not None:
        if not (folder / CACHE_FILE).is_file():
            raise FileNotFoundError(
                f"--target_outputs cache_only: {folder} holds no complete target cache; build "
                "it first with --target_outputs cache (the same data, target and --cache_dir)"
            )
        cache_state(folder, wanted)
    return CachedRows(rows, TargetCache(folder))


# --------------------------------------------------------------------------- internals


def _rank_world(accelerator: Any) -> tuple[int, int]:
    if accelerator is None:
        return 0, 1
    return accelerator.process_index, accelerator.num_processes


def _barrier(accelerator: Any) -> None:
    if accelerator is not None:
        accelerator.wait_for_everyone()


def _parts(num_sequences: int, part_sequences: int) -> list[range]:
    if part_sequences < 1:
        raise ValueError(f"part_sequences must be >= 1, got {part_sequences}")
    return [
        range(start, min(start + part_sequences, num_sequences))
        for start in range(0, num_sequences, part_sequences)
    ]


def _remove_stray_parts(folder: Path) -> None:
    """Shards with neither a manifest nor a build key: of no known run, so not reusable."""
    for stray in folder.glob("shard-*.safetensors"):
        stray.unlink()


def _score_parts(
    target: torch.nn.Module,
    rows: Sequence[dict[str, Any]],
    folder: Path,
    parts: list[range],
    mine: list[int],
    k: int,
    pad_token_id: int,
    device: torch.device,
    batch_size: int,
    hidden_layer_ids: list[int] | None,
    dtype: str,
    accelerator: Any,
    progress: bool,
) -> int:
    """Score this process's missing parts; return how many it wrote."""
    from draftsmith.data.cache import TargetCacheWriter, read_shard_entry, save_shard
    from draftsmith.data.packing import collate
    from tqdm.auto import tqdm

    todo = []
    for p in mine:
        done = read_shard_entry(folder, p)
        if done is None or done["num_sequences"] != len(parts[p]):
            todo.append(p)
    batches = [
        (p, range(start, min(start + batch_size, parts[p].stop)))
        for p in todo
        for start in range(parts[p].start, parts[p].stop, batch_size)
    ]
    passes = _common_pass_count(len(batches), target, accelerator)
    was_training = target.training
    target.eval()
    # The writer checks and compresses each sequence; parts are taken from it, so it never
    # writes a shard of its own (its scratch folder stays empty and is removed).
    scratch = folder / f".scratch-{_rank_world(accelerator)[0]}"
    writer = TargetCacheWriter(
        scratch, k, shard_tokens=2**62, hidden_layer_ids=hidden_layer_ids, dtype=dtype
    )
    for index in tqdm(range(passes), desc="target cache", disable=not progress):
        if index >= len(batches):
            target(input_ids=torch.full((1, 1), pad_token_id, device=device), use_cache=False)
            continue
        part, span = batches[index]
        batch = collate([rows[i] for i in span], pad_token_id)
        outputs = target(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
            output_hidden_states=hidden_layer_ids is not None,
            use_cache=False,
        )
        for row, length in enumerate(batch["attention_mask"].sum(-1).tolist()):
            hidden = None
            if hidden_layer_ids is not None:
                hidden = torch.stack(
                    [outputs.hidden_states[i][row, :length] for i in hidden_layer_ids]
                )
            writer.add(batch["input_ids"][row, :length], outputs.logits[row, :length], hidden)
        if span.stop == parts[part].stop:
            save_shard(folder, part, writer.take(), hidden_layer_ids is not None)
    target.train(was_training)
    shutil.rmtree(scratch, ignore_errors=True)
    return len(todo)


def _common_pass_count(own: int, target: torch.nn.Module, accelerator: Any) -> int:
    """Forward passes this process runs: its own, or the most of any process when the target
    is sharded (its forwards are collectives every process must join)."""
    from torch.distributed.fsdp import FSDPModule

    if accelerator is None or accelerator.num_processes == 1 or not isinstance(target, FSDPModule):
        return own
    from accelerate.utils import gather_object

    return max(int(n) for n in gather_object([own]))


def _finish(
    folder: Path,
    parts: list[range],
    k: int,
    dtype: str,
    hidden_layer_ids: list[int] | None,
    target: torch.nn.Module,
    wanted: dict[str, Any],
) -> None:
    """Check every part is there with its count of sequences, then write ``cache.json``."""
    from draftsmith.data.cache import read_shard_entry, write_manifest

    shards = []
    for p, span in enumerate(parts):
        entry = read_shard_entry(folder, p)
        if entry is None or entry["num_sequences"] != len(span):
            raise RuntimeError(
                f"part {p} of the target cache in {folder} is missing after every process "
                "finished scoring; run the build again (finished parts are kept)"
            )
        shards.append(entry)
    hidden_shape = None
    if hidden_layer_ids is not None:
        from safetensors import safe_open

        with safe_open(str(folder / shards[0]["file"]), framework="pt") as handle:
            layers, _, width = handle.get_slice("hidden_states").get_shape()
        hidden_shape = (int(layers), int(width))
    vocab = int(target.config.vocab_size)
    output = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    if output is not None and hasattr(output, "out_features"):
        vocab = int(output.out_features)
    write_manifest(folder, shards, k, vocab, dtype, hidden_layer_ids, hidden_shape, key=wanted)
    for leftover in folder.glob(".shard-*.tmp-*"):  # a part being written when a process died
        leftover.unlink()
    (folder / BUILD_FILE).unlink(missing_ok=True)
