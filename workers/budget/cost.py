"""The verifier's cost model: step time as c_base + c_seq x active + c_tok x verified tokens, fitted online by
ridge least squares over a window of measured steps (`FittedCostModel`)."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from history_store.native.bundles import gather
from monitoring.metrics import COST_COEFFICIENTS, COST_MODEL_COEFFICIENT
from workers.budget.config import BudgetConfig
from workers.budget.state import CostState
from workers.errors import InvalidInput

# Fields of `FittedCostModel`'s int64 state: rows in the window, the next row to write, steps since the last fit,
# and whether the coefficients are pinned (`FittedCostModel.pin`: nothing is fitted then).
_C_COUNT, _C_NEXT, _C_SINCE, _C_PINNED = 0, 1, 2, 3


@njit(cache=True)
def _add_row(sums, row, sign):
    # sums[i, j] += sign x row[i] x row[j]: rows are (1, active, tokens, seconds), so sums[:, :3] is the Gram
    # matrix of the regressors and sums[:, 3] their products with the step times.
    for i in range(3):
        for j in range(4):
            sums[i, j] += sign * (row[i] * row[j])


@njit(cache=True)
def solve_augmented(a, m, x):
    """Solves the m x m system a[:m, :m] x = a[:m, m] into x[:m] by Gaussian elimination with partial
    pivoting (overwriting a)."""
    for c in range(m):
        p = c
        for r in range(c + 1, m):
            if abs(a[r, c]) > abs(a[p, c]):
                p = r
        if p != c:
            for j in range(m + 1):
                a[c, j], a[p, j] = a[p, j], a[c, j]
        for r in range(c + 1, m):
            f = a[r, c] / a[c, c]
            for j in range(c, m + 1):
                a[r, j] -= f * a[c, j]
    for r in range(m - 1, -1, -1):
        v = a[r, m]
        for j in range(r + 1, m):
            v -= a[r, j] * x[j]
        x[r] = v / a[r, r]


@njit(cache=True)
def _solve_nonnegative(sums, target, ridge, coef):
    """Ridge least squares toward `target` (per column, weighted by the column's scale) over the window whose
    sums are `sums`; a coefficient that comes out negative is pinned at zero and the others refitted."""
    a = np.empty((3, 3))
    rhs = np.empty(3)
    for i in range(3):
        # Per-column weights make the ridge independent of the columns' scales (tokens dwarf the intercept).
        lam = ridge * sums[i, i]
        for j in range(3):
            a[i, j] = sums[i, j]
        a[i, i] += lam
        rhs[i] = sums[i, 3] + lam * target[i]
    free = np.ones(3, np.bool_)
    idx = np.empty(3, np.int64)
    m_a = np.empty((3, 4))
    x = np.empty(3)
    while free.any():
        m = 0
        for i in range(3):
            if free[i]:
                idx[m] = i
                m += 1
        # The free columns' system, augmented with its right-hand side.
        for r in range(m):
            for c in range(m):
                m_a[r, c] = a[idx[r], idx[c]]
            m_a[r, m] = rhs[idx[r]]
        solve_augmented(m_a, m, x)
        coef[:] = 0.0
        for r in range(m):
            coef[idx[r]] = x[r]
        if (coef >= 0.0).all():
            break
        # Time never shrinks with more work: a coefficient that comes out negative is pinned at zero and the
        # others refitted without it (clamping alone would break the fit of the rest).
        for i in range(3):
            free[i] = free[i] and coef[i] > 0.0


@njit(cache=True, inline="always")
def _cost_observe(cost, active, tokens, seconds):
    """Adds a step to the window (ring buffer `ring`, its running sums `sums`) of `cost` (a CostState) and
    refits when due into its coefficients. Returns whether they changed."""
    ring, sums, state, prior, coef = cost.ring, cost.sums, cost.state, cost.prior, cost.coefficients
    min_fit_steps, refit_every = cost.min_fit_steps, cost.refit_every
    if state[_C_PINNED]:
        return False
    window = ring.shape[0]
    at = state[_C_NEXT]
    if state[_C_COUNT] == window:
        _add_row(sums, ring[at], -1.0)  # the oldest step leaves the window
    row = ring[at]
    row[0] = 1.0
    row[1] = active
    row[2] = tokens
    row[3] = seconds
    state[_C_NEXT] = (at + 1) % window
    state[_C_COUNT] = min(state[_C_COUNT] + 1, window)
    state[_C_SINCE] += 1
    if state[_C_NEXT] == 0:
        # Once per lap, sums from scratch: adding and subtracting step times leaves rounding that would pile up.
        sums[:] = 0.0
        for r in range(window):
            _add_row(sums, ring[r], 1.0)
    else:
        _add_row(sums, row, 1.0)
    refit = state[_C_SINCE] >= refit_every
    if state[_C_COUNT] >= min_fit_steps and not refit:
        return False
    # The ridge target decides the split along directions the window leaves free (a batch size that never
    # changed, drafts that never varied) while the data set the rest. Until the first fit it is the prior: it
    # says how a step's time splits, not how long it is, so it is scaled to the measured steps (sums[0] sums
    # each column). From then on it is the current fit (fits start once min_fit_steps are in the window): a
    # free direction keeps what earlier windows taught instead of sliding back to the prior's split, which is
    # deliberately pessimistic about drafting. Pulled back, c_tok stayed well above the truth whenever active
    # requests and verified tokens moved together (the cold epoch; drafts that stop varying), as
    # `test_cost_model_keeps_what_it_learned_when_drafting_stops_varying` shows.
    if state[_C_COUNT] > min_fit_steps:
        target = coef.copy()
    else:
        predicted = sums[0, 0] * prior[0] + sums[0, 1] * prior[1] + sums[0, 2] * prior[2]
        target = prior * (sums[0, 3] / max(predicted, 1e-12))
    if state[_C_COUNT] < min_fit_steps:
        coef[:] = target  # too few steps to fit: the prior's split at the measured scale
    else:
        _solve_nonnegative(sums, target, cost.ridge, coef)
        state[_C_SINCE] = 0
    return True


class FittedCostModel:
    """Verifier step time as c_base + c_seq x active + c_tok x tokens, fitted by ridge least squares.

    The window of measured steps is a ring buffer whose Gram matrix is kept up to date as steps enter and
    leave it, so a refit solves a 3x3 system instead of re-reading the window.
    """

    def __init__(self, config: BudgetConfig) -> None:
        prior = np.array([config.prior_c_base, config.prior_c_seq, config.prior_c_tok])
        # The fit's arrays never change identity, so the bundle is built once.
        ring, sums, state = np.zeros((config.cost_window, 4)), np.zeros((3, 4)), np.zeros(4, np.int64)
        self._fit = gather(
            CostState, config, ring=ring, sums=sums, state=state, prior=prior, coefficients=prior.copy()
        )
        self._gauges = [COST_MODEL_COEFFICIENT.labels(coefficient=name) for name in COST_COEFFICIENTS]
        self.coefficients = self._fit.coefficients  # refitted in place by `_cost_observe`
        self.publish()

    @property
    def steps(self) -> int:
        """Steps currently in the fitting window."""
        return int(self._fit.state[_C_COUNT])

    def observe(self, active: int, tokens: int, seconds: float) -> None:
        """Adds one measured step; refits every `refit_every` steps."""
        if active <= 0 or tokens < active or not math.isfinite(seconds) or seconds <= 0:
            raise InvalidInput(f"invalid step: active={active} tokens={tokens} seconds={seconds}")
        if _cost_observe(self.kernel_state(), int(active), int(tokens), float(seconds)):
            self.publish()

    def pin(self, coefficients: tuple[float, float, float]) -> None:
        """Fixes the coefficients (c_base, c_seq, c_tok) and stops fitting: a replay that must price steps as
        a recorded engine priced them (`das bench fidelity`) pins each step's."""
        self.coefficients[:] = coefficients
        self._fit.state[_C_PINNED] = 1

    def publish(self) -> None:
        """Hands the coefficients to their Prometheus gauges."""
        for gauge, value in zip(self._gauges, self.coefficients.tolist(), strict=True):
            gauge.set(value)

    def kernel_state(self) -> CostState:
        """The fit's arrays and settings, for `_cost_observe` here and for a caller that observes from its own
        kernel."""
        return self._fit

    def predict(self, active: int, tokens: int) -> float:
        """Predicted seconds of a step with `active` requests verifying `tokens` tokens in total."""
        c_base, c_seq, c_tok = self.coefficients
        return float(c_base + c_seq * active + c_tok * tokens)
