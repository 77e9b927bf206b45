"""The tail first: a request's predicted length before it starts, and the admission priority it earns.

A rollout step is larger than an engine's concurrency, so requests queue, and the request admitted last sets
the epoch's tail. Admitting the longest first (LPT scheduling) shortens the tail; a request's length is known
before it starts only from evidence: its problem's recent lengths, the cap (max_tokens) and the siblings of
the same epoch that already finished (`observe` every response as it finishes). The prediction is the
expected length under the cap: the mean of the problem's recent lengths, each cut at the cap. Within a group,
samples differ more than groups do, so on real rollouts it separates problems, not samples.

vLLM admits by `priority` under `scheduling_policy="priority"`, lower first: `priorities` hands out ranks, 0
for the longest predicted, ties in submission order (what vLLM's queue does with equal priorities), as verl
numbers its rows 0..n-1.

Plain numpy on purpose: this module is imported where vLLM engines are started, and numba (the budget's
`LengthModel`) imported before an engine starts breaks vLLM 0.32's CPU worker start (its kernel rebinding
scans every loaded module and trips on llvmlite's function wrappers).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

# Recent lengths kept per problem: the budget's window (`BudgetConfig.lengths_per_problem`), about three
# epochs of 16 samples.
LENGTHS_PER_PROBLEM = 48
# Recent lengths of all problems, the prediction for a problem without history.
POOL_LENGTHS = 1024


class LengthPredictor:
    """Expected response length per problem from its recent lengths, cut at the cap.

    Args:
        max_tokens: the response cap every request runs under (vLLM's max_tokens), or None.
        per_problem: recent lengths kept per problem.
    """

    def __init__(self, max_tokens: int | None = None, per_problem: int = LENGTHS_PER_PROBLEM) -> None:
        if per_problem < 1:
            raise ValueError(f"per_problem must be >= 1, got {per_problem}")
        self.max_tokens = max_tokens
        self._per_problem = per_problem
        self._lengths: dict[str, deque[int]] = {}
        self._pool: deque[int] = deque(maxlen=POOL_LENGTHS)

    def observe(self, problem_id: str, length: int) -> None:
        """A finished response: history for later requests, and a sibling for this epoch's queued ones."""
        lengths = self._lengths.get(problem_id)
        if lengths is None:
            lengths = self._lengths[problem_id] = deque(maxlen=self._per_problem)
        lengths.append(length)
        self._pool.append(length)

    def _expected(self, lengths: Sequence[int]) -> float:
        values = np.fromiter(lengths, np.float64, len(lengths))
        if self.max_tokens is not None:
            values = np.minimum(values, self.max_tokens)
        return float(values.mean())

    def predict(self, problem_ids: Sequence[str | None]) -> np.ndarray:
        """Expected length of a new request of each problem; problems without history get every problem's
        (the pool's), and with no history at all every request gets 0: a tie, so the submission order stands."""
        pool = self._expected(self._pool) if self._pool else 0.0
        cache: dict[str | None, float] = {}
        out = np.empty(len(problem_ids))
        for i, problem_id in enumerate(problem_ids):
            if problem_id not in cache:
                lengths = self._lengths.get(problem_id) if problem_id is not None else None
                cache[problem_id] = self._expected(lengths) if lengths else pool
            out[i] = cache[problem_id]
        return out

    def priorities(self, problem_ids: Sequence[str | None]) -> list[int]:
        """vLLM priorities (lower runs first): each request's rank by predicted length, longest first, ties in
        the given order."""
        order = np.argsort(-self.predict(problem_ids), kind="stable")
        ranks = np.empty(len(problem_ids), np.int64)
        ranks[order] = np.arange(len(problem_ids))
        return ranks.tolist()
