"""The offline target cache at scale: parts written by several processes, resumable, keyed.

A build killed with SIGKILL and run again loses and duplicates no sequence (2 ranks, a sharded
target; ``slow``: two torchrun launches). In one process: a cache of another key is refused by
name, an interrupted build rescores only its missing parts, a cache serves any subset of its
sequences and appends the ones a run lacks (or refuses them by name), a truncated, flipped or
missing shard is refused by name and rebuilt alone (the other shards' bytes unchanged), a
manifest edited against its shards is refused, the target loads without its layers for
``cache_only``, and a drafter trained from a cache that keeps every log-prob reproduces online
training.
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
from draftsmith.data.cache import CACHE_FILE, CacheShardError, TargetCache, write_manifest
from draftsmith.train.distill import main
from draftsmith.train.target.cache import (
    CacheKeyError,
    CacheMissingError,
    build_or_reuse_cache,
    cache_key,
    open_cached_rows,
)
from draftsmith.train.target.model import checkpoint_bytes, load_model_without_layers
from draftsmith.train.tracking import read_metrics_log
from safetensors import safe_open
from safetensors.torch import load

REPO = Path(__file__).resolve().parents[2]
PARTS = CACHE_SEQUENCES // 2  # part_sequences = 2


KEY = {"test": "kill"}


def _build(folder: Path, k: int = 8, part_sequences: int = 2, target=None, rows=None, **extra):
    return build_or_reuse_cache(
        target if target is not None else cache_target(),
        cache_rows() if rows is None else rows,
        folder,
        k=k,
        key=KEY,
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
    assert not list(folder.glob("*.entry.json")) and not list(folder.glob(".shard-*"))
    _build(tmp_path / "reference")  # one process, the whole target: the same bytes
    # (each rank read only its share of the weights: the outputs are still bitwise equal)
    _assert_same_cache(folder, tmp_path / "reference")


def test_interrupted_build_rescores_only_its_missing_parts(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    first = _build(folder)
    assert first.parts_written == PARTS and first.sequences_scored == CACHE_SEQUENCES
    meta = json.loads((folder / CACHE_FILE).read_text())
    # As if killed mid-way through the first build: the empty manifest with the key, the
    # finished parts each with its entry, two parts never written.
    for entry in meta["shards"]:
        (folder / f"{entry['file']}.entry.json").write_text(json.dumps(entry))
    write_manifest(folder, [], 8, meta["vocab_size"], "float16", [0, 2], None, key=meta["key"])
    for part in (3, 7):
        (folder / f"shard-{part:05d}.safetensors").unlink()
    again = _build(folder)
    assert again.parts_written == 2
    assert sorted(_stored_first_tokens(folder)) == list(range(CACHE_SEQUENCES))
    assert not list(folder.glob("*.entry.json"))
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
    with pytest.raises(CacheKeyError, match=r"hidden_layer_ids: cache \[0, 2\], run \[1\]"):
        open_cached_rows(cache_rows(), folder, cache_key(KEY, 4, [1], "float16"))


def test_cache_serves_the_tokens_it_scored_and_appends_others(tmp_path: Path) -> None:
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
    stats = build(changed)  # that sequence is another one: scored and appended, nothing else
    assert (stats.parts_written, stats.sequences_scored, stats.num_sequences) == (1, 1, 25)
    joined = open_cached_rows(changed, folder)
    assert joined[5]["input_ids"].tolist() == changed[5]["input_ids"]
    assert joined[4]["input_ids"].tolist() == rows[4]["input_ids"]


# --------------------------------------------------------------------------- data, not a run


def _shard_bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.glob("shard-*.safetensors"))}


def _wanted(k: int = 8, dtype: str = "float16", layers=(0, 2)) -> dict:
    return cache_key(KEY, k, list(layers), dtype)


def test_cache_with_more_sequences_than_the_run_reads_serves_a_subset(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    _build(folder)
    before = _shard_bytes(folder)
    rows = cache_rows()
    subset = [rows[i] for i in (17, 3, 3, 9, 22)]  # any order, repeats allowed
    joined = open_cached_rows(subset, folder, _wanted())
    assert [int(joined[i]["input_ids"][0]) - 3 for i in range(5)] == [17, 3, 3, 9, 22]
    stats = _build(folder, rows=subset)
    assert (stats.parts_written, stats.sequences_scored, stats.run_sequences) == (0, 0, 4)
    assert _shard_bytes(folder) == before


def test_run_needing_more_sequences_is_refused_or_appended(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    _build(folder)
    before = _shard_bytes(folder)
    more = cache_rows(CACHE_SEQUENCES + 5)
    with pytest.raises(CacheMissingError, match=r"29 distinct sequences and 5 of them are not"):
        open_cached_rows(more, folder, _wanted())
    stats = _build(folder, rows=more)  # --target_outputs cache: scores only the 5
    assert (stats.parts_written, stats.sequences_scored, stats.num_sequences) == (3, 5, 29)
    after = _shard_bytes(folder)
    assert {name: after[name] for name in before} == before  # the old shards untouched
    assert len(after) == PARTS + 3
    joined = open_cached_rows(more, folder, _wanted())
    assert [int(joined[i]["input_ids"][0]) - 3 for i in range(29)] == list(range(29))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # in the tensors, after the header: only the checksum can tell
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (_truncate, "bytes where the manifest says"),
        (_flip_byte, "failing its SHA-256 checksum"),
        (Path.unlink, "missing"),
    ],
)
def test_damaged_shard_is_refused_by_name_and_only_it_is_rebuilt(
    tmp_path: Path, damage, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "cache"
    _build(folder)
    before = _shard_bytes(folder)
    damage(folder / "shard-00005.safetensors")
    with pytest.raises(
        CacheShardError, match=rf"shard-00005.safetensors is[^.]*{said}.*same flags"
    ):
        open_cached_rows(cache_rows(), folder, _wanted())
    reader = TargetCache(folder)  # any reader refuses it on first read, by name
    with pytest.raises(CacheShardError, match=r"shard-00005\.safetensors"):
        reader[10]
    assert reader[0]["input_ids"].shape[0] > 0  # the other shards still read
    capsys.readouterr()
    stats = _build(folder)  # the same flags again: only the damaged shard is rescored
    assert stats.shards_rebuilt == ["shard-00005.safetensors"]
    assert (stats.parts_written, stats.sequences_scored) == (1, 2)
    assert "1 damaged shards rescored" in capsys.readouterr().out
    after = _shard_bytes(folder)
    rebuilt, original = after.pop("shard-00005.safetensors"), before.pop("shard-00005.safetensors")
    assert after == before  # every other shard's bytes unchanged
    rebuilt, original = load(rebuilt), load(original)  # the same tensors (header order may vary)
    assert rebuilt.keys() == original.keys()
    assert all(torch.equal(rebuilt[name], original[name]) for name in original)
    open_cached_rows(cache_rows(), folder, _wanted())


def _edit_manifest(folder: Path, edit) -> None:
    meta = json.loads((folder / CACHE_FILE).read_text())
    edit(meta)
    (folder / CACHE_FILE).write_text(json.dumps(meta))


def test_manifest_edited_against_its_shards_is_refused_by_name(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    _build(folder)

    def bump_k(meta):
        meta["k"] += 7

    _edit_manifest(folder, bump_k)  # the edit: cache.json's k alone
    with pytest.raises(ValueError, match=r"cache.json disagrees with itself \(k 15, expected 8"):
        open_cached_rows(cache_rows(), folder, _wanted())

    def k_everywhere(meta):
        meta["key"]["k"] = meta["k"]  # now consistent with itself, not with its shards

    _edit_manifest(folder, k_everywhere)
    with pytest.raises(CacheShardError, match=r"shard-00000.safetensors is disagreeing with "
                       r"cache.json \(k: cache.json 15, shard 8\)"):  # fmt: skip
        open_cached_rows(cache_rows(), folder, _wanted(k=15))

    def retype(meta):
        meta["k"] = meta["key"]["k"] = 8
        meta["dtype"] = meta["key"]["dtype"] = "bfloat16"

    _edit_manifest(folder, retype)
    with pytest.raises(CacheShardError, match=r"dtype: cache.json 'bfloat16', shard 'float16'"):
        open_cached_rows(cache_rows(), folder, _wanted(dtype="bfloat16"))

    def relayer(meta):
        meta["dtype"] = meta["key"]["dtype"] = "float16"
        meta["hidden_layer_ids"] = meta["key"]["hidden_layer_ids"] = [0, 1]

    _edit_manifest(folder, relayer)
    with pytest.raises(CacheShardError, match=r"hidden_layer_ids: cache.json \[0, 1\], shard"):
        open_cached_rows(cache_rows(), folder, _wanted(layers=(0, 1)))

    def recount(meta):
        meta["hidden_layer_ids"] = meta["key"]["hidden_layer_ids"] = [0, 2]
        meta["shards"][4]["num_tokens"] += 1
        meta["num_tokens"] += 1

    _edit_manifest(folder, recount)
    with pytest.raises(CacheShardError, match=r"shard-00004.safetensors is disagreeing.*num_tok"):
        open_cached_rows(cache_rows(), folder, _wanted())


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


@pytest.mark.slow
def test_one_cache_serves_runs_of_other_steps_batches_and_losses(tmp_path: Path, tiny_argv) -> None:
    """Built once, trained from with three step counts, two batch sizes and two losses: no
    part is scored again and no shard changes; a truncated shard then stops the next run by
    name before any step."""
    cache = ("--cache_dir", str(tmp_path / "c"), "--eval_source", "data")
    cap = ("--max_train_sequences", "16", "--speed_eval_prompts", "0")
    build = ("--target_outputs", "cache", "--cache_build_only", "true")
    built = main(tiny_argv(tmp_path / "build", *cache, *cap, *build))
    assert built["cache"]["num_sequences"] == 16
    before = _shard_bytes(tmp_path / "c")
    for steps, batch, loss in (("2", "2", "tv"), ("3", "4", "fkl"), ("5", "2", "fkl")):
        summary = main(
            tiny_argv(
                tmp_path / f"run-{steps}",
                *cache,
                *cap,
                "--target_outputs",
                "cache_only",
                "--max_steps",
                steps,
                "--per_device_batch_size",
                batch,
                "--loss",
                loss,
            )
        )
        assert summary["steps"] == int(steps) and summary["cache"]["parts_written"] == 0
        assert summary["cache"]["run_sequences"] == min(16, int(steps) * int(batch))
    assert _shard_bytes(tmp_path / "c") == before
    _truncate(next((tmp_path / "c").glob("shard-*.safetensors")))
    with pytest.raises(CacheShardError, match=r"shard-00000\.safetensors is .* bytes"):
        main(tiny_argv(tmp_path / "damaged", *cache, *cap, "--target_outputs", "cache_only"))
    assert not (tmp_path / "damaged" / "drafter").exists()
