"""Verification as pure tensor functions: exact acceptance rules on hand-made distributions."""

from __future__ import annotations

import torch
from draftsmith.decode.rejection import verify_greedy, verify_stochastic


def test_greedy_accepts_matching_prefix_then_emits_argmax() -> None:
    logits = torch.full((2, 4, 5), -5.0)
    for row, choices in enumerate([[1, 2, 3, 4], [1, 0, 0, 2]]):
        for position, token in enumerate(choices):
            logits[row, position, token] = 5.0
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3]])
    accepted, next_tokens = verify_greedy(drafts, logits)
    assert accepted.tolist() == [3, 1]
    assert next_tokens.tolist() == [4, 0]  # bonus for row 0, target's choice for row 1


def _one_step_law(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor, rows: int):
    """Empirical law of the token emitted at position 1 (accepted draft or recovered)."""
    generator = torch.Generator().manual_seed(0)
    target_probs = torch.stack([p, p])[None].repeat(rows, 1, 1)  # [R, 2, V]
    draft_probs = None if q is None else q[None, None].repeat(rows, 1, 1)
    accepted, next_tokens = verify_stochastic(draft[:, None], draft_probs, target_probs, generator)
    emitted = torch.where(accepted == 1, draft, next_tokens)
    return torch.bincount(emitted, minlength=p.numel()).double() / rows, accepted


def test_stochastic_matches_target_with_sampled_drafts() -> None:
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    rows = 200_000
    draft = torch.multinomial(q, rows, replacement=True, generator=torch.Generator().manual_seed(1))
    law, accepted = _one_step_law(p, q, draft, rows)
    assert torch.allclose(law, p.double(), atol=4e-3)
    alpha = torch.minimum(p, q).sum()
    assert abs(accepted.double().mean() - alpha) < 4e-3


def test_stochastic_one_hot_drafts_accept_with_p_and_recover_without_x() -> None:
    p = torch.tensor([0.6, 0.3, 0.1])
    rows = 200_000
    draft = torch.zeros(rows, dtype=torch.long)  # a deterministic proposer always says 0
    law, accepted = _one_step_law(p, None, draft, rows)
    assert abs(accepted.double().mean() - 0.6) < 4e-3
    assert torch.allclose(law, p.double(), atol=4e-3)


def test_bonus_token_only_when_every_draft_is_accepted() -> None:
    # The target puts all mass on the drafted tokens at positions 1-2; position 3 is the bonus.
    target_probs = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    accepted, next_tokens = verify_stochastic(
        torch.tensor([[1, 2]]), None, target_probs, torch.Generator().manual_seed(0)
    )
    assert accepted.tolist() == [2] and next_tokens.tolist() == [0]
    # A rejected draft never yields the bonus distribution: the residual excludes the draft.
    target_probs = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])
    for seed in range(20):
        accepted, next_tokens = verify_stochastic(
            torch.tensor([[1]]), None, target_probs, torch.Generator().manual_seed(seed)
        )
        assert (accepted.item(), next_tokens.item()) in {(1, 2), (0, 0)}


def test_ngram_lookup_copies_a_full_continuation_on_repeats() -> None:
    from draftsmith.decode import NgramDrafter

    drafter = NgramDrafter(vocab_size=10, max_ngram=2)
    assert drafter.lookup([5, 5, 5, 5, 5, 5], 3) == ([5, 5, 5], 2)
    assert drafter.lookup([1, 2, 3, 4, 1, 2], 3) == ([3, 4, 1], 2)
    assert drafter.lookup([1, 2, 3, 4, 9], 3) == ([], 0)


def test_ngram_index_lookup_equals_a_direct_scan() -> None:
    """The indexed lookup finds what scanning the whole history from the right finds."""
    import random

    from draftsmith.decode.drafters.ngram import NgramDrafter, NgramIndex

    def scan(history: list[int], num_tokens: int) -> tuple[list[int], int]:
        for n in range(min(3, len(history) - 1), 0, -1):
            suffix, best = history[len(history) - n :], []
            for start in range(len(history) - n - 1, -1, -1):
                if history[start : start + n] == suffix:
                    continuation = history[start + n : start + n + num_tokens]
                    if len(continuation) == num_tokens:
                        return continuation, n
                    best = continuation if len(continuation) > len(best) else best
            if best:
                return best, n
        return [], 0

    drafter, rng = NgramDrafter(vocab_size=4, max_ngram=3), random.Random(0)
    for _ in range(500):
        history = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        num_tokens = rng.randrange(1, 6)
        index = NgramIndex(history[:5], max_ngram=3)
        index.extend(history[5:])  # built incrementally, as commits do
        assert drafter.lookup(index, num_tokens) == scan(history, num_tokens)
