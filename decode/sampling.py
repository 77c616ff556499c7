"""From logits to the distribution a token is drawn from.

docs/theory.md §2: ``p`` and ``q`` are the distributions *after* every sampling transform
(temperature, then top-k, then top-p, renormalised). One function applies those transforms, to
the target's and the draft's logits alike, so the two can never disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import torch

# Temperatures below this are greedy (vLLM's convention, its ``_SAMPLING_EPS``). Dividing
# logits by a smaller positive number overflows them to inf (5e-324 turns a logit of 1 into
# inf), and the softmax of infinities is NaN; at 1e-5 the largest logit already wins by any
# margin a float32 softmax can tell apart from greedy.
GREEDY_TEMPERATURE_FLOOR = 1e-5


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding parameters, validated once here for every caller (API, server, evaluation).

    ``temperature`` is a finite number >= 0; below ``GREEDY_TEMPERATURE_FLOOR`` (0 included)
    decoding is greedy (argmax) and top-k/top-p do not apply. ``top_k`` is an integer >= 0 (0
    disables it) and ``top_p`` a number in (0, 1] (1 disables it). Bad values raise
    ``ValueError`` naming the field, wrong types (bools, strings, tensors) too.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        temperature = _real(self.temperature, "temperature", "a finite number >= 0 (0 is greedy)")
        if temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}"
            )
        top_p = _real(self.top_p, "top_p", "a number in (0, 1] (1 disables it)")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1] (1 disables it), got {self.top_p!r}")
        if not isinstance(self.top_k, Integral) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        # Plain Python numbers from here on (numpy scalars compare and hash alike).
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "top_k", int(self.top_k))

    @property
    def greedy(self) -> bool:
        """Argmax decoding: ``temperature < GREEDY_TEMPERATURE_FLOOR``."""
        return self.temperature < GREEDY_TEMPERATURE_FLOOR


def _real(value: object, name: str, expected: str) -> float:
    """``value`` as a finite float; ``ValueError`` for bools, non-numbers, NaN and infinities."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return number


def logits_to_probs(
    logits: torch.Tensor,  # [..., V]
    config: SamplingConfig,
) -> torch.Tensor:  # [..., V] float32, rows sum to 1
    """Apply temperature, then top-k, then top-p, and renormalise.

    Greedy configs return the one-hot distribution of the argmax, so that code which needs a
    distribution (acceptance statistics, overlaps) works at temperature 0 too.
    """
    logits = logits.float()
    if config.greedy:
        return torch.nn.functional.one_hot(greedy_tokens(logits), logits.shape[-1]).to(logits.dtype)
    logits = logits / config.temperature
    if 0 < config.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if config.top_p < 1.0:
        probs = _top_p_filter(probs, config.top_p)
    return probs


def _top_p_filter(
    probs: torch.Tensor,  # [..., V]
    top_p: float,
) -> torch.Tensor:  # [..., V]
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (Holtzman 2020).

    A token is kept when the mass strictly before it in descending order is below ``top_p``;
    the most likely token is always kept. Matches Hugging Face's ``TopPLogitsWarper`` up to
    ties.
    """
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    # A top_p below float32's smallest number compares as 0: keep the most likely token anyway.
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    filtered = probs * keep
    return filtered / filtered.sum(-1, keepdim=True)


def sample(
    probs: torch.Tensor,  # [..., V]
    generator: torch.Generator | None,
) -> torch.Tensor:  # [...] int64
    """Draw one token per row from ``probs`` with an explicit generator (inverse CDF).

    One uniform ``u`` per row picks the first token whose cumulative mass exceeds
    ``u * total``; tokens of zero mass are never picked. ``torch.multinomial`` draws one
    exponential per vocabulary entry instead, about 0.5 ms per row at V = 8192 on a CPU core:
    more than a small draft model's whole layer.
    """
    flat = probs.reshape(-1, probs.shape[-1])  # [R, V]
    cdf = flat.double().cumsum(-1)  # [R, V]
    uniform = torch.rand(
        flat.shape[0], 1, generator=generator, dtype=torch.float64, device=flat.device
    )
    # Scaling by the double just below the total keeps u * total strictly under it even after
    # rounding (u < 1), so the search always lands on a token with mass, never past the last.
    below_total = torch.nextafter(cdf[:, -1:], torch.zeros_like(cdf[:, -1:]))  # [R, 1]
    drawn = torch.searchsorted(cdf, uniform * below_total, right=True)  # [R, 1]
    return drawn.reshape(probs.shape[:-1])


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [...] int64
    """The argmax of each row: the first index of the largest logit (NaN counts as largest).

    ``max(-1).indices`` returns what ``argmax(-1)`` does, ties and NaN included, but ATen's
    bfloat16 ``argmax`` on CPU is a scalar loop: over a verify pass's [1, 13, 8192] logits it
    took 211 microseconds against 39 for ``max`` (46 for a float32 copy and its argmax), and 92
    against 19 over 5 rows (torch 2.13, 2 threads, AMD EPYC with AVX512-BF16).
    """
    return logits.max(-1).indices


def select_tokens(
    logits: torch.Tensor,  # [..., V]
    config: SamplingConfig,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # tokens [...], probs [..., V] or None if greedy
    """Pick the next token(s) as plain decoding would: argmax when greedy, else a sample.

    Returns the distribution the token was drawn from (``None`` for greedy, whose ``q`` is
    one-hot).
    """
    if config.greedy:
        return greedy_tokens(logits), None
    probs = logits_to_probs(logits, config)
    return sample(probs, generator), probs
