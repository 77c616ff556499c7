"""Offline target cache: write -> read round trip, rest mass, topk_to_probs, interrupted writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from draftsmith.data.cache import (
    CACHE_FILE,
    TargetCache,
    TargetCacheWriter,
    collate_cached,
    compress_logits,
    topk_to_probs,
)

VOCAB, K, LAYERS, HIDDEN = 50, 5, 2, 8


def _sequences(generator: torch.Generator, lengths: list[int]):
    for length in lengths:
        input_ids = torch.randint(0, VOCAB, (length,), generator=generator)
        logits = 3 * torch.randn(length, VOCAB, generator=generator)
        hidden = torch.randn(LAYERS, length, HIDDEN, generator=generator)
        yield input_ids, logits, hidden


def test_round_trip_across_shards(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    sequences = list(_sequences(generator, [7, 3, 12, 1, 9]))
    with TargetCacheWriter(tmp_path, k=K, shard_tokens=10, hidden_layer_ids=[1, 3]) as writer:
        for input_ids, logits, hidden in sequences:
            writer.add(input_ids, logits, hidden)
    cache = TargetCache(tmp_path)
    meta = json.loads((tmp_path / CACHE_FILE).read_text())
    assert meta["num_sequences"] == len(cache) == 5
    assert meta["num_tokens"] == 32
    assert meta["k"] == K and meta["vocab_size"] == VOCAB
    assert meta["has_hidden_states"] and meta["hidden_layer_ids"] == [1, 3]
    assert len(meta["shards"]) == 3  # 7+3 | 12 | 1+9
    for index, (input_ids, logits, hidden) in enumerate(sequences):
        item = cache[index]
        assert item["input_ids"].dtype == torch.int64
        assert item["topk_ids"].dtype == torch.int32
        assert item["topk_logprobs"].dtype == torch.float16
        assert item["rest_logmass"].dtype == torch.float32
        assert item["hidden_states"].dtype == torch.float16
        assert torch.equal(item["input_ids"], input_ids)
        logprobs = torch.log_softmax(logits.double(), -1)
        top = torch.topk(logprobs, K, -1)
        assert torch.equal(item["topk_ids"].long(), top.indices)
        torch.testing.assert_close(item["topk_logprobs"].double(), top.values, atol=1e-2, rtol=1e-3)
        rest = 1 - top.values.exp().sum(-1)
        torch.testing.assert_close(item["rest_logmass"].double().exp(), rest, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(item["hidden_states"].float(), hidden, atol=1e-2, rtol=1e-3)
        probs = topk_to_probs(item["topk_ids"], item["topk_logprobs"], item["rest_logmass"], VOCAB)
        assert probs.shape == (input_ids.shape[0], VOCAB)
        torch.testing.assert_close(probs.sum(-1), torch.ones(input_ids.shape[0]))
        torch.testing.assert_close(
            probs.double(), _reference(logprobs, top.indices), atol=2e-3, rtol=0
        )
    assert torch.equal(cache[-1]["input_ids"], sequences[-1][0])
    with pytest.raises(IndexError):
        cache[5]


def _reference(logprobs: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
    """Exact top-k probabilities at their ids, the rest spread uniformly (float64)."""
    probs = logprobs.exp()
    kept = probs.gather(-1, top_ids)
    rest = 1 - kept.sum(-1, keepdim=True)
    out = (rest / (VOCAB - K)).expand_as(probs).clone()
    return out.scatter(-1, top_ids, kept)


def test_rest_mass_is_stable_when_tiny() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[0, 3] = 60.0  # all but e^-60 of the mass on one token
    logits[1, :K] = 40.0
    _, top_logprobs, rest_logmass = compress_logits(logits, K)
    reference = torch.log_softmax(logits.double(), -1)
    # log(1 - sum top-k) would be log(0) = -inf here; the rest is e.g. log(45 e^-60).
    expected = torch.logsumexp(reference.sort(-1, descending=True).values[:, K:], -1)
    assert torch.isfinite(rest_logmass).all()
    torch.testing.assert_close(rest_logmass.double(), expected, atol=1e-4, rtol=1e-5)
    assert top_logprobs.shape == (2, K)


def test_k_equal_vocab_has_no_rest() -> None:
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    ids, logprobs, rest = compress_logits(logits, 6)
    assert torch.isneginf(rest).all()
    probs = topk_to_probs(ids, logprobs, rest, 6)
    torch.testing.assert_close(probs, torch.softmax(logits, -1))


def test_bytes_per_token_reports_the_saving(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(2)
    with TargetCacheWriter(tmp_path, k=K) as writer:
        for input_ids, logits, _ in _sequences(generator, [64, 64]):
            writer.add(input_ids, logits)
    cache = TargetCache(tmp_path)
    assert not cache.meta["has_hidden_states"] and "hidden_states" not in cache[0]
    payload = 8 + K * (4 + 2) + 4  # ids, top-k ids and log-probs, rest mass
    assert payload <= cache.bytes_per_token < payload + 10
    assert cache.full_logits_bytes_per_token() == 2 * VOCAB
    assert cache.full_logits_bytes_per_token(32_000) == 64_000


def test_interrupted_write_has_no_cache_json(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    with (
        pytest.raises(RuntimeError, match="boom"),
        TargetCacheWriter(tmp_path, k=K, shard_tokens=4) as writer,
    ):
        for input_ids, logits, _ in _sequences(generator, [5, 5]):
            writer.add(input_ids, logits)
        raise RuntimeError("boom")
    assert any(tmp_path.glob("shard-*.safetensors"))
    assert not (tmp_path / CACHE_FILE).exists()
    with pytest.raises(FileNotFoundError, match="rebuild"):
        TargetCache(tmp_path)
    with pytest.raises(FileNotFoundError, match="rebuild"):
        TargetCache(tmp_path / "never_built")


def test_writer_errors(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(4)
    ((input_ids, logits, hidden),) = _sequences(generator, [6])
    writer = TargetCacheWriter(tmp_path / "a", k=K)
    with pytest.raises(ValueError, match=r"logits must be \[T, V\]"):
        writer.add(input_ids, logits[None])
    with pytest.raises(ValueError, match="1-D integer"):
        writer.add(input_ids[None], logits)
    writer.add(input_ids, logits)
    with pytest.raises(ValueError, match="vocabulary size 49"):
        writer.add(input_ids, logits[:, :-1])
    with pytest.raises(ValueError, match="hidden_states or none"):
        writer.add(input_ids, logits, hidden)
    writer.close()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        TargetCacheWriter(tmp_path / "a", k=K)
    TargetCacheWriter(tmp_path / "a", k=K, overwrite=True)
    assert not (tmp_path / "a" / CACHE_FILE).exists()
    with pytest.raises(ValueError, match="2 layers but hidden_layer_ids"):
        TargetCacheWriter(tmp_path / "b", k=K, hidden_layer_ids=[0, 1, 2]).add(
            input_ids, logits, hidden
        )
    with pytest.raises(ValueError, match="no sequences"):
        TargetCacheWriter(tmp_path / "c", k=K).close()
    with pytest.raises(ValueError, match="overflow float16"):
        TargetCacheWriter(tmp_path / "d", k=K).add(input_ids, logits, hidden * 1e6)


def test_collate_cached(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(5)
    with TargetCacheWriter(tmp_path, k=K) as writer:
        for input_ids, logits, hidden in _sequences(generator, [4, 2]):
            writer.add(input_ids, logits, hidden)
    cache = TargetCache(tmp_path)
    batch = collate_cached([cache[0], cache[1]], pad_token_id=0)
    assert batch["input_ids"].shape == (2, 4)
    assert batch["topk_ids"].shape == batch["topk_logprobs"].shape == (2, 4, K)
    assert batch["hidden_states"].shape == (2, LAYERS, 4, HIDDEN)
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert torch.equal(batch["topk_ids"][1, :2], cache[1]["topk_ids"].long())
