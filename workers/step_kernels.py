"""The proposer's decode step in two native calls.

`before_draft` works out what the previous step's verification did (`step_book._prepare`) and teaches the
budget policy (`budget._observe_kernel`, the acceptance model's Newton step, `budget._cost_observe`);
`draft_step` asks the policy for budgets (`budget._budgets_kernel`), commits every row's new
tokens and drafts (`_kernels.step_rows`), applies the pay-off rule (`budget._truncate_kernel`) and counts the
drafts (`step_book._record`). They compose the same kernels the replay and the per-part APIs call one by one,
so the engine runs exactly the replay's policy; calling them from one kernel saves what dominates a small
batch: numba unboxes every argument of every call (about 60 ns an array) and each Python wrapper around it.
"""

from __future__ import annotations

from numba import njit

from history_store import _kernels as K
from workers.budget import (
    MEDIUM,
    _acceptance_added,
    _budgets_kernel,
    _cost_observe,
    _observe_kernel,
    _truncate_kernel,
)
from workers.step_book import END, HEADROOM, OUTPUT, _prepare, _record


@njit(cache=True)
def before_draft(
    seqs,
    slot_table,
    slots,
    num_tokens,
    step_no,
    k,
    max_model_len,
    drafted_at,
    length,
    prompt_len,
    rows,
    accepted,
    accepted_by_position,
    totals,
    per_row,
    kept_store,
    features,
    model_p,
    slot_problem,
    request_outcomes,
    problem_outcomes,
    problem_stamp,
    recalibration,
    policy_step,
    request_decay,
    problem_decay,
    accepted_rate,
    rate_decay,
    gradient,
    curvature,
    acceptance_state,
    min_trials,
    forgetting,
    acceptance_ridge,
    accumulated,
    acceptance_weights,
    joined,
    verify_seconds,
    last_rows,
    last_tokens,
    ring,
    sums,
    cost_state,
    prior,
    coefficients,
    min_fit_steps,
    refit_every,
    ridge,
):
    """Per-row END/NEW/HEADROOM/OUTPUT into per_row, the verified rows' acceptance into the policy, and the
    previous step's time into the cost model when it was a clean decode step (no request joined, every row
    committed, something was verified). Returns (verified rows, clean, trials learned, cost refitted)."""
    have = K.committed(seqs, slot_table, slots)
    m, every_row_new = _prepare(
        slots,
        num_tokens,
        have,
        step_no,
        k,
        max_model_len,
        drafted_at,
        length,
        prompt_len,
        rows,
        accepted,
        accepted_by_position,
        totals,
        per_row,
    )
    trials = 0
    if m:
        trials = _observe_kernel(
            rows[:m],
            accepted[:m],
            kept_store,
            features,
            model_p,
            slot_problem,
            request_outcomes,
            problem_outcomes,
            problem_stamp,
            recalibration,
            policy_step,
            request_decay,
            problem_decay,
            accepted_rate,
            rate_decay,
            gradient,
            curvature,
        )
        if trials:
            _acceptance_added(
                acceptance_state,
                trials,
                min_trials,
                forgetting,
                acceptance_ridge,
                accumulated,
                curvature,
                gradient,
                recalibration,
                acceptance_weights,
            )
    clean = not joined and every_row_new and last_rows > 0 and verify_seconds > 0.0
    refitted = False
    if clean:
        refitted = _cost_observe(
            ring,
            sums,
            cost_state,
            prior,
            coefficients,
            last_rows,
            last_rows + last_tokens,
            verify_seconds,
            min_fit_steps,
            refit_every,
            ridge,
        )
    return m, clean, refitted


@njit(cache=True)
def draft_step(
    budget_on,
    resume,
    row,
    slots,
    per_row,
    slot_problem,
    length_count,
    quantile_table,
    atypical,
    accepted_rate,
    outlived,
    coefficients,
    n_bins,
    k,
    weights,
    value,
    classes,
    budgets,
    states,
    edges,
    hashes,
    meta,
    trees,
    seqs,
    pool,
    slot_table,
    bases,
    src,
    max_depth,
    spec_factor,
    spec_offset,
    min_prob,
    escape,
    all_matches,
    out_tok,
    out_prob,
    out_sup,
    out_info,
    out_score,
    request_outcomes,
    problem_outcomes,
    acceptance_weights,
    recalibration,
    features,
    kept_store,
    model_p,
    rate_decay,
    predicted,
    kept,
    step_no,
    bounds,
    drafted_at,
    length,
    drafted_by_position,
    by_source,
    by_bucket,
    sum_by_class,
    totals,
):
    """Budgets (unless `resume`), commit and draft from `row` on, truncation and counting. Returns (status,
    row reached, rows promoted to the tail, draft tokens): a status other than K.DONE means the index must
    make room for that row and the caller calls again with resume=True from it. The kept draft lengths are
    in `kept` with the budget on, else in out_info[:, I_LEN]."""
    promoted = 0
    if not resume:
        if budget_on:
            promoted = _budgets_kernel(
                slots,
                per_row[OUTPUT],
                per_row[HEADROOM],
                slot_problem,
                length_count,
                quantile_table,
                atypical,
                accepted_rate,
                outlived,
                coefficients,
                n_bins,
                k,
                weights,
                value,
                classes,
                budgets,
            )
        else:
            for i in range(slots.shape[0]):
                budgets[i] = per_row[HEADROOM, i]
                classes[i] = MEDIUM
    row, status = K.step_rows(
        states,
        edges,
        hashes,
        meta,
        trees,
        seqs,
        pool,
        slot_table,
        slots,
        bases,
        per_row[END],
        budgets,
        src,
        row,
        True,
        max_depth,
        spec_factor,
        spec_offset,
        min_prob,
        escape,
        all_matches,
        out_tok,
        out_prob,
        out_sup,
        out_info,
        out_score,
    )
    if status != K.DONE:
        return status, row, promoted, 0
    sources = out_info[:, K.I_SOURCE]
    if not budget_on:
        tokens = _record(
            slots,
            out_info[:, K.I_LEN],
            classes,
            sources,
            budgets,
            step_no,
            bounds,
            drafted_at,
            length,
            drafted_by_position,
            by_source,
            by_bucket,
            sum_by_class,
            totals,
        )
        return status, row, promoted, tokens
    _truncate_kernel(
        out_prob,
        out_sup,
        out_info[:, K.I_LEN],
        out_info[:, K.I_MATCH],
        sources,
        slots,
        slot_problem,
        request_outcomes,
        problem_outcomes,
        acceptance_weights,
        recalibration,
        value,
        coefficients[2],
        features,
        kept_store,
        model_p,
        accepted_rate,
        rate_decay,
        predicted,
        kept,
    )
    tokens = _record(
        slots,
        kept,
        classes,
        sources,
        budgets,
        step_no,
        bounds,
        drafted_at,
        length,
        drafted_by_position,
        by_source,
        by_bucket,
        sum_by_class,
        totals,
    )
    return status, row, promoted, tokens
