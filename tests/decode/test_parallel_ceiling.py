"""decode/measure/parallel_ceiling.py: the water-filling optimum against a search over the simplex,
and the beam walk against a target whose laws are known in closed form (a Markov chain)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from draftsmith.decode.measure.parallel_ceiling import (
    DepthCeiling,
    best_shared_overlap,
    mixture_overlap,
    parallel_ceilings,
    tau_cap,
)


def _value(probs: torch.Tensor, weights: torch.Tensor, q: torch.Tensor) -> float:
    w = weights / weights.sum()
    return float((w[:, None] * torch.minimum(probs, q)).sum())


def test_one_law_or_equal_laws_are_matched_exactly() -> None:
    law = torch.softmax(torch.randn(50), 0)
    assert best_shared_overlap(law[None], torch.ones(1)) == pytest.approx(1.0)
    assert best_shared_overlap(law.expand(4, 50), torch.rand(4)) == pytest.approx(1.0)


def test_disjoint_laws_are_worth_the_heaviest_path() -> None:
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.2, 0.8]])
    weights = torch.tensor([0.7, 0.3])
    assert best_shared_overlap(probs, weights) == pytest.approx(0.7)
    assert mixture_overlap(probs, weights) == pytest.approx(0.7 * 0.7 + 0.3 * 0.3)


@pytest.mark.parametrize("seed", range(6))
def test_the_water_filling_optimum_matches_a_search_over_the_simplex(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    paths, vocab, steps = 1 + seed % 3, 3, 200
    probs = torch.softmax(3 * torch.randn(paths, vocab, generator=generator), -1).double()
    weights = torch.rand(paths, generator=generator).double() + 0.1
    grid = [
        torch.tensor([a / steps, b / steps, (steps - a - b) / steps], dtype=torch.float64)
        for a, b in itertools.product(range(steps + 1), repeat=2)
        if a + b <= steps
    ]
    searched = max(_value(probs, weights, q) for q in grid)
    best = best_shared_overlap(probs, weights)
    assert searched - 1e-9 <= best <= searched + 2.0 / steps  # the grid is 1/steps coarse
    assert best >= mixture_overlap(probs, weights) - 1e-9  # the mixture is one candidate


class MarkovTarget(torch.nn.Module):
    """A "language model" whose next-token law depends on the last token only:
    ``p(. | ..., a) = chain[a]``, so every depth's paths and laws are known in closed form."""

    def __init__(self, chain: torch.Tensor) -> None:
        super().__init__()
        self.chain = chain

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.chain[input_ids].log())


def test_the_beam_walk_measures_the_closed_form_caps_of_a_markov_target() -> None:
    vocab = 5
    chain = torch.softmax(
        2 * torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1)), -1
    )
    target = MarkovTarget(chain)
    context = torch.tensor([3, 1, 4])
    figures = parallel_ceilings(target, [context], depths=3, top_k=vocab, beam=vocab**2)
    # Depth 2: paths y_1 ~ chain[4], laws chain[y_1]. Depth 3: paths (y_1, y_2), laws chain[y_2],
    # with weight sum over y_1 of chain[4, y_1] chain[y_1, y_2] = (chain @ chain)[4, y_2].
    assert [f.depth for f in figures] == [1, 2, 3]
    assert figures[0].ceiling == 1.0
    assert figures[1].ceiling == pytest.approx(best_shared_overlap(chain, chain[4]), abs=1e-6)
    assert figures[1].mixture == pytest.approx(mixture_overlap(chain, chain[4]), abs=1e-6)
    two_steps = (chain @ chain)[4]
    assert figures[2].ceiling == pytest.approx(best_shared_overlap(chain, two_steps), abs=1e-6)
    assert figures[1].coverage == pytest.approx(1.0) and figures[2].coverage == pytest.approx(1.0)
    assert figures[2].lower == pytest.approx(figures[2].ceiling)
    assert figures[2].upper == pytest.approx(figures[2].ceiling)
    # A narrower beam keeps less of the probability, says so, and its bracket holds the cap.
    narrow = parallel_ceilings(target, [context], depths=3, top_k=2, beam=2)
    assert narrow[2].coverage < 1.0
    assert narrow[2].lower - 1e-9 <= figures[2].ceiling <= narrow[2].upper + 1e-9
    assert narrow[1].lower - 1e-9 <= figures[1].ceiling <= narrow[1].upper + 1e-9
    # A deterministic target (a permutation) leaves nothing uncertain: every cap is 1.
    permutation = torch.eye(vocab)[torch.tensor([1, 2, 3, 4, 0])] * 0.999 + 0.001 / vocab
    exact = parallel_ceilings(MarkovTarget(permutation), [context], depths=4, top_k=3, beam=9)
    assert all(f.ceiling > 0.99 for f in exact)


def test_tau_cap_multiplies_the_caps_and_rejects_bad_requests() -> None:
    caps = [DepthCeiling(1, 1.0, 1.0, 1.0, 1), DepthCeiling(2, 0.5, 0.4, 1.0, 1)]
    assert tau_cap(caps, 1) == pytest.approx(2.0)
    assert tau_cap(caps, 3) == pytest.approx(1 + 1 + 0.5 + 0.25)  # deeper keep the last cap
    with pytest.raises(ValueError, match="depths must be >= 2"):
        parallel_ceilings(MarkovTarget(torch.eye(3)), [torch.tensor([0])], depths=1)
    with pytest.raises(ValueError, match="no context"):
        parallel_ceilings(MarkovTarget(torch.eye(3)), [], depths=2)
