"""The tail first: a request's predicted length before it starts, and the admission priority it earns.

A rollout step is larger than an engine's concurrency, so requests queue, and the request admitted last sets
the epoch's tail. Admitting the longest first (LPT scheduling) shortens the tail; a request's length is known
before it starts only from evidence: its problem's recent lengths (finished siblings of earlier epochs), the
cap (max_tokens), and every response as it finishes (`observe`). The expected length under the cap is the
mean of the problem's recent lengths, each cut at the cap.

Within a GRPO group samples differ more than groups do, so a problem's mean is a noisy key: on the replay's
traces even each group's true mean, known in advance, admits some epochs' tails later than the layout's
order does. So the order is conservative (`blocks`): problems are sorted by expected length, and neighbours
whose means a two-sided z-test at a family-wise FAMILY_ERROR over all neighbouring pairs (Bonferroni) does
not separate, with the standard error of the difference from the pooled within-problem spread, share a
block; blocks run longest first, and within a block the submission order (verl's layout, FCFS) stands. With no within-problem spread (greedy decoding) every difference separates;
with little history nothing does, and the order is FCFS.

A request's own progress and speed exist only once it runs, and vLLM fixes a request's priority when it is
submitted: they cannot order admission. This epoch's finished siblings are not used for queued requests of
the same epoch either: the short ones finish first, so they would bias their problem short.

vLLM admits by `priority` under `scheduling_policy="priority"`, lower first, ties in arrival order:
`priorities` hands out ranks 0..n-1 (blocks first, submission order within), as verl numbers its rows.

Plain numpy on purpose: this module is imported where vLLM engines are started, and numba (the budget's
`LengthModel`) imported before an engine starts breaks vLLM 0.32's CPU worker start (its kernel rebinding
scans every loaded module and trips on llvmlite's function wrappers).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np

from workers.errors import InvalidInput

# Recent lengths kept per problem: the budget's window (`BudgetConfig.lengths_per_problem`), about three
# epochs of 16 samples.
LENGTHS_PER_PROBLEM = 48
# Recent lengths of all problems, the prediction for a problem without history.
POOL_LENGTHS = 1024
# Chance that any neighbouring pair of problems with equal expected lengths is split into two blocks.
FAMILY_ERROR = 0.05


class LengthPredictor:
    """Expected response length per problem from its recent lengths, cut at the cap, and the conservative
    admission order built on it.

    Args:
        max_tokens: the response cap every request runs under (vLLM's max_tokens), or None.
        per_problem: recent lengths kept per problem.
    """

    def __init__(self, max_tokens: int | None = None, per_problem: int = LENGTHS_PER_PROBLEM) -> None:
        if per_problem < 1:
            raise InvalidInput(f"per_problem must be >= 1, got {per_problem}")
        self.max_tokens = max_tokens
        self._per_problem = per_problem
        self._lengths: dict[str, deque[int]] = {}
        self._pool: deque[int] = deque(maxlen=POOL_LENGTHS)

    def observe(self, problem_id: str, length: int) -> None:
        """A finished response: history for later requests."""
        lengths = self._lengths.get(problem_id)
        if lengths is None:
            lengths = self._lengths[problem_id] = deque(maxlen=self._per_problem)
        lengths.append(length)
        self._pool.append(length)

    def _capped(self, lengths: Sequence[int]) -> np.ndarray:
        values = np.fromiter(lengths, np.float64, len(lengths))
        return np.minimum(values, self.max_tokens) if self.max_tokens is not None else values

    def predict(self, problem_ids: Sequence[str | None]) -> np.ndarray:
        """Expected length of a new request of each problem; problems without history get every problem's
        (the pool's), and with no history at all every request gets 0."""
        pool = float(self._capped(self._pool).mean()) if self._pool else 0.0
        cache: dict[str | None, float] = {}
        out = np.empty(len(problem_ids))
        for i, problem_id in enumerate(problem_ids):
            if problem_id not in cache:
                lengths = self._lengths.get(problem_id) if problem_id is not None else None
                cache[problem_id] = float(self._capped(lengths).mean()) if lengths else pool
            out[i] = cache[problem_id]
        return out

    def blocks(self, problem_ids: Sequence[str | None]) -> np.ndarray:
        """Each request's block, 0 for the longest: every problem with history, sorted by expected length, a
        new block wherever a neighbouring pair's means differ significantly (at a family-wise FAMILY_ERROR).
        A problem without history joins the block of the problems around the pool's mean."""
        if not self._pool:
            return np.zeros(len(problem_ids), np.int64)
        capped = {p: self._capped(v) for p, v in self._lengths.items()}
        spreads = [v.var(ddof=1) for v in capped.values() if v.size > 1]
        within = float(np.mean(spreads)) if spreads else 0.0
        ranked = sorted(capped, key=lambda p: -capped[p].mean())
        separation = NormalDist().inv_cdf(1 - FAMILY_ERROR / (2 * max(len(ranked) - 1, 1)))
        block: dict[str | None, int] = {}
        current = 0
        for j, problem in enumerate(ranked):
            if j:
                longer, shorter = capped[ranked[j - 1]], capped[problem]
                se = np.sqrt(within * (1 / longer.size + 1 / shorter.size))
                if longer.mean() - shorter.mean() > separation * se:
                    current += 1
            block[problem] = current
        pool = float(self._capped(self._pool).mean())
        average = next((block[p] for p in ranked if capped[p].mean() <= pool), current)
        return np.array([block.get(p, average) for p in problem_ids], np.int64)

    def priorities(self, problem_ids: Sequence[str | None]) -> list[int]:
        """vLLM priorities (lower runs first): each request's rank, blocks longest first, the given order
        within a block."""
        order = np.argsort(self.blocks(problem_ids), kind="stable")
        ranks = np.empty(len(problem_ids), np.int64)
        ranks[order] = np.arange(len(problem_ids))
        return ranks.tolist()
