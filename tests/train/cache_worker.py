"""Worker of the kill-and-resume test: 2 ranks (torchrun) build one target cache.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/train/cache_worker.py <cache folder> <seconds per forward> <target folder>

The target (``cache_helpers.cache_target``, saved in the target folder) is loaded sharded over
the ranks, each reading its share of the weights, so the build also runs collective forwards;
a delay per forward gives the test time to kill it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from cache_helpers import cache_rows
from draftsmith.train.target.cache import build_or_reuse_cache
from draftsmith.train.target.sharding import load_sharded_target


def main(folder: Path, delay: float, target_folder: str) -> None:
    accelerator = Accelerator(cpu=True)
    target = load_sharded_target(target_folder, torch.float32, accelerator)
    if delay:
        target.register_forward_pre_hook(lambda *_: time.sleep(delay))
    stats = build_or_reuse_cache(
        target,
        cache_rows(),
        folder,
        k=8,
        key={"test": "kill"},
        pad_token_id=0,
        device=accelerator.device,
        batch_size=1,
        hidden_layer_ids=[0, 2],
        progress=False,
        accelerator=accelerator,
        part_sequences=2,
    )
    print(json.dumps({"rank": accelerator.process_index, "parts_written": stats.parts_written}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3])
