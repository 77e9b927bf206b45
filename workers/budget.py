"""Length-aware speculation budget: how many draft tokens each request may send to the verifier this step.

Three parts, each fitted online from what the engine observes:
- a length class per request (short / medium / long) from its problem's recent response lengths, relative to
  the longest prediction in the live batch (the epoch's makespan horizon), promoted when the request outlives
  its prediction. Short requests finish before the tail anyway: they get no draft tokens (DAS).
- a verifier cost model, step seconds = c_base + c_seq x active requests + c_tok x tokens verified, fitted by
  ridge least squares over recent measured steps (ridge toward the prior keeps it defined while the batch size
  does not vary).
- an acceptance calibrator: the tree's path probabilities are count ratios, overconfident on real rollouts (and
  underconfident on thin history), so they are mapped to observed acceptance per (length class, bin of the
  tree's per-token ratio), pooled over draft positions.

The rule: a draft token is kept while its calibrated acceptance probability times the value of saving one step
of its request pays for verifying it (c_tok). A budget of zero is always allowed. No vLLM import: the policy is
tested on its own and reused by the replay.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from monitoring.metrics import CLASS_PROMOTIONS, COST_COEFFICIENTS, COST_MODEL_COEFFICIENT, LENGTH_CLASSES

SHORT, MEDIUM, LONG = 0, 1, 2


@dataclass(frozen=True)
class BudgetConfig:
    """Tunables of the policy. Validated once; the defaults are what the CPU engine tests and benchmarks use."""

    # K: vLLM's num_speculative_tokens; no budget exceeds it (vLLM asserts accepted <= K).
    max_tokens: int = 8
    # A request is short when its predicted length is below this fraction of the batch horizon (the longest
    # prediction among live requests): it ends well before the tail, so drafting for it cannot shorten the epoch.
    short_fraction: float = 0.25
    # At or above this fraction of the horizon a request is on the tail: it gets the full budget.
    long_fraction: float = 0.6
    # Budget cap of medium requests as a fraction of K (DAS gives the tail the aggressive budgets).
    medium_cap_fraction: float = 0.5
    # Recent response lengths kept per problem: about three epochs of 16 samples, the history window.
    lengths_per_problem: int = 48
    # Cost model prior (seconds), used until enough steps are measured and as the ridge target: the CPU test
    # model (SmolLM2-135M fp32 on two cores) verifies a token in about a millisecond on top of a ~60 ms step.
    prior_c_base: float = 0.06
    prior_c_seq: float = 0.004
    prior_c_tok: float = 0.001
    # Steps kept for the fit: a few seconds of decoding, long enough to average noise, short enough to follow
    # load changes (other processes on the machine, batch size changes).
    cost_window: int = 256
    # Steps measured before the fit replaces the prior.
    min_fit_steps: int = 16
    # Ridge weight, relative to the data's scale; small: it only matters along directions the data leaves free.
    ridge: float = 1e-3
    # Pseudo-observations at the tree's raw probability in each calibration cell: few enough that observed
    # acceptance takes over after a few dozen drafts, enough that one rejection does not zero a cell.
    calibration_prior: float = 8.0
    # Probability bins of the calibrator (raw path probability in [0, 1]).
    probability_bins: int = 10

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.short_fraction <= self.long_fraction <= 1.0:
            raise ValueError(
                f"need 0 <= short_fraction <= long_fraction <= 1, got {self.short_fraction}, {self.long_fraction}"
            )
        if not 0.0 <= self.medium_cap_fraction <= 1.0:
            raise ValueError(f"medium_cap_fraction must be in [0, 1], got {self.medium_cap_fraction}")
        if min(self.prior_c_base, self.prior_c_seq, self.prior_c_tok) < 0:
            raise ValueError("cost model priors must be >= 0")
        if self.lengths_per_problem < 1 or self.cost_window < 3 or self.probability_bins < 1:
            raise ValueError(
                "lengths_per_problem >= 1, cost_window >= 3 and probability_bins >= 1 are required"
            )
        if self.min_fit_steps < 3 or self.calibration_prior <= 0 or self.ridge <= 0:
            raise ValueError("min_fit_steps >= 3, calibration_prior > 0 and ridge > 0 are required")


class LengthTracker:
    """Recent response lengths per problem; predicts a new request's length from its problem's window."""

    def __init__(self, per_problem: int) -> None:
        self._per_problem = per_problem
        self._lengths: dict[str, deque[int]] = {}

    def observe(self, problem_id: str, length: int) -> None:
        """Records one finished response of `problem_id` with `length` tokens."""
        window = self._lengths.get(problem_id)
        if window is None:
            window = self._lengths[problem_id] = deque(maxlen=self._per_problem)
        window.append(int(length))

    def forget(self, problem_id: str) -> None:
        """Drops a problem's lengths (its history was evicted)."""
        self._lengths.pop(problem_id, None)

    def predict(self, problem_id: str | None) -> tuple[int, int] | None:
        """(p50, p90) of the problem's recent lengths, or None when it has no history."""
        window = self._lengths.get(problem_id) if problem_id is not None else None
        if not window:
            return None
        p50, p90 = np.percentile(np.fromiter(window, dtype=np.int64), [50, 90], method="inverted_cdf")
        return int(p50), int(p90)


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
        if len(self._rows) >= self._config.min_fit_steps and self._since_fit >= 4:
            self._fit()

    def _fit(self) -> None:
        data = np.asarray(self._rows)
        x, y = data[:, :3], data[:, 3]
        gram = x.T @ x
        # Per-column weights make the ridge independent of the columns' scales (tokens dwarf the intercept).
        lam = self._config.ridge * np.diag(np.diag(gram))
        rhs = x.T @ y + lam @ self._prior
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

    def _publish(self) -> None:
        for name, value in zip(COST_COEFFICIENTS, self.coefficients, strict=True):
            COST_MODEL_COEFFICIENT.labels(coefficient=name).set(float(value))

    def predict(self, active: int, tokens: int) -> float:
        """Predicted seconds of a step with `active` requests verifying `tokens` tokens in total."""
        c_base, c_seq, c_tok = self.coefficients
        return float(c_base + c_seq * active + c_tok * tokens)


class AcceptanceCalibrator:
    """Maps the tree's probabilities to observed acceptance.

    The tree gives a path probability per draft position; its step ratio p_j / p_(j-1) is the tree's estimate
    that token j is accepted once token j-1 was. The calibrator learns the real conditional acceptance per
    (length class, bin of that ratio), pooled over positions: a deep position then borrows what shallow ones
    taught (a per-position table never learns positions the rule has not yet dared to draft), and the
    calibrated path probability is the running product of the calibrated conditionals.
    """

    def __init__(self, config: BudgetConfig) -> None:
        self._bins = config.probability_bins
        self._prior = config.calibration_prior
        self._trials = np.zeros((len(LENGTH_CLASSES), self._bins))
        self._accepted = np.zeros((len(LENGTH_CLASSES), self._bins))

    def _conditionals(self, probs: np.ndarray, classes: np.ndarray) -> tuple[np.ndarray, ...]:
        probs = np.clip(np.asarray(probs, dtype=np.float64), 0.0, 1.0)
        previous = np.concatenate([np.ones((probs.shape[0], 1)), probs[:, :-1]], axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(previous > 0, np.clip(probs / previous, 0.0, 1.0), 0.0)
        bins = np.clip((ratio * self._bins).astype(np.int64), 0, self._bins - 1)
        return ratio, np.broadcast_to(np.asarray(classes)[:, None], probs.shape), bins

    def calibrate(self, probs: np.ndarray, classes: np.ndarray) -> np.ndarray:
        """Calibrated acceptance probability of every draft position (path probabilities: non-increasing
        along each row, since a token is accepted only if every earlier one is)."""
        ratio, cls, bins = self._conditionals(probs, classes)
        conditional = (self._accepted[cls, bins] + self._prior * ratio) / (
            self._trials[cls, bins] + self._prior
        )
        return np.cumprod(conditional, axis=1)

    def observe(
        self, probs: np.ndarray, lengths: np.ndarray, classes: np.ndarray, accepted: np.ndarray
    ) -> None:
        """Records verification outcomes: row i drafted `lengths[i]` tokens, the first `accepted[i]` passed.
        Token j is a trial of its conditional when every earlier token passed (j <= accepted)."""
        _, cls, bins = self._conditionals(probs, classes)
        pos = np.arange(cls.shape[1])[None, :]
        tried = (pos < np.asarray(lengths)[:, None]) & (pos <= np.asarray(accepted)[:, None])
        hit = tried & (pos < np.asarray(accepted)[:, None])
        np.add.at(self._trials, (cls[tried], bins[tried]), 1.0)
        np.add.at(self._accepted, (cls[hit], bins[hit]), 1.0)

    def table(self) -> list[list[float]]:
        """Observed conditional acceptance per (class, ratio bin) (NaN where nothing was tried)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = np.where(self._trials > 0, self._accepted / self._trials, np.nan)
        return rate.round(4).tolist()


@dataclass
class _Request:
    problem_id: str | None
    predicted: int | None  # predicted response length (tokens); None: the problem has no history
    p90: int | None
    length_class: int = MEDIUM
    promotions: int = 0


class BudgetPolicy:
    """Per-step draft budgets for a decode batch. Not thread-safe: one instance per proposer."""

    def __init__(self, config: BudgetConfig | None = None) -> None:
        self.config = config or BudgetConfig()
        self.lengths = LengthTracker(self.config.lengths_per_problem)
        self.cost = CostModel(self.config)
        self.calibrator = AcceptanceCalibrator(self.config)
        self._requests: dict[str, _Request] = {}
        k = self.config.max_tokens
        self._caps = np.array([0, round(k * self.config.medium_cap_fraction), k], dtype=np.int32)

    def start(self, key: str, problem_id: str | None) -> None:
        """Registers a new request; its prediction comes from its problem's recent lengths."""
        predicted = self.lengths.predict(problem_id)
        self._requests[key] = _Request(
            problem_id, predicted[0] if predicted else None, predicted[1] if predicted else None
        )

    def finish(self, key: str, response_len: int | None) -> None:
        """Drops a request; a finished response's length (when known) feeds its problem's predictions."""
        request = self._requests.pop(key, None)
        if request is not None and request.problem_id is not None and response_len is not None:
            self.lengths.observe(request.problem_id, response_len)

    def budgets(
        self, keys: list[str], output_lens: np.ndarray, headroom: np.ndarray
    ) -> tuple[np.ndarray, ...]:
        """Maximum draft tokens per row and each row's length class.

        Args:
            keys: request key per row (each registered with `start`).
            output_lens: tokens generated so far per row.
            headroom: most draft tokens each row may take (max_model_len - tokens - 1, and 0 for rows that
                must not draft, e.g. partial prefills); negative values count as 0.

        Raises:
            KeyError: a key was not registered with `start`.
        """
        n = len(keys)
        classes = np.full(n, MEDIUM, dtype=np.int64)
        predicted = np.zeros(n, dtype=np.float64)
        known = np.zeros(n, dtype=bool)
        for i, key in enumerate(keys):
            request = self._requests[key]
            if request.predicted is not None:
                done = int(output_lens[i])
                if done > request.predicted:
                    # Outlived its prediction: from now on expect the problem's p90, or past that, twice what
                    # it has produced (long-tail lengths are heavy-tailed: the longer it ran, the longer it runs).
                    request.predicted = (
                        request.p90 if request.p90 is not None and request.p90 > done else 2 * done
                    )
                    request.promotions += 1
                predicted[i] = request.predicted
                known[i] = True
        if known.any():
            horizon = predicted[known].max()
            ratio = predicted / horizon
            classes[known] = np.where(
                ratio[known] < self.config.short_fraction,
                SHORT,
                np.where(ratio[known] >= self.config.long_fraction, LONG, MEDIUM),
            )
        for i, key in enumerate(keys):
            request = self._requests[key]
            if classes[i] > request.length_class and request.promotions:
                CLASS_PROMOTIONS.labels(length_class=LENGTH_CLASSES[classes[i]]).inc()
            request.length_class = int(classes[i])
        budgets = np.minimum(self._caps[classes], np.maximum(np.asarray(headroom, dtype=np.int64), 0))
        return budgets.astype(np.int32), classes

    def truncate(self, lengths: np.ndarray, probs: np.ndarray, classes: np.ndarray) -> np.ndarray:
        """Draft lengths after the pay-off rule: keep a token while calibrated acceptance x step value >= c_tok.

        The value of one accepted token is one saved step of its request: a full step for a long request (the
        tail sets the epoch's makespan), its share of the step (1 / active) for a medium one.
        """
        lengths = np.asarray(lengths, dtype=np.int32)
        active = len(lengths)
        if active == 0 or not lengths.any():
            return lengths
        calibrated = self.calibrator.calibrate(probs, classes)
        step = self.cost.predict(active, active + int(lengths.sum()))
        value = np.where(classes == LONG, step, np.where(classes == MEDIUM, step / active, 0.0))
        pays = calibrated * value[:, None] >= self.cost.coefficients[2]
        # Calibrated path probabilities are non-increasing along a row, so the kept tokens are a prefix.
        kept = pays.sum(axis=1).astype(np.int32)
        return np.minimum(lengths, kept)

    def observe_step(self, active: int, tokens: int, seconds: float) -> None:
        """Feeds one measured verification step into the cost model."""
        self.cost.observe(active, tokens, seconds)

    def observe_acceptance(
        self, probs: np.ndarray, lengths: np.ndarray, classes: np.ndarray, accepted: np.ndarray
    ) -> None:
        """Feeds verification outcomes of the previous step's drafts into the calibrator."""
        self.calibrator.observe(probs, lengths, classes, accepted)

    def snapshot(self) -> dict:
        """Coefficients, live classes and the calibration table, for statistics and tests."""
        counts = np.bincount([r.length_class for r in self._requests.values()], minlength=3)
        return {
            "cost_model": dict(zip(COST_COEFFICIENTS, map(float, self.cost.coefficients), strict=True)),
            "cost_model_steps": self.cost.steps,
            "live_classes": dict(zip(LENGTH_CLASSES, map(int, counts), strict=True)),
            "acceptance_by_class_ratio_bin": dict(zip(LENGTH_CLASSES, self.calibrator.table(), strict=True)),
        }
