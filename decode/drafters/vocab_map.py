"""A pruned draft vocabulary and its map to the target's (EAGLE-3's ``d2t``/``t2d``).

A drafter whose output layer covers only ``V_draft`` of the target's ``V`` tokens (the most
frequent training labels; Li et al., EAGLE-3, 2025) computes its logits ``z`` [V_draft] and
samples there: its law in the target vocabulary is

    q(x) = softmax(z)[d]   if x = draft_to_target[d],   q(x) = 0 for every pruned x,

which is a distribution over the target's tokens, so speculative sampling (Leviathan et al.
2023) stays exact as long as the verifier is given this ``q`` (docs/theory.md §1). Only the
chosen ids are mapped (``target_id = draft_id + d2t[draft_id]``); the probability vector is
placed into the target vocabulary only when the verifier needs it (T > 0).

``draft_to_target`` is ``None`` for a drafter over the whole vocabulary: every function is then
the identity. The EAGLE-3 runtime (``draftsmith.decode.drafters.eagle.lean``) and the draft LM
(``draftsmith.decode.drafters.draft_lm``) share these functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VocabMap:
    """The draft vocabulary's target ids (strictly increasing) and the target's size."""

    draft_to_target: torch.Tensor  # [V_draft] int64
    target_vocab_size: int

    @property
    def draft_vocab_size(self) -> int:
        return int(self.draft_to_target.shape[0])

    @classmethod
    def from_maps(cls, d2t: torch.Tensor, t2d: torch.Tensor, source: str = "the maps") -> VocabMap:
        """Check EAGLE-3's ``d2t`` [V_draft] (offsets) and ``t2d`` [V] (kept mask) and build the map.

        Raises ``ValueError`` naming ``source`` when ``d2t`` does not map draft ids to strictly
        increasing target ids inside the vocabulary or ``t2d`` does not mark exactly those.
        """
        if d2t.ndim != 1 or t2d.ndim != 1 or d2t.dtype.is_floating_point:
            raise ValueError(
                f"{source}: d2t must be 1-D integer [V_draft] and t2d 1-D [V_target], got "
                f"{tuple(d2t.shape)} {d2t.dtype} and {tuple(t2d.shape)} {t2d.dtype}"
            )
        vocab = int(t2d.shape[0])
        ids = torch.arange(d2t.shape[0]) + d2t.long().cpu()  # [V_draft]
        if (
            ids.numel() == 0
            or ids.numel() > vocab
            or int(ids.min()) < 0
            or int(ids.max()) >= vocab
            or bool((ids[1:] <= ids[:-1]).any())
        ):
            raise ValueError(
                f"{source}: d2t must map draft ids to strictly increasing target ids inside the "
                f"vocabulary of {vocab} tokens (target_id = draft_id + d2t[draft_id])"
            )
        expected = torch.zeros(vocab, dtype=torch.bool)
        expected[ids] = True
        if not torch.equal(expected, t2d.bool().cpu()):
            raise ValueError(f"{source}: t2d must mark exactly the target ids that d2t maps to")
        return cls(ids, vocab)

    def maps(self) -> tuple[torch.Tensor, torch.Tensor]:  # d2t [V_draft] int64, t2d [V] bool
        """EAGLE-3's stored form: offsets ``d2t`` and the kept-token mask ``t2d``."""
        ids = self.draft_to_target.cpu()
        t2d = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        t2d[ids] = True
        return ids - torch.arange(ids.shape[0]), t2d

    def to(self, device: torch.device | str) -> VocabMap:
        return VocabMap(self.draft_to_target.to(device), self.target_vocab_size)


def to_target_ids(
    draft_ids: torch.Tensor,  # [...] int64 draft ids
    draft_to_target: torch.Tensor | None,  # [V_draft] int64; None: the whole vocabulary
) -> torch.Tensor:  # [...] int64 target ids
    """``target_id = draft_to_target[draft_id]`` (the identity without a pruned vocabulary)."""
    if draft_to_target is None:
        return draft_ids
    return draft_to_target[draft_ids]


def to_target_probs(
    probs: torch.Tensor,  # [..., V_draft]
    draft_to_target: torch.Tensor | None,  # [V_draft] int64; None: the whole vocabulary
    target_vocab_size: int,
) -> torch.Tensor:  # [..., V_target]
    """Draft-vocabulary probabilities placed in the target vocabulary (0 elsewhere)."""
    if draft_to_target is None:
        return probs
    out = probs.new_zeros((*probs.shape[:-1], target_vocab_size))
    out[..., draft_to_target] = probs
    return out


def to_target_logits(
    logits: torch.Tensor,  # [..., V_draft]
    draft_to_target: torch.Tensor | None,  # [V_draft] int64; None: the whole vocabulary
    target_vocab_size: int,
) -> torch.Tensor:  # [..., V_target]
    """Draft-vocabulary logits placed in the target vocabulary (``-inf`` elsewhere)."""
    if draft_to_target is None:
        return logits
    out = logits.new_full((*logits.shape[:-1], target_vocab_size), float("-inf"))
    out[..., draft_to_target] = logits
    return out


def to_draft_ids(
    target_ids: torch.Tensor,  # [...] int64 target ids
    draft_to_target: torch.Tensor | None,  # [V_draft] int64; None: the whole vocabulary
    target_vocab_size: int,
) -> torch.Tensor:  # [...] int64 draft ids, -1 for pruned tokens
    """The inverse map: each target id's draft id, ``-1`` where the token was pruned."""
    if draft_to_target is None:
        return target_ids
    inverse = torch.full(
        (target_vocab_size,), -1, dtype=torch.long, device=draft_to_target.device
    )  # [V]
    inverse[draft_to_target] = torch.arange(draft_to_target.shape[0], device=inverse.device)
    return inverse[target_ids]


__all__ = ["VocabMap", "to_draft_ids", "to_target_ids", "to_target_logits", "to_target_probs"]
