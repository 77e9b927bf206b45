"""Speculation budget: how many draft tokens each request sends to the verifier, from what each token is worth.

A step costs c_base + c_seq x active + c_tok x verified tokens (`FittedCostModel`, fitted online from measured
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

import numpy as np
from numba import njit

from history_store.automaton.bundles import gather
from history_store.automaton.dense_rows import DenseRows
from monitoring.metrics import CLASS_PROMOTIONS, COST_COEFFICIENTS, LENGTH_CLASSES
from workers.budget.acceptance import (
    N_FEATURES,
    TOKEN_BUCKETS,
    AcceptanceModel,
    _observe_kernel,
    _truncate_kernel,
)
from workers.budget.config import BudgetConfig
from workers.budget.cost import FittedCostModel
from workers.budget.lengths import LengthModel, _atypical
from workers.budget.state import Drafted, PolicyBuffers, PolicyState
from workers.budget.tail_weights import critical_weights

# Length classes, for dashboards: short = not worth drafting this step, long = likelier than average to be
# the batch's last request, medium = the rest.
SHORT, MEDIUM, LONG = 0, 1, 2


@njit(cache=True, inline="always")
def _budgets_kernel(slots, output_lens, headroom, policy, lengths, coefficients, buffers, running):
    """`BudgetPolicy.budgets` in one call: each row's critical weight, the value of one of its accepted tokens,
    its class and budget (into `buffers`, a PolicyBuffers). Marks the slots that just outlived their problem's
    lengths in `policy.outlived` and returns how many did. `lengths` is a LengthState, `coefficients` the cost
    model's. The first `running` rows are running; the rest (if any) are queued requests, which compete for
    the tail but get no budget."""
    slot_problem, accepted_rate, outlived = policy.slot_problem, policy.accepted_rate, policy.outlived
    max_length = policy.max_length
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
    # With requests queued, the engine is full and every slot a request frees admits the next one: a token
    # accepted anywhere brings every later admission, the last one's too, about 1/running of a step closer.
    # Without a queue only the batch's last request's tokens shorten the epoch beyond their own share.
    floor = 1.0 / running if running < n else 0.0
    promoted = 0
    for i in range(n):
        s = slots[i]
        # Outliving nearly every length expected of one's problem is the old "promotion" of a length class.
        if rows[i] > 0 and outputs[i] > quantiles[i, q - 1] and not outlived[s]:
            outlived[s] = True
            promoted += 1
        # One accepted token is one step fewer for its request: its own share of that step always, and the
        # whole step when the request is the batch's last.
        value[i] = max(weights[i], floor) * c_base + c_seq + c_tok
        if value[i] >= c_tok:
            # For dashboards: long = likelier than average to be the batch's last.
            classes[i] = LONG if weights[i] * n >= 1.0 else MEDIUM
            budgets[i] = min(max(headroom[i], 0), k)
        else:
            classes[i] = SHORT
            budgets[i] = 0
    return promoted


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

    def __init__(self, config: BudgetConfig | None = None, request_rows: DenseRows | None = None) -> None:
        """`request_rows`: the allocator of the slots requests are named by (the index's, so that one growth
        serves every owner); a policy of its own by default."""
        self.config = config or BudgetConfig()
        k = self.config.max_tokens
        self.cost = FittedCostModel(self.config)
        self.acceptance = AcceptanceModel(self.config)
        self.lengths = LengthModel(self.config.lengths_per_problem)
        # Per problem row (row 0: requests without a problem), grown with the length model's rows: recent
        # (accepted, predicted, tried) tokens, and the observe step that last decayed the row (a new row's 0
        # stamp decays nothing: its outcomes are zeros).
        problems = self.lengths.problem_rows
        problems.register(self, "problem_outcomes", (3,))
        problems.register(self, "problem_stamp", dtype=np.int64)
        # Recent (accepted, predicted, tried) of drafted tokens, by bucket of token id (`_kernels._slot`).
        self.token_outcomes = np.zeros((TOKEN_BUCKETS, 3))
        self.observe_step_no = 0
        # Per slot: problem row, recent outcomes, accepted tokens per step, promotion, and the
        # features and kept length of its last draft (learned from when the verifier answers).
        self.request_rows = request_rows if request_rows is not None else DenseRows()
        for name, tail, dtype in (
            ("slot_problem", (), np.int64),
            ("request_outcomes", (3,), np.float64),
            ("accepted_rate", (), np.float64),
            ("outlived", (), bool),
            ("max_length", (), np.float64),  # the most tokens the request may generate (0: no cap known)
            ("features", (k, N_FEATURES), np.float64),
            ("kept", (), np.int64),  # kept draft tokens awaiting the verifier's answer
            ("model_p", (k,), np.float64),  # the acceptance model's conditional probabilities of those tokens
            ("path_p", (k,), np.float64),  # their path probabilities before the past-match recalibration
            ("first_past", (), np.int64),  # the first of them drafted past the match length
            ("drafted_bucket", (k,), np.int64),  # their tokens' buckets of token_outcomes
        ):
            self.request_rows.register(self, name, tail, dtype)
        # The last budgets / truncate call.
        self._value = np.zeros(0)
        self._slots = np.zeros(0, np.int64)
        self._buffers = _PolicyRows(k, LengthModel.QUANTILES, self.BINS)
        self._promotions = CLASS_PROMOTIONS.labels(length_class=LENGTH_CLASSES[LONG])
        self.last_predicted = np.zeros((0, k))
        self.last_classes = np.zeros(0, np.int64)

    # ---- requests

    def start(self, slot: int, problem_id: str | None, max_length: int | None = None) -> None:
        """Registers a new request in `slot` (given by `request_rows`, or any dense id: the tables grow to
        hold it). max_length: the most tokens it may generate (vLLM's max_tokens, within max_model_len), when
        known."""
        self.request_rows.reserve(slot + 1)
        # Problem row 0 (the pool) stands for requests without a problem.
        self.slot_problem[slot] = self.lengths.problem(problem_id) if problem_id is not None else 0
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
        return gather(PolicyState, self, self.config, n_bins=self.BINS)

    # ---- the step

    def budgets(
        self,
        slots: np.ndarray,
        output_lens: np.ndarray,
        headroom: np.ndarray,
        queued: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Maximum draft tokens per row (0 where even a sure token would not pay, else min(K, headroom)) and
        each row's class (SHORT: no draft pays; LONG: likelier than average to finish last). Both are views of
        reused buffers: valid until the next step's `budgets`.

        Args:
            slots: the rows' slots (given to `start`).
            output_lens: tokens generated so far per row.
            headroom: most draft tokens each row may take (max_model_len - tokens - 1, and 0 for rows that
                must not draft, e.g. partial prefills); negative values count as 0.
            queued: slots of requests waiting for the engine (started, nothing generated): they compete for
                the tail like the rows, but get no budget and are not rows of the result.
        """
        slots = np.asarray(slots)
        n = slots.shape[0]
        output_lens, headroom = np.asarray(output_lens), np.asarray(headroom)
        if queued is not None and queued.size:
            slots = np.concatenate([slots, queued])
            output_lens = np.concatenate([output_lens, np.zeros(queued.shape[0], output_lens.dtype)])
            headroom = np.concatenate([headroom, np.zeros(queued.shape[0], headroom.dtype)])
        buffers = self._buffers.views(slots.shape[0])
        promoted = _budgets_kernel(
            slots=slots,
            output_lens=output_lens,
            headroom=headroom,
            policy=self.kernel_state(),
            lengths=self.lengths.kernel_state(),
            coefficients=self.cost.coefficients,
            buffers=buffers,
            running=n,
        )
        self.count_promotions(promoted)
        self._value = buffers.value[:n]
        self._slots = slots[:n]
        self.last_classes = buffers.classes[:n]
        return buffers.budgets[:n], buffers.classes[:n]

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
        remembered: np.ndarray | None = None,
    ) -> np.ndarray:
        """Draft lengths after the pay-off rule, for the rows of the last `budgets` call (a view of a reused
        buffer, like `last_predicted`: valid until the next step's `truncate`).

        Args:
            lengths: tokens drafted per row (at most its budget).
            probs: the tree's path probabilities (n, K).
            match_lens: context suffix length the draft was matched on.
            sources: which tree drafted it (a kernels.Source).
            support: occurrences behind each draft token (n, K).
            agreement: (n, 2) draft tokens each other tree's likeliest path repeats (BatchDrafts.agreement).
            tokens: the drafted token ids (n, K).
            remembered: the mean probability each draft token was sampled with in history, float32 (n, K),
                -1 where unknown (BatchDrafts.remembered); None: unknown everywhere.
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
            remembered=np.full(np.shape(probs), -1.0, np.float32)
            if remembered is None
            else np.asarray(remembered),
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
