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
Python loop over requests. The step itself is `workers.budget.step` (learn, price, plan, cut); this class owns
the state those kernels read and calls them one at a time. No vLLM import.
"""

from __future__ import annotations

import numpy as np

from history_store.native.bundles import gather
from history_store.native.dense_rows import DenseRows
from monitoring.metrics import CLASS_PROMOTIONS, COST_COEFFICIENTS, LENGTH_CLASSES
from workers.budget.acceptance import N_FEATURES, TOKEN_BUCKETS, AcceptanceModel
from workers.budget.config import BudgetConfig
from workers.budget.cost import FittedCostModel
from workers.budget.lengths import LengthModel
from workers.budget.state import Drafted, PolicyBuffers, PolicyState
from workers.budget.step import LONG, BudgetTables, cut, learn, plan


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
        # Recent (accepted, predicted, tried) of drafted tokens, by bucket of token id (`kernels.hash_bucket`).
        self.token_outcomes = np.zeros((TOKEN_BUCKETS, 3))
        self.observed = np.zeros(1, np.int64)  # the problems' decay clock (`step.learn` ticks it)
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

    def tables(self, rows: int) -> BudgetTables:
        """The budget's state as the step kernels (`workers.budget.step`) take it, with the per-row buffers of
        `rows` rows (running and queued requests): valid until `start` grows the slots or the next step."""
        return BudgetTables(
            policy=self.kernel_state(),
            lengths=self.lengths.kernel_state(),
            acceptance=self.acceptance.kernel_state(),
            cost=self.cost.kernel_state(),
            buffers=self._buffers.views(rows),
        )

    # ---- the step, one kernel at a time (the engine's decode step composes the same kernels natively)

    def budgets(
        self,
        slots: np.ndarray,
        output_lens: np.ndarray,
        headroom: np.ndarray,
        queued: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Maximum draft tokens per row (0 where even a sure token would not pay, else min(K, headroom)) and
        each row's class (SHORT: no draft pays; LONG: likelier than average to finish last): `step.plan`. Both
        are views of reused buffers: valid until the next step's `budgets`.

        Args:
            slots: the rows' slots (given to `start`).
            output_lens: tokens generated so far per row.
            headroom: most draft tokens each row may take (max_model_len - tokens - 1, and 0 for rows that
                must not draft, e.g. partial prefills); negative values count as 0.
            queued: slots of requests waiting for the engine (started, nothing generated): they compete for
                the tail like the rows, but get no budget and are not rows of the result.
        """
        slots = np.asarray(slots, np.int64)
        queued = np.zeros(0, np.int64) if queued is None else np.asarray(queued, np.int64)
        n = slots.shape[0]
        tables = self.tables(n + queued.shape[0])
        self.count_promotions(
            plan(tables, slots, np.asarray(output_lens, np.int64), np.asarray(headroom, np.int64), queued)
        )
        buffers = tables.buffers
        self.drafted(slots, buffers.value[:n], buffers.classes[:n], self.last_predicted)
        return buffers.budgets[:n], buffers.classes[:n]

    def step_buffers(self, n: int) -> PolicyBuffers:
        """The per-row buffers for n rows (running and queued), for a caller that runs the step kernels from
        its own (then `drafted` records what they computed)."""
        return self._buffers.views(n)

    def count_promotions(self, promoted: int) -> None:
        """Counts requests that just outlived their problem's lengths (`step.plan` returns how many)."""
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
        """Draft lengths after the pay-off rule (`step.cut`), for the rows of the last `budgets` call (a view
        of a reused buffer, like `last_predicted`: valid until the next step's `truncate`).

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
        tables = self.tables(n)
        cut(tables._replace(buffers=tables.buffers._replace(value=self._value)), drafted, slots)
        self.last_predicted = tables.buffers.predicted
        return tables.buffers.kept

    def observe_acceptance(self, slots: np.ndarray, accepted: np.ndarray) -> None:
        """Verification outcomes of the last `truncate`'s drafts: slots[i]'s first accepted[i] tokens passed
        (`step.learn`). Drafted rows not listed (finished, preempted) teach nothing. Updates the acceptance
        model, the requests' and their problems' recent outcomes, and the requests' accepted tokens per
        step."""
        learn(self.tables(0), np.asarray(slots, np.int64), np.asarray(accepted, np.int64))

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
