"""The budget's state as its kernels take it: named bundles of the policy's arrays and settings (see
`history_store.native.bundles`). Each owner builds its own by keyword (`FittedCostModel.kernel_state`, ...)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from history_store.native.bundles import B1, F1, F2, F3, FLOAT, I1, I2, I32_1, INT


class CostState(NamedTuple):
    """The cost model's fit as its kernel takes it (`FittedCostModel.kernel_state`)."""

    ring: F2  # [window, 4]: (1, active, tokens, seconds) of each measured step
    sums: F2  # [3, 4]: the window's Gram matrix and its products with the step times
    state: I1  # [4]: _C_COUNT, _C_NEXT, _C_SINCE, _C_PINNED
    prior: F1  # [3]: the prior coefficients
    coefficients: F1  # [3]: c_base, c_seq, c_tok, refitted in place
    min_fit_steps: INT
    refit_every: INT
    ridge: FLOAT


class AcceptanceState(NamedTuple):
    """The acceptance model's arrays and settings as its kernels take them (`AcceptanceModel.kernel_state`)."""

    weights: F1  # [N_FEATURES] the logistic model's weights
    recalibration: F2  # [bins, 2]: (accepted, tried) by bin of predicted conditional acceptance
    path_recalibration: F2  # [bins, 2]: the same for paths drafted past the match length
    gradient: F1  # [N_FEATURES] log-likelihood gradient since the last Newton step
    curvature: F2  # [N_FEATURES, N_FEATURES] its curvature since then
    accumulated: F2  # [N_FEATURES, N_FEATURES] the forgetting sum of past curvatures
    state: I1  # [2]: _A_TRIALS, _A_PENDING
    min_trials: INT
    forgetting: FLOAT
    ridge: FLOAT


class LengthState(NamedTuple):
    """What a decode step reads of the length model (`LengthModel.kernel_state`)."""

    count: I1  # [problems + 1] lengths held per row (row 0: the pool)
    quantiles: F2  # [problems + 1, QUANTILES] each row's equally likely lengths, ascending
    stats: I1  # [3]: _L_RATIOS, _L_BEYOND, _L_PREDICTED


class PolicyBuffers(NamedTuple):
    """Per-row outputs and scratch of a step's policy kernels (`BudgetPolicy.step_buffers`): one row per
    running request, then one per queued request (tail candidates: weights and scratch only)."""

    weights: F1  # [rows] critical weights
    value: F1  # [rows] seconds one accepted token saves
    classes: I1  # [rows] SHORT, MEDIUM or LONG
    budgets: I32_1  # [rows] draft tokens the row may send
    predicted: F2  # [rows, K] predicted path acceptance of each draft token
    kept: I32_1  # [rows] draft tokens kept after the pay-off rule
    tail_quantiles: F2  # [rows, QUANTILES] critical_weights' scratch: each row's length quantiles,
    tail_remaining: F2  # [rows, 4 x QUANTILES] the remaining steps of each (length, speed) outcome,
    tail_mass: F2  # [rows, 4 x QUANTILES] its probability,
    tail_below: F2  # [rows, BINS] and P(ends before each grid bin)


class PolicyState(NamedTuple):
    """The policy's per-slot and per-problem state and its settings, as its kernels take them
    (`BudgetPolicy.kernel_state`)."""

    slot_problem: I1  # [slots] the request's problem row (0: none)
    request_outcomes: F2  # [slots, 3] recent (accepted, predicted, tried) draft tokens
    accepted_rate: F1  # [slots] recent accepted tokens per step
    outlived: B1  # [slots] outlived its problem's lengths
    max_length: F1  # [slots] the most tokens the request may generate (0: no cap known)
    features: F3  # [slots, K, N_FEATURES] of its last draft's tokens
    kept: I1  # [slots] kept draft tokens awaiting the verifier's answer
    model_p: F2  # [slots, K] the acceptance model's conditional probabilities of those tokens
    path_p: F2  # [slots, K] their path probabilities before the past-match recalibration
    first_past: I1  # [slots] the first of them drafted past the match length
    drafted_bucket: I2  # [slots, K] their tokens' buckets of token_outcomes
    problem_outcomes: F2  # [problems + 1, 3] recent (accepted, predicted, tried) per problem row
    problem_stamp: I1  # [problems + 1] the observe step that last decayed the row
    token_outcomes: F2  # [TOKEN_BUCKETS, 3] recent (accepted, predicted, tried) by token bucket
    observed: I1  # [1]: steps whose verification was learned from (`step.learn`): the problems' decay clock
    n_bins: INT  # BudgetPolicy.BINS
    max_tokens: INT  # K
    request_decay: FLOAT
    problem_decay: FLOAT
    token_decay: FLOAT
    rate_decay: FLOAT


class Drafted(NamedTuple):
    """A batch's drafts as `_truncate_kernel` reads them (row-aligned with the last `budgets` call)."""

    tokens: np.ndarray  # [rows, K] draft token ids
    probs: np.ndarray  # [rows, K] the tree's path probabilities
    support: np.ndarray  # [rows, K] occurrences behind each draft token
    remembered: np.ndarray  # [rows, K] their mean sampling probability in history (-1: unknown)
    lengths: np.ndarray  # [rows] tokens drafted (at most the budget)
    match_lens: np.ndarray  # [rows] context suffix length the draft was matched on
    sources: np.ndarray  # [rows] which tree drafted it (a kernels.Source)
    agreement: np.ndarray  # [rows, 2] draft tokens each other tree's likeliest path repeats
