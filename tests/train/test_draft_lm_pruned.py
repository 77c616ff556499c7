"""The draft LM objective with a pruned draft vocabulary (``--draft_vocab_size``): the vocabulary
is the most frequent training labels, the head starts from the target's rows of those tokens,
the loss compares with the target restricted to them, and the exported folder loads back into a
drafter whose proposals are identical to the trained model's."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from draftsmith.decode.drafters.draft_lm import DRAFT_VOCAB_FILE, DraftModelDrafter
from draftsmith.decode.drafters.registry import load_drafter
from draftsmith.decode.drafters.vocab_map import VocabMap
from draftsmith.decode.sampling import SamplingConfig
from draftsmith.train.config import DrafterConfig
from draftsmith.train.drafter_models import build_draft_lm
from draftsmith.train.losses import build_loss
from draftsmith.train.objectives.draft_lm import DraftLMObjective
from objective_helpers import bind, sampled_batch, train
from tiny_models import TINY_VOCAB, tiny_llama

DRAFT_VOCAB = 20


def _objective(target: torch.nn.Module, loss: str = "tv", **kwargs: object) -> DraftLMObjective:
    drafter = build_draft_lm(DrafterConfig(), target, seed=0)
    return DraftLMObjective(
        drafter, target, build_loss(loss), draft_vocab_size=DRAFT_VOCAB, **kwargs
    )


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(seed=0, dtype=torch.float32)


@pytest.fixture(scope="module")
def batch(target: torch.nn.Module) -> dict[str, torch.Tensor]:
    return sampled_batch(target, rows=8, length=24, seed=0)


def test_prepare_chooses_frequent_labels_and_target_rows(
    target: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> None:
    objective = _objective(target)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(batch["input_ids"].shape[0])]
    objective.prepare(rows)
    labels = batch["input_ids"][batch["loss_mask"].bool()]
    counts = torch.bincount(labels, minlength=TINY_VOCAB)
    kept = objective.draft_to_target
    assert kept.shape == (DRAFT_VOCAB,) and bool((kept[1:] > kept[:-1]).all())
    assert int(counts[kept].min()) >= int(counts[~torch.isin(torch.arange(TINY_VOCAB), kept)].max())
    head = objective.drafter.get_output_embeddings().weight
    assert head.shape == (DRAFT_VOCAB, 32)
    assert torch.equal(head, target.get_output_embeddings().weight[kept])
    assert objective.describe()["draft_vocab_size"] == DRAFT_VOCAB
    assert 0.0 < objective.vocab_coverage <= 1.0


@pytest.mark.parametrize("loss", ["tv", "fkl+0.1*ce"])
def test_loss_against_the_restricted_target_trains(
    target: torch.nn.Module, batch: dict[str, torch.Tensor], loss: str
) -> None:
    objective = bind(_objective(target, loss))
    rows = [{k: v[i] for k, v in batch.items()} for i in range(batch["input_ids"].shape[0])]
    objective.prepare(rows)
    before = objective.evaluate(batch)
    losses = train(objective, batch, steps=15, lr=3e-3)
    after = objective.evaluate(batch)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    mean = {k: s / w for k, (s, w) in after.items()}
    assert (
        after["overlap@1"][0] / after["overlap@1"][1]
        > before["overlap@1"][0] / before["overlap@1"][1]
    )
    assert 0.0 < mean["label_in_draft_vocab"] < 1.0  # some labels were pruned
    assert mean["overlap@1"] <= 1.0 and "draft_nll" in mean
    # the target's mass on the draft vocabulary: below 1 once tokens are pruned, and a cap
    assert mean["overlap@1"] <= mean["draftable_mass"] < 1.0


def test_restricted_target_is_the_target_renormalised(
    target: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> None:
    """With the draft equal to the target's own logits on the draft tokens, TV is 0."""
    objective = _objective(target)
    target_logits = objective._target(batch)  # [B, T-1, V]
    restricted = objective._restrict(target_logits)  # [B, T-1, V_draft]
    mask = torch.ones(restricted.shape[:2], dtype=torch.bool)
    parts = objective.loss.parts(restricted, restricted, mask, 1.0)
    assert float(parts["tv"]) == pytest.approx(0.0, abs=1e-6)
    expected = torch.softmax(target_logits[..., objective.draft_to_target], -1)
    assert torch.allclose(torch.softmax(restricted, -1), expected)


def test_save_load_round_trip_gives_identical_proposals(
    target: torch.nn.Module, batch: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    objective = bind(_objective(target))
    rows = [{k: v[i] for k, v in batch.items()} for i in range(batch["input_ids"].shape[0])]
    objective.prepare(rows)
    train(objective, batch, steps=3)
    objective.save_drafter(tmp_path / "drafter")
    folder = tmp_path / "drafter"
    assert (folder / DRAFT_VOCAB_FILE).is_file()
    meta = json.loads((folder / "drafter.json").read_text())
    assert meta["draft_vocab_size"] == DRAFT_VOCAB and meta["kind"] == "draft_lm"
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == TINY_VOCAB and not config["tie_word_embeddings"]

    loaded = load_drafter(folder, target)
    assert isinstance(loaded, DraftModelDrafter) and loaded.vocab_map is not None
    assert torch.equal(loaded.vocab_map.draft_to_target, objective.draft_to_target)
    trained = DraftModelDrafter(
        objective.unwrapped_module, VocabMap(objective.draft_to_target, TINY_VOCAB)
    )
    prompt = batch["input_ids"][:3, :8]
    for sampling in (SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)):
        proposals = []
        for drafter in (trained, loaded):
            drafter.prefill(prompt, torch.ones_like(prompt), None, prompt[:, -1])
            proposals.append(drafter.propose(5, sampling, torch.Generator().manual_seed(4)))
        assert torch.equal(proposals[0].tokens, proposals[1].tokens)
        if not sampling.greedy:
            assert torch.allclose(proposals[0].probs, proposals[1].probs, atol=1e-6)


def test_corrupt_maps_are_refused(
    target: torch.nn.Module, batch: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    from draftsmith.decode.loading import LoadError
    from safetensors.torch import load_file, save_file

    objective = _objective(target)
    objective.save_drafter(tmp_path)
    tensors = load_file(str(tmp_path / DRAFT_VOCAB_FILE))
    tensors["d2t"][0] = 5  # draft id 0 -> target id 5, after draft id 1 -> target id 1
    save_file(tensors, str(tmp_path / DRAFT_VOCAB_FILE))
    with pytest.raises(LoadError, match="strictly increasing"):
        load_drafter(tmp_path, target)


def test_out_of_range_size_is_refused(target: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="--draft_vocab_size must lie in"):
        DraftLMObjective(
            build_draft_lm(DrafterConfig(), target, 0),
            target,
            build_loss("tv"),
            draft_vocab_size=TINY_VOCAB + 1,
        )


@pytest.mark.slow
def test_tiny_distill_exports_a_loadable_pruned_folder(
    tmp_path: Path, tiny_argv: Callable[..., list[str]]
) -> None:
    from draftsmith.decode.loading import load_causal_lm
    from draftsmith.train.distill import main

    argv = tiny_argv(tmp_path / "out", "--draft_vocab_size", "32", "--max_steps", "3")
    summary = main([*argv, "--eval_sequences", "4", "--checkpoint_every", "0"])
    folder = Path(summary["drafter_dir"])
    target = load_causal_lm(argv[3])
    drafter = load_drafter(folder, target)
    assert isinstance(drafter, DraftModelDrafter)
    assert drafter.vocab_map.draft_vocab_size == 32 and drafter.vocab_size == 512
    assert drafter.model.get_output_embeddings().weight.shape[0] == 32
    card = (folder / "README.md").read_text()
    assert "Pruned draft vocabulary" in card and DRAFT_VOCAB_FILE in card
    prompt = torch.tensor([[5, 9, 5, 9]])
    drafter.prefill(prompt, torch.ones_like(prompt), None, prompt[:, -1])
    proposal = drafter.propose(3, SamplingConfig(temperature=0.0), None)
    assert bool(torch.isin(proposal.tokens, drafter.vocab_map.draft_to_target).all())


def test_cached_target_and_on_policy_batches(
    target: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> None:
    """The offline cache's top-k restricted in log space, and drafter-sampled continuations
    mapped to target ids (the pruned head samples draft ids)."""
    objective = bind(_objective(target, on_policy_fraction=1.0, on_policy_prompt_tokens=8))
    rows = [{k: v[i] for k, v in batch.items()} for i in range(batch["input_ids"].shape[0])]
    objective.prepare(rows)
    with torch.no_grad():
        logprobs = torch.log_softmax(target(input_ids=batch["input_ids"]).logits, -1)
    top = logprobs.topk(8, dim=-1)  # [B, T, 8]
    rest = torch.log1p(-top.values.exp().sum(-1).clamp(max=1 - 1e-6))  # [B, T]
    cached = {**batch, "topk_ids": top.indices, "topk_logprobs": top.values, "rest_logmass": rest}
    restricted = objective._restrict(objective._target(cached))  # [B, T-1, V_draft]
    assert restricted.shape[-1] == DRAFT_VOCAB and bool(torch.isfinite(restricted).all())
    online = objective._restrict(objective._target(batch))
    in_top = torch.isin(objective.draft_to_target, top.indices[0, 0])
    if bool(in_top.any()):  # cached top-k entries are the target's own log-probs
        assert torch.allclose(
            restricted[0, 0, in_top],
            torch.log_softmax(online[0, 0], -1)[in_top]
            + torch.logsumexp(logprobs[0, 0, objective.draft_to_target], -1),
            atol=1e-5,
        )
    on_policy = objective.on_policy_batch(batch)
    generated = on_policy["input_ids"][:, 8:][on_policy["loss_mask"][:, 8:].bool()]
    assert generated.numel() > 0
    assert bool(torch.isin(generated, objective.draft_to_target).all())
    loss, metrics = objective.compute_loss(batch)
    assert torch.isfinite(loss) and metrics["on_policy"] == 1.0
