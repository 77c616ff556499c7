"""Distillation losses over a large vocabulary in chunks of positions, and a tensor-byte meter.

With Llama-3's vocabulary (V = 128,256) a 2,048-token row has float32 logits of
``2048 * 128256 * 4`` bytes = 1.05 GB, for the draft and again for the target, and the losses
of ``draftsmith.train.losses`` form several more [N, V] tensors (both log-softmaxes, ``exp``, the
differences) plus their gradients. :func:`chunked_loss_parts` never forms more than
``chunk`` rows of any of them: it takes the *hidden states* of both models at the trained
positions and, ``chunk`` positions at a time, applies each model's output head, scores the
chunk with the same per-position terms (``Loss.parts`` with ``reduction="sum"``) and adds the
sums. Each chunk runs under activation checkpointing (``torch.utils.checkpoint``), so its
[chunk, V] intermediates are dropped after the forward pass and recomputed, one chunk at a
time, in the backward pass. Every term of ``draftsmith.train.losses`` is a sum over positions of a
function of that position's two rows, so the chunked value is the unchunked one with the
positions summed in another order, and so are the gradients (tested to 1e-6 at V = 128,256,
T = 2,048). Peak memory of the loss goes from ``O(T V)`` to ``O(chunk V)``; the price is the
heads run twice (forward and recomputation).

:class:`TensorBytes` counts the bytes of the tensors alive while it is active (every tensor an
operator creates, until its storage is freed), which gives a deterministic peak on any device,
the CPU included, where no allocator statistics exist.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from draftsmith.train.losses import Loss, Target
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

TargetRows = Callable[[torch.Tensor], Target]
"""Flat position indices [n] -> the target at those positions, logits/log-probs [n, V]."""


def chunked_loss_parts(
    loss: Loss,
    draft_hidden: torch.Tensor,  # [B, T, H_draft], graph attached
    draft_head: Callable[[torch.Tensor], torch.Tensor],  # [n, H_draft] -> [n, V]
    target_rows: TargetRows,
    mask: torch.Tensor,  # [B, T] bool or 0/1
    temperature: float = 1.0,
    *,
    labels: torch.Tensor | None = None,  # [B, T] int64, for a "ce" term
    chunk: int = 256,
) -> dict[str, torch.Tensor]:  # term key -> unweighted mean over the kept positions
    """``loss.parts`` of the draft head's logits against ``target_rows``, ``chunk`` kept
    positions at a time (module docstring); the same values and gradients."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 positions, got {chunk}")
    if mask.shape != draft_hidden.shape[:-1]:
        raise ValueError(
            f"mask has shape {tuple(mask.shape)} but draft_hidden {tuple(draft_hidden.shape)} "
            "needs draft_hidden.shape[:-1]"
        )
    kept = mask.reshape(-1).bool().nonzero().squeeze(-1).to(draft_hidden.device)  # [N]
    if kept.numel() == 0:
        raise ValueError(
            "mask keeps no position, so the loss is undefined (a mean over nothing is NaN); "
            "skip this batch or make sure each batch has at least one trained position"
        )
    hidden = draft_hidden.reshape(-1, draft_hidden.shape[-1])[kept]  # [N, H]
    flat_labels = None if labels is None else labels.reshape(-1)[kept.to(labels.device)]
    keys = list(dict.fromkeys(term.key for term in loss.spec.terms))

    def chunk_sums(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # [n, H] -> [terms]
        draft = draft_head(rows)  # [n, V]
        with torch.no_grad():
            target = target_rows(kept[index]) if loss.needs_target else None  # [n, V]
        chunk_labels = None if flat_labels is None else flat_labels[index.to(flat_labels.device)]
        parts = loss.parts(
            draft[None],
            None if target is None else _batched(target),
            torch.ones(1, draft.shape[0], dtype=torch.bool, device=draft.device),
            temperature,
            labels=None if chunk_labels is None else chunk_labels[None],
            reduction="sum",
        )
        return torch.stack([parts[key] for key in keys])

    total: torch.Tensor | None = None
    for start in range(0, kept.numel(), chunk):
        index = torch.arange(start, min(start + chunk, kept.numel()), device=kept.device)
        sums = checkpoint(chunk_sums, hidden[index], index, use_reentrant=False)
        total = sums if total is None else total + sums
    assert total is not None
    means = total / kept.numel()
    return {key: means[i] for i, key in enumerate(keys)}


def _batched(target: Target) -> Target:
    """A target of [n, V] rows as a batch of one, [1, n, V]."""
    from draftsmith.train.losses import TargetProbs

    if isinstance(target, TargetProbs):
        return TargetProbs(target.probs[None])
    return target[None]


class TensorBytes(TorchDispatchMode):
    """Count the bytes of tensors created while active, and their peak (use as ``with``).

    Every operator's outputs are counted once per storage (views share it) from creation until
    the storage is freed; tensors that existed before ``with`` are not counted. The backward
    pass of a ``.backward()`` called inside is counted too (CPU autograd runs on this thread).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in self.live:
                continue
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key)
        return out
