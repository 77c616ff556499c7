"""Chain verification: which drafted tokens the target accepts, and the token after them.

Leviathan et al. 2023 and Chen et al. 2023 (docs/theory.md §2-3). For draft token ``x`` drawn
from ``q``, accept with probability ``min(1, p(x) / q(x))``; at the first rejection emit a
*recovered* token from ``norm(max(0, p - q))``; if all N drafts are accepted emit a *bonus* token
from the target's distribution at position N+1. The emitted tokens are distributed exactly as
the target's. Deterministic proposers have a one-hot ``q``: accept with probability ``p(x)``,
and the residual is ``p`` with ``x`` removed. Greedy verification accepts a draft iff it equals
the target's argmax and emits the target's argmax at the first mismatch.

All functions are pure and batched; rows accept different numbers of tokens.
"""

from __future__ import annotations

import torch
from draftsmith.decode.sampling import SamplingConfig, greedy_tokens, logits_to_probs, sample


def verify_greedy(
    draft_tokens: torch.Tensor,  # [B, N]
    target_logits: torch.Tensor,  # [B, N + 1, V]
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B], next_tokens [B]
    """Accept the longest prefix of drafts equal to the target's argmax."""
    target_choice = greedy_tokens(target_logits)  # [B, N + 1]
    num_accepted = _accepted_prefix_length(draft_tokens == target_choice[:, :-1])
    next_tokens = target_choice.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_tokens


def verify_stochastic(
    draft_tokens: torch.Tensor,  # [B, N]
    draft_probs: torch.Tensor | None,  # [B, N, V] the q each draft was drawn from; None: one-hot
    target_probs: torch.Tensor,  # [B, N + 1, V] after the sampling transforms
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B], next_tokens [B]
    """Speculative sampling: accept, then a recovered or bonus token (exact in distribution)."""
    batch, num_drafts = draft_tokens.shape
    vocab = target_probs.shape[-1]
    p_of_draft = target_probs[:, :num_drafts].gather(2, draft_tokens[..., None]).squeeze(-1)
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(-1)
    uniform = torch.rand(
        (batch, num_drafts), generator=generator, device=target_probs.device, dtype=p_of_draft.dtype
    )
    # u < p / q, written without the division (q(x) > 0 because x was drawn from q).
    num_accepted = _accepted_prefix_length(uniform * q_of_draft < p_of_draft)

    gather_at = num_accepted[:, None, None].expand(batch, 1, vocab)
    p_next = target_probs.gather(1, gather_at).squeeze(1)  # [B, V]
    if num_drafts == 0:
        return num_accepted, sample(p_next, generator)
    rejected = (num_accepted < num_drafts)[:, None]  # [B, 1]; False means bonus token
    at_rejection = num_accepted.clamp(max=num_drafts - 1)
    if draft_probs is None:
        rejected_token = draft_tokens.gather(1, at_rejection[:, None]).squeeze(1)
        q_next = torch.nn.functional.one_hot(rejected_token, vocab).to(p_next.dtype)
    else:
        q_next = draft_probs.gather(1, at_rejection[:, None, None].expand(batch, 1, vocab))
        q_next = q_next.squeeze(1).to(p_next.dtype)
    residual = (p_next - q_next * rejected).clamp(min=0)  # bonus rows: residual == p
    mass = residual.sum(-1, keepdim=True)
    # mass == 0 only when p == q up to rounding, where rejection has probability ~0: use p.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
    return num_accepted, sample(residual, generator)


def verify_chain(
    draft_tokens: torch.Tensor,  # [B, N]
    draft_probs: torch.Tensor | None,  # [B, N, V] or None (one-hot q)
    target_logits: torch.Tensor,  # [B, N + 1, V]
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B], next_tokens [B]
    """Verify a chain under ``sampling``: greedy at temperature 0, else speculative sampling."""
    if sampling.greedy:
        return verify_greedy(draft_tokens, target_logits)
    target_probs = logits_to_probs(target_logits, sampling)
    return verify_stochastic(draft_tokens, draft_probs, target_probs, generator)


def _accepted_prefix_length(
    accepted: torch.Tensor,  # [B, N] bool
) -> torch.Tensor:  # [B] int64: index of the first False (N if none)
    return accepted.long().cumprod(dim=1).sum(dim=1)
