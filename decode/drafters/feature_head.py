"""What every head that drafts from the target's features shares: the captured hidden states,
the (optionally pruned) draft vocabulary and the weight check of a folder.

EAGLE-3 and P-EAGLE (``draftsmith.decode.drafters.eagle``) and DFlash
(``draftsmith.decode.drafters.dflash``) read ``aux_hidden_state_layer_ids`` of the target's
``output_hidden_states`` tuple (index 0 the embeddings, index i the output of layer i - 1; the
convention of ``draftsmith.decode.drafters.eagle.config``) and draft over a vocabulary of
``draft_vocab_size`` tokens: EAGLE-3's pruned LM head (Li et al., 2025), where
``target_id = draft_id + d2t[draft_id]`` and ``t2d`` marks the kept target ids. With the full
vocabulary both maps are the identity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


class FeatureHead(nn.Module):
    """Base of the heads that read the target's hidden states (module docstring).

    Subclasses build their modules after ``super().__init__(config)``; ``config`` must carry
    ``aux_hidden_state_layer_ids``, ``draft_vocab_size`` and ``target_vocab_size``.
    """

    kind: str

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        vocab, draft = config.target_vocab_size, config.draft_vocab_size
        self.register_buffer("d2t", torch.zeros(draft, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(vocab, dtype=torch.bool))
        if draft != vocab:
            self.t2d.zero_()
            self.t2d[:draft] = True

    # -- vocabulary -----------------------------------------------------------------------
    def set_vocab_maps(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install maps from ``build_vocab_maps`` (checked for consistency)."""
        vd, vt = self.config.draft_vocab_size, self.config.target_vocab_size
        if d2t.shape != (vd,) or t2d.shape != (vt,):
            raise ValueError(
                f"vocab maps must have shapes d2t [{vd}] and t2d [{vt}], got "
                f"{tuple(d2t.shape)} and {tuple(t2d.shape)}"
            )
        ids = torch.arange(vd) + d2t.long().cpu()
        if ids.min() < 0 or ids.max() >= vt or (vd > 1 and (ids.diff() <= 0).any()):
            raise ValueError(
                "d2t must map draft ids to strictly increasing target ids inside the vocabulary "
                "(as build_vocab_maps does)"
            )
        expected = torch.zeros(vt, dtype=torch.bool)
        expected[ids] = True
        if not torch.equal(expected, t2d.bool().cpu()):
            raise ValueError("t2d must mark exactly the target ids that d2t maps to")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_to_target_ids(self) -> torch.Tensor:  # [V_draft] int64
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target_logits(
        self, draft_logits: torch.Tensor
    ) -> torch.Tensor:  # [..., Vd] -> [..., Vt]
        """Scatter draft-vocabulary logits into the target vocabulary (-inf elsewhere)."""
        if self.config.draft_vocab_size == self.config.target_vocab_size:
            return draft_logits  # increasing draft ids over the whole vocabulary: the identity
        out = draft_logits.new_full(
            (*draft_logits.shape[:-1], self.config.target_vocab_size), float("-inf")
        )
        out[..., self.draft_to_target_ids] = draft_logits
        return out

    def to_draft_vocab(self, target_values: torch.Tensor) -> torch.Tensor:  # [..., Vt] -> [..., Vd]
        """Select the draft vocabulary's entries of target-vocabulary values (e.g. target logits)."""
        return target_values[..., self.draft_to_target_ids]

    # -- features -------------------------------------------------------------------------
    def gather_aux(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:  # -> [B, T, A*H]
        """Concatenate the configured entries of an ``output_hidden_states`` tuple."""
        needed = max(self.config.aux_hidden_state_layer_ids)
        if len(hidden_states) <= needed:
            raise ValueError(
                f"the target returned {len(hidden_states)} hidden states but the head reads index "
                f"{needed}: run the target with output_hidden_states=True and check "
                "aux_hidden_state_layer_ids against its depth"
            )
        return torch.cat([hidden_states[i] for i in self.config.aux_hidden_state_layer_ids], -1)

    # -- weights --------------------------------------------------------------------------
    def load_checked_weights(
        self,
        state: dict[str, torch.Tensor],
        *,
        ignored: Callable[[str], bool] = lambda name: "embed_tokens" in name,
    ) -> None:
        """Load ``state`` (names without a ``model.`` prefix) after checking that it holds
        exactly this head's weights with this config's shapes; missing vocabulary maps are the
        identity, as the engines read them. The head takes the weights' dtype."""
        state = {
            k.removeprefix("model."): v
            for k, v in state.items()
            if not ignored(k.removeprefix("model."))
        }
        if "d2t" not in state:  # engines treat a missing map as the identity
            state["d2t"] = torch.zeros(self.config.draft_vocab_size, dtype=torch.long)
        if "t2d" not in state:
            t2d = torch.zeros(self.config.target_vocab_size, dtype=torch.bool)
            t2d[torch.arange(self.config.draft_vocab_size) + state["d2t"].long()] = True
            state["t2d"] = t2d
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"{self.kind} weights do not match the config: missing {missing}, "
                f"unexpected {unexpected}"
            )
        for name, tensor in state.items():
            if tensor.shape != expected[name].shape:
                raise ValueError(
                    f"weight {name} has shape {tuple(tensor.shape)}, the config "
                    f"implies {tuple(expected[name].shape)}"
                )
        dtype = next(t.dtype for n, t in state.items() if t.is_floating_point())
        self.to(dtype)
        self.load_state_dict(state)
        self.set_vocab_maps(self.d2t.clone(), self.t2d.clone())
