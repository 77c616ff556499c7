"""Score sequences with the target once, into the offline top-k cache, and serve any run from it.

Online distillation runs the target on every batch of every epoch; the offline cache
(``draftsmith.data.cache``) runs it once and keeps, per token, the top-k log-probabilities, their ids and
the log of the remaining mass (about ``6k + 12`` bytes per token against ``2V`` for full fp16
logits), plus the hidden states a head drafter reads. Training rows then carry those fields
and the objective rebuilds ``p`` from them.

The cache is data, not a run. Its key (:func:`cache_key`) is what makes a cached value true:
the target and its dtype, the tokenizer, k, the stored hidden layers and the cache dtype; a
folder of another key is refused by name (:class:`CacheKeyError`), never reused or
overwritten. Within a key, every sequence is named by its tokens
(``draftsmith.data.cache.sequence_digest``) and the manifest lists the sequences of each shard,
so a run finds the sequences it reads whatever its steps, batch, learning rate, loss or drafter
settings. A build (:func:`build_or_reuse_cache`) plans once from the manifest and the run's rows
(:func:`plan_build`):

- sequences the run reads that the cache lacks are scored and appended as new shards;
- shards holding sequences the run reads that are missing, truncated or fail their checksum
  are rescored under the same names; every other shard's bytes stay as they were;
- nothing else is scored (a complete, sound cache costs no forward pass).

A run that only reads (``cache_only``) opens it with :func:`open_cached_rows`, which refuses
missing sequences and damaged shards by name, with the fix (:class:`CacheMissingError`,
``draftsmith.data.cache.CacheShardError``).

Every process of a launch writes its share into one folder: the planned parts go to process
``p mod N`` and each is written atomically (``draftsmith.data.cache.save_shard``) with its
manifest entry (size, SHA-256, sequences) beside it as ``shard-NNNNN.entry.json``. The main
process folds the entries into ``cache.json`` once every part exists. A build killed at any
moment leaves whole parts; run again, it makes the same plan (the manifest is unchanged until
the end), keeps the parts whose entries match and scores only the others, so no sequence is lost
or written twice. A sharded target (``draftsmith.train.target.sharding``) takes part in
collective forwards, so every process runs the same number of them (a process with fewer
sequences runs one-token passes).
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

PART_SEQUENCES = 64  # sequences per new part (one shard file each)
_ENTRY_SUFFIX = ".entry.json"  # a finished part's manifest entry, until cache.json holds it
_REBUILD = (
    "rerun the build with the same flags and --target_outputs cache: it rescores only the "
    "damaged shards and leaves the others as they are"
)

# (hidden size, vocabulary) of the shapes the cache states its cost for (bf16 hidden states).
SCALE_SHAPES = {"llama-3-8b": (4096, 128_256), "llama-3-70b": (8192, 128_256)}


class CacheKeyError(ValueError):
    """The cache folder holds outputs of another target, tokenizer or layout (its key differs)."""


class CacheMissingError(ValueError):
    """A run that only reads the cache needs sequences the cache does not hold."""


@dataclass
class CacheStats:
    """What the cache costs and what this run did with it, for the summary and the model card."""

    folder: str
    k: int
    num_sequences: int
    num_tokens: int
    bytes_per_token: float
    full_fp16_bytes_per_token: int
    parts_written: int = 0  # parts this process scored in this run (0: all reused)
    at_scale: dict[str, dict[str, int]] = field(default_factory=dict)
    run_sequences: int = 0  # distinct sequences this run reads from the cache
    sequences_scored: int = 0  # of them, scored by this build (missing or in a damaged shard)
    shards_rebuilt: list[str] = field(default_factory=list)  # damaged shards rewritten

    @property
    def compression(self) -> float:
        return self.full_fp16_bytes_per_token / self.bytes_per_token


@dataclass
class BuildPlan:
    """What a build scores: ``parts`` are (shard index, row indices) in scoring order; the
    first ``len(rebuilt)`` rewrite the damaged shards, the rest append."""

    parts: list[tuple[int, list[int]]]
    rebuilt: dict[str, str]  # damaged shard file -> what was wrong with it
    missing: int  # distinct sequences the run reads that no shard holds
    needed: int  # distinct sequences the run reads
    dropped: int  # sequences of damaged shards this run cannot rescore (not among its rows)


class CachedRows(Sequence):
    """Training rows joined with their cached target outputs (row i: cache sequence
    ``positions[i]``, the same tokens)."""

    def __init__(self, rows: Sequence[dict[str, Any]], cache: Any, positions: list[int]) -> None:
        self.rows = rows
        self.cache = cache
        self.positions = positions

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]
        row = self.rows[index]
        cached = self.cache[self.positions[index]]
        if cached["input_ids"].shape[0] != len(row["input_ids"]):
            raise ValueError(
                f"cached sequence {self.positions[index]} has {cached['input_ids'].shape[0]} "
                f"tokens but the training row has {len(row['input_ids'])}; delete "
                f"{self.cache.folder} to rebuild"
            )
        return {**cached, "loss_mask": row["loss_mask"]}


def cache_key(
    key: dict[str, Any], k: int, hidden_layer_ids: list[int] | None, dtype: str
) -> dict[str, Any]:
    """The key a cache folder must carry to serve a run: the caller's fields (the target, its
    dtype, the tokenizer) and the layout (k, hidden layers, cache dtype). The sequences are not
    part of it: the manifest lists them, and a run reads whichever it needs."""
    return {**key, "k": k, "hidden_layer_ids": hidden_layer_ids, "dtype": dtype}


def tokenizer_digest(tokenizer: Any) -> str:
    """SHA-256 (first 16 hex digits) of the tokenizer's vocabulary (token -> id, added tokens
    included): two tokenizers share it only when every token has the same id."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def row_digests(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Each row's sequence digest (``draftsmith.data.cache.sequence_digest``), in order. Loss
    masks are not part of it: they come from the run's rows, never from the cache."""
    from draftsmith.data.cache import sequence_digest

    return [sequence_digest(row["input_ids"]) for row in rows]


def check_key(folder: Path, found: dict[str, Any] | None, wanted: dict[str, Any]) -> None:
    """Raise :class:`CacheKeyError` naming every field where ``found`` differs from ``wanted``."""
    found = found or {}
    fields = sorted(set(found) | set(wanted))
    differ = [
        f"{name}: cache {found.get(name)!r}, run {wanted.get(name)!r}"
        for name in fields
        if found.get(name) != wanted.get(name)
    ]
    if differ:
        raise CacheKeyError(
            f"the target cache in {folder} was built for another target, tokenizer or layout "
            f"({'; '.join(differ)}); it is not reused: delete that folder to rebuild it, or pass "
            "another --cache_dir"
        )


def plan_build(cache: Any, digests: list[str], part_sequences: int = PART_SEQUENCES) -> BuildPlan:
    """What a build of the rows named ``digests`` must score in ``cache`` (a
    ``draftsmith.data.cache.TargetCache``, or None for an empty folder): the damaged shards
    holding sequences of the run, rewritten with the rows they held, then the missing
    sequences in new parts of ``part_sequences``. Every process makes the same plan."""
    if part_sequences < 1:
        raise ValueError(f"part_sequences must be >= 1, got {part_sequences}")
    first_row: dict[str, int] = {}
    for row, digest in enumerate(digests):
        first_row.setdefault(digest, row)
    shards = [] if cache is None else cache.shards
    held = {d: i for i, shard in enumerate(shards) for d in shard["sequences"]}
    needed_shards = sorted({held[d] for d in first_row if d in held})
    damaged = {} if cache is None else cache.damaged_shards(needed_shards)
    parts, dropped = [], 0
    for shard_index in damaged:
        stored = shards[shard_index]["sequences"]
        rows = [first_row[d] for d in stored if d in first_row]
        dropped += len(stored) - len(rows)
        parts.append((_shard_number(shards[shard_index]["file"]), rows))
    missing = [row for d, row in first_row.items() if d not in held]
    start = 1 + max((_shard_number(s["file"]) for s in shards), default=-1)
    for offset in range(0, len(missing), part_sequences):
        parts.append((start + offset // part_sequences, missing[offset : offset + part_sequences]))
    rebuilt = {shards[i]["file"]: why for i, why in damaged.items()}
    return BuildPlan(parts, rebuilt, len(missing), len(first_row), dropped)


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
    """Make the cache in ``folder`` hold ``target``'s outputs on every one of ``rows``: reuse
    what it holds, rewrite its damaged shards, append what it lacks (module docstring).

    Every process of ``accelerator`` calls it with the same rows; each scores its parts.
    Without an accelerator one process writes them all.
    """
    from draftsmith.data.cache import CACHE_FILE, TargetCache, read_manifest, write_manifest

    folder = Path(folder)
    wanted = cache_key(key, k, hidden_layer_ids, dtype)
    rank, world = _rank_world(accelerator)
    if rank == 0:
        if (folder / CACHE_FILE).is_file():
            check_key(folder, read_manifest(folder).get("key"), wanted)
        else:  # a new cache: its key first, so a killed first build is continued, not lost
            folder.mkdir(parents=True, exist_ok=True)
            _remove_unlisted(folder)
            vocab = _vocab_size(target)
            write_manifest(folder, [], k, vocab, dtype, hidden_layer_ids, None, key=wanted)
    _barrier(accelerator)
    cache = TargetCache(folder)
    check_key(folder, cache.meta.get("key"), wanted)
    plan = plan_build(cache, row_digests(rows), part_sequences)
    if rank == 0:
        print(_plan_line(folder, plan), flush=True)
    written = 0
    if plan.parts:
        mine = [part for index, part in enumerate(plan.parts) if index % world == rank]
        layout = {"k": k, "dtype": dtype, "hidden_layer_ids": hidden_layer_ids}
        written = _score_parts(
            target, rows, folder, mine, layout, pad_token_id, device, batch_size, accelerator,
            progress,
        )  # fmt: skip
        _barrier(accelerator)
        if rank == 0:
            _fold_entries(folder, cache, plan)
        _barrier(accelerator)
    stats = cache_stats(folder, written)
    stats.run_sequences = plan.needed
    stats.sequences_scored = sum(len(part) for _, part in plan.parts)
    stats.shards_rebuilt = list(plan.rebuilt)
    return stats


def cache_stats(folder: Path, written: int = 0) -> CacheStats:
    """Sizes of the cache in ``folder``, and its cost per token at 8 B and 70 B."""
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
    """The rows joined with the cache in ``folder``: its key checked when ``wanted`` is given,
    every row's sequence found by its tokens, and every shard they lie in checked (size,
    checksum, header). Missing sequences are :class:`CacheMissingError`, damaged shards
    ``CacheShardError``, both naming the fix."""
    from draftsmith.data.cache import CACHE_FILE, TargetCache

    folder = Path(folder)
    if not (folder / CACHE_FILE).is_file():
        raise FileNotFoundError(
            f"--target_outputs cache_only: {folder} holds no target cache; build it first with "
            "--target_outputs cache (the same data, target and --cache_dir)"
        )
    cache = TargetCache(folder)
    if wanted is not None:
        check_key(folder, cache.meta.get("key"), wanted)
    digests = row_digests(rows)
    positions = [cache.position(digest) for digest in digests]
    absent = {d for d, p in zip(digests, positions, strict=True) if p is None}
    if absent:
        raise CacheMissingError(
            f"the run reads {len(set(digests))} distinct sequences and {len(absent)} of them are "
            f"not in the target cache in {folder} (it holds {len(cache)}); score them with "
            "--target_outputs cache and the same flags, which appends only the missing ones"
        )
    cache.check_shards([cache.shard_of(p) for p in positions], _fix_line(folder))
    return CachedRows(rows, cache, positions)


# --------------------------------------------------------------------------- internals


def _fix_line(folder: Path) -> str:
    return f"To repair it, {_REBUILD} (--cache_dir {folder})."


def _plan_line(folder: Path, plan: BuildPlan) -> str:
    """The build's plan in one log line: what is reused, scored and rewritten."""
    reused = (
        plan.needed - plan.missing - sum(len(rows) for _, rows in plan.parts[: len(plan.rebuilt)])
    )
    line = (
        f"target cache {folder}: the run reads {plan.needed} sequences; {reused} reused, "
        f"{plan.missing} missing (scored into {len(plan.parts) - len(plan.rebuilt)} new parts), "
        f"{len(plan.rebuilt)} damaged shards rescored"
    )
    if plan.rebuilt:
        line += " (" + "; ".join(f"{file} is {why}" for file, why in plan.rebuilt.items()) + ")"
    if plan.dropped:
        line += f"; {plan.dropped} sequences of those shards are not among this run's rows: dropped"
    return line


def _shard_number(file: str) -> int:
    """``shard-00012.safetensors`` -> 12."""
    return int(file.split("-", 1)[1].split(".", 1)[0])


def _vocab_size(target: torch.nn.Module) -> int:
    vocab = int(target.config.vocab_size)
    output = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    if output is not None and hasattr(output, "out_features"):
        vocab = int(output.out_features)
    return vocab


def _rank_world(accelerator: Any) -> tuple[int, int]:
    if accelerator is None:
        return 0, 1
    return accelerator.process_index, accelerator.num_processes


def _barrier(accelerator: Any) -> None:
    if accelerator is not None:
        accelerator.wait_for_everyone()


def _remove_unlisted(folder: Path) -> None:
    """Shards and entries with no manifest: of no known build, so not reusable."""
    for stray in [*folder.glob("shard-*.safetensors"), *folder.glob(f"shard-*{_ENTRY_SUFFIX}")]:
        stray.unlink()


def _entry_path(folder: Path, shard_index: int) -> Path:
    from draftsmith.data.cache import shard_name

    return folder / (shard_name(shard_index) + _ENTRY_SUFFIX)


def _finished_entry(folder: Path, shard_index: int, digests: list[str]) -> dict[str, Any] | None:
    """The entry of part ``shard_index`` when a build killed earlier finished it with exactly
    ``digests`` and its bytes still match; None otherwise."""
    from draftsmith.data.cache import file_sha256, shard_name

    path = _entry_path(folder, shard_index)
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    shard = folder / shard_name(shard_index)
    if (
        not isinstance(entry, dict)
        or entry.get("sequences") != digests
        or not shard.is_file()
        or shard.stat().st_size != entry.get("bytes")
        or file_sha256(shard) != entry.get("sha256")
    ):
        return None
    return entry


def _score_parts(
    target: torch.nn.Module,
    rows: Sequence[dict[str, Any]],
    folder: Path,
    parts: list[tuple[int, list[int]]],
    layout: dict[str, Any],
    pad_token_id: int,
    device: torch.device,
    batch_size: int,
    accelerator: Any,
    progress: bool,
) -> int:
    """Score this process's parts (those not finished by an earlier, killed build); each is
    written as its shard, then its manifest entry. Return how many it wrote."""
    from draftsmith.data.atomic_io import write_json_atomic
    from draftsmith.data.cache import TargetCacheWriter, save_shard
    from draftsmith.data.packing import collate
    from tqdm.auto import tqdm

    digests = row_digests(rows)
    todo = [
        (index, part)
        for index, part in parts
        if _finished_entry(folder, index, [digests[i] for i in part]) is None
    ]
    batches = [
        (index, part[start : start + batch_size], start + batch_size >= len(part))
        for index, part in todo
        for start in range(0, len(part), batch_size)
    ]
    passes = _common_pass_count(len(batches), target, accelerator)
    hidden_layer_ids = layout["hidden_layer_ids"]
    was_training = target.training
    target.eval()
    # The writer checks and compresses each sequence; parts are taken from it, so it never
    # writes a shard of its own (its scratch folder stays empty and is removed).
    scratch = folder / f".scratch-{_rank_world(accelerator)[0]}"
    writer = TargetCacheWriter(
        scratch,
        layout["k"],
        shard_tokens=2**62,
        hidden_layer_ids=hidden_layer_ids,
        dtype=layout["dtype"],
    )
    for number in tqdm(range(passes), desc="target cache", disable=not progress):
        if number >= len(batches):
            target(input_ids=torch.full((1, 1), pad_token_id, device=device), use_cache=False)
            continue
        index, span, last = batches[number]
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
        if last:
            entry = save_shard(folder, index, writer.take(), hidden_layer_ids is not None, layout)
            write_json_atomic(_entry_path(folder, index), entry)
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


def _fold_entries(folder: Path, cache: Any, plan: BuildPlan) -> None:
    """Put every planned part's entry in ``cache.json`` (rewritten shards in their place, new
    ones at the end), then remove the entries and any half-written leftovers."""
    from draftsmith.data.cache import shard_name, write_manifest

    entries = {}
    for index, _ in plan.parts:
        path = _entry_path(folder, index)
        if not path.is_file():
            raise RuntimeError(
                f"part {shard_name(index)} of the target cache in {folder} is missing after "
                "every process finished scoring; run the build again (finished parts are kept)"
            )
        entries[index] = json.loads(path.read_text(encoding="utf-8"))
    shards = [entries.pop(_shard_number(s["file"]), s) for s in cache.shards]
    shards = [s for s in shards if s["num_sequences"] > 0] + list(entries.values())
    meta = cache.meta
    hidden_shape = _hidden_shape(folder, shards) if meta["hidden_layer_ids"] is not None else None
    write_manifest(
        folder,
        shards,
        meta["k"],
        meta["vocab_size"],
        meta["dtype"],
        meta["hidden_layer_ids"],
        hidden_shape,
        key=meta["key"],
    )
    listed = {shard["file"] for shard in shards}
    unlisted = [p for p in folder.glob("shard-*.safetensors") if p.name not in listed]
    for leftover in [  # entries now in cache.json, parts of an abandoned plan, half-written parts
        *folder.glob(f"shard-*{_ENTRY_SUFFIX}"),
        *unlisted,
        *folder.glob(".shard-*.tmp-*"),
    ]:
        leftover.unlink()


def _hidden_shape(folder: Path, shards: list[dict[str, Any]]) -> tuple[int, int] | None:
    """(layers, width) of the stored hidden states, read from the first shard's header."""
    from safetensors import safe_open

    if not shards:
        return None
    with safe_open(str(folder / shards[0]["file"]), framework="pt") as handle:
        layers, _, width = handle.get_slice("hidden_states").get_shape()
    return int(layers), int(width)
