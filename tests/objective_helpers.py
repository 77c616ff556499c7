"""Shared helpers of the objective tests (EAGLE-3, Medusa, the protocol): batches the target
writes itself, a few optimiser steps, held-out means, the offline cache, greedy decoding."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import torch
from draftsmith.decode.drafters.base import TreeSpec
from draftsmith.decode.drafters.registry import load_drafter
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.decode.sampling import SamplingConfig
from draftsmith.train.generation import sample_continuations
from draftsmith.train.loop import make_accelerator
from draftsmith.train.objectives import Objective

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

ObjectiveT = TypeVar("ObjectiveT", bound=Objective)


def sampled_batch(
    target: torch.nn.Module, rows: int, length: int, seed: int, temperature: float = 1.0
) -> dict[str, torch.Tensor]:
    """Sequences the target writes itself from 4 random prompt tokens; the continuation counts."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, target.config.vocab_size, (rows, 4), generator=generator)
    out = sample_continuations(
        target,
        prompt,
        torch.ones_like(prompt),
        length - 4,
        SamplingConfig(temperature=temperature),
        generator,
    )
    input_ids = torch.cat((prompt, out.tokens), dim=1)
    loss_mask = torch.ones_like(input_ids)
    loss_mask[:, :4] = 0
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "loss_mask": loss_mask,
    }


def bind(objective: ObjectiveT) -> ObjectiveT:
    """Bind the objective to its own module on a CPU accelerator, as the loop does."""
    objective.bind(objective.trainable_module(), make_accelerator(cpu=True))
    return objective


def train(objective: Objective, batch: dict, steps: int, lr: float = 3e-3) -> list[float]:
    """``steps`` AdamW steps on one batch; the losses before each step."""
    params = [p for p in objective.trainable_module().parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    losses = []
    for _ in range(steps):
        loss, _ = objective.compute_loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def means(sums: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Held-out ``name -> (sum, weight)`` as means."""
    return {name: total / weight for name, (total, weight) in sums.items()}


def assert_aligned_with_greedy_labels(aligned, length: int, parts: int) -> list[float]:
    """Part k of a head objective's alignment on greedy text of ``length`` tokens: its draft,
    target and mask cover ``length - 2 - k`` positions, and the target's argmax is the label
    wherever the mask keeps a position. Returns each part's weight."""
    weights = []
    for k, (weight, draft, target_k, mask, labels) in enumerate(aligned):
        assert draft.shape[:2] == target_k.shape[:2] == mask.shape == labels.shape
        assert draft.shape[1] == length - 2 - k
        assert torch.equal(target_k.argmax(-1)[mask], labels[mask])
        weights.append(weight)
    assert len(weights) == parts
    return weights


def train_on_own_text(
    objective: Objective, target: torch.nn.Module, steps: int = 40
) -> tuple[dict[str, float], dict[str, float], dict[str, torch.Tensor]]:
    """Train on 16 sequences the target wrote and measure 8 held-out ones before and after;
    the loss must fall by 30% on the training batch and fall on the held-out one. Returns the
    held-out means before and after, and the held-out batch."""
    train_batch = sampled_batch(target, rows=16, length=32, seed=1)
    held_out = sampled_batch(target, rows=8, length=32, seed=2)
    before = means(objective.evaluate(held_out))
    losses = train(objective, train_batch, steps=steps)
    after = means(objective.evaluate(held_out))
    assert losses[-1] < 0.7 * losses[0]
    assert after["loss"] < before["loss"]
    return before, after, held_out


def cached_batch(
    target: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    folder: Path,
    k: int,
    layers: list[int],
) -> dict[str, torch.Tensor]:
    """``batch`` written to an offline target cache (top-``k``, hidden states ``layers``) and
    read back as a training batch."""
    from draftsmith.data.cache import TargetCache, TargetCacheWriter, collate_cached

    rows = batch["input_ids"].shape[0]
    with torch.no_grad(), TargetCacheWriter(folder, k, hidden_layer_ids=layers) as writer:
        out = target(batch["input_ids"], output_hidden_states=True)
        for row in range(rows):
            hidden = torch.stack([out.hidden_states[i][row] for i in layers])
            writer.add(batch["input_ids"][row], out.logits[row], hidden)
    cache = TargetCache(folder)
    cached = collate_cached([cache[i] for i in range(rows)], pad_token_id=0)
    cached["loss_mask"] = batch["loss_mask"]
    return cached


def assert_decodes_greedy_output(
    target: torch.nn.Module, folders: list[Path], kind: str, trees: list[TreeSpec | None]
) -> None:
    """Every drafter folder decodes exactly the target's greedy output, chains and trees."""
    prompt = torch.tensor([[5, 9, 11, 3, 7, 8], [0, 0, 4, 13, 6, 21]])
    mask = (prompt != 0).long()
    with torch.no_grad():
        expected = target.generate(
            input_ids=prompt, attention_mask=mask, max_new_tokens=20, do_sample=False
        )
    for path in folders:
        drafter = load_drafter(path, target)
        assert drafter.kind == kind
        for tree in trees:
            decoder = SpeculativeDecoder(target, drafter, num_draft_tokens=3, tree=tree)
            out = decoder.generate(prompt, mask, max_new_tokens=20)
            assert torch.equal(out.sequences, expected), (path, tree)
