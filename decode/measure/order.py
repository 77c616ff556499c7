"""The order in which measurements that are compared take their turns across repeats."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

Item = TypeVar("Item")

# How a record's repeats ordered its turns (``balanced_order``; records made before it ran the
# same order every repeat and name none).
ORDERS = {
    "alternating": "the order reversed at every repeat",
    "same": "the same order every repeat",
}


def balanced_order(items: Sequence[Item], repeat: int) -> list[Item]:
    """The order of the turns in repeat ``repeat``: as given, then reversed, in turn (A B C,
    C B A, ...). A machine whose speed drifts during a comparison favours whichever contender
    runs later in every repeat; in alternating order a drift linear in time gives each the
    same mean place over every two repeats. In one run of the server's draft policies at four
    clients (T = 0, the AVX2-only AMD EPYC), plain decoding ran last in each repeat and its
    windows rose 93 -> 102 -> 136 -> 145 tokens/s with the machine's speed."""
    return list(items) if repeat % 2 == 0 else list(items)[::-1]
