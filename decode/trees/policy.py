"""Each round's tree shape, chosen from measured acceptance and measured cost: the tree
counterpart of :class:`draftsmith.decode.draft_length.AdaptiveDraftLength`.

A round's shape comes from a fixed menu built once from the user's :class:`TreeSpec` and the
depth limit N: a plain target step, chains of 1..N drafts, and trees. Its layout is a function
of the shape alone, never of the sampled values, and the shape is fixed from past rounds before
the round is drafted, so every round is verified exactly (docs/theory.md §4, §7).

**Expected tokens of a sampled tree** (T > 0, children drawn from q without replacement; the
layout of :func:`draftsmith.decode.trees.layout.sampled_tree_chain_lengths`: ``c`` root children, child ``i``
continued as a chain of ``L_i`` nodes). The walk tries root child i only after children
0..i-1 were rejected; with ``beta_i`` the probability that child i is accepted given that it is
tried (its residual test, docs/theory.md §4) and ``gamma_j`` the probability that the chain's
node at depth j is accepted given its parent was,

    E = 1 + sum_{i < c} R_i * beta_i * (1 + sum_{j=2}^{L_i} prod_{l=2}^{j} gamma_l(i)),
    R_i = prod_{i' < i} (1 - beta_i'),

the tree form of ``E[L] = 1 + sum_i prod_{j <= i} alpha_j`` (docs/theory.md §5; Sequoia, Chen
et al. 2024, value a tree by the same sum over nodes of the probability that each is reached
and accepted, SpecInfer, Miao et al. 2024, introduced the multi-draft test). Child 0 and its
chain are drawn exactly as a sampled chain, so ``beta_0`` and ``gamma_j(0)`` are the chain's
``alpha_1`` and ``alpha_j`` and every chain round measures them too; ``beta_i`` (i >= 1) is
kept per sibling rank and ``gamma_j`` of the later children's chains per depth, apart from the
first chain's (their roots are less likely tokens). These rates extrapolate to every shape of
the menu, run or not.

**Top-k trees** (T = 0; and T > 0 for drafters without sampled trees): which nodes an EAGLE-2
tree keeps depends on the draft's scores, so no per-rank law gives its layout in advance.
Each top-k shape keeps its own per-depth rates ``alpha_j`` (the accepted path reaching depth
j given depth j - 1), ``E = 1 + sum_j prod_{l <= j} alpha_l``, and is measured once before it
is compared.

**Cost.** A round of ``n`` scored tokens (nodes + 1), ``s`` draft-network steps (depth - 1;
the first level comes from the logits of the last commit) and, for a tree, its tree-masked
verify pass takes

    T = a + b * n + c * s + e * [tree]

seconds: the verify pass widens with every scored token (on a CPU a 5-token verify costs
about 1.7 target steps, docs/theory.md §5) and every level is a draft step. The coefficients
are one least-squares fit over every round seen, weighted by recency (each round's weight
decays by ``decay``, recursive least squares with forgetting), with non-negative slopes; a
round slower than 1.5 times a prediction the past rounds pin down counts as 1.5 times (the
machine is shared: a stall says nothing about the shape). One model for all shapes compares
them under the same recent load, where per-shape averages would compare a shape timed during
a stall with one timed in a quiet moment. What the plane misses about one shape (a top-k
tree's wider draft steps, a longer commit after longer accepted paths) is kept as that
shape's ratio of measured to predicted time (a decayed mean over its own rounds with a prior
of one round at 1), which the load does not change, so a shape run rarely keeps what its
runs taught. The policy picks

    s* = argmax_s E(s) / T(s)

over the shapes that fit the rows' remaining room: expected tokens per second. The chains and
the plain step are on the menu, so in expectation it never does worse than the best chain.
As in the chain policy, rates are decayed counts (factor 0.99, prior one acceptance in two);
the longest chain, a plain step, a half-length chain (three points of the cost plane) and the
largest tree are measured first (every top-k tree, whose rates are its own), each shape's
first round counting its acceptance but not its time, which pays one-time costs (a kernel
built for a new row count, a layout prepared on first use; ``draftsmith.decode.draft_length``); every
``probe_every``-th round runs the runner-up or the least recently run of the five best
shapes, and the current shape is kept until another promises ``switch_margin`` more tokens
per second. The state carries over from one ``generate`` call to the next.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from draftsmith.decode.draft_length import PRIOR_ACCEPTED, PRIOR_REACHED, RoundPolicy
from draftsmith.decode.drafters.base import TreeSpec
from draftsmith.decode.trees.layout import sampled_tree_chain_lengths

# Sampled trees on the menu have at most this many root children: each further sibling is
# tried only after all earlier ones failed, and the menu stays small.
MAX_SAMPLED_CHILDREN = 4
CHAIN, SAMPLED, TOP_K = "chain", "sampled", "top-k"


@dataclass(frozen=True)
class RoundShape:
    """One entry of the menu: a plain step or chain (``kind`` "chain", ``nodes == depth``), a
    sampled tree (``children`` root children, ``nodes`` in all) or a top-k tree
    (``children`` = top_k, ``nodes`` = total_tokens, ``frontier`` nodes expanded per level;
    0: top_k)."""

    kind: str
    depth: int
    children: int = 1
    nodes: int = 0
    frontier: int = 0

    @classmethod
    def chain(cls, length: int) -> RoundShape:
        return cls(CHAIN, length, 1, length)

    @property
    def scored_tokens(self) -> int:
        """Tokens the verify pass scores: the pending token and every node."""
        return self.nodes + 1

    def chain_lengths(self) -> list[int]:
        """A sampled tree's chains under the root's children (a chain: one)."""
        if self.kind == CHAIN:
            return [self.depth] if self.depth else []
        return sampled_tree_chain_lengths(self.children, self.depth, self.nodes)

    def tree_spec(self, base: TreeSpec) -> TreeSpec:
        """The spec the drafter builds this shape from (static choices stay the user's)."""
        if base.choices is not None:
            return base
        return replace(base, top_k=self.children, total_tokens=self.nodes, frontier=self.frontier)


class _Rates:
    """Decayed Bernoulli counts per index (acceptance given reached), prior 1 in 2."""

    def __init__(self, size: int) -> None:
        self.reached = [PRIOR_REACHED] * size
        self.accepted = [PRIOR_ACCEPTED] * size

    def __getitem__(self, index: int) -> float:
        return self.accepted[index] / self.reached[index]

    def add(self, index: int, reached: int, accepted: int, decay: float) -> None:
        if reached:
            self.reached[index] = decay * self.reached[index] + reached
            self.accepted[index] = decay * self.accepted[index] + accepted


def shape_menu(spec: TreeSpec, max_depth: int, *, sampled: bool, vary: bool) -> list[RoundShape]:
    """The fixed menu: a plain step, chains 1..``max_depth``, then trees.

    ``sampled``: sampled trees with 2..min(top_k, 4) root children, every depth up to
    ``max_depth`` and three node counts: one node under each later child, full chains
    (capped at ``spec.total_tokens``) and halfway. Otherwise top-k trees ``max_depth`` deep:
    with ``vary`` (a drafter that builds its tree from top_k and total_tokens, EAGLE-2's)
    top_k in {2, spec.top_k} and totals in {N + 2, 2N, spec.total_tokens} (at most what the
    tree holds; the user's ``frontier``, capped at each top_k), else the user's tree alone.
    """
    menu = [RoundShape.chain(w) for w in range(max_depth + 1)]
    if sampled:
        for children in range(2, min(spec.top_k, MAX_SAMPLED_CHILDREN) + 1):
            for depth in range(1, max_depth + 1):
                fewest = depth + children - 1  # one node under each later child
                most = min(spec.total_tokens, children * depth)  # full chains
                for nodes in sorted({fewest, (fewest + most) // 2, most}):
                    if nodes <= most:
                        menu.append(RoundShape(SAMPLED, depth, children, nodes))
        return menu
    if not vary:
        return [*menu, RoundShape(TOP_K, max_depth, spec.top_k, spec.total_tokens, spec.frontier)]
    for top_k in sorted({2, spec.top_k}):
        frontier = min(spec.frontier, top_k)
        capacity = replace(spec, top_k=top_k, frontier=frontier).capacity(max_depth)
        most = min(capacity, spec.total_tokens)
        for nodes in sorted({n for n in (max_depth + 2, 2 * max_depth, most) if n <= most}):
            menu.append(RoundShape(TOP_K, max_depth, top_k, nodes, frontier))
    return menu


class TreeSizePolicy(RoundPolicy):
    """Picks each round's :class:`RoundShape`; fed each round's acceptance and duration.

    The engine asks :meth:`choose_shape` inside its tree round, where the sampling mode is
    known. The policy also speaks :class:`AdaptiveDraftLength`'s protocol so that the chain
    rounds it delegates report to it: :meth:`choose` passes the round's depth limit through
    and :meth:`update` records a chain round.
    """

    def __init__(
        self,
        spec: TreeSpec,
        max_depth: int,
        *,
        vary_top_k: bool = True,
        decay: float = 0.99,
        probe_every: int = 16,
        switch_margin: float = 0.1,
    ) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        super().__init__(decay, probe_every, switch_margin)
        self.spec = spec
        self.max_depth = max_depth
        self.menus = {
            mode: shape_menu(spec, max_depth, sampled=mode == SAMPLED, vary=vary_top_k)
            for mode in (SAMPLED, TOP_K)
        }
        children = max(MAX_SAMPLED_CHILDREN, spec.top_k)
        self._chain = {greedy: _Rates(max_depth) for greedy in (False, True)}  # alpha_j
        self._siblings = _Rates(children)  # beta_i of sampled trees (index 0 unused)
        self._side = _Rates(max_depth)  # gamma_j of the chains under later siblings
        self._top_k: dict[tuple[RoundShape, bool], _Rates] = {}
        self.cost = RoundCost(decay)
        self._ratio: dict[RoundShape, float] = {}  # measured time / the plane's, decayed mean
        self._lengths_cache: dict[RoundShape, list[int]] = {}
        self._ratio_sums: dict[RoundShape, tuple[float, float]] = {}
        self._scored: dict[RoundShape, int] = {}  # scored tokens where a shape has run
        self._timed: set[RoundShape] = set()  # shapes whose time the cost model has seen
        self._last_run: dict[RoundShape, int] = {}
        self._current: RoundShape | None = None
        self._greedy = True  # the mode of the latest choice (chain rounds report into it)
        self._rounds = 0

    # -- the expected tokens ------------------------------------------------------------------
    def expected_tokens(self, shape: RoundShape, greedy: bool) -> float:
        """``E(s)``: tokens a round of ``shape`` emits on average (see the module docstring)."""
        return self._expected(shape, greedy, self._tables(greedy))

    def _tables(self, greedy: bool) -> tuple[list[float], list[float], list[float]]:
        """Path sums of the first chain and of the later chains by length, and ``beta_i``."""
        alpha, side = self._chain[greedy], self._side
        first = [
            _path_sum([alpha[j] for j in range(1, length)])
            for length in range(1, 1 + self.max_depth)
        ]
        later = [
            _path_sum([side[j] for j in range(1, length)])
            for length in range(1, 1 + self.max_depth)
        ]
        betas = [alpha[0]] + [self._siblings[i] for i in range(1, len(self._siblings.reached))]
        return first, later, betas

    def _expected(self, shape: RoundShape, greedy: bool, tables: tuple[list[float], ...]) -> float:
        if shape.kind == TOP_K:
            rates = self._top_k.get((shape, greedy)) or _Rates(shape.depth)
            return _path_sum([rates[j] for j in range(shape.depth)])
        first, later, betas = tables
        total, reach = 1.0, 1.0
        for rank, length in enumerate(self._lengths(shape)):
            below = first if rank == 0 else later
            total += reach * betas[rank] * below[length - 1]
            reach *= 1.0 - betas[rank]
        return total

    def _lengths(self, shape: RoundShape) -> list[int]:
        lengths = self._lengths_cache.get(shape)
        if lengths is None:
            lengths = self._lengths_cache[shape] = shape.chain_lengths()
        return lengths

    # -- the cost -----------------------------------------------------------------------------
    def round_seconds(self, shape: RoundShape) -> float | None:
        """``T(s)``: the fitted cost model times the shape's own measured ratio to it (None
        before any round)."""
        coef = self.cost.coefficients()
        if coef is None:
            return None
        return _dot(coef, self._features(shape)) * self._ratio.get(shape, 1.0)

    def _features(self, shape: RoundShape) -> tuple[float, ...]:
        scored = self._scored.get(shape, shape.scored_tokens)  # a top-k tree's real size
        return _features(scored, max(shape.depth - 1, 0), shape.kind != CHAIN)

    # -- choosing -----------------------------------------------------------------------------
    def choose(self, limit: int) -> int:
        """The engine's draft-length hook: the depth limit passes through to the tree round."""
        return min(limit, self.max_depth)

    def choose_shape(self, limit: int, *, greedy: bool, sampled: bool) -> RoundShape:
        """The shape of the next round, at most ``limit`` deep (the rows' remaining room).

        ``sampled``: the drafter draws sampled trees (T > 0); else top-k trees are on the menu.
        """
        self._greedy = greedy
        limit = min(limit, self.max_depth)
        full = self.menus[SAMPLED if sampled else TOP_K]
        menu = [s for s in full if s.depth <= limit]
        for shape in self._first_measured(full):
            if shape not in self._timed and shape.depth <= limit:
                return self._ran(shape)
        tables = self._tables(greedy)
        rates = {s: self._expected(s, greedy, tables) / self.round_seconds(s) for s in menu}
        ranked = sorted(menu, key=rates.__getitem__, reverse=True)
        best, current = ranked[0], self._current
        if current in rates and rates[best] < rates[current] * (1 + self.switch_margin):
            best = current
        self._current = best
        if self.probe_every and self._rounds % self.probe_every == self.probe_every - 1:
            others = [s for s in ranked[:5] if s != best]
            if others:
                if (self._rounds // self.probe_every) % 2 == 0:
                    return self._ran(others[0])
                return self._ran(min(others, key=lambda s: self._last_run.get(s, -1)))
        return self._ran(best)

    def _first_measured(self, menu: list[RoundShape]) -> list[RoundShape]:
        """Measured before any comparison (where they fit the room): the longest chain, a
        plain step and a half-length chain (the cost plane), the largest tree (the tree
        term and the sibling rates); every top-k tree, whose rates are its own."""
        half = RoundShape.chain((self.max_depth + 1) // 2)
        chains = list(dict.fromkeys([RoundShape.chain(self.max_depth), RoundShape.chain(0), half]))
        trees = [s for s in menu if s.kind != CHAIN]
        if not trees:
            return chains
        if trees[0].kind == TOP_K:
            return chains + trees
        return [*chains, max(trees, key=lambda s: (s.nodes, s.children))]

    def _ran(self, shape: RoundShape) -> RoundShape:
        self._last_run[shape] = self._rounds
        return shape

    # -- learning -----------------------------------------------------------------------------
    def update(
        self,
        width: int,
        num_accepted: torch.Tensor,  # [B] accepted drafts of the rows that were active
        seconds: float,
    ) -> None:
        """Fold in a chain round (``AdaptiveDraftLength``'s signature)."""
        shape = RoundShape.chain(width)
        self._time(shape, shape.scored_tokens, seconds)
        if width == 0 or num_accepted.numel() == 0:
            return
        counts = torch.bincount(num_accepted.clamp(max=width), minlength=width + 1).tolist()
        rates = self._chain[self._greedy]
        for j in range(width):
            rates.add(j, sum(counts[j:]), sum(counts[j + 1 :]), self.decay)

    def update_tree(
        self,
        shape: RoundShape,
        accepted_nodes: torch.Tensor,  # [B, D] accepted path of the active rows, -1 padded
        num_nodes: int,  # nodes the round's tree really had
        seconds: float,
    ) -> None:
        """Fold in a tree round: its duration, and the acceptance along each row's path."""
        self._time(shape, num_nodes + 1, seconds)
        if accepted_nodes.numel() == 0:
            return
        num_accepted = (accepted_nodes >= 0).sum(1).tolist()
        if shape.kind == TOP_K:
            rates = self._top_k.setdefault((shape, self._greedy), _Rates(shape.depth))
            for j in range(shape.depth):
                reached = sum(n >= j for n in num_accepted)
                rates.add(j, reached, sum(n > j for n in num_accepted), self.decay)
            return
        # Sampled layout: the root's children are nodes 0..c-1, in trial order.
        lengths = shape.chain_lengths()
        first = accepted_nodes[:, 0].tolist()
        for rank in range(len(lengths)):
            tried = sum(f < 0 or f >= rank for f in first)
            taken = sum(f == rank for f in first)
            if rank == 0:
                self._chain[self._greedy].add(0, tried, taken, self.decay)
            else:
                self._siblings.add(rank, tried, taken, self.decay)
        for rank, length in enumerate(lengths):
            below = [n for f, n in zip(first, num_accepted, strict=True) if f == rank]
            rates = self._chain[self._greedy] if rank == 0 else self._side
            for j in range(1, length):
                reached = sum(n >= j for n in below)
                rates.add(j, reached, sum(n > j for n in below), self.decay)

    def _time(self, shape: RoundShape, scored: int, seconds: float) -> None:
        self._rounds += 1
        self._scored[shape] = scored
        if self._warming_up(shape):  # one-time costs: its acceptance counts, its time not
            return
        self._timed.add(shape)
        features = self._features(shape)
        predicted = self.cost.pinned(features)
        if predicted is not None:  # what the plane misses about this shape, load aside
            ratio = min(max(seconds / predicted, 1 / self.cost.clip), self.cost.clip)
            total, count = self._ratio_sums.get(shape, (1.0, 1.0))  # prior: on the plane
            total, count = self.decay * total + ratio, self.decay * count + 1.0
            self._ratio_sums[shape] = (total, count)
            self._ratio[shape] = total / count
        self.cost.add(features, seconds)


def _path_sum(rates: list[float]) -> float:
    """``1 + sum_j prod_{l <= j} rates_l``: expected length of a path with these rates."""
    total, survive = 1.0, 1.0
    for rate in rates:
        survive *= rate
        total += survive
    return total


def _features(scored: int, draft_steps: int, tree: bool) -> tuple[float, ...]:
    """``(1, n, s, [tree])``: the regressors of the cost model."""
    return (1.0, float(scored), float(draft_steps), float(tree))


class RoundCost:
    """``T = a + b * n + c * s + e * [tree]`` by least squares with forgetting.

    Keeps the decayed normal equations ``G = sum_r w_r x_r x_r^T``, ``m = sum_r w_r x_r t_r``
    (``w_r = decay^age``); a slope that comes out negative is fixed at 0 and the rest refitted.
    A round is clipped at ``clip`` times its prediction only where its leverage
    ``x^T G^-1 x`` is below 1/2, i.e. where earlier rounds already determine that prediction.
    Directions no round has explored yet (a tree term before any tree ran) get a tiny ridge
    and so a coefficient near 0. Plain floats: a 4 x 4 system per round costs microseconds,
    where tensor calls would cost a visible share of a small target's round.
    """

    def __init__(self, decay: float = 0.99, clip: float = 1.5) -> None:
        size = len(_features(0, 0, False))
        self.decay = decay
        self.clip = clip
        self._gram = [[0.0] * size for _ in range(size)]
        self._moment = [0.0] * size
        self._coef: list[float] | None = None
        self._rounds = 0

    def add(self, x: tuple[float, ...], seconds: float) -> None:
        """Fold in one round of features ``x`` that took ``seconds``."""
        predicted = self.pinned(x)
        if predicted is not None:
            seconds = min(seconds, self.clip * predicted)
        decay = self.decay
        for i, row in enumerate(self._gram):
            for j in range(len(row)):
                row[j] = decay * row[j] + x[i] * x[j]
            self._moment[i] = decay * self._moment[i] + x[i] * seconds
        self._coef = None
        self._rounds += 1

    def coefficients(self) -> list[float] | None:
        """``[a, b, c, e]`` (None before any round)."""
        if not self._rounds:
            return None
        if self._coef is None:
            self._coef = self._fit()
        return self._coef

    def predict(self, x: tuple[float, ...]) -> float | None:
        """Seconds of a round with features ``x`` (None before any round)."""
        coef = self.coefficients()
        return None if coef is None else _dot(coef, x)

    def pinned(self, x: tuple[float, ...]) -> float | None:
        """The prediction at ``x`` where past rounds determine it (leverage < 1/2), else None."""
        if not self._rounds:
            return None
        free = list(range(len(x)))
        leverage = _dot(x, _solve(self._gram, list(x), free, self._ridge()))
        return self.predict(x) if leverage < 0.5 else None

    def _ridge(self) -> float:
        return 1e-9 * sum(self._gram[i][i] for i in range(len(self._gram))) + 1e-30

    def _fit(self) -> list[float]:
        free = list(range(len(self._moment)))
        while True:
            coef = _solve(self._gram, self._moment, free, self._ridge())
            worst = min(free[1:], key=lambda i: coef[i], default=None)
            if worst is None or coef[worst] >= 0:
                return coef
            free.remove(worst)  # a negative slope: hold it at 0, refit the rest


def _dot(a: list[float] | tuple[float, ...], b: list[float] | tuple[float, ...]) -> float:
    return max(sum(u * v for u, v in zip(a, b, strict=True)), 1e-9)


def _solve(gram: list[list[float]], rhs: list[float], free: list[int], ridge: float) -> list[float]:
    """``(G + ridge I) w = rhs`` restricted to the indices ``free`` (the others 0), by Gaussian
    elimination with partial pivoting."""
    size = len(free)
    rows = [[gram[i][j] + (ridge if i == j else 0.0) for j in free] + [rhs[i]] for i in free]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, size):
            factor = rows[r][col] / rows[col][col]
            for c in range(col, size + 1):
                rows[r][c] -= factor * rows[col][c]
    solution = [0.0] * size
    for r in reversed(range(size)):
        tail = sum(rows[r][c] * solution[c] for c in range(r + 1, size))
        solution[r] = (rows[r][size] - tail) / rows[r][r]
    full = [0.0] * len(rhs)
    for value, i in zip(solution, free, strict=True):
        full[i] = value
    return full
