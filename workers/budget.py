"""Speculation budget: how many draft tokens each request sends to the verifier, from what each token is worth.

A step costs c_base + c_seq x active + c_tok x verified tokens (`CostModel`, fitted online from measured
steps). An epoch's makespan is then c_base x (steps of its last request) plus each request's own share,
c_seq + c_tok x (1 + drafted), for every step it runs. So one more accepted token of request i saves

    value_i = (w_i x c_base + c_seq + c_tok x (1 + L_i)) / (1 + A_i)    seconds,

where w_i is the probability that i is the last request of the batch to finish (`critical_weights`: from its
problem's recent lengths, conditioned on what it has already produced, against every other live request),
L_i and A_i its recent drafted and accepted tokens per step (one accepted token saves 1 / (1 + A_i) of its
steps). A tail request's tokens save whole steps of the epoch; a request that finishes long before the tail
saves only its own share. Draft token j is kept while

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

from collections import deque
from dataclasses import dataclass

import numpy as np
from numba import njit

from monitoring.metrics import CLASS_PROMOTIONS, COST_COEFFICIENTS, COST_MODEL_COEFFICIENT, LENGTH_CLASSES

# Length classes, for dashboards: short = not worth drafting this step, long = the tail's share of the step
# dominates the token's value, medium = the rest.
SHORT, MEDIUM, LONG = 0, 1, 2
# Sources of a draft, in ProblemIndex.draft_batch's numbering (0: no draft).
SOURCE_PROBLEM, SOURCE_LIVE, SOURCE_GLOBAL = 1, 2, 3
# Features of a draft token (see `token_features`).
N_FEATURES = 8


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
    # Ridge weight, relative to the data's scale; small: it only matters along directions the data leaves free.
    ridge: float = 1e-3
    # Acceptance model: per-step forgetting of its accumulated curvature (a few hundred steps of memory, so it
    # follows policy drift across epochs) and the ridge that keeps it defined along features never seen.
    acceptance_forgetting: float = 0.99
    acceptance_ridge: float = 1.0
    # Recent acceptance of a request decays by this factor per verified draft, of a problem per step.
    request_decay: float = 0.7
    problem_decay: float = 0.98
    # Decay of a request's running drafted / accepted tokens per step.
    rate_decay: float = 0.8

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if min(self.prior_c_base, self.prior_c_seq, self.prior_c_tok) < 0:
            raise ValueError("cost model priors must be >= 0")
        if self.lengths_per_problem < 1 or self.cost_window < 3:
            raise ValueError("lengths_per_problem >= 1 and cost_window >= 3 are required")
        if self.min_fit_steps < 3 or self.ridge <= 0 or self.acceptance_ridge <= 0:
            raise ValueError("min_fit_steps >= 3, ridge > 0 and acceptance_ridge > 0 are required")
        for name in ("acceptance_forgetting", "request_decay", "problem_decay", "rate_decay"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")


class CostModel:
    """Verifier step time as c_base + c_seq x active + c_tok x tokens, fitted by ridge least squares."""

    def __init__(self, config: BudgetConfig) -> None:
        self._config = config
        self._prior = np.array([config.prior_c_base, config.prior_c_seq, config.prior_c_tok])
        self._rows: deque[tuple[float, float, float, float]] = deque(maxlen=config.cost_window)
        self._since_fit = 0
        self.coefficients = self._prior.copy()
        self._publish()

    @property
    def steps(self) -> int:
        """Steps currently in the fitting window."""
        return len(self._rows)

    def observe(self, active: int, tokens: int, seconds: float) -> None:
        """Adds one measured step; refits every few steps (the fit costs ~50 us, a step tens of ms)."""
        if active <= 0 or tokens < active or not np.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"invalid step: active={active} tokens={tokens} seconds={seconds}")
        self._rows.append((1.0, float(active), float(tokens), float(seconds)))
        self._since_fit += 1
        if len(self._rows) < self._config.min_fit_steps:
            # Too few steps to fit: the prior's split at the measured scale.
            self.coefficients = self._scaled_prior(np.asarray(self._rows))
            self._publish()
        elif self._since_fit >= 4:
            self._fit()

    def _fit(self) -> None:
        data = np.asarray(self._rows)
        x, y = data[:, :3], data[:, 3]
        # The prior says how a step's time splits, not how long it is: scaled to the measured steps, it is the
        # ridge target, which decides the split along directions the data leave free (a batch size that never
        # changed, drafts that never varied) while the data set the overall scale.
        prior = self._scaled_prior(data)
        gram = x.T @ x
        # Per-column weights make the ridge independent of the columns' scales (tokens dwarf the intercept).
        lam = self._config.ridge * np.diag(np.diag(gram))
        rhs = x.T @ y + lam @ prior
        # Time never shrinks with more work: a coefficient that comes out negative is pinned at zero and the
        # others refitted without it (clamping alone would break the fit of the rest).
        free = np.ones(3, dtype=bool)
        coef = np.zeros(3)
        while free.any():
            a = (gram + lam)[np.ix_(free, free)]
            coef[:] = 0.0
            coef[free] = np.linalg.solve(a, rhs[free])
            if (coef >= 0).all():
                break
            free &= coef > 0
        self.coefficients = coef
        self._since_fit = 0
        self._publish()

    def _scaled_prior(self, data: np.ndarray) -> np.ndarray:
        return self._prior * (data[:, 3].sum() / max(float((data[:, :3] @ self._prior).sum()), 1e-12))

    def _publish(self) -> None:
        for name, value in zip(COST_COEFFICIENTS, self.coefficients, strict=True):
            COST_MODEL_COEFFICIENT.labels(coefficient=name).set(float(value))

    def predict(self, active: int, tokens: int) -> float:
        """Predicted seconds of a step with `active` requests verifying `tokens` tokens in total."""
        c_base, c_seq, c_tok = self.coefficients
        return float(c_base + c_seq * active + c_tok * tokens)


# ---------------------------------------------------------------------------------------------- kernels


@njit(cache=True)
def critical_weights(candidates, weights, outputs, speeds, n_bins, out):
    """out[i] = P(row i is the last of the batch to finish), rows independent.

    Row i's total length is candidates[i, c] with probability weights[i, c], conditioned on exceeding
    outputs[i]; remaining steps = remaining tokens / speeds[i]. A row that outlived every candidate expects to
    run as long again as it has (heavy tails: the longer it ran, the longer it runs). Rows without any
    candidate share one unknown length: they tie, and ties split evenly.
    """
    n, m = candidates.shape
    remaining = np.zeros((n, m + 1))
    mass = np.zeros((n, m + 1))
    used = np.zeros(n, np.int64)
    horizon = 1.0
    for i in range(n):
        o = outputs[i]
        k = 0
        total = 0.0
        seen = False
        for c in range(m):
            if weights[i, c] <= 0.0:
                continue
            seen = True
            if candidates[i, c] > o:
                remaining[i, k] = (candidates[i, c] - o) / speeds[i]
                mass[i, k] = weights[i, c]
                total += weights[i, c]
                k += 1
        if k == 0 and seen:
            remaining[i, 0] = max(o, 1.0) / speeds[i]
            mass[i, 0] = 1.0
            total = 1.0
            k = 1
        for c in range(k):
            mass[i, c] /= total
            horizon = max(horizon, remaining[i, c])
        used[i] = k
    cdf = np.zeros((n, n_bins))
    for i in range(n):
        if used[i] == 0:
            cdf[i, n_bins - 1] = 1.0  # unknown: everyone unknown ties in the last bin
            continue
        for c in range(used[i]):
            b = min(n_bins - 1, int(remaining[i, c] / horizon * n_bins))
            cdf[i, b] += mass[i, c]
        for b in range(1, n_bins):
            cdf[i, b] += cdf[i, b - 1]
    # P(i last) = sum_b P(i ends in bin b) x prod_{j != i} P(j ends before i), ties in a bin counted half.
    for i in range(n):
        out[i] = 0.0
    for b in range(n_bins):
        zeros = 0
        log_sum = 0.0
        for j in range(n):
            f = cdf[j, b] - 0.5 * (cdf[j, b] - (cdf[j, b - 1] if b > 0 else 0.0))
            if f <= 0.0:
                zeros += 1
            else:
                log_sum += np.log(f)
        for i in range(n):
            mass = cdf[i, b] - (cdf[i, b - 1] if b > 0 else 0.0)
            if mass <= 0.0:
                continue
            f = cdf[i, b] - 0.5 * mass
            if f <= 0.0:
                others = np.exp(log_sum) if zeros == 1 else 0.0
            else:
                others = np.exp(log_sum - np.log(f)) if zeros == 0 else 0.0
            out[i] += mass * others
    # The midpoint rule undercounts ties (n rows tied in one bin get 2^-(n-1) each instead of 1/n), and exactly
    # one row is last: normalise. An underflowed total (hundreds of tied rows) means they all tie.
    total = 0.0
    for i in range(n):
        total += out[i]
    for i in range(n):
        out[i] = out[i] / total if total > 0.0 else 1.0 / n


@njit(cache=True)
def token_features(probs, lengths, match_lens, sources, request_rate, problem_rate, out):
    """Features of draft token j of row i (out[i, j]) for its acceptance given token j-1 was accepted:
    bias, logit of the tree's conditional ratio p_j / p_(j-1), log match length, drafted by the problem's
    history tree, drafted by the global tree, log position, logits of the request's and the problem's
    recent conditional acceptance."""
    n, k = probs.shape
    for i in range(n):
        previous = 1.0
        for j in range(lengths[i]):
            ratio = probs[i, j] / previous if previous > 0 else 0.0
            previous = probs[i, j]
            ratio = min(max(ratio, 0.02), 0.98)
            out[i, j, 0] = 1.0
            out[i, j, 1] = np.log(ratio / (1.0 - ratio))
            out[i, j, 2] = np.log1p(match_lens[i]) / 4.0
            out[i, j, 3] = 1.0 if sources[i] == SOURCE_PROBLEM else 0.0
            out[i, j, 4] = 1.0 if sources[i] == SOURCE_GLOBAL else 0.0
            out[i, j, 5] = np.log1p(j) / 2.0
            out[i, j, 6] = np.log(request_rate[i] / (1.0 - request_rate[i]))
            out[i, j, 7] = np.log(problem_rate[i] / (1.0 - problem_rate[i]))


@njit(cache=True)
def path_probabilities(features, lengths, weights, out):
    """out[i, j] = P(tokens 0..j of row i all accepted) = product of the conditional acceptances."""
    n, k, f = features.shape
    for i in range(n):
        path = 1.0
        for j in range(k):
            if j >= lengths[i]:
                out[i, j] = 0.0
                continue
            z = 0.0
            for c in range(f):
                z += features[i, j, c] * weights[c]
            path *= 1.0 / (1.0 + np.exp(-z))
            out[i, j] = path


@njit(cache=True)
def acceptance_statistics(features, lengths, accepted, weights, gradient, curvature, hits, trials):
    """Adds the log-likelihood gradient and curvature of the verified draft tokens: token j of row i is a
    trial of its conditional acceptance when tokens 0..j-1 were accepted (j <= accepted[i]), a success when
    it was accepted too. Also counts hits and trials per row."""
    n, k, f = features.shape
    for i in range(n):
        hits[i] = 0.0
        trials[i] = 0.0
        for j in range(min(lengths[i], accepted[i] + 1)):
            z = 0.0
            for c in range(f):
                z += features[i, j, c] * weights[c]
            p = 1.0 / (1.0 + np.exp(-z))
            y = 1.0 if j < accepted[i] else 0.0
            hits[i] += y
            trials[i] += 1.0
            for a in range(f):
                gradient[a] += (y - p) * features[i, j, a]
                for b in range(f):
                    curvature[a, b] += p * (1.0 - p) * features[i, j, a] * features[i, j, b]


class AcceptanceModel:
    """Online logistic regression of a draft token's acceptance given the previous token was accepted.

    Fitted by one Newton step per verified batch on an exponentially forgetting log-likelihood (recursive
    least squares for logistic regression), so it follows drift across epochs without a schedule.
    """

    def __init__(self, config: BudgetConfig) -> None:
        self._forgetting = config.acceptance_forgetting
        self._ridge = config.acceptance_ridge * np.eye(N_FEATURES)
        # Start near the tree's own ratio, slightly discounted: overconfident ratios were the rule on real
        # rollouts, and thin evidence should draft little until the verifier has spoken.
        self.weights = np.zeros(N_FEATURES)
        self.weights[0], self.weights[1] = -0.5, 1.0
        self._curvature = np.zeros((N_FEATURES, N_FEATURES))
        self.trials = 0.0

    def predict(self, features: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Path acceptance probabilities (n, K): non-increasing along each row, zero past its length."""
        out = np.empty(features.shape[:2])
        path_probabilities(features, lengths, self.weights, out)
        return out

    def update(self, features: np.ndarray, lengths: np.ndarray, accepted: np.ndarray) -> np.ndarray:
        """Learns from one verified batch; returns (hits, trials) per row."""
        n = features.shape[0]
        gradient = np.zeros(N_FEATURES)
        curvature = np.zeros((N_FEATURES, N_FEATURES))
        hits, trials = np.zeros(n), np.zeros(n)
        acceptance_statistics(features, lengths, accepted, self.weights, gradient, curvature, hits, trials)
        self._curvature = self._forgetting * self._curvature + curvature
        step = np.linalg.solve(self._curvature + self._ridge, gradient)
        # Far from the optimum a Newton step on the logistic loss overshoots (the curvature of confident wrong
        # predictions is small): move at most one logit unit per feature per batch; more data keeps coming.
        self.weights = self.weights + step / max(1.0, float(np.abs(step).max()))
        self.trials += float(trials.sum())
        return np.stack([hits, trials])


# ---------------------------------------------------------------------------------------------- the policy


class BudgetPolicy:
    """Per-step draft budgets for a decode batch. Not thread-safe: one instance per proposer.

    A step: `budgets(slots, ...)` before drafting, `truncate(...)` on the drafts, then, once the verifier has
    spoken, `observe_acceptance(rows, accepted)` and `observe_step(active, tokens, seconds)`.
    """

    # Grid of the remaining-steps distributions in `critical_weights`.
    _BINS = 64
    # Weight of the shared shape in a problem's length distribution, in samples (see `budgets`).
    _PSEUDO_SAMPLES = 2.0
    # Length / problem-median ratios kept for that shape.
    _RATIOS = 64

    def __init__(self, config: BudgetConfig | None = None) -> None:
        self.config = config or BudgetConfig()
        self.cost = CostModel(self.config)
        self.acceptance = AcceptanceModel(self.config)
        m = self.config.lengths_per_problem
        # Problems: row 0 pools every problem's lengths (for problems without history yet).
        self._problem_of: dict[str, int] = {}
        self._lengths = np.zeros((1, m), np.float64)
        self._length_count = np.zeros(1, np.int64)
        self._length_next = np.zeros(1, np.int64)
        self._median = np.zeros(1)
        self._ratios = np.zeros(self._RATIOS)
        self._ratio_count = 0
        self._problem_hits = np.zeros(1)
        self._problem_trials = np.zeros(1)
        # Requests, by slot.
        self._free: list[int] = []
        self._slot_problem = np.zeros(0, np.int64)
        self._request_hits = np.zeros(0)
        self._request_trials = np.zeros(0)
        self._drafted_rate = np.zeros(0)
        self._accepted_rate = np.zeros(0)
        self._outlived = np.zeros(0, bool)
        self._base_rate = 0.5  # recent conditional acceptance of all drafts, the prior of the rates
        # The last budgets / truncate call, for truncation and learning.
        self._value = np.zeros(0)
        self._slots = np.zeros(0, np.int64)
        self._features = np.zeros((0, self.config.max_tokens, N_FEATURES))
        self._kept = np.zeros(0, np.int32)
        self.last_predicted = np.zeros((0, self.config.max_tokens))
        self.last_classes = np.zeros(0, np.int64)

    # ---- problems and requests

    def _problem(self, problem_id: str) -> int:
        p = self._problem_of.get(problem_id)
        if p is None:
            p = self._problem_of[problem_id] = len(self._problem_of) + 1
            if p >= self._lengths.shape[0]:
                grow = max(64, p)
                self._lengths = np.concatenate([self._lengths, np.zeros((grow, self._lengths.shape[1]))])
                for name in ("_length_count", "_length_next"):
                    setattr(self, name, np.concatenate([getattr(self, name), np.zeros(grow, np.int64)]))
                for name in ("_problem_hits", "_problem_trials", "_median"):
                    setattr(self, name, np.concatenate([getattr(self, name), np.zeros(grow)]))
        return p

    def observe_length(self, problem_id: str, length: int) -> None:
        """Records a finished response of `problem_id` (history or a sibling that just ended)."""
        problem = self._problem(problem_id)
        if self._length_count[problem]:
            self._ratios[self._ratio_count % self._RATIOS] = length / max(self._median[problem], 1.0)
            self._ratio_count += 1
        for p in (problem, 0):
            self._lengths[p, self._length_next[p]] = length
            self._length_next[p] = (self._length_next[p] + 1) % self._lengths.shape[1]
            self._length_count[p] = min(self._length_count[p] + 1, self._lengths.shape[1])
            self._median[p] = np.median(self._lengths[p, : self._length_count[p]])

    def forget_problem(self, problem_id: str) -> None:
        """Drops a problem's lengths (its history was evicted)."""
        p = self._problem_of.get(problem_id)
        if p is not None:
            self._length_count[p] = self._length_next[p] = 0

    def predicted_length(self, problem_id: str | None) -> tuple[int, int] | None:
        """(p50, p90) of the problem's recent lengths, or None when it has none."""
        p = self._problem_of.get(problem_id) if problem_id is not None else None
        if p is None or not self._length_count[p]:
            return None
        window = self._lengths[p, : self._length_count[p]]
        p50, p90 = np.percentile(window, [50, 90], method="inverted_cdf")
        return int(p50), int(p90)

    def start(self, problem_id: str | None) -> int:
        """Registers a new request; returns its slot, which names it in every later call."""
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._slot_problem.shape[0]
            grow = max(64, slot)
            self._slot_problem = np.concatenate([self._slot_problem, np.zeros(grow, np.int64)])
            for name in ("_request_hits", "_request_trials", "_drafted_rate", "_accepted_rate"):
                setattr(self, name, np.concatenate([getattr(self, name), np.zeros(grow)]))
            self._outlived = np.concatenate([self._outlived, np.zeros(grow, bool)])
            self._free.extend(range(slot + grow - 1, slot, -1))
        # Problem row 0 (the pool) stands for requests without a problem.
        self._slot_problem[slot] = self._problem(problem_id) if problem_id is not None else 0
        self._request_hits[slot] = self._request_trials[slot] = 0.0
        self._drafted_rate[slot] = self._accepted_rate[slot] = 0.0
        self._outlived[slot] = False
        return slot

    def finish(self, slot: int) -> None:
        """Frees a request's slot."""
        self._free.append(slot)

    # ---- the step

    def budgets(self, slots: np.ndarray, output_lens: np.ndarray, headroom: np.ndarray) -> np.ndarray:
        """Maximum draft tokens per row: 0 where even a sure token would not pay, else min(K, headroom).

        Args:
            slots: the rows' slots (from `start`).
            output_lens: tokens generated so far per row.
            headroom: most draft tokens each row may take (max_model_len - tokens - 1, and 0 for rows that
                must not draft, e.g. partial prefills); negative values count as 0.
        """
        slots = np.asarray(slots, np.int64)
        c_base, c_seq, c_tok = self.cost.coefficients
        problems = self._slot_problem[slots]
        count = self._length_count[problems]
        n, m = slots.shape[0], self._lengths.shape[1]
        # A problem's length distribution: its few recent lengths, plus (as if two more samples) its median
        # times the length / median ratios seen across problems: a handful of samples understates how far
        # the tail can run, and problems vary alike relative to their own scale. A cold problem takes every
        # problem's recent lengths.
        cold = count == 0
        n_ratios = min(self._ratio_count, self._RATIOS)
        shared = np.where(cold | (n_ratios == 0), 0.0, self._PSEUDO_SAMPLES / (count + self._PSEUDO_SAMPLES))
        column = np.arange(m)[None, :]
        own = np.where(column < count[:, None], ((1.0 - shared) / np.maximum(count, 1))[:, None], 0.0)
        ratio_mix = np.broadcast_to((shared / max(n_ratios, 1))[:, None], (n, self._RATIOS)) * (
            np.arange(self._RATIOS)[None, :] < n_ratios
        )
        pool = np.where(
            cold[:, None] & (column < self._length_count[0]), 1.0 / max(self._length_count[0], 1), 0.0
        )
        candidates = np.concatenate(
            [
                self._lengths[problems],
                self._median[problems][:, None] * self._ratios[None, :],
                np.broadcast_to(self._lengths[0], (n, m)),
            ],
            axis=1,
        )
        mix = np.concatenate([own, ratio_mix, pool], axis=1)
        weights = np.empty(n)
        outputs = np.asarray(output_lens, np.float64)
        critical_weights(candidates, mix, outputs, 1.0 + self._accepted_rate[slots], self._BINS, weights)
        # Outliving every recent length of one's problem is the old "promotion" of a length class.
        known = count > 0
        outlived = known & (outputs > self._lengths[problems].max(axis=1)) & ~self._outlived[slots]
        if outlived.any():
            self._outlived[slots[outlived]] = True
            CLASS_PROMOTIONS.labels(length_class=LENGTH_CLASSES[LONG]).inc(int(outlived.sum()))
        tail = weights * c_base
        own = c_seq + c_tok * (1.0 + self._drafted_rate[slots])
        self._value = (tail + own) / (1.0 + self._accepted_rate[slots])
        self._slots = slots
        pays = self._value >= c_tok
        self.last_classes = np.where(~pays, SHORT, np.where(tail >= own, LONG, MEDIUM))
        k = self.config.max_tokens
        return np.where(pays, np.clip(np.asarray(headroom, np.int64), 0, k), 0).astype(np.int32)

    def truncate(
        self, lengths: np.ndarray, probs: np.ndarray, match_lens: np.ndarray, sources: np.ndarray
    ) -> np.ndarray:
        """Draft lengths after the pay-off rule, for the rows of the last `budgets` call.

        Args:
            lengths: tokens drafted per row (at most its budget).
            probs: the tree's path probabilities (n, K).
            match_lens: context suffix length the draft was matched on.
            sources: which tree drafted it (ProblemIndex.SOURCE_*).
        """
        lengths = np.asarray(lengths, np.int32)
        n, k = lengths.shape[0], self.config.max_tokens
        if n != self._slots.shape[0]:
            raise ValueError(f"truncate got {n} rows but the last budgets call had {self._slots.shape[0]}")
        features = np.zeros((n, k, N_FEATURES))
        token_features(
            np.asarray(probs, np.float64)[:, :k],
            lengths,
            np.asarray(match_lens, np.float64),
            np.asarray(sources, np.int64),
            self._rate(self._request_hits[self._slots], self._request_trials[self._slots], 2.0),
            self._rate(
                self._problem_hits[self._slot_problem[self._slots]],
                self._problem_trials[self._slot_problem[self._slots]],
                8.0,
            ),
            features,
        )
        predicted = self.acceptance.predict(features, lengths)
        # Path probabilities are non-increasing along a row, so the tokens that pay are a prefix.
        kept = (predicted * self._value[:, None] >= self.cost.coefficients[2]).sum(axis=1).astype(np.int32)
        kept = np.minimum(kept, lengths)
        self._features, self._kept = features, kept
        self.last_predicted = predicted
        return kept

    def _rate(self, hits: np.ndarray, trials: np.ndarray, prior: float) -> np.ndarray:
        rate = (hits + prior * self._base_rate) / (trials + prior)
        return np.clip(rate, 0.02, 0.98)

    def observe_acceptance(self, rows: np.ndarray, accepted: np.ndarray) -> None:
        """Verification outcomes of the last `truncate`: row rows[i] had its first accepted[i] tokens accepted.
        Rows not listed (finished, or preempted) teach nothing. Updates the acceptance model, the rows' and
        their problems' recent acceptance, and the rows' drafted / accepted tokens per step."""
        rows = np.asarray(rows, np.int64)
        accepted = np.minimum(np.asarray(accepted, np.int64), self._kept[rows])
        slots = self._slots[rows]
        kept = self._kept[rows]
        decay = self.config.rate_decay
        self._drafted_rate[slots] = decay * self._drafted_rate[slots] + (1 - decay) * kept
        self._accepted_rate[slots] = decay * self._accepted_rate[slots] + (1 - decay) * accepted
        drafted = kept > 0
        if not drafted.any():
            return
        rows, slots, kept, accepted = rows[drafted], slots[drafted], kept[drafted], accepted[drafted]
        hits, trials = self.acceptance.update(self._features[rows], kept, accepted)
        d = self.config.request_decay
        self._request_hits[slots] = d * self._request_hits[slots] + hits
        self._request_trials[slots] = d * self._request_trials[slots] + trials
        self._problem_hits *= self.config.problem_decay
        self._problem_trials *= self.config.problem_decay
        problems = self._slot_problem[slots]
        np.add.at(self._problem_hits, problems, hits)
        np.add.at(self._problem_trials, problems, trials)
        step_rate = hits.sum() / trials.sum()
        self._base_rate = 0.95 * self._base_rate + 0.05 * step_rate

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
