"""Score the training sequences with the target once, into the offline top-k cache.

Online distillation runs the target on every batch of every epoch; the offline cache
(``data.cache``) runs it once and keeps, per token, the top-k log-probabilities, their ids and
the log of the remaining mass (about ``6k + 12`` bytes per token against ``2V`` for full fp16
logits). Training rows then carry those fields and the objective rebuilds ``p`` with
``data.cache.topk_to_probs``. The cache is reused when its key (target, data, k, sequences)
matches, and rebuilt otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

KEY_FILE = "draftsmith_cache_key.json"


@dataclass
class CacheStats:
    """What the cache costs, for the run summary and the model card."""

    folder: str
    k: int
    num_sequences: int
    num_tokens: int
    bytes_per_token: float
    full_fp16_bytes_per_token: int

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
) -> CacheStats:
    """Write (or reuse) the cache of ``target``'s outputs on ``rows`` in ``folder``."""
    from tqdm.auto import tqdm

    from data.cache import CACHE_FILE, TargetCache, TargetCacheWriter
    from data.packing import collate

    folder = Path(folder)
    full_key = {**key, "k": k, "num_sequences": len(rows), "hidden_layer_ids": hidden_layer_ids}
    key_path = folder / KEY_FILE
    reusable = (folder / CACHE_FILE).is_file() and key_path.is_file()
    if not (reusable and json.loads(key_path.read_text()) == full_key):
        was_training = target.training
        target.eval()
        with TargetCacheWriter(
            folder, k, hidden_layer_ids=hidden_layer_ids, overwrite=True
        ) as writer:
            starts = range(0, len(rows), batch_size)
            for start in tqdm(starts, desc="target cache", disable=not progress):
                chunk = [rows[i] for i in range(start, min(start + batch_size, len(rows)))]
                batch = collate(chunk, pad_token_id)
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
                    writer.add(
                        batch["input_ids"][row, :length],
                        outputs.logits[row, :length],
                        hidden,
                    )
        key_path.write_text(json.dumps(full_key, indent=2, sort_keys=True))
        target.train(was_training)
    cache = TargetCache(folder)
    return CacheStats(
        folder=str(folder),
        k=cache.k,
        num_sequences=len(cache),
        num_tokens=int(cache.meta["num_tokens"]),
        bytes_per_token=cache.bytes_per_token,
        full_fp16_bytes_per_token=cache.full_logits_bytes_per_token(),
    )


def open_cached_rows(rows: Sequence[dict[str, Any]], folder: Path) -> CachedRows:
    """The training rows joined with the cache in ``folder``."""
    from data.cache import TargetCache

    return CachedRows(rows, TargetCache(folder))
