"""The offline target cache at scale: parts written by several processes, resumable, keyed.

A build killed with SIGKILL and run again loses and duplicates no sequence (2 ranks, a sharded
target; ``slow``: two torchrun launches). In one process: a cache of another key is refused by
name, an interrupted build rescores only its missing parts, the target loads without its
layers for ``cache_only``, and a drafter trained from a cache that keeps every log-prob
reproduces online training.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cache_helpers import CACHE_SEQUENCES, cache_rows, cache_target
from draftsmith.data.cache import CACHE_FILE, TargetCache
from draftsmith.train.distill import main
from draftsmith.train.target.cache import BUILD_FILE, CacheKeyError, build_or_reuse_cache
from draftsmith.train.target.model import checkpoint_bytes, load_model_without_layers
from draftsmith.train.tracking import read_metrics_log
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[2]
PARTS = CACHE_SEQUENCES // 2  # part_sequences = 2


def _build(folder: Path, k: int = 8, part_sequences: int = 2, target=None, **extra):
    return build_or_reuse_cache(
        target if target is not None else cache_target(),
        cache_rows(),
        folder,
        k=k,
        key={"test": "kill"},
        pad_token_id=0,
        device=torch.device("cpu"),
        batch_size=1,
        hidden_layer_ids=[0, 2],
        progress=False,
        part_sequences=part_sequences,
        **extra,
    )


def _stored_first_tokens(folder: Path) -> list[int]:
    """The first token of every sequence in every shard file on disk (each row's index + 3)."""
    firsts = []
    for path in sorted(folder.glob("shard-*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            ids, offsets = handle.get_tensor("input_ids"), handle.get_tensor("offsets")
        firsts += [int(ids[start]) - 3 for start in offsets[:-1].tolist()]
    return firsts


def _kill_workers(folder: Path) -> None:
    """SIGKILL the worker processes building ``folder`` (found by their command lines)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            any(part.endswith(b"cache_worker.py") for part in command)
            and str(folder).encode() in command
        ):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def _assert_same_cache(folder: Path, reference: Path) -> None:
    a, b = TargetCache(folder), TargetCache(reference)
    assert len(a) == len(b) == CACHE_SEQUENCES
    for i in range(CACHE_SEQUENCES):
        for name, tensor in b[i].items():
            assert torch.equal(a[i][name], tensor), (i, name)


@pytest.mark.slow
def test_killed_two_rank_build_resumes_without_losing_or_duplicating(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    cache_target().save_pretrained(tmp_path / "target")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(REPO / "tests" / "train" / "cache_worker.py"), str(folder),
    ]  # fmt: skip
    target = str(tmp_path / "target")
    slow = subprocess.Popen(
        [*command, "0.4", target],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while len(list(folder.glob("shard-*.safetensors"))) < 3 and time.monotonic() < deadline:
        assert slow.poll() is None, "the slow build ended before it could be killed"
        time.sleep(0.05)
    os.killpg(slow.pid, signal.SIGKILL)
    _kill_workers(folder)  # torchrun starts its workers in sessions of their own
    slow.wait()
    kept = len(list(folder.glob("shard-*.safetensors")))
    assert 3 <= kept < PARTS and not (folder / CACHE_FILE).exists()
    done = subprocess.run(
        [*command, "0", target], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    written = [
        json.loads(line)["parts_written"] for line in done.stdout.splitlines() if "{" in line
    ]
    assert len(written) == 2 and sum(written) == PARTS - kept  # only the missing parts
    firsts = _stored_first_tokens(folder)
    lost = len(set(range(CACHE_SEQUENCES)) - set(firsts))
    print(f"killed with {kept}/{PARTS} parts; the rerun wrote {sum(written)}; lost {lost}, "
          f"duplicated {len(firsts) - len(set(firsts))}")  # fmt: skip
    assert sorted(firsts) == list(range(CACHE_SEQUENCES))  # 0 lost, 0 duplicated
    assert not (folder / BUILD_FILE).exists() and not list(folder.glob(".shard-*"))
    _build(tmp_path / "reference")  # one process, the whole target: the same bytes
    # (each rank read only its share of the weights: the outputs are still bitwise equal)
    _assert_same_cache(folder, tmp_path / "reference")


def test_interrupted_build_rescores_only_its_missing_parts(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    first = _build(folder)
    assert first.parts_written == PARTS
    meta = json.loads((folder / CACHE_FILE).read_text())
    (folder / CACHE_FILE).unlink()  # as if killed before the manifest, after two parts
    (folder / BUILD_FILE).write_text(json.dumps(meta["key"]))
    for part in (3, 7):
        (folder / f"shard-{part:05d}.safetensors").unlink()
    again = _build(folder)
    assert again.parts_written == 2
    assert sorted(_stored_first_tokens(folder)) == list(range(CACHE_SEQUENCES))
    _build(tmp_path / "reference")
    _assert_same_cache(folder, tmp_path / "reference")
    assert _build(folder).parts_written == 0  # complete: reused


def test_cache_of_another_key_is_refused_by_name(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    _build(folder, k=4)
    with pytest.raises(CacheKeyError, match=r"k: cache 4, run 8.*another --cache_dir"):
        _build(folder, k=8)
    with pytest.raises(CacheKeyError, match="dtype: cache 'float16', run 'float32'"):
        _build(folder, k=4, dtype="float32")
    (folder / CACHE_FILE).unlink()  # an interrupted build of k = 4 is not continued for k = 8
    (folder / BUILD_FILE).write_text(json.dumps({"k": 4}))
    with pytest.raises(CacheKeyError, match="k: cache 4, run 8"):
        _build(folder, k=8)


def test_cache_serves_the_tokens_it_scored_and_no_others(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    rows = cache_rows()
    build = functools.partial(
        build_or_reuse_cache,
        cache_target(),
        folder=folder,
        k=8,
        key={"test": "tokens"},
        pad_token_id=0,
        device=torch.device("cpu"),
        batch_size=1,
        progress=False,
    )
    assert build(rows).parts_written > 0
    copied = [
        {"input_ids": list(r["input_ids"]), "loss_mask": [0] * len(r["loss_mask"])} for r in rows
    ]
    assert build(copied).parts_written == 0  # the same tokens (other loss masks): reused
    changed = [dict(row) for row in rows]  # one token of one row differs; counts and lengths equal
    changed[5] = {
        **rows[5],
        "input_ids": [*rows[5]["input_ids"][:-1], rows[5]["input_ids"][-1] % 60 + 3 + 1],
    }
    assert changed[5]["input_ids"] != rows[5]["input_ids"]
    with pytest.raises(CacheKeyError, match=r"tokens: cache '[0-9a-f]{16}', run '[0-9a-f]{16}'"):
        build(changed)


def test_cache_states_its_bytes_per_token_at_8b_and_70b(tmp_path: Path) -> None:
    stats = _build(tmp_path / "cache", dtype="bfloat16")
    at = stats.at_scale
    # 8 + 4k + 2k + 4 + 2 * 2 layers * H at k = 8.
    assert at["llama-3-8b"]["cache_bytes_per_token"] == 8 + 32 + 16 + 4 + 2 * 2 * 4096
    assert at["llama-3-70b"]["cache_bytes_per_token"] == 8 + 32 + 16 + 4 + 2 * 2 * 8192
    assert at["llama-3-70b"]["full_fp16_logits_bytes_per_token"] == 2 * 128_256
    assert TargetCache(tmp_path / "cache")[0]["hidden_states"].dtype == torch.bfloat16


def test_target_without_layers_keeps_only_what_a_drafter_reads(tmp_path: Path) -> None:
    whole = cache_target()
    whole.save_pretrained(tmp_path / "target")
    hollow = load_model_without_layers(str(tmp_path / "target"))
    assert len(hollow.get_decoder().layers) == 0
    assert hollow.config.num_hidden_layers == whole.config.num_hidden_layers == 2
    for name in ("get_input_embeddings", "get_output_embeddings"):
        assert torch.equal(getattr(hollow, name)().weight, getattr(whole, name)().weight)
    assert torch.equal(hollow.get_decoder().norm.weight, whole.get_decoder().norm.weight)
    with pytest.raises(RuntimeError, match="without its decoder layers"):
        hollow(input_ids=torch.ones(1, 3, dtype=torch.long))
    held = sum(p.numel() * p.element_size() for p in hollow.parameters())
    full = sum(p.numel() * p.element_size() for p in whole.parameters())
    assert held < full and checkpoint_bytes(str(tmp_path / "target")) == full


@pytest.mark.slow
def test_drafter_trained_from_a_full_cache_reproduces_online_training(
    tmp_path: Path, tiny_argv
) -> None:
    """k = V = 512 in float32: the cache holds the whole distribution, so the cache-only run
    (no target layers) trains and evaluates like the online one."""
    common = (
        "--max_steps", "10", "--eval_every", "5", "--eval_source", "data",
        "--max_train_sequences", "40",  # the rows a cached run reads: the same for the online one
        "--target_dtype", "float32", "--mixed_precision", "no",
    )  # fmt: skip
    online = main(tiny_argv(tmp_path / "online", *common))
    cache = ("--cache_top_k", "512", "--cache_dtype", "float32", "--cache_dir", str(tmp_path / "c"))
    built = main(tiny_argv(tmp_path / "cache", *common, "--target_outputs", "cache", *cache))
    only = main(tiny_argv(tmp_path / "only", *common, "--target_outputs", "cache_only", *cache))
    assert only["cache"]["parts_written"] == 0 and built["cache"]["num_sequences"] == 40

    def losses(run: str) -> list[float]:
        records = read_metrics_log(tmp_path / run / "logs" / "metrics.jsonl")
        return [r["train/loss"] for r in records if "train/loss" in r]

    assert len(losses("online")) == 10
    for run in ("cache", "only"):
        assert max(abs(a - b) for a, b in zip(losses(run), losses("online"), strict=True)) < 1e-4
    for key, value in online["held_out"].items():
        assert abs(only["held_out"][key] - value) < 1e-4, key
    memory = only["target_memory"]
    assert memory["layers_loaded"] is False and memory["ratio"] < 1.0
    assert only["peak_rss_bytes"] > 0
