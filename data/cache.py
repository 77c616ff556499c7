"""The offline cache of target outputs: top-k log-probabilities (and hidden states) per token.

Distilling a drafter needs the target's next-token distribution ``p`` at every position. The
full distribution costs ``2 V`` bytes per token in fp16 (64 KB at V = 32k); the cache keeps
the ``k`` largest log-probabilities and their ids plus the log of the mass outside them, about
``6 k + 12`` bytes per token. Sparse top-k targets are the standard trade-off for offline
distillation (e.g. the top-k logit caches of DistillSpec, Zhou et al. 2024, and of MiniLLM-style
pipelines); ``topk_to_probs`` rebuilds a proper distribution:

    p_hat(x) = exp(topk_logprobs[j])               if x = topk_ids[j]
    p_hat(x) = exp(rest_logmass) / (V - k)         otherwise

renormalised to sum to 1 (the fp16 rounding of the stored log-probs leaves a tiny deficit).

Layout (docs/interfaces.md, "Offline target cache"): a folder of ``shard-NNNNN.safetensors``
files plus ``cache.json``, the manifest. Each shard concatenates its sequences along the token
axis: ``input_ids`` [N] int64, ``topk_ids`` [N, k] int32, ``topk_logprobs`` [N, k] float16,
``rest_logmass`` [N] float32, optionally ``hidden_states`` [L, N, H] float16, and ``offsets``
[S + 1] int64 (sequence s is tokens ``offsets[s]:offsets[s + 1]``). Shards and ``cache.json``
are written to a temporary sibling and renamed (``draftsmith.data.atomic_io``), so a shard on
disk is always complete.

The cache is data, keyed by what it holds: every sequence is named by the digest of its tokens
(:func:`sequence_digest`), and the manifest lists, per shard, the digests it holds, its size
in bytes and its SHA-256, taken from the bytes written before the shard got its name
(:func:`save_shard`). A reader finds any subset of the sequences from the manifest alone, and
checks each shard it reads (:meth:`TargetCache.check_shards`): missing, truncated, failing its
checksum, or disagreeing with the manifest (k, dtype, hidden layers, sequence and token
counts, which sequences) is a :class:`CacheShardError` naming the shard. ``dtype`` (float16 by
default, bfloat16 or float32) is the dtype of the stored log-probs and hidden states; bytes per
token are :func:`cache_bytes_per_token`. ``draftsmith.train.target.cache`` builds a cache from
several processes, appends missing sequences and rewrites damaged shards.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from draftsmith.data.atomic_io import atomic_file, write_json_atomic
from safetensors import safe_open
from safetensors.torch import save_file

CACHE_FILE = "cache.json"
FORMAT_VERSION = 2  # 2: per-shard sequences, bytes and SHA-256
_SHARD_NAME = "shard-{:05d}.safetensors"
_SHARD_GLOB = "shard-*.safetensors"
CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_FIELDS = ("input_ids", "topk_ids", "topk_logprobs", "rest_logmass")


class CacheShardError(ValueError):
    """A shard of a target cache is missing, damaged, or disagrees with the manifest."""


def sequence_digest(input_ids: Any) -> str:
    """The name of one cached sequence: SHA-256 (first 16 hex digits) of its token ids as
    little-endian int64. Two sequences share it only when their tokens are the same."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(-1)
    return hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest()[:16]


def file_sha256(path: str | Path) -> str:
    """SHA-256 of the file at ``path``, read in blocks (a shard can be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def shard_name(index: int) -> str:
    """File name of shard (or part) ``index``."""
    return _SHARD_NAME.format(index)


def cache_bytes_per_token(
    k: int, hidden_size: int = 0, hidden_layers: int = 0, value_bytes: int = 2
) -> int:
    """Bytes a cached token costs: ``8 + 4 k + b k + 4 + b L H``.

    The token id (int64), ``k`` ids (int32), ``k`` log-probs and ``L`` hidden states of width
    ``H`` in the cache dtype (``b`` bytes: 2 for float16/bfloat16) and the rest mass (float32).
    For an EAGLE-3 head (L = 3) at k = 32 in bfloat16: 24,780 bytes on Llama-3-8B's H = 4096,
    49,356 on Llama-3-70B's H = 8192; full fp16 logits over V = 128,256 would be 256,512.
    """
    return 8 + 4 * k + value_bytes * k + 4 + value_bytes * hidden_layers * hidden_size


def full_logits_bytes_per_token(vocab_size: int, bytes_per_value: int = 2) -> int:
    """Bytes per token of storing the full distribution instead (``2 V`` in fp16)."""
    return vocab_size * bytes_per_value


def compress_logits(
    logits: torch.Tensor,  # [..., V]
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [..., k] int64, [..., k] f32, [...] f32
    """Top-k of ``log_softmax(logits)`` and the log of the mass outside the top k.

    ``rest_logmass = logsumexp`` of the log-probs that are not in the top k: computed from the
    excluded entries themselves rather than as ``log(1 - sum top-k)``, so it keeps full relative
    precision when the rest is tiny (no cancellation); it is ``-inf`` when k = V.
    """
    vocab_size = logits.shape[-1]
    if not 1 <= k <= vocab_size:
        raise ValueError(f"k must lie in [1, vocab size {vocab_size}], got {k}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, k, dim=-1)
    outside = logprobs.scatter(-1, top.indices, float("-inf"))
    rest_logmass = torch.logsumexp(outside, dim=-1)
    return top.indices, top.values, rest_logmass


def topk_to_probs(
    topk_ids: torch.Tensor,  # [..., k]
    topk_logprobs: torch.Tensor,  # [..., k]
    rest_logmass: torch.Tensor,  # [...]
    vocab_size: int,
) -> torch.Tensor:  # [..., V] float32, rows sum to 1
    """The distribution stored in the cache: top-k mass at its ids, the rest spread uniformly.

    See the module docstring for the formula. Rows are renormalised to sum to exactly 1.
    """
    k = topk_ids.shape[-1]
    if k > vocab_size:
        raise ValueError(f"topk_ids has k = {k} entries per row but vocab_size is {vocab_size}")
    if topk_logprobs.shape != topk_ids.shape or rest_logmass.shape != topk_ids.shape[:-1]:
        raise ValueError(
            f"shapes disagree: topk_ids {tuple(topk_ids.shape)}, topk_logprobs "
            f"{tuple(topk_logprobs.shape)}, rest_logmass {tuple(rest_logmass.shape)}; expected "
            "[..., k], [..., k] and [...]"
        )
    rest = rest_logmass.float().exp() if k < vocab_size else torch.zeros_like(rest_logmass.float())
    spread = rest / max(vocab_size - k, 1)  # [...]
    probs = spread.unsqueeze(-1).expand(*spread.shape, vocab_size).clone()  # [..., V]
    probs.scatter_(-1, topk_ids.long(), topk_logprobs.float().exp())
    return probs / probs.sum(-1, keepdim=True)


class TargetCacheWriter:
    """Write a target cache; use as a context manager (``cache.json`` is written on close).

    ``shard_tokens`` bounds the tokens buffered in memory before a shard is written: with hidden
    states a token costs ``2 L H`` more bytes (24 KB for 3 layers of 4096), so lower it for
    large targets. Leaving the ``with`` block through an exception writes no ``cache.json``.
    """

    def __init__(
        self,
        folder: str | Path,
        k: int,
        shard_tokens: int = 1_000_000,
        hidden_layer_ids: list[int] | None = None,
        overwrite: bool = False,
        dtype: str = "float16",
    ) -> None:
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(CACHE_DTYPES)}, got {dtype!r}")
        self.dtype = dtype
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
        self.folder = Path(folder)
        self.k = k
        self.shard_tokens = shard_tokens
        self.hidden_layer_ids = None if hidden_layer_ids is None else list(hidden_layer_ids)
        if (self.folder / CACHE_FILE).exists():
            if not overwrite:
                raise FileExistsError(
                    f"{self.folder} already holds a target cache; pass overwrite=True to replace "
                    "it or choose another folder"
                )
            (self.folder / CACHE_FILE).unlink()
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(_SHARD_GLOB):  # no cache.json: left by an interrupted write
            stale.unlink()
        self._vocab_size: int | None = None
        self._hidden_shape: tuple[int, int] | None = None  # (L, H)
        self._has_hidden: bool | None = None
        self._buffer: list[dict[str, torch.Tensor]] = []
        self._buffered_tokens = 0
        self._shards: list[dict[str, Any]] = []
        self.num_sequences = 0
        self.num_tokens = 0
        self._closed = False

    def __enter__(self) -> TargetCacheWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self._buffer.clear()
            self._closed = True

    def add(
        self,
        input_ids: torch.Tensor,  # [T]
        logits: torch.Tensor,  # [T, V]
        hidden_states: torch.Tensor | None = None,  # [L, T, H]
    ) -> None:
        """Store one sequence: its ids, the target's logits at each position, and hidden states.

        ``logits[t]`` is the target's prediction for token ``t + 1`` (what the model returns for
        ``input_ids``); it is reduced at once to top-k log-probs, so nothing of size V is kept.
        """
        if self._closed:
            raise RuntimeError("this TargetCacheWriter is closed; open a new one to write more")
        if input_ids.dim() != 1 or input_ids.numel() == 0 or input_ids.is_floating_point():
            raise ValueError(
                f"input_ids must be a non-empty 1-D integer tensor [T], got {input_ids.dtype} "
                f"{tuple(input_ids.shape)}; for a batch of one pass input_ids[0]"
            )
        length = input_ids.shape[0]
        if logits.dim() != 2 or logits.shape[0] != length:
            raise ValueError(
                f"logits must be [T, V] with T = {length} (the length of input_ids), got "
                f"{tuple(logits.shape)}; for a batch of one pass logits[0]"
            )
        if self._vocab_size is None:
            if logits.shape[1] < self.k:
                raise ValueError(f"k = {self.k} exceeds the vocabulary size {logits.shape[1]}")
            self._vocab_size = logits.shape[1]
        elif logits.shape[1] != self._vocab_size:
            raise ValueError(
                f"logits have vocabulary size {logits.shape[1]} but earlier sequences had "
                f"{self._vocab_size}; one cache holds one target"
            )
        hidden = self._check_hidden(hidden_states, length)
        topk_ids, topk_logprobs, rest_logmass = compress_logits(logits.detach(), self.k)
        entry = {
            "input_ids": input_ids.detach().to("cpu", torch.int64),
            "topk_ids": topk_ids.to("cpu", torch.int32),
            "topk_logprobs": topk_logprobs.to("cpu", CACHE_DTYPES[self.dtype]),
            "rest_logmass": rest_logmass.to("cpu", torch.float32),
        }
        if hidden is not None:
            entry["hidden_states"] = hidden
        self._buffer.append(entry)
        self._buffered_tokens += length
        self.num_sequences += 1
        self.num_tokens += length
        if self._buffered_tokens >= self.shard_tokens:
            self._flush()

    def _check_hidden(
        self,
        hidden_states: torch.Tensor | None,  # [L, T, H]
        length: int,
    ) -> torch.Tensor | None:  # [L, T, H] in the cache dtype on CPU
        if self._has_hidden is None:
            self._has_hidden = hidden_states is not None
            if not self._has_hidden and self.hidden_layer_ids is not None:
                raise ValueError(
                    "hidden_layer_ids was given but add() got no hidden_states; pass them or "
                    "leave hidden_layer_ids=None"
                )
        if (hidden_states is not None) != self._has_hidden:
            raise ValueError(
                "every sequence of a cache must come with hidden_states or none may: the first "
                f"{'had' if self._has_hidden else 'had no'} hidden states"
            )
        if hidden_states is None:
            return None
        if hidden_states.dim() != 3 or hidden_states.shape[1] != length:
            raise ValueError(
                f"hidden_states must be [L, T, H] with T = {length}, got "
                f"{tuple(hidden_states.shape)}; stack the chosen layers of output_hidden_states "
                "and drop the batch axis"
            )
        shape = (hidden_states.shape[0], hidden_states.shape[2])
        if self.hidden_layer_ids is not None and shape[0] != len(self.hidden_layer_ids):
            raise ValueError(
                f"hidden_states has {shape[0]} layers but hidden_layer_ids names "
                f"{len(self.hidden_layer_ids)}: {self.hidden_layer_ids}"
            )
        if self._hidden_shape is None:
            self._hidden_shape = shape
        elif shape != self._hidden_shape:
            raise ValueError(
                f"hidden_states has (L, H) = {shape} but earlier sequences had {self._hidden_shape}"
            )
        hidden = hidden_states.detach().to("cpu", CACHE_DTYPES[self.dtype])
        if not torch.isfinite(hidden).all() and torch.isfinite(hidden_states).all():
            raise ValueError(
                f"hidden_states overflow {self.dtype} (|x| > 65504 in float16); store them as "
                "bfloat16 (--cache_dtype bfloat16), or cache an earlier layer or normalised states"
            )
        return hidden

    def _flush(self) -> None:
        if not self._buffer:
            return
        self._shards.append(
            save_shard(
                self.folder,
                len(self._shards),
                self._buffer,
                bool(self._has_hidden),
                shard_layout(self.k, self.dtype, self.hidden_layer_ids),
            )
        )
        self._buffer.clear()
        self._buffered_tokens = 0

    def take(self) -> list[dict[str, torch.Tensor]]:
        """The sequences added so far and not written, handed over and forgotten.

        For callers that lay out shards themselves (:func:`save_shard`, one part of a
        multi-process cache per call); checks and compression stay :meth:`add`'s.
        """
        entries, self._buffer = self._buffer, []
        self._buffered_tokens = 0
        return entries

    def close(self) -> None:
        """Write the last shard, then ``cache.json``; a second call does nothing."""
        if self._closed:
            return
        if self.num_sequences == 0:
            raise ValueError(f"no sequences were added to the cache in {self.folder}; add() some")
        self._flush()
        write_manifest(
            self.folder,
            self._shards,
            self.k,
            self._vocab_size,
            self.dtype,
            self.hidden_layer_ids,
            self._hidden_shape,
        )
        self._closed = True


def shard_layout(k: int, dtype: str, hidden_layer_ids: list[int] | None) -> dict[str, Any]:
    """What a shard's header states about its layout, for :func:`save_shard`."""
    return {"k": k, "dtype": dtype, "hidden_layer_ids": hidden_layer_ids}


def save_shard(
    folder: Path,
    index: int,
    entries: Sequence[dict[str, torch.Tensor]],
    has_hidden: bool,
    layout: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``entries`` (sequences as :meth:`TargetCacheWriter.add` keeps them) atomically as
    shard ``index``; return its manifest entry: file, counts, the sequences' digests, size and
    SHA-256 (of the bytes written, taken before the file gets its name). ``layout`` (k, dtype,
    hidden layer ids) goes in the file's metadata too, so a manifest edited against its shards
    is caught by reading the shard's header."""
    lengths = [entry["input_ids"].shape[0] for entry in entries]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), dim=0)
    tensors = {
        name: torch.cat([entry[name] for entry in entries], dim=0).contiguous() for name in _FIELDS
    }
    if has_hidden:
        tensors["hidden_states"] = torch.cat(
            [entry["hidden_states"] for entry in entries], dim=1
        ).contiguous()
    tensors["offsets"] = offsets
    name = shard_name(index)
    sequences = [sequence_digest(entry["input_ids"]) for entry in entries]
    metadata = {
        "format": "pt",
        "num_sequences": str(len(lengths)),
        "sequences": json.dumps(sequences),
        **{key: json.dumps(value) for key, value in (layout or {}).items()},
    }
    with atomic_file(Path(folder) / name) as temporary:
        save_file(tensors, str(temporary), metadata=metadata)
        size, checksum = temporary.stat().st_size, file_sha256(temporary)
    return {
        "file": name,
        "num_sequences": len(lengths),
        "num_tokens": int(offsets[-1]),
        "bytes": size,
        "sha256": checksum,
        "sequences": sequences,
    }


def shard_problem(folder: Path, entry: dict[str, Any], meta: dict[str, Any]) -> str | None:
    """What is wrong with the shard of manifest ``entry`` in ``folder`` (``meta``: the
    manifest), or None: missing, another size (truncated), failing its checksum, an unreadable
    header, or a header that disagrees with the manifest."""
    path = Path(folder) / entry["file"]
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != entry.get("bytes"):
        return f"{size} bytes where the manifest says {entry.get('bytes')} (truncated or replaced)"
    if file_sha256(path) != entry.get("sha256"):
        return "failing its SHA-256 checksum (its bytes changed after it was written)"
    return _header_problem(path, entry, meta)


def _header_problem(path: Path, entry: dict[str, Any], meta: dict[str, Any]) -> str | None:
    """Where the shard's own header disagrees with the manifest (k, dtype, hidden layers,
    sequence and token counts, which sequences), or None."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            found = handle.metadata() or {}
            topk = handle.get_slice("topk_logprobs")
            rows, k = topk.get_shape()
            dtype = _DTYPE_NAMES.get(topk.get_dtype(), topk.get_dtype())
            offsets = handle.get_slice("offsets")
            sequences = offsets.get_shape()[0] - 1
            layers = None
            if "hidden_states" in handle.keys():  # noqa: SIM118 - safe_open has no __contains__
                layers = handle.get_slice("hidden_states").get_shape()[0]
            layer_ids = json.loads(found.get("hidden_layer_ids", "null"))
            digests = json.loads(found.get("sequences", "[]"))
    except Exception as error:  # safetensors raises its own error type for a bad header
        return f"unreadable ({' '.join(str(error).split())})"
    wanted_layers = meta.get("hidden_layer_ids")
    wanted_count = None if not meta.get("has_hidden_states") else meta.get("num_hidden_layers")
    checks = [
        ("k", meta.get("k"), k),
        ("dtype", meta.get("dtype"), dtype),
        ("hidden layers", wanted_count, layers),
        ("num_tokens", entry.get("num_tokens"), rows),
        ("num_sequences", entry.get("num_sequences"), sequences),
        ("sequences", entry.get("sequences"), digests),
    ]
    if "hidden_layer_ids" in found:
        checks.append(("hidden_layer_ids", wanted_layers, layer_ids))
    differ = [
        f"{name}: cache.json {_short(said)}, shard {_short(held)}"
        for name, said, held in checks
        if said != held
    ]
    if differ:
        return "disagreeing with cache.json (" + "; ".join(differ) + ")"
    return None


_DTYPE_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def write_manifest(
    folder: Path,
    shards: Sequence[dict[str, Any]],
    k: int,
    vocab_size: int | None,
    dtype: str,
    hidden_layer_ids: list[int] | None,
    hidden_shape: tuple[int, int] | None,
    key: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``cache.json`` for ``shards`` (manifest entries, in sequence order) atomically;
    return it."""
    num_tokens = sum(int(shard["num_tokens"]) for shard in shards)
    disk_bytes = sum(int(shard["bytes"]) for shard in shards)
    meta = {
        "format_version": FORMAT_VERSION,
        "k": k,
        "vocab_size": vocab_size,
        "dtype": dtype,
        "num_sequences": sum(int(shard["num_sequences"]) for shard in shards),
        "num_tokens": num_tokens,
        "bytes_per_token": disk_bytes / max(num_tokens, 1),
        "has_hidden_states": hidden_shape is not None,
        "hidden_layer_ids": hidden_layer_ids,
        "hidden_size": None if hidden_shape is None else hidden_shape[1],
        "num_hidden_layers": None if hidden_shape is None else hidden_shape[0],
        "shards": list(shards),
        "key": key,
    }
    write_json_atomic(Path(folder) / CACHE_FILE, meta)
    return meta


def read_manifest(folder: Path) -> dict[str, Any]:
    """``cache.json`` of ``folder``, checked to be a manifest of this format that agrees with
    itself; ``FileNotFoundError`` or ``ValueError`` naming the file and the fix otherwise."""
    path = Path(folder) / CACHE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: {folder} holds no target cache (never built, or its first "
            "write was interrupted); build or rebuild it with --target_outputs cache (or "
            "TargetCacheWriter)"
        )
    rebuild = f"delete {folder} and build the cache again"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{path} is not a JSON manifest ({error}); {rebuild}") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise ValueError(
            f"{path} has format_version {version!r}, this reader understands {FORMAT_VERSION} "
            f"(shards with their sequences, sizes and checksums); {rebuild}"
        )
    problem = _manifest_problem(meta)
    if problem:
        raise ValueError(f"{path} disagrees with itself ({problem}); it was edited: {rebuild}")
    return meta


def _manifest_problem(meta: dict[str, Any]) -> str | None:
    """Where the manifest's totals or its key contradict its own fields, or None."""
    shards = meta.get("shards")
    fields = ("file", "num_sequences", "num_tokens", "bytes", "sha256", "sequences")
    if not isinstance(shards, list) or any(
        not isinstance(shard, dict) or any(name not in shard for name in fields) for shard in shards
    ):
        return f"every entry of 'shards' needs {', '.join(fields)}"
    checks = [
        ("num_sequences", sum(int(s["num_sequences"]) for s in shards)),
        ("num_tokens", sum(int(s["num_tokens"]) for s in shards)),
    ]
    key = meta.get("key") or {}
    checks += [(name, key[name]) for name in ("k", "dtype", "hidden_layer_ids") if name in key]
    differ = [
        f"{name} {meta.get(name)!r}, expected {wanted!r}"
        for name, wanted in checks
        if meta.get(name) != wanted
    ]
    differ += [
        f"{shard['file']} lists {len(shard['sequences'])} sequences, num_sequences "
        f"{shard['num_sequences']}"
        for shard in shards
        if len(shard["sequences"]) != shard["num_sequences"]
    ]
    return "; ".join(differ) or None


class TargetCache:
    """Read a target cache: ``cache[i]`` is sequence i as a dict of CPU tensors.

    Keys: ``input_ids`` [T] int64, ``topk_ids`` [T, k] int32, ``topk_logprobs`` [T, k]
    float16, ``rest_logmass`` [T] float32 and, when cached, ``hidden_states`` [L, T, H]
    float16. Shards are memory-mapped and read lazily, so the cache can exceed RAM; each is
    checked (:func:`shard_problem`) before its first read, and :meth:`check_shards` checks
    many at once. :meth:`position` finds a sequence by its digest.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.meta: dict[str, Any] = read_manifest(self.folder)
        self._shards: list[dict[str, Any]] = self.meta["shards"]
        self._first_index = [0]
        for shard in self._shards:
            self._first_index.append(self._first_index[-1] + shard["num_sequences"])
        self._where: list[tuple[int, int]] = [
            (shard_index, local)
            for shard_index, shard in enumerate(self._shards)
            for local in range(shard["num_sequences"])
        ]
        self._positions: dict[str, int] = {}
        for shard_index, shard in enumerate(self._shards):
            for local, digest in enumerate(shard["sequences"]):
                self._positions.setdefault(digest, self._first_index[shard_index] + local)
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, list[int]] = {}
        self._checked: set[int] = set()

    def __len__(self) -> int:
        return int(self.meta["num_sequences"])

    @property
    def k(self) -> int:
        return int(self.meta["k"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def shards(self) -> list[dict[str, Any]]:
        """The manifest's shard entries, in sequence order."""
        return self._shards

    @property
    def bytes_per_token(self) -> float:
        """Bytes on disk per cached token (shards including their headers)."""
        return float(self.meta["bytes_per_token"])

    def full_logits_bytes_per_token(self, vocab_size: int | None = None) -> int:
        """What full fp16 logits would cost per token (``2 V``), for reporting the saving."""
        return full_logits_bytes_per_token(self.vocab_size if vocab_size is None else vocab_size)

    def position(self, digest: str) -> int | None:
        """Index of the sequence named ``digest`` (:func:`sequence_digest`), None if absent."""
        return self._positions.get(digest)

    def shard_of(self, index: int) -> int:
        """Index (into :attr:`shards`) of the shard holding sequence ``index``."""
        return self._where[index][0]

    def damaged_shards(self, shard_indices: Sequence[int]) -> dict[int, str]:
        """``{shard index: what is wrong}`` for the shards of ``shard_indices`` that fail
        :func:`shard_problem` (each read once in full for its checksum)."""
        damaged = {}
        for shard_index in sorted(set(shard_indices) - self._checked):
            problem = shard_problem(self.folder, self._shards[shard_index], self.meta)
            if problem is None:
                self._checked.add(shard_index)
            else:
                damaged[shard_index] = problem
        return damaged

    def check_shards(self, shard_indices: Sequence[int], fix: str | None = None) -> None:
        """:class:`CacheShardError` naming every damaged shard of ``shard_indices`` and ``fix``."""
        damaged = self.damaged_shards(shard_indices)
        if damaged:
            named = "; ".join(f"{self._shards[i]['file']} is {why}" for i, why in damaged.items())
            raise CacheShardError(
                f"the target cache in {self.folder} is damaged: {named}. "
                + (fix or "Rebuild the cache with the same flags.")
            )

    def _shard(self, shard_index: int) -> tuple[Any, list[int]]:
        if shard_index not in self._handles:
            self.check_shards([shard_index])
            handle = safe_open(str(self.folder / self._shards[shard_index]["file"]), framework="pt")
            self._handles[shard_index] = handle
            self._offsets[shard_index] = handle.get_tensor("offsets").tolist()
        return self._handles[shard_index], self._offsets[shard_index]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sequence {index} out of range for a cache of {len(self)}")
        shard_index, local = self._where[index % len(self)]
        handle, offsets = self._shard(shard_index)
        start, stop = offsets[local], offsets[local + 1]
        item = {name: handle.get_slice(name)[start:stop] for name in _FIELDS}
        if self.meta["has_hidden_states"]:
            item["hidden_states"] = handle.get_slice("hidden_states")[:, start:stop]
        return item


def collate_cached(
    examples: Sequence[dict[str, torch.Tensor]],
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """Right-pad cache items into a batch.

    Returns ``input_ids`` [B, T] int64, ``attention_mask`` [B, T] int64, ``topk_ids`` [B, T, k]
    int64 (0 on padding), ``topk_logprobs`` [B, T, k] float32 (0 on padding), ``rest_logmass``
    [B, T] float32 and, when present, ``hidden_states`` [B, L, T, H] float32. Padded positions
    carry no valid distribution: mask them with ``attention_mask``.
    """
    if len(examples) == 0:
        raise ValueError("collate_cached got an empty list of examples; pass at least one")
    lengths = [example["input_ids"].shape[0] for example in examples]
    batch_size, length = len(examples), max(lengths)
    k = examples[0]["topk_ids"].shape[-1]
    batch = {
        "input_ids": torch.full((batch_size, length), pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros((batch_size, length), dtype=torch.long),
        "topk_ids": torch.zeros((batch_size, length, k), dtype=torch.long),
        "topk_logprobs": torch.zeros((batch_size, length, k), dtype=torch.float32),
        "rest_logmass": torch.zeros((batch_size, length), dtype=torch.float32),
    }
    has_hidden = "hidden_states" in examples[0]
    if has_hidden:
        layers, _, hidden_size = examples[0]["hidden_states"].shape
        batch["hidden_states"] = torch.zeros(
            (batch_size, layers, length, hidden_size), dtype=torch.float32
        )
    for row, (example, n) in enumerate(zip(examples, lengths, strict=True)):
        batch["input_ids"][row, :n] = example["input_ids"]
        batch["attention_mask"][row, :n] = 1
        batch["topk_ids"][row, :n] = example["topk_ids"].long()
        batch["topk_logprobs"][row, :n] = example["topk_logprobs"].float()
        batch["rest_logmass"][row, :n] = example["rest_logmass"].float()
        if has_hidden:
            batch["hidden_states"][row, :, :n] = example["hidden_states"].float()
    return batch
