"""Speculation budget: how many draft tokens each request sends to the verifier, from what each token is worth.

A step costs c_base + c_seq x active + c_tok x verified tokens (`CostModel`, fitted online from measured
steps). An epoch's makespan is then c_base x (steps of its last request) plus each request's own share,
c_seq + c_tok, for every step it runs, plus c_tok for every draft token verified. A request needs one step
fewer for each accepted draft token, so that token saves

    value_i = w_i x c_base + c_seq + c_tok    seconds,

where w_i is the probability that i is the last request of the batch to finish (`critical_weights`: from its
problem's recent lengths, conditioned on what it has already produced and on its recent tokens per step,
against every other live request). A tail request's tokens save whole steps of the epoch; a request that
finishes long before the tail saves only its own share (on a verifier where c_seq is small next to c_tok, as
on the CPU, nothing at all). Draft token j is kept while

    P(tokens 1..j accepted) x value_i >= c_tok,

with P from `AcceptanceModel`: an online logistic model of each token's acceptance given the previous one was
accepted, fitted on every verification outcome from the evidence the drafter gives (the tree's count ratio,
match length, source tree, position) and from what the verifier said lately (the request's and its problem's
recent acceptance). The tree's ratios alone are not acceptance probabilities: overconfident on diverse
rollouts, underconfident on thin history. Zero drafts is always allowed and is what thin evidence gets.

Per-request state lives in numpy arrays indexed by a dense slot (`start` hands one out), so a step has no
Python loop over requests. No vLLM import: the engine's proposer and the trace replay run this same code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from history_store.automaton.kernels import _slot
from monitoring.metrics import CLASS_PROMOTIONS, COST_COEFFICIENTS, COST_MODEL_COEFFICIENT, LENGTH_CLASSES
from workers.budget.state import AcceptanceState, CostState, Drafted, LengthState, PolicyBuffers, PolicyState

# Length classes, for dashboards: short = not worth drafting this step, long = likelier than average to be
# the batch's last request, medium = the rest.
SHORT, MEDIUM, LONG = 0, 1, 2
# Sources of a draft, in ProblemIndex.draft_batch's numbering (0: no draft).
SOURCE_PROBLEM, SOURCE_LIVE, SOURCE_GLOBAL = 1, 2, 3
# Features of a draft token (see `_features_of`).
N_FEATURES = 11
# Buckets of the drafted tokens' recent outcomes (`token_outcomes`): token ids hashed into a table that stays
# in cache (a vocabulary-sized one would be a cache miss per draft token); collisions only blur it.
TOKEN_BUCKETS = 4096


@dataclass(frozen=True)
class BudgetConfig:
    """Tunables of the policy. None is per model or per trace: costs and acceptance are fitted online."""

    # K: vLLM's num_speculative_tokens; no budget exceeds it (vLLM asserts accepted <= K).
    max_tokens: int = 8
    # Recent response lengths kept per problem: about three epochs of 16 samples, the history window.
    lengths_per_problem: int = 48
    # Cost model prior (seconds), used until enough steps are measured and as a weak ridge target. Only its
    # ratios matter before the fit, and it is deliberately pessimistic about drafting: a verified token costs
    # a fiftieth of a step (the CPU test model's order); GPU verifiers fit far cheaper tokens within steps.
    prior_c_base: float = 0.05
    prior_c_seq: float = 0.001
    prior_c_tok: float = 0.001
    # Steps kept for the fit: a few seconds of decoding, long enough to average noise, short enough to follow
    # load changes (other processes on the machine, batch size changes).
    cost_window: int = 256
    # Steps measured before the fit replaces the prior.
    min_fit_steps: int = 16
    # Steps between refits (a fit costs tens of microseconds; the window moves slowly).
    refit_every: int = 8
    # Ridge weight, relative to the data's scale; small: it only matters along directions the data leaves free.
    ridge: float = 1e-3
    # Acceptance model: per-step forgetting of its accumulated curvature (a few hundred steps of memory, so it
    # follows policy drift across epochs) and the ridge that keeps it defined along features never seen.
    acceptance_forgetting: float = 0.99
    acceptance_ridge: float = 1.0
    # Recent acceptance of a request decays by this factor per verified draft, of a problem per step.
    request_decay: float = 0.7
    problem_decay: float = 0.98
    # Recent acceptance of a drafted token (its bucket of `token_outcomes`) decays by this factor per trial.
    token_decay: float = 0.99
    # Decay of a request's running accepted tokens per step (its speed, for the tail probability).
    rate_decay: float = 0.8

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if min(self.prior_c_base, self.prior_c_seq, self.prior_c_tok) < 0:
            raise ValueError("cost model priors must be >= 0")
        if self.lengths_per_problem < 1 or self.cost_window < 3:
            raise ValueError("lengths_per_problem >= 1 and cost_window >= 3 are required")
        if self.min_fit_steps < 3 or self.refit_every < 1 or self.ridge <= 0 or self.acceptance_ridge <= 0:
            raise ValueError(
                "min_fit_steps >= 3, refit_every >= 1, ridge > 0 and acceptance_ridge > 0 are required"
            )
        for name in ("acceptance_forgetting", "request_decay", "problem_decay", "token_decay", "rate_decay"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")


# Fields of `CostModel`'s int64 state: rows in the window, the next row to write, steps since the last fit.
_C_COUNT, _C_NEXT, _C_SINCE = 0, 1, 2


@njit(cache=True)
def _add_row(sums, row, sign):
    # sums[i, j] += sign x row[i] x row[j]: rows are (1, active, tokens, seconds), so sums[:, :3] is the Gram
    # matrix of the regressors and sums[:, 3] their products with the step times.
    for i in range(3):
        for j in range(4):
            sums[i, j] += sign * (row[i] * row[j])


@njit(cache=True)
def _solve_augmented(a, m, x):
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
        _solve_augmented(m_a, m, x)
        coef[:] = 0.0
        for r in range(m):
            coef[idx[r]] = x[r]
        if (coef >= 0.0).all():
            break
        # Time never shrinks with more work: a coefficient that comes out negative is pinned at zero and the
        # others refitted without it (clamping alone would break the fit of the rest).
        for i in range(3):
            free[i] = free[i] and coef[i] > 0.0


@njit(cache=True)
def _cost_observe(cost, active, tokens, seconds):
    """Adds a step to the window (ring buffer `ring`, its running sums `sums`) of `cost` (a CostState) and
    refits when due into its coefficients. Returns whether they changed."""
    ring, sums, state, prior, coef = cost.ring, cost.sums, cost.state, cost.prior, cost.coefficients
    min_fit_steps, refit_every = cost.min_fit_steps, cost.refit_every
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


class CostModel:
    """Verifier step time as c_base + c_seq x active + c_tok x tokens, fitted by ridge least squares.

    The window of measured steps is a ring buffer whose Gram matrix is kept up to date as steps enter and
    leave it, so a refit solves a 3x3 system instead of re-reading the window.
    """

    def __init__(self, config: BudgetConfig) -> None:
        self._config = config
        self._prior = np.array([config.prior_c_base, config.prior_c_seq, config.prior_c_tok])
        self._ring = np.zeros((config.cost_window, 4))
        self._sums = np.zeros((3, 4))
        self._state = np.zeros(3, np.int64)
        self._gauges = [COST_MODEL_COEFFICIENT.labels(coefficient=name) for name in COST_COEFFICIENTS]
        self.coefficients = self._prior.copy()  # refitted in place by `_cost_observe`
        self.publish()

    @property
    def steps(self) -> int:
        """Steps currently in the fitting window."""
        return int(self._state[_C_COUNT])

    def observe(self, active: int, tokens: int, seconds: float) -> None:
        """Adds one measured step; refits every `refit_every` steps."""
        if active <= 0 or tokens < active or not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"invalid step: active={active} tokens={tokens} seconds={seconds}")
        if _cost_observe(self.kernel_state(), int(active), int(tokens), float(seconds)):
            self.publish()

    def publish(self) -> None:
        """Hands the coefficients to their Prometheus gauges."""
        for gauge, value in zip(self._gauges, self.coefficients.tolist(), strict=True):
            gauge.set(value)

    def kernel_state(self) -> CostState:
        """The fit's arrays and settings, for `_cost_observe` here and for a caller that observes from its own
        kernel."""
        config = self._config
        return CostState(
            ring=self._ring,
            sums=self._sums,
            state=self._state,
            prior=self._prior,
            coefficients=self.coefficients,
            min_fit_steps=config.min_fit_steps,
            refit_every=config.refit_every,
            ridge=config.ridge,
        )

    def predict(self, active: int, tokens: int) -> float:
        """Predicted seconds of a step with `active` requests verifying `tokens` tokens in total."""
        c_base, c_seq, c_tok = self.coefficients
        return float(c_base + c_seq * active + c_tok * tokens)


# ---------------------------------------------------------------------------------------------- kernels

# Rescaling step of `critical_weights`' running products (far from both ends of float64's range).
_TINY, _HUGE = 1e-280, 1e280


@njit(cache=True)
def _grid_bin(remaining, per_step, n_bins):
    """The bin of the shared grid that `remaining` steps fall in: n_bins over [0, horizon], per_step = n_bins /
    horizon (a multiplication per outcome instead of a division); horizon itself falls in the last."""
    return min(n_bins - 1, int(remaining * per_step))


@njit(cache=True)
def critical_weights(quantiles, pool, atypical, outputs, speeds, caps, n_bins, out, remaining, mass, below):
    """out[i] = P(row i is the last of the batch to finish), rows independent.

    Row i's total length is one of its problem's quantiles[i] (ascending, equally likely; all <= 0:
    unknown) with probability 1 - atypical, or one of every problem's (`pool`) with probability `atypical`
    (a request unlike its problem's history), conditioned on exceeding outputs[i]; remaining steps =
    remaining tokens / speed, where the speed is 1 or 2 x speeds[i] - 1 (tokens per step), equally likely:
    a request's recent speed says little about how many of its next drafts pass, and a sure speed would
    hand the whole tail to whichever of two nearly tied requests happens to lag by a token. Conditioning is
    what moves the tail: a request that outlived nearly all of its problem's lengths is left with the
    lengths of all problems that ran that long. Past every length it expects to run as long again as it
    has, at its recent speed (heavy tails: the longer it ran, the longer it runs). Unknown rows share one
    length: they tie, and ties split evenly.

    No length passes caps[i] (> 0: the most tokens row i may generate, its max_tokens; <= 0: no cap): the
    lengths past it pile up at it. RL rollouts often run into their cap, and then the tail is the capped
    request furthest behind, not the one whose lengths were extrapolated furthest.

    remaining and mass (at least n x 4q) and below (n x n_bins) are scratch, which the step keeps per batch
    size (`BudgetPolicy.step_buffers`): allocated here, they took half a megabyte a step at batch 256.
    """
    n, q = quantiles.shape
    if n == 1:  # the only row is the last: what the rest computes too (acc / acc), without its arrays
        out[0] = 1.0
        return
    used = np.zeros(n, np.int64)
    horizon = 1.0
    for i in range(n):
        if quantiles[i, q - 1] <= 0.0:
            continue
        k = 0
        total = 0.0
        slow = 1.0 / (2.0 * speeds[i] - 1.0)  # steps per token at the second speed
        for c in range(2 * q):
            length = quantiles[i, c] if c < q else pool[c - q]
            if caps[i] > 0.0:
                length = min(length, caps[i])
            if length > outputs[i]:
                for v in range(2):
                    remaining[i, k] = (length - outputs[i]) * (1.0 if v == 0 else slow)
                    mass[i, k] = 0.5 * ((1.0 - atypical) if c < q else atypical)
                    total += mass[i, k]
                    horizon = max(horizon, remaining[i, k])
                    k += 1
        if total <= 0.0:
            again = max(outputs[i], 1.0)
            if caps[i] > 0.0:
                again = max(min(again, caps[i] - outputs[i]), 1.0)
            remaining[i, 0] = again / speeds[i]
            horizon = max(horizon, remaining[i, 0])
            mass[i, 0] = total = 1.0
            k = 1
        norm = 1.0 / total
        for c in range(k):
            mass[i, c] *= norm
        used[i] = k
    # Each row's remaining steps as a histogram over a shared grid; the unknown sit in the last bin.
    # below[i, b] = P(row i ends in an earlier bin) + half of P(it ends in bin b). prod[b] is the product of
    # every row's below[., b] that is > 0 (zeros[b] counts the others), kept as prod[b] x TINY^scale[b] so
    # that hundreds of factors do not underflow: plain products, no logarithm per row and bin. A row's
    # below is 0 before its first likely outcome's bin (counted in zeros through starts) and 1 after its
    # last (up to rounding: a factor left out), so only the bins between are written and multiplied.
    per_step = n_bins / horizon
    pmf = np.zeros(n_bins)
    prod = np.ones(n_bins)
    scale = np.zeros(n_bins, np.int64)
    starts = np.zeros(n_bins, np.int64)  # rows whose first outcome falls in each bin
    for i in range(n):
        k = used[i]
        if k == 0:  # one outcome, in the last bin
            remaining[i, 0] = horizon
            mass[i, 0] = 1.0
            k = 1
        first = n_bins - 1
        last = 0
        for c in range(k):
            if mass[i, c] > 0.0:
                b = _grid_bin(remaining[i, c], per_step, n_bins)
                pmf[b] += mass[i, c]
                first = min(first, b)
                last = max(last, b)
        starts[first] += 1
        cum = 0.0
        for b in range(first, last + 1):
            v = cum + 0.5 * pmf[b]
            cum += pmf[b]
            pmf[b] = 0.0
            below[i, b] = v  # > 0: the first bin holds a likely outcome
            p = prod[b] * v
            if p < _TINY:
                p *= _HUGE
                scale[b] += 1
            prod[b] = p
    zeros = np.zeros(n_bins, np.int64)  # rows whose below is 0 in each bin: those that start later
    later = 0
    for b in range(n_bins - 1, -1, -1):
        zeros[b] = later
        later += starts[b]
    # P(i last) = sum over its outcomes of P(outcome) x prod_{j != i} P(j ends before), ties counted half.
    total = 0.0
    for i in range(n):
        acc = 0.0
        last_bin = -1
        share = 0.0
        for c in range(max(used[i], 1)):
            b = _grid_bin(remaining[i, c], per_step, n_bins)
            if mass[i, c] > 0.0 and zeros[b] == 0:
                if b != last_bin:  # outcomes in one bin share its product
                    last_bin = b
                    share = prod[b] / below[i, b]
                    for _ in range(scale[b]):
                        share *= _TINY
                acc += mass[i, c] * share
        out[i] = acc
        total += acc
    # The half-tie rule undercounts ties (n rows tied in one bin get 2^-(n-1) each instead of 1/n), and exactly
    # one row is last: normalise. An underflowed total (hundreds of tied rows) means they all tie.
    for i in range(n):
        out[i] = out[i] / total if total > 0.0 else 1.0 / n


@njit(cache=True)
def _budgets_kernel(slots, output_lens, headroom, policy, lengths, coefficients, buffers):
    """`BudgetPolicy.budgets` in one call: each row's critical weight, the value of one of its accepted tokens,
    its class and budget (into `buffers`, a PolicyBuffers). Marks the slots that just outlived their problem's
    lengths in `policy.outlived` and returns how many did. `lengths` is a LengthState, `coefficients` the cost
    model's."""
    slot_problem, accepted_rate, outlived, max_length = (
        policy.slot_problem,
        policy.accepted_rate,
        policy.outlived,
        policy.max_length,
    )
    length_count, quantile_table = lengths.count, lengths.quantiles
    weights, value, classes, budgets = buffers.weights, buffers.value, buffers.classes, buffers.budgets
    quantiles = buffers.tail_quantiles
    k = policy.max_tokens
    n = slots.shape[0]
    q = quantile_table.shape[1]
    outputs = np.empty(n)
    speeds = np.empty(n)
    caps = np.empty(n)
    rows = np.empty(n, np.int64)
    for i in range(n):
        s = slots[i]
        p = slot_problem[s]
        rows[i] = p if length_count[p] > 0 else 0  # problems without history take the pool's lengths
        for c in range(q):  # indexed: row views cost atomic reference counts
            quantiles[i, c] = quantile_table[rows[i], c]
        outputs[i] = output_lens[i]
        speeds[i] = 1.0 + accepted_rate[s]
        caps[i] = max_length[s]
    critical_weights(
        quantiles=quantiles,
        pool=quantile_table[0],
        atypical=_atypical(lengths.stats),
        outputs=outputs,
        speeds=speeds,
        caps=caps,
        n_bins=policy.n_bins,
        out=weights,
        remaining=buffers.tail_remaining,
        mass=buffers.tail_mass,
        below=buffers.tail_below,
    )
    c_base, c_seq, c_tok = coefficients[0], coefficients[1], coefficients[2]
    promoted = 0
    for i in range(n):
        s = slots[i]
        # Outliving nearly every length expected of one's problem is the old "promotion" of a length class.
        if rows[i] > 0 and outputs[i] > quantiles[i, q - 1] and not outlived[s]:
            outlived[s] = True
            promoted += 1
        # One accepted token is one step fewer for its request: its own share of that step always, and the
        # whole step when the request is the batch's last.
        value[i] = weights[i] * c_base + c_seq + c_tok
        if value[i] >= c_tok:
            # For dashboards: long = likelier than average to be the batch's last.
            classes[i] = LONG if weights[i] * n >= 1.0 else MEDIUM
            budgets[i] = min(max(headroom[i], 0), k)
        else:
            classes[i] = SHORT
            budgets[i] = 0
    return promoted


@njit(cache=True)
def _log_odds_gain(outcomes, row):
    # Log odds of the accepted against the predicted share of tried tokens, from the (accepted, predicted,
    # tried) sums in outcomes[row]; half a pseudo-token each side keeps it finite, and no trials give 0.
    accepted, predicted, tried = outcomes[row, 0] + 0.5, outcomes[row, 1] + 0.5, outcomes[row, 2] + 1.0
    return np.log(accepted / (tried - accepted)) - np.log(predicted / (tried - predicted))


@njit(cache=True)
def _features_of(drafted, i, j, previous, log_match, request_gain, problem_gain, token_gain, out, s):
    """Features of row i's draft token j, into out[s, j], for its acceptance given token j-1 was accepted:
    which tree drafted it (one intercept per source: what the verifier taught about one source says nothing
    about another, e.g. siblings of epoch 0 about the history of epoch 1), logit of the tree's conditional
    ratio p_j / p_(j-1), log match length, log position, how much better or worse than predicted the request's
    and the problem's recent drafts did (0 without trials, so a request or problem that stopped drafting is
    not held to its old failures forever), and the log of the occurrences behind the token (a ratio of 1/2
    from one sighting is weaker evidence than one from 100), and half the number of the other trees whose own
    likeliest path drafts the token too (`agreement`: the row's two counts of draft tokens they repeat), and
    how much better or worse than predicted the same token did when drafted before (`token_gain`: how freely
    the model picks a token varies with the token, which no tree's counts say).
    log_match is the row's log1p(match length) / 4. Every array is indexed by row rather than passed as a row
    view: a view costs two atomic reference counts, and this runs per draft token."""
    source, agreement = drafted.sources[i], drafted.agreement
    ratio = drafted.probs[i, j] / previous if previous > 0 else 0.0
    ratio = min(max(ratio, 0.02), 0.98)
    out[s, j, 0] = 1.0 if source == SOURCE_PROBLEM else 0.0
    out[s, j, 1] = 1.0 if source == SOURCE_LIVE else 0.0
    out[s, j, 2] = 1.0 if source == SOURCE_GLOBAL else 0.0
    out[s, j, 3] = np.log(ratio / (1.0 - ratio))
    out[s, j, 4] = log_match
    out[s, j, 5] = _LOG_POSITION[j] if j < _LOG_POSITION.shape[0] else np.log1p(j) / 2.0
    out[s, j, 6] = request_gain
    out[s, j, 7] = problem_gain
    out[s, j, 8] = np.log1p(drafted.support[i, j]) / 4.0
    out[s, j, 9] = ((agreement[i, 0] > j) + (agreement[i, 1] > j)) / 2.0
    out[s, j, 10] = token_gain


# log1p(j) / 2 for draft positions j: a table lookup instead of a logarithm per draft token.
_LOG_POSITION = np.log1p(np.arange(64)) / 2.0
# Pseudo-trials in each recalibration bin; fewer for the paths of tokens drafted past the match length,
# which are rarer (20 learned too slowly on rl_t1.0 at factor 4).
_RECALIBRATION_PRIOR = 20.0
_PATH_PRIOR = 5.0


@njit(cache=True)
def _bin(p, table):
    """The row of a recalibration table (equal-width bins over [0, 1]) that probability p falls in."""
    return min(int(p * table.shape[0]), table.shape[0] - 1)


@njit(cache=True)
def _recalibrated(p, table, prior, prior_mean):
    """A predicted probability p mapped through observed acceptance in p's bin (table[b] = accepted, tried),
    with `prior` pseudo-trials at `prior_mean`: the logistic model's conditional acceptance (prior at p: a
    logistic curve in these features is not exactly right at either end), or the path of tokens drafted past
    the match length (prior at p squared: such paths are accepted at about that rate or less, e.g. 0.18 at a
    raw path of 0.45 and 0.27 at 0.55 on templated_t0.7 at factor 4, `das bench replay`'s
    `past_match_raw_path`; a prior at p drafted past the match on every cold or forgotten bin, and that waste
    made more drafting freedom cost makespan)."""
    b = _bin(p, table)
    return (table[b, 0] + prior * prior_mean) / (table[b, 1] + prior)


@njit(cache=True)
def _truncate_kernel(drafted, slots, policy, acceptance, c_tok, buffers):
    """Per row of `drafted` (a Drafted): each draft token's path acceptance probability (buffers.predicted[i,
    j]) and the kept prefix (buffers.kept), the tokens whose probability times the row's value
    (buffers.value) pays for their verification (c_tok). Stores each slot's
    features, the model's conditional probabilities (model_p: the learning step reuses them) and kept length
    for learning, and decays the speed of rows that draft nothing.

    A token drafted past its match length (only with max_spec_factor above 1) shows its path probability
    through `path_recalibration` instead: what paths so predicted turned out to be. The product of conditionals
    overstated those paths, so drafting freedom beyond the match was paid for with waste (`--max-spec-factor 4`
    in the README's replay figures); the raw path (`path_p`) and where the row's past tokens
    start (`first_past`) are kept for the learning step. `policy` is the PolicyState, `acceptance` the
    AcceptanceState."""
    probs, lengths, match_lens, tokens = drafted.probs, drafted.lengths, drafted.match_lens, drafted.tokens
    slot_problem, request_outcomes, problem_outcomes = (
        policy.slot_problem,
        policy.request_outcomes,
        policy.problem_outcomes,
    )
    token_outcomes, drafted_bucket, features, kept_store = (
        policy.token_outcomes,
        policy.drafted_bucket,
        policy.features,
        policy.kept,
    )
    model_p, path_p, first_past, accepted_rate, rate_decay = (
        policy.model_p,
        policy.path_p,
        policy.first_past,
        policy.accepted_rate,
        policy.rate_decay,
    )
    weights, recalibration, path_recalibration = (
        acceptance.weights,
        acceptance.recalibration,
        acceptance.path_recalibration,
    )
    value, predicted, kept = buffers.value, buffers.predicted, buffers.kept
    n, k = predicted.shape
    f = weights.shape[0]
    for i in range(n):
        s = slots[i]
        if lengths[i] == 0:
            for j in range(k):
                predicted[i, j] = 0.0
            kept[i] = kept_store[s] = 0
            accepted_rate[s] *= rate_decay
            continue
        request_gain = _log_odds_gain(request_outcomes, s)
        problem_gain = _log_odds_gain(problem_outcomes, slot_problem[s])
        log_match = np.log1p(match_lens[i]) / 4.0
        path = 1.0
        previous = 1.0
        keep = 0
        shown = 1.0
        past = match_lens[i] if match_lens[i] > 0 else k
        first_past[s] = past
        for j in range(k):
            if j >= lengths[i]:
                predicted[i, j] = 0.0
                continue
            bucket = _slot(tokens[i, j], TOKEN_BUCKETS - 1)  # the arena's hash
            drafted_bucket[s, j] = bucket
            _features_of(
                drafted=drafted,
                i=i,
                j=j,
                previous=previous,
                log_match=log_match,
                request_gain=request_gain,
                problem_gain=problem_gain,
                token_gain=_log_odds_gain(token_outcomes, bucket),
                out=features,
                s=s,
            )
            previous = probs[i, j]
            z = 0.0
            for c in range(f):
                z += features[s, j, c] * weights[c]
            p = 1.0 / (1.0 + np.exp(-z))
            model_p[s, j] = p
            path *= _recalibrated(p, recalibration, _RECALIBRATION_PRIOR, p)
            path_p[s, j] = path
            # Never above the previous token's: the kept tokens stay a prefix.
            if j >= past:
                shown = min(shown, _recalibrated(path, path_recalibration, _PATH_PRIOR, path * path))
            else:
                shown = min(shown, path)
            predicted[i, j] = shown
            if shown * value[i] >= c_tok:
                keep = j + 1  # path probabilities never grow along a row: the kept tokens are a prefix
        kept[i] = keep
        kept_store[s] = keep
        if keep == 0:
            accepted_rate[s] *= rate_decay


@njit(cache=True)
def _observe_kernel(slots, accepted, policy, acceptance, step):
    """Learns from verified drafts: slots[i] had its first accepted[i] kept tokens accepted (`policy` is the
    PolicyState, `acceptance` the AcceptanceState, `step` the observe step's number). Token j is a trial
    of its conditional acceptance when tokens 0..j-1 were accepted (j <= accepted), a success when it was
    accepted too. Adds the log-likelihood gradient and curvature, and updates the slot's, its problem's and
    each tried token's (accepted, predicted, tried) sums and the slot's accepted tokens per step. Returns the
    trials."""
    kept_store, features, model_p, slot_problem = (
        policy.kept,
        policy.features,
        policy.model_p,
        policy.slot_problem,
    )
    request_outcomes, problem_outcomes, problem_stamp = (
        policy.request_outcomes,
        policy.problem_outcomes,
        policy.problem_stamp,
    )
    token_outcomes, drafted_bucket, path_p, first_past, accepted_rate = (
        policy.token_outcomes,
        policy.drafted_bucket,
        policy.path_p,
        policy.first_past,
        policy.accepted_rate,
    )
    request_decay, problem_decay, token_decay, rate_decay = (
        policy.request_decay,
        policy.problem_decay,
        policy.token_decay,
        policy.rate_decay,
    )
    recalibration, path_recalibration, gradient, curvature = (
        acceptance.recalibration,
        acceptance.path_recalibration,
        acceptance.gradient,
        acceptance.curvature,
    )
    f = features.shape[2]
    trials = 0
    outcome = np.zeros(3)
    for i in range(slots.shape[0]):
        s = slots[i]
        length = kept_store[s]
        if length == 0:
            continue  # nothing drafted, or the answer came after the slot was reused
        a = min(accepted[i], length)
        accepted_rate[s] = rate_decay * accepted_rate[s] + (1.0 - rate_decay) * a
        outcome[0] = outcome[1] = outcome[2] = 0.0
        for j in range(min(length, a + 1)):
            p = model_p[s, j]  # what truncate predicted: the weights change only after this kernel
            y = 1.0 if j < a else 0.0
            b = _bin(p, recalibration)
            recalibration[b, 0] += y
            recalibration[b, 1] += 1.0
            outcome[0] += y
            outcome[1] += p
            outcome[2] += 1.0
            t = drafted_bucket[s, j]
            token_outcomes[t, 0] = token_decay * token_outcomes[t, 0] + y
            token_outcomes[t, 1] = token_decay * token_outcomes[t, 1] + p
            token_outcomes[t, 2] = token_decay * token_outcomes[t, 2] + 1.0
            w = p * (1.0 - p)
            for c in range(f):  # features indexed, not through a row view (two atomic reference counts)
                x_c = features[s, j, c]
                gradient[c] += (y - p) * x_c
                for d in range(c + 1):
                    curvature[c, d] += w * x_c * features[s, j, d]
        for j in range(first_past[s], length):
            # Paths of tokens drafted past the match: was the whole path up to j accepted?
            b = _bin(path_p[s, j], path_recalibration)
            path_recalibration[b, 0] += 1.0 if j < a else 0.0
            path_recalibration[b, 1] += 1.0
        trials += int(outcome[2])
        for c in range(3):
            request_outcomes[s, c] = request_decay * request_outcomes[s, c] + outcome[c]
        problem = slot_problem[s]
        if problem_stamp[problem] != step:
            # Problems decay per step they are seen in, by the steps since they were last seen.
            problem_outcomes[problem] *= problem_decay ** (step - problem_stamp[problem])
            problem_stamp[problem] = step
        for c in range(3):
            problem_outcomes[problem, c] += outcome[c]
        kept_store[s] = 0
    for c in range(f):
        for d in range(c):
            curvature[d, c] = curvature[c, d]
    return trials


# Fields of `AcceptanceModel.state`: verified tokens learned from in all, and since the last Newton step.
_A_TRIALS, _A_PENDING = 0, 1


@njit(cache=True)
def _acceptance_added(acceptance, trials):
    """`trials` more verified tokens are in the AcceptanceState's gradient and curvature: once min_trials are
    pending, folds them into the forgetting curvature and takes a Newton step on its weights in place.
    Returns whether it stepped."""
    state, forgetting, accumulated, curvature, gradient = (
        acceptance.state,
        acceptance.forgetting,
        acceptance.accumulated,
        acceptance.curvature,
        acceptance.gradient,
    )
    recalibration, path_recalibration, weights = (
        acceptance.recalibration,
        acceptance.path_recalibration,
        acceptance.weights,
    )
    state[_A_TRIALS] += trials
    state[_A_PENDING] += trials
    if state[_A_PENDING] < acceptance.min_trials:
        return False
    f = weights.shape[0]
    a = np.empty((f, f + 1))
    for i in range(f):
        for j in range(f):
            accumulated[i, j] = forgetting * accumulated[i, j] + curvature[i, j]
            a[i, j] = accumulated[i, j]
        a[i, i] += acceptance.ridge
        a[i, f] = gradient[i]
    for r in range(recalibration.shape[0]):
        recalibration[r, 0] *= forgetting
        recalibration[r, 1] *= forgetting
        path_recalibration[r, 0] *= forgetting
        path_recalibration[r, 1] *= forgetting
    step = np.empty(f)
    _solve_augmented(a, f, step)  # symmetric positive definite: the ridge
    largest = 1.0
    for i in range(f):
        largest = max(largest, abs(step[i]))
    # Far from the optimum a Newton step on the logistic loss overshoots (the curvature of confident wrong
    # predictions is small): move at most one logit unit per feature per step; more data keeps coming.
    for i in range(f):
        weights[i] += step[i] / largest
        gradient[i] = 0.0
        for j in range(f):
            curvature[i, j] = 0.0
    state[_A_PENDING] = 0
    return True


class AcceptanceModel:
    """Online logistic regression of a draft token's acceptance given the previous token was accepted.

    Fitted by a Newton step per `MIN_TRIALS` verified tokens or more on an exponentially forgetting
    log-likelihood (recursive least squares for logistic regression), so it follows drift across epochs
    without a schedule. The policy's kernels add each verified batch's log-likelihood gradient and curvature
    to `gradient` and `curvature`; a small batch (batch size 1) waits for more before the step's solve.
    """

    MIN_TRIALS = 64

    def __init__(self, config: BudgetConfig) -> None:
        self.forgetting = config.acceptance_forgetting
        self.ridge = config.acceptance_ridge
        # Start near the tree's own ratio, slightly discounted: overconfident ratios were the rule on real
        # rollouts, and thin evidence should draft little until the verifier has spoken.
        self.weights = np.zeros(N_FEATURES)
        self.weights[:3], self.weights[3] = -0.5, 1.0
        # Agreeing trees: each one added 0.4-0.5 to a first token's log odds of acceptance at the same ratio on
        # dev_rollouts and rl_t1.0 (the feature counts half a tree per unit).
        self.weights[9] = 0.8
        # A token's own record: on dev_rollouts and rl_t1.0 (ad hoc, replayed drafts) adding 0.5-0.75 of its log
        # odds gain to the model's log odds took the Brier score from 0.188 to 0.177 and 0.194 to 0.179.
        self.weights[10] = 0.5
        self.accumulated = np.zeros((N_FEATURES, N_FEATURES))  # the forgetting sum of past curvatures
        self.gradient = np.zeros(N_FEATURES)
        self.curvature = np.zeros((N_FEATURES, N_FEATURES))
        self.state = np.zeros(2, np.int64)
        # Observed acceptance by bin of the model's prediction (accepted, tried), forgotten like the fit.
        self.recalibration = np.zeros((20, 2))
        # The same for whole paths of tokens drafted past their match length, by bin of predicted path.
        self.path_recalibration = np.zeros((20, 2))

    @property
    def trials(self) -> int:
        """Verified tokens learned from."""
        return int(self.state[_A_TRIALS])

    def kernel_state(self) -> AcceptanceState:
        """The model as its kernels take it (its arrays are shared, not copied)."""
        return AcceptanceState(
            weights=self.weights,
            recalibration=self.recalibration,
            path_recalibration=self.path_recalibration,
            gradient=self.gradient,
            curvature=self.curvature,
            accumulated=self.accumulated,
            state=self.state,
            min_trials=self.MIN_TRIALS,
            forgetting=self.forgetting,
            ridge=self.ridge,
        )

    def added(self, trials: int) -> None:
        """`trials` more verified tokens are in `gradient` and `curvature`: a Newton step once enough are."""
        _acceptance_added(self.kernel_state(), trials)


# ---------------------------------------------------------------------------------------------- the policy


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
        self._lengths = np.zeros((1, per_problem))
        self.count = np.zeros(1, np.int64)  # lengths held per row
        self._next = np.zeros(1, np.int64)
        self._ratios = np.zeros(self._RATIOS)
        self.quantiles = np.zeros((1, self.QUANTILES))
        # Ratios seen; responses that ran past every quantile their problem predicted, of those predicted.
        self.stats = np.zeros(3, np.int64)

    @property
    def capacity(self) -> int:
        """Rows allocated (problems + the pool); per-problem arrays elsewhere grow to match."""
        return self._lengths.shape[0]

    def problem(self, problem_id: str) -> int:
        """The problem's dense row (1, 2, ...), allocated on first sight."""
        p = self._ids.get(problem_id)
        if p is None:
            p = self._ids[problem_id] = len(self._ids) + 1
            if p >= self.capacity:
                grow = max(64, p)
                self._lengths = np.concatenate([self._lengths, np.zeros((grow, self._lengths.shape[1]))])
                self.count = np.concatenate([self.count, np.zeros(grow, np.int64)])
                self._next = np.concatenate([self._next, np.zeros(grow, np.int64)])
                self.quantiles = np.concatenate([self.quantiles, np.zeros((grow, self.QUANTILES))])
        return p

    def kernel_state(self) -> LengthState:
        """The arrays a step reads (replaced when the model grows: ask again after `problem`)."""
        return LengthState(count=self.count, quantiles=self.quantiles, stats=self.stats)

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


class _PolicyRows:
    """`PolicyBuffers` allocated for the largest batch seen and reused; the views of the last batch size are
    kept too (a view costs about as much as a small numpy operation)."""

    def __init__(self, k: int, quantiles: int, bins: int) -> None:
        self._widths = {"predicted": k, "tail_quantiles": quantiles, "tail_remaining": 4 * quantiles}
        self._widths.update(tail_mass=4 * quantiles, tail_below=bins)
        self._rows = 0
        self._arrays: PolicyBuffers | None = None
        self._n = -1
        self._views: PolicyBuffers | None = None

    def views(self, n: int) -> PolicyBuffers:
        """The buffers for n rows: valid until the next step."""
        if n == self._n and self._views is not None:
            return self._views
        if n > self._rows or self._arrays is None:
            self._rows = max(n, 2 * self._rows, 64)
            dtypes = {"classes": np.int64, "budgets": np.int32, "kept": np.int32}
            self._arrays = PolicyBuffers(
                *(
                    np.zeros(
                        (self._rows, self._widths[name]) if name in self._widths else self._rows,
                        dtypes.get(name, np.float64),
                    )
                    for name in PolicyBuffers._fields
                )
            )
        self._n = n
        self._views = PolicyBuffers(*(a[:n] for a in self._arrays))
        return self._views


class BudgetPolicy:
    """Per-step draft budgets for a decode batch. Not thread-safe: one instance per proposer.

    Requests are named by dense slots the caller chooses (the index's request slots): `start(slot, ...)`,
    `finish(slot)`. A step: `budgets(slots, ...)` before drafting, `truncate(...)` on the drafts, then, once
    the verifier has spoken, `observe_acceptance(slots, accepted)` for the drafted rows and
    `observe_step(active, tokens, seconds)`.
    """

    # Grid of the remaining-steps distributions in `critical_weights`.
    BINS = 32

    def __init__(self, config: BudgetConfig | None = None) -> None:
        self.config = config or BudgetConfig()
        k = self.config.max_tokens
        self.cost = CostModel(self.config)
        self.acceptance = AcceptanceModel(self.config)
        self.lengths = LengthModel(self.config.lengths_per_problem)
        # Recent (accepted, predicted, tried) tokens per problem row (row 0: requests without a problem).
        self.problem_outcomes = np.zeros((1, 3))
        self.problem_stamp = np.zeros(1, np.int64)  # the observe step that last decayed the row
        # Recent (accepted, predicted, tried) of drafted tokens, by bucket of token id (`_kernels._slot`).
        self.token_outcomes = np.zeros((TOKEN_BUCKETS, 3))
        self.observe_step_no = 0
        # Per slot: problem row, recent outcomes, accepted tokens per step, promotion, and the
        # features and kept length of its last draft (learned from when the verifier answers).
        self.slot_problem = np.zeros(0, np.int64)
        self.request_outcomes = np.zeros((0, 3))
        self.accepted_rate = np.zeros(0)
        self.outlived = np.zeros(0, bool)
        self.max_length = np.zeros(0)  # the most tokens the request may generate (0: no cap known)
        self.features = np.zeros((0, k, N_FEATURES))
        self.kept = np.zeros(0, np.int64)  # kept draft tokens awaiting the verifier's answer
        self.model_p = np.zeros((0, k))  # the acceptance model's conditional probabilities of those tokens
        self.path_p = np.zeros((0, k))  # their path probabilities before the past-match recalibration
        self.first_past = np.zeros(0, np.int64)  # the first of them drafted past the match length
        self.drafted_bucket = np.zeros((0, k), np.int64)  # their tokens' buckets of token_outcomes
        # The last budgets / truncate call.
        self._value = np.zeros(0)
        self._slots = np.zeros(0, np.int64)
        self._buffers = _PolicyRows(k, LengthModel.QUANTILES, self.BINS)
        self._promotions = CLASS_PROMOTIONS.labels(length_class=LENGTH_CLASSES[LONG])
        self.last_predicted = np.zeros((0, k))
        self.last_classes = np.zeros(0, np.int64)

    # ---- requests

    def start(self, slot: int, problem_id: str | None, max_length: int | None = None) -> None:
        """Registers a new request in `slot` (dense: the tables grow when one lands past their end).
        max_length: the most tokens it may generate (vLLM's max_tokens, within max_model_len), when known."""
        size = self.slot_problem.shape[0]
        if slot >= size:
            grown = max(2 * size, slot + 1, 64)
            for name in (
                "slot_problem",
                "request_outcomes",
                "accepted_rate",
                "outlived",
                "max_length",
                "features",
                "kept",
                "model_p",
                "path_p",
                "first_past",
                "drafted_bucket",
            ):
                old = getattr(self, name)
                new = np.zeros((grown, *old.shape[1:]), old.dtype)
                new[:size] = old
                setattr(self, name, new)
        # Problem row 0 (the pool) stands for requests without a problem.
        self.slot_problem[slot] = self.lengths.problem(problem_id) if problem_id is not None else 0
        grow = self.lengths.capacity - self.problem_outcomes.shape[0]
        if grow > 0:
            self.problem_outcomes = np.concatenate([self.problem_outcomes, np.zeros((grow, 3))])
            self.problem_stamp = np.concatenate(
                [self.problem_stamp, np.full(grow, self.observe_step_no, np.int64)]
            )
        self.request_outcomes[slot] = 0.0
        self.accepted_rate[slot] = 0.0
        self.outlived[slot] = False
        self.max_length[slot] = max(max_length or 0, 0)
        self.kept[slot] = 0

    def finish(self, slot: int) -> None:
        """Ends a request (its slot may be reused by `start`)."""
        self.kept[slot] = 0

    def kernel_state(self) -> PolicyState:
        """The per-slot and per-problem arrays and the settings, as the kernels take them (arrays shared, not
        copied; `start` may replace them, so ask again after it)."""
        config = self.config
        return PolicyState(
            slot_problem=self.slot_problem,
            request_outcomes=self.request_outcomes,
            accepted_rate=self.accepted_rate,
            outlived=self.outlived,
            max_length=self.max_length,
            features=self.features,
            kept=self.kept,
            model_p=self.model_p,
            path_p=self.path_p,
            first_past=self.first_past,
            drafted_bucket=self.drafted_bucket,
            problem_outcomes=self.problem_outcomes,
            problem_stamp=self.problem_stamp,
            token_outcomes=self.token_outcomes,
            n_bins=self.BINS,
            max_tokens=config.max_tokens,
            request_decay=config.request_decay,
            problem_decay=config.problem_decay,
            token_decay=config.token_decay,
            rate_decay=config.rate_decay,
        )

    # ---- the step

    def budgets(
        self, slots: np.ndarray, output_lens: np.ndarray, headroom: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Maximum draft tokens per row (0 where even a sure token would not pay, else min(K, headroom)) and
        each row's class (SHORT: no draft pays; LONG: likelier than average to finish last). Both are views of
        reused buffers: valid until the next step's `budgets`.

        Args:
            slots: the rows' slots (given to `start`).
            output_lens: tokens generated so far per row.
            headroom: most draft tokens each row may take (max_model_len - tokens - 1, and 0 for rows that
                must not draft, e.g. partial prefills); negative values count as 0.
        """
        slots = np.asarray(slots)
        buffers = self._buffers.views(slots.shape[0])
        promoted = _budgets_kernel(
            slots=slots,
            output_lens=np.asarray(output_lens),
            headroom=np.asarray(headroom),
            policy=self.kernel_state(),
            lengths=self.lengths.kernel_state(),
            coefficients=self.cost.coefficients,
            buffers=buffers,
        )
        self.count_promotions(promoted)
        self._value = buffers.value
        self._slots = slots
        self.last_classes = buffers.classes
        return buffers.budgets, buffers.classes

    def step_buffers(self, n: int) -> PolicyBuffers:
        """The per-row buffers for n rows, for a caller that runs the policy's kernels from its own (then
        `drafted` records what they computed)."""
        return self._buffers.views(n)

    def count_promotions(self, promoted: int) -> None:
        """Counts requests that just outlived their problem's lengths (`_budgets_kernel` returns how many)."""
        if promoted:
            self._promotions.inc(promoted)

    def drafted(
        self, slots: np.ndarray, value: np.ndarray, classes: np.ndarray, predicted: np.ndarray
    ) -> None:
        """Records a step a caller ran through the kernels itself, as `budgets` and `truncate` do."""
        self._value, self._slots, self.last_classes, self.last_predicted = value, slots, classes, predicted

    def truncate(
        self,
        lengths: np.ndarray,
        probs: np.ndarray,
        match_lens: np.ndarray,
        sources: np.ndarray,
        support: np.ndarray,
        agreement: np.ndarray,
        tokens: np.ndarray,
    ) -> np.ndarray:
        """Draft lengths after the pay-off rule, for the rows of the last `budgets` call (a view of a reused
        buffer, like `last_predicted`: valid until the next step's `truncate`).

        Args:
            lengths: tokens drafted per row (at most its budget).
            probs: the tree's path probabilities (n, K).
            match_lens: context suffix length the draft was matched on.
            sources: which tree drafted it (ProblemIndex.SOURCE_*).
            support: occurrences behind each draft token (n, K).
            agreement: (n, 2) draft tokens each other tree's likeliest path repeats (BatchDrafts.agreement).
            tokens: the drafted token ids (n, K).
        """
        slots = self._slots
        n = len(lengths)
        if n != slots.shape[0]:
            raise ValueError(f"truncate got {n} rows but the last budgets call had {slots.shape[0]}")
        buffers = self._buffers.views(n)
        # No dtype conversions: the kernel compiles for the index's own (float32 probabilities, int32 counts),
        # which widen to float64 exactly inside it.
        drafted = Drafted(
            tokens=np.asarray(tokens),
            probs=np.asarray(probs),
            support=np.asarray(support),
            lengths=np.asarray(lengths),
            match_lens=np.asarray(match_lens),
            sources=np.asarray(sources),
            agreement=np.asarray(agreement),
        )
        _truncate_kernel(
            drafted=drafted,
            slots=slots,
            policy=self.kernel_state(),
            acceptance=self.acceptance.kernel_state(),
            c_tok=float(self.cost.coefficients[2]),
            buffers=buffers._replace(value=self._value),
        )
        self.last_predicted = buffers.predicted
        return buffers.kept

    def observe_acceptance(self, slots: np.ndarray, accepted: np.ndarray) -> None:
        """Verification outcomes of the last `truncate`'s drafts: slots[i]'s first accepted[i] tokens passed.
        Drafted rows not listed (finished, preempted) teach nothing. Updates the acceptance model, the
        requests' and their problems' recent outcomes, and the requests' accepted tokens per step."""
        self.observe_step_no += 1
        trials = _observe_kernel(
            slots=np.asarray(slots),
            accepted=np.asarray(accepted),
            policy=self.kernel_state(),
            acceptance=self.acceptance.kernel_state(),
            step=self.observe_step_no,
        )
        if trials:
            self.acceptance.added(trials)

    def observe_step(self, active: int, tokens: int, seconds: float) -> None:
        """Feeds one measured verification step into the cost model."""
        self.cost.observe(active, tokens, seconds)

    def snapshot(self) -> dict:
        """Cost model, acceptance model and the classes of the last step, for statistics and tests."""
        counts = np.bincount(self.last_classes, minlength=3)
        return {
            "cost_model": dict(zip(COST_COEFFICIENTS, map(float, self.cost.coefficients), strict=True)),
            "cost_model_steps": self.cost.steps,
            "live_classes": dict(zip(LENGTH_CLASSES, map(int, counts), strict=True)),
            "acceptance_weights": [round(float(w), 4) for w in self.acceptance.weights],
            "acceptance_trials": int(self.acceptance.trials),
        }
