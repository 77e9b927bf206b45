"""Each problem's response length distribution (`LengthModel`), which the critical-path weights read."""

from __future__ import annotations

import numpy as np
from numba import njit

from history_store.native.bundles import gather
from history_store.native.dense_rows import DenseRows
from workers.budget.state import LengthState

# Fields of `LengthModel.stats`: ratios seen, responses past every predicted quantile, responses predicted.
_L_RATIOS, _L_BEYOND, _L_PREDICTED = 0, 1, 2


@njit(cache=True)
def _requantile(lengths, count, ratios, n_ratios, quantiles, row, pseudo_samples):
    """quantiles[row] from the row's recent lengths, mixed (n_ratios > 0) with its median times the shared
    length / median ratios, weighted as `pseudo_samples` samples."""
    own = lengths[row, : count[row]]
    n = own.shape[0]
    if n_ratios:
        alpha = pseudo_samples / (n + pseudo_samples)
        values = np.empty(n + n_ratios)
        weights = np.empty(n + n_ratios)
        median = np.median(own)
        for i in range(n):
            values[i] = own[i]
            weights[i] = (1 - alpha) * (1.0 / n)
        for i in range(n_ratios):
            values[n + i] = median * ratios[i]
            weights[n + i] = alpha / n_ratios
    else:
        values = own.copy()
        weights = np.full(n, 1.0 / n)
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    q = quantiles.shape[1]
    for j in range(q):
        level = (j + 0.5) / q * cumulative[-1]
        pick = min(np.searchsorted(cumulative, level), values.shape[0] - 1)
        quantiles[row, j] = values[order[pick]]


@njit(cache=True)
def _atypical(stats):
    """Share of responses unlike their problem's history, from a LengthModel's stats: those longer than every
    quantile predicted for them (a 1/(2Q) share would be typical), with a prior of one in ten."""
    return (stats[_L_BEYOND] + 1.0) / (stats[_L_PREDICTED] + 10.0)


@njit(cache=True)
def _observe_length(lengths, count, nxt, ratios, stats, quantiles, p, length, pseudo_samples):
    """Records a finished response of problem row p (and of the pool, row 0) and recomputes both rows'
    quantiles; counts whether it ran past every quantile predicted for it."""
    if count[p]:
        stats[_L_PREDICTED] += 1
        if length > quantiles[p, quantiles.shape[1] - 1]:
            stats[_L_BEYOND] += 1
        ratios[stats[_L_RATIOS] % ratios.shape[0]] = length / max(np.median(lengths[p, : count[p]]), 1.0)
        stats[_L_RATIOS] += 1
    width = lengths.shape[1]
    for row in (p, 0):
        lengths[row, nxt[row]] = length
        nxt[row] = (nxt[row] + 1) % width
        count[row] = min(count[row] + 1, width)
    n_ratios = min(stats[_L_RATIOS], ratios.shape[0])
    _requantile(lengths, count, ratios, n_ratios, quantiles, p, pseudo_samples)
    _requantile(lengths, count, ratios, 0, quantiles, 0, pseudo_samples)


class LengthModel:
    """Each problem's response length distribution, as `QUANTILES` equally likely lengths per problem.

    A problem's distribution mixes its recent lengths with, as if two more samples, its median times the
    length / median ratios seen across all problems: a handful of samples understates how far the tail can
    run, and problems vary alike relative to their own scale. Row 0 holds every problem's recent lengths, the
    distribution of a problem without history. Quantiles are recomputed when a length arrives (one kernel),
    so a decode step only gathers rows.
    """

    QUANTILES = 16
    # Weight of the shared shape in a problem's distribution, in samples.
    _PSEUDO_SAMPLES = 2.0
    # Length / problem-median ratios kept for that shape.
    _RATIOS = 64

    def __init__(self, per_problem: int) -> None:
        self._ids: dict[str, int] = {}
        # Per row (row 0: the pool, then one per problem); other per-problem arrays register here too.
        self.problem_rows = DenseRows()
        self.problem_rows.register(self, "_lengths", (per_problem,))
        self.problem_rows.register(self, "count", dtype=np.int64)  # lengths held per row
        self.problem_rows.register(self, "_next", dtype=np.int64)
        self.problem_rows.register(self, "quantiles", (self.QUANTILES,))
        self.problem_rows.reserve(1)
        self._ratios = np.zeros(self._RATIOS)
        # Ratios seen; responses that ran past every quantile their problem predicted, of those predicted.
        self.stats = np.zeros(3, np.int64)

    def problem(self, problem_id: str) -> int:
        """The problem's dense row (1, 2, ...), allocated on first sight."""
        p = self._ids.get(problem_id)
        if p is None:
            p = self._ids[problem_id] = len(self._ids) + 1
            self.problem_rows.reserve(p + 1)
        return p

    def kernel_state(self) -> LengthState:
        """The arrays a step reads (replaced when the model grows: ask again after `problem`)."""
        return gather(LengthState, self)

    def window(self, problem: int) -> np.ndarray:
        return self._lengths[problem, : self.count[problem]]

    def observe(self, problem_id: str, length: int) -> None:
        """Records a finished response of `problem_id`."""
        p = self.problem(problem_id)  # first: a new problem may grow the arrays passed below
        _observe_length(
            self._lengths,
            self.count,
            self._next,
            self._ratios,
            self.stats,
            self.quantiles,
            p,
            float(length),
            self._PSEUDO_SAMPLES,
        )

    def forget(self, problem_id: str) -> None:
        """Drops a problem's lengths (its history was evicted)."""
        p = self._ids.get(problem_id)
        if p is not None:
            self.count[p] = self._next[p] = 0
            self.quantiles[p] = 0.0

    def predict(self, problem_id: str | None) -> tuple[int, int] | None:
        """(p50, p90) of the problem's recent lengths, or None when it has none."""
        p = self._ids.get(problem_id) if problem_id is not None else None
        if p is None or not self.count[p]:
            return None
        p50, p90 = np.percentile(self.window(p), [50, 90], method="inverted_cdf")
        return int(p50), int(p90)
