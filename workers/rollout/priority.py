"""The tail first: a request's predicted length before it starts, and the admission priority it earns.

A rollout step is larger than an engine's concurrency, so requests queue, and the request admitted last sets
the epoch's tail. Admitting the longest first (LPT scheduling) shortens the tail; what a request's length will
be is known only from evidence: its problem's recent lengths (the budget's `LengthModel`, which mixes them
with the shape of every problem's length spread), the cap (max_tokens) and the siblings of the same epoch that
already finished (`observe` them as they finish). Within a group, samples differ more than groups do, so the
prediction often says little; a predictor without measured skill must not reorder anything. Each prediction
made for a problem with history is scored against the length that arrives next (`observe`), and the order
follows the prediction only while their correlation clears its noise level; otherwise every request ties and
the submission order (FCFS) stands.

vLLM admits by `priority` under `scheduling_policy="priority"`, lower first: `priorities` hands out ranks,
0 for the longest predicted, ties in submission order, as verl numbers its rows 0..n-1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from workers.budget.policy import LengthModel

# (predicted, observed) pairs kept to measure the predictor's skill: a few epochs of a small RL step.
SKILL_WINDOW = 512
# Pairs needed before a correlation is trusted at all.
MIN_SKILL_PAIRS = 16
# The correlation must clear this many standard errors of a zero one (1/sqrt(pairs)).
SKILL_SIGMAS = 2.0


class LengthPredictor:
    """Expected response length per problem from history, capped, with a measured skill gate.

    Args:
        max_tokens: the response cap every request runs under (vLLM's max_tokens), or None.
        per_problem: recent lengths kept per problem (the budget's window: about three epochs of 16 samples).
    """

    def __init__(self, max_tokens: int | None = None, per_problem: int = 48) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.lengths = LengthModel(per_problem)
        self._pairs = np.zeros((SKILL_WINDOW, 2))
        self._seen = 0

    def _expected(self, row: int) -> float:
        """Mean of the row's quantiles under the cap: the expected length of its distribution."""
        q = self.lengths.quantiles[row]
        if self.max_tokens is not None:
            q = np.minimum(q, self.max_tokens)
        return float(q.mean())

    def _row(self, problem_id: str | None) -> int | None:
        """The problem's row in the length model if it has lengths, else None."""
        row = self.lengths._ids.get(problem_id) if problem_id is not None else None
        return row if row is not None and self.lengths.count[row] else None

    def observe(self, problem_id: str, length: int) -> None:
        """A finished response: history for later requests, a sibling for this epoch's queued ones, and a
        score of the prediction its problem had."""
        row = self._row(problem_id)
        if row is not None:
            self._pairs[self._seen % SKILL_WINDOW] = (self._expected(row), length)
            self._seen += 1
        self.lengths.observe(problem_id, length)

    def skill(self) -> float:
        """Correlation of the predictions with the lengths that followed (0 with too few pairs)."""
        pairs = self._pairs[: min(self._seen, SKILL_WINDOW)]
        if pairs.shape[0] < MIN_SKILL_PAIRS or pairs[:, 0].std() == 0 or pairs[:, 1].std() == 0:
            return 0.0
        return float(np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1])

    def skilled(self) -> bool:
        """True while the predictions beat noise: correlation above SKILL_SIGMAS / sqrt(pairs)."""
        pairs = min(self._seen, SKILL_WINDOW)
        return pairs >= MIN_SKILL_PAIRS and self.skill() > SKILL_SIGMAS / np.sqrt(pairs)

    def predict(self, problem_ids: Sequence[str | None]) -> np.ndarray:
        """Expected length of a new request of each problem; problems without history get every problem's
        (the length model's pool), and with no history at all every request gets 0."""
        pool = self._expected(0) if self.lengths.count[0] else 0.0
        out = np.full(len(problem_ids), pool)
        for i, problem_id in enumerate(problem_ids):
            row = self._row(problem_id)
            if row is not None:
                out[i] = self._expected(row)
        return out

    def keys(self, problem_ids: Sequence[str | None]) -> np.ndarray:
        """Admission keys, larger first: the predictions while they have skill, else all equal (FCFS)."""
        if not self.skilled():
            return np.zeros(len(problem_ids))
        return self.predict(problem_ids)

    def priorities(self, problem_ids: Sequence[str | None]) -> list[int]:
        """vLLM priorities (lower runs first): each request's rank by `keys`, ties in the given order."""
        order = np.argsort(-self.keys(problem_ids), kind="stable")
        ranks = np.empty(len(problem_ids), np.int64)
        ranks[order] = np.arange(len(problem_ids))
        return ranks.tolist()
