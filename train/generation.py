"""Sampling continuations from a causal LM with an explicit generator (training-side helper).

Used to build what a drafter must imitate where the target actually goes: held-out sequences
continued by the target, regenerated responses (``scripts/regenerate_data.py``) and on-policy
batches continued by the drafter itself (GKD, Agarwal et al. 2024). Tokens are drawn with
``draftsmith.decode.sampling`` (temperature, then top-k, then top-p, the same transforms decoding uses)
from a seeded ``torch.Generator``, so a run replays exactly, resumed or not.

Prompts may be left-padded (``attention_mask`` 0 on the left); ``draftsmith.decode.forward.cached_sequence`` counts
positions from each row's first real token, as Hugging Face ``generate`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from draftsmith.decode.forward.cached_sequence import CachedSequence
from draftsmith.decode.forward.lean_decoder import LeanDecoder
from draftsmith.decode.forward.output_head import OutputHead
from draftsmith.decode.sampling import SamplingConfig, select_tokens


@dataclass
class Continuations:
    """Sampled tokens and which of them are real (before and including an eos)."""

    tokens: torch.Tensor  # [B, N] int64, pad_token_id after a row stopped
    valid: torch.Tensor  # [B, N] bool


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists of any lengths as one left-padded batch: ids and attention mask, [B, P]."""
    if not rows or not all(rows):
        raise ValueError("left_pad needs at least one row and no empty row")
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, P]
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, P]
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(list(row), dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask


@torch.no_grad()
def sample_continuations(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, P] left-padded prompts
    attention_mask: torch.Tensor,  # [B, P] 1 on real tokens
    max_new_tokens: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
) -> Continuations:
    """Autoregressively draw up to ``max_new_tokens`` tokens per row with a KV cache.

    A row stops after emitting a stop token (``eos_token_id``: one id or several); later
    tokens are ``pad_token_id`` and marked invalid. Greedy when ``sampling.temperature == 0``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must both be [B, P]"
        )
    if bool((attention_mask.sum(-1) == 0).any()):
        raise ValueError("every prompt needs at least one real token (attention_mask row of 0s)")
    stops = _stop_ids(eos_token_id, input_ids.device)
    was_training = model.training
    model.eval()
    # A frozen Llama-family model (the target) on CPU runs through the lean forward (the same
    # logits to float rounding); a model in training or with adapters keeps its own forward.
    frozen = not was_training and not hasattr(model, "peft_config")
    head = OutputHead.for_model(model) if frozen else None
    decoder = LeanDecoder.for_model(model) if head is not None else None
    sequence = CachedSequence(model, input_ids.shape[0], input_ids.device, head, decoder)
    logits = sequence.extend(input_ids, attention_mask.bool(), logits_to_keep=1).logits[:, -1]
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    tokens, valid = [], []
    for step in range(max_new_tokens):
        token, _ = select_tokens(logits.float(), sampling, generator)  # [B]
        token = torch.where(finished, torch.full_like(token, pad_token_id), token)
        tokens.append(token)
        valid.append(~finished)
        if stops is not None:
            finished = finished | torch.isin(token, stops)
        if step + 1 == max_new_tokens or bool(finished.all()):
            break
        logits = sequence.extend(token[:, None], logits_to_keep=1).logits[:, -1]
    model.train(was_training)
    out_tokens = torch.stack(tokens, dim=1)
    out_valid = torch.stack(valid, dim=1)
    missing = max_new_tokens - out_tokens.shape[1]
    if missing:
        pad = torch.full((out_tokens.shape[0], missing), pad_token_id, dtype=out_tokens.dtype)
        out_tokens = torch.cat([out_tokens, pad.to(out_tokens.device)], dim=1)
        out_valid = torch.cat([out_valid, torch.zeros_like(pad, dtype=torch.bool)], dim=1)
    return Continuations(tokens=out_tokens, valid=out_valid)


def _stop_ids(
    eos_token_id: int | Sequence[int] | None, device: torch.device
) -> torch.Tensor | None:  # [S] int64
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None
