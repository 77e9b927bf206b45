"""The proposer's decode step in one native call (`decode_step`; `draft_step` again only when the index had
to grow mid-step).

`before_draft` works out what the previous step's verification did (`step_book._prepare`) and teaches the
budget policy (`budget._observe_kernel`, the acceptance model's Newton step, `budget._cost_observe`);
`draft_step` asks the policy for budgets (`budget._budgets_kernel`), commits every row's new
tokens and drafts (`_kernels.step_rows`), applies the pay-off rule (`budget._truncate_kernel`) and counts the
drafts (`step_book._record`). They compose the same kernels the replay and the per-part APIs call one by one,
so the engine runs exactly the replay's policy.

Both take the step's tables as one `StepTables` value: numba unboxes every argument of every call (about
100 ns an array), so passing some sixty arrays cost more than a batch of one's whole drafting. The proposer
packs them once and packs again only after something outside these kernels replaced an array (a request
joined or finished, the history changed, the index grew, the batch size changed). `DirectCall` then skips
numba's typing of the tables on each call (2.8 µs; 1.6-2.1 µs of an 18-20 µs step at batch 1, measured).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, types
from numba.experimental import structref

from history_store.automaton import kernels as K
from workers.budget.policy import (
    MEDIUM,
    _acceptance_added,
    _budgets_kernel,
    _cost_observe,
    _observe_kernel,
    _truncate_kernel,
)
from workers.generator.step_book import END, HEADROOM, OUTPUT, _prepare, _record


@structref.register
class _StepTablesType(types.StructRef):
    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(t)) for name, t in fields)


class StepTables(structref.StructRefProxy):
    """Every array and setting the two step kernels read or update, as one native value (`pack_tables`)."""


structref.define_boxing(_StepTablesType, StepTables)

_I1, _I2, _I32_1, _I32_2 = types.int64[::1], types.int64[:, ::1], types.int32[::1], types.int32[:, ::1]
_F1, _F2 = types.float64[::1], types.float64[:, ::1]
# Grouped as `pack_tables` takes them, one group per owner.
_FIELDS = (
    # the index's forest (SuffixForest.tables) and per-request slots
    ("states", _I32_2),
    ("edges", _I32_2),
    ("hashes", _I32_2),
    ("meta", _I1),
    ("trees", _I2),
    ("seqs", _I2),
    ("pool", _I32_1),
    ("slot_table", _I2),
    # the index's per-batch outputs (ProblemIndex.step_buffers)
    ("out_tok", _I32_2),
    ("out_prob", types.float32[:, ::1]),
    ("out_sup", _I32_2),
    ("out_info", _I32_2),
    ("out_score", _F1),
    # drafting settings (DraftConfig.kernel_args)
    ("max_depth", types.int64),
    ("spec_factor", types.float64),
    ("spec_offset", types.float64),
    ("min_prob", types.float64),
    ("escape", types.float64),
    ("all_matches", types.boolean),
    ("draft_threads", types.int64),  # ProblemIndex.draft_threads
    # the step book
    ("drafted_at", _I1),
    ("length", _I1),
    ("prompt_len", _I1),
    ("rows", _I1),
    ("accepted", _I1),
    ("accepted_by_position", _I1),
    ("drafted_by_position", _I1),
    ("totals", _I1),
    ("per_row", types.int64[:, :]),  # a view of the first n columns
    ("bounds", _F1),
    ("by_source", _I1),
    ("by_bucket", _I2),
    ("sum_by_class", _I1),
    # the budget policy's per-request and per-problem state and settings
    ("kept_store", _I1),
    ("features", types.float64[:, :, ::1]),
    ("model_p", _F2),
    ("path_p", _F2),
    ("first_past", _I1),
    ("slot_problem", _I1),
    ("request_outcomes", _F2),
    ("problem_outcomes", _F2),
    ("problem_stamp", _I1),
    ("token_outcomes", _F2),
    ("drafted_bucket", _I2),
    ("accepted_rate", _F1),
    ("outlived", types.boolean[::1]),
    ("max_length", _F1),
    ("n_bins", types.int64),
    ("budget_max_tokens", types.int64),
    ("request_decay", types.float64),
    ("problem_decay", types.float64),
    ("token_decay", types.float64),
    ("rate_decay", types.float64),
    # the reply: the kept draft tokens packed, row i's from reply_bounds[i] to reply_bounds[i + 1]
    ("reply_tokens", _I32_1),
    ("reply_bounds", _I1),
    # the policy's per-batch buffers (BudgetPolicy.step_buffers)
    ("weights", _F1),
    ("value", _F1),
    ("classes", _I1),
    ("budgets", _I32_1),
    ("predicted", _F2),
    ("kept", _I32_1),
    ("tail_quantiles", _F2),  # the critical-path weights' scratch (BudgetPolicy.tail_scratch)
    ("tail_remaining", _F2),
    ("tail_mass", _F2),
    ("tail_below", _F2),
    # the length model
    ("length_count", _I1),
    ("quantile_table", _F2),
    ("length_stats", _I1),
    # the acceptance model
    ("recalibration", _F2),
    ("path_recalibration", _F2),
    ("gradient", _F1),
    ("curvature", _F2),
    ("acceptance_state", _I1),
    ("min_trials", types.int64),
    ("forgetting", types.float64),
    ("acceptance_ridge", types.float64),
    ("accumulated", _F2),
    ("acceptance_weights", _F1),
    # the cost model (CostModel.kernel_state)
    ("ring", _F2),
    ("sums", _F2),
    ("cost_state", _I1),
    ("prior", _F1),
    ("coefficients", _F1),
    ("min_fit_steps", types.int64),
    ("refit_every", types.int64),
    ("ridge", types.float64),
    # the proposer
    ("k", types.int64),
    ("max_model_len", types.int64),
)
_STEP_TABLES = _StepTablesType(_FIELDS)


@njit(cache=True)
def pack_tables(
    forest,
    slot_table,
    outputs,
    draft_args,
    book,
    policy,
    buffers,
    reply,
    lengths,
    acceptance,
    cost,
    k,
    max_model_len,
):
    """One StepTables from its owners' groups, in `_FIELDS`' order (arrays are shared, not copied)."""
    t = structref.new(_STEP_TABLES)
    t.states, t.edges, t.hashes, t.meta, t.trees, t.seqs, t.pool = forest
    t.slot_table = slot_table
    t.out_tok, t.out_prob, t.out_sup, t.out_info, t.out_score = outputs
    (t.max_depth, t.spec_factor, t.spec_offset, t.min_prob, t.escape, t.all_matches, t.draft_threads) = (
        draft_args
    )
    (
        t.drafted_at,
        t.length,
        t.prompt_len,
        t.rows,
        t.accepted,
        t.accepted_by_position,
        t.drafted_by_position,
        t.totals,
        t.per_row,
        t.bounds,
        t.by_source,
        t.by_bucket,
        t.sum_by_class,
    ) = book
    (
        t.kept_store,
        t.features,
        t.model_p,
        t.path_p,
        t.first_past,
        t.slot_problem,
        t.request_outcomes,
        t.problem_outcomes,
        t.problem_stamp,
        t.token_outcomes,
        t.drafted_bucket,
        t.accepted_rate,
        t.outlived,
        t.max_length,
        t.n_bins,
        t.budget_max_tokens,
        t.request_decay,
        t.problem_decay,
        t.token_decay,
        t.rate_decay,
    ) = policy
    (
        t.weights,
        t.value,
        t.classes,
        t.budgets,
        t.predicted,
        t.kept,
        t.tail_quantiles,
        t.tail_remaining,
        t.tail_mass,
        t.tail_below,
    ) = buffers
    t.reply_tokens, t.reply_bounds = reply
    t.length_count, t.quantile_table, t.length_stats = lengths
    (
        t.recalibration,
        t.path_recalibration,
        t.gradient,
        t.curvature,
        t.acceptance_state,
        t.min_trials,
        t.forgetting,
        t.acceptance_ridge,
        t.accumulated,
        t.acceptance_weights,
    ) = acceptance
    (
        t.ring,
        t.sums,
        t.cost_state,
        t.prior,
        t.coefficients,
        t.min_fit_steps,
        t.refit_every,
        t.ridge,
    ) = cost
    t.k = k
    t.max_model_len = max_model_len
    return t


@njit(cache=True)
def before_draft(t, slots, num_tokens, step_no, policy_step, joined, verify_seconds, last_rows, last_tokens):
    """Per-row END/NEW/HEADROOM/OUTPUT into per_row, the verified rows' acceptance into the policy, and the
    previous step's time into the cost model when it was a clean decode step (no request joined, every row
    committed, something was verified). Returns (verified rows, clean)."""
    have = K.committed(t.seqs, t.slot_table, slots)
    m, every_row_new = _prepare(
        slots,
        num_tokens,
        have,
        step_no,
        t.k,
        t.max_model_len,
        t.drafted_at,
        t.length,
        t.prompt_len,
        t.rows,
        t.accepted,
        t.accepted_by_position,
        t.totals,
        t.per_row,
    )
    if m:
        trials = _observe_kernel(
            t.rows[:m],
            t.accepted[:m],
            t.kept_store,
            t.features,
            t.model_p,
            t.slot_problem,
            t.request_outcomes,
            t.problem_outcomes,
            t.problem_stamp,
            t.token_outcomes,
            t.drafted_bucket,
            t.recalibration,
            t.path_p,
            t.first_past,
            t.path_recalibration,
            policy_step,
            t.request_decay,
            t.problem_decay,
            t.token_decay,
            t.accepted_rate,
            t.rate_decay,
            t.gradient,
            t.curvature,
        )
        if trials:
            _acceptance_added(
                t.acceptance_state,
                trials,
                t.min_trials,
                t.forgetting,
                t.acceptance_ridge,
                t.accumulated,
                t.curvature,
                t.gradient,
                t.recalibration,
                t.path_recalibration,
                t.acceptance_weights,
            )
    clean = not joined and every_row_new and last_rows > 0 and verify_seconds > 0.0
    if clean:
        _cost_observe(
            t.ring,
            t.sums,
            t.cost_state,
            t.prior,
            t.coefficients,
            last_rows,
            last_rows + last_tokens,
            verify_seconds,
            t.min_fit_steps,
            t.refit_every,
            t.ridge,
        )
    return m, clean


@njit(cache=True)
def draft_step(t, budget_on, resume, row, slots, bases, src, step_no):
    """Budgets (unless `resume`), commit and draft from `row` on, truncation and counting. Returns (status,
    row reached, rows promoted to the tail, draft tokens): a status other than K.DONE means the index must
    make room for that row and the caller packs the tables again and calls with resume=True from it. The
    kept draft tokens are packed in reply_tokens (row i's from reply_bounds[i] to reply_bounds[i + 1])."""
    promoted = 0
    per_row, budgets, classes = t.per_row, t.budgets, t.classes
    if not resume:
        if budget_on:
            promoted = _budgets_kernel(
                slots,
                per_row[OUTPUT],
                per_row[HEADROOM],
                t.slot_problem,
                t.length_count,
                t.quantile_table,
                t.length_stats,
                t.accepted_rate,
                t.outlived,
                t.max_length,
                t.coefficients,
                t.n_bins,
                t.budget_max_tokens,
                t.weights,
                t.value,
                classes,
                budgets,
                t.tail_quantiles,
                t.tail_remaining,
                t.tail_mass,
                t.tail_below,
            )
        else:
            for i in range(slots.shape[0]):
                budgets[i] = per_row[HEADROOM, i]
                classes[i] = MEDIUM
    out_info = t.out_info
    row, status = K.step_rows(
        t.states,
        t.edges,
        t.hashes,
        t.meta,
        t.trees,
        t.seqs,
        t.pool,
        t.slot_table,
        slots,
        bases,
        per_row[END],
        budgets,
        src,
        row,
        True,
        t.max_depth,
        t.spec_factor,
        t.spec_offset,
        t.min_prob,
        t.escape,
        t.all_matches,
        t.out_tok,
        t.out_prob,
        t.out_sup,
        out_info,
        t.out_score,
        t.draft_threads,
    )
    if status != K.DONE:
        return status, row, promoted, 0
    sources = out_info[:, K.I_SOURCE]
    if budget_on:
        _truncate_kernel(
            t.out_prob,
            t.out_sup,
            out_info[:, K.I_LEN],
            out_info[:, K.I_MATCH],
            sources,
            out_info[:, K.I_AGREE : K.I_AGREE + 2],
            t.out_tok,
            slots,
            t.slot_problem,
            t.request_outcomes,
            t.problem_outcomes,
            t.token_outcomes,
            t.drafted_bucket,
            t.acceptance_weights,
            t.recalibration,
            t.path_recalibration,
            t.value,
            t.coefficients[2],
            t.features,
            t.kept_store,
            t.model_p,
            t.path_p,
            t.first_past,
            t.accepted_rate,
            t.rate_decay,
            t.predicted,
            t.kept,
        )
        lengths = t.kept
    else:
        lengths = out_info[:, K.I_LEN]
    tokens = _record(
        slots,
        lengths,
        classes,
        sources,
        budgets,
        step_no,
        t.bounds,
        t.drafted_at,
        t.length,
        t.drafted_by_position,
        t.by_source,
        t.by_bucket,
        t.sum_by_class,
        t.totals,
    )
    _pack_reply(t.out_tok, lengths, t.reply_tokens, t.reply_bounds)
    return status, row, promoted, tokens


@njit(cache=True)
def _pack_reply(drafted, lengths, packed, bounds):
    """Row i's first lengths[i] drafted tokens into packed[bounds[i]:bounds[i + 1]]: vLLM takes a list per row,
    and slicing one list of the packed tokens builds them faster than cutting a list of every row's K. Copied
    token by token: slices would cost two views, each two atomic reference counts, per row."""
    total = 0
    bounds[0] = 0
    for i in range(lengths.shape[0]):
        for j in range(lengths[i]):
            packed[total + j] = drafted[i, j]
        total += lengths[i]
        bounds[i + 1] = total


@njit(cache=True)
def decode_step(
    t,
    slots,
    num_tokens,
    step_no,
    policy_step,
    joined,
    verify_seconds,
    last_rows,
    last_tokens,
    budget_on,
    bases,
    src,
):
    """`before_draft`, then `draft_step` from the first row: the whole step in one call when the index has
    room. Returns before_draft's (verified rows, clean), then draft_step's (status, row reached, rows promoted,
    draft tokens)."""
    m, clean = before_draft(
        t, slots, num_tokens, step_no, policy_step, joined, verify_seconds, last_rows, last_tokens
    )
    status, row, promoted, tokens = draft_step(t, budget_on, False, 0, slots, bases, src, step_no)
    return m, clean, status, row, promoted, tokens


class DirectCall:
    """A kernel whose first argument is a `StepTables`, called through the compiled overload's entry point
    instead of the dispatcher while the tables keep the type it last compiled for.

    The dispatcher types every argument on every call to pick its overload; for a StepTables value that
    costs 2.8 µs (numba types its eighty fields each time), about a tenth of the whole step at batch 1. numba
    interns types, so "the same tables type" is one identity test. The entry point unboxes by its signature
    without checking, so the caller must keep every other argument's type: the proposer builds each array it
    passes with a fixed dtype, rank and layout, and normalizes vLLM's token counts on entry (checking the
    arrays here cost as much as it saved). Any other tables type goes through the dispatcher, which types
    it, compiles if needed and becomes the new fast path.
    """

    def __init__(self, dispatcher: Any) -> None:
        self.dispatcher = dispatcher
        self._fast: tuple[Any, Any] | None = None  # (tables type, entry point), replaced as one value

    def __call__(self, tables: Any, *args: Any) -> Any:
        fast = self._fast
        if fast is not None and tables._numba_type_ is fast[0]:
            return fast[1](tables, *args)
        result = self.dispatcher(tables, *args)
        self._learn(tables, args)
        return result

    def _learn(self, tables: Any, args: tuple[Any, ...]) -> None:
        if any(isinstance(a, np.ndarray) and not a.flags.c_contiguous for a in args):
            self._fast = None  # a strided view: leave such calls to the dispatcher
            return
        signature = tuple(self.dispatcher.typeof_pyval(a) for a in (tables, *args))
        overload = self.dispatcher.overloads.get(signature)
        self._fast = None if overload is None else (tables._numba_type_, overload.entry_point)
