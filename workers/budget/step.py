"""The budget's public step: four kernels over one bundle of the budget's state (`BudgetTables`).

A decode step asks the budget, in this order:
- `learn`: what the verifier accepted of the previous step's kept drafts (the acceptance model's trials);
- `price`: what that verification step cost (the cost model's fit), when it was a clean decode step;
- `plan`: each running row's budget and length class, with the requests still queued as tail candidates;
- `cut`: each row's kept draft prefix, the tokens whose acceptance pays for their verification.

The engine's decode step (`workers.generator.step`) composes them in one native call; `BudgetPolicy` calls
them one at a time for callers outside a step; the replay runs the engine's proposer itself
(`workers.bench.replay`). So every budget any figure reports comes from this one composition.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from history_store.native.bundles import numba_type
from workers.budget.acceptance import _acceptance_added, _observe_kernel, _truncate_kernel
from workers.budget.cost import _cost_observe
from workers.budget.lengths import _atypical
from workers.budget.state import AcceptanceState, CostState, LengthState, PolicyBuffers, PolicyState
from workers.budget.tail_weights import critical_weights

# Length classes, for dashboards: short = not worth drafting this step, long = likelier than average to be
# the batch's last request, medium = the rest.
SHORT, MEDIUM, LONG = 0, 1, 2


class BudgetTables(NamedTuple):
    """The budget's state as its step kernels take it (`BudgetPolicy.tables`): arrays shared, not copied."""

    policy: numba_type(PolicyState)  # per-request and per-problem state, and the settings
    lengths: numba_type(LengthState)  # the length model
    acceptance: numba_type(AcceptanceState)  # the acceptance model
    cost: numba_type(CostState)  # the verifier's cost model
    buffers: numba_type(PolicyBuffers)  # per-row outputs and scratch, one row per running or queued request


@njit(cache=True, inline="always")
def learn(budget, slots, accepted):
    """The verifier's answer to the last kept drafts: slots[i] had its first accepted[i] kept tokens accepted.
    A step with verified rows is one tick of the problems' decay clock (`policy.observed`). Updates the
    acceptance model (a Newton step once enough trials are pending) and the requests', problems' and tokens'
    recent outcomes. Returns the trials learned from."""
    if slots.shape[0] == 0:
        return 0
    policy = budget.policy
    policy.observed[0] += 1
    trials = _observe_kernel(slots, accepted, policy, budget.acceptance, policy.observed[0])
    if trials:
        _acceptance_added(budget.acceptance, trials)
    return trials


@njit(cache=True, inline="always")
def price(budget, rows, tokens, seconds):
    """One measured verification step (rows requests verifying tokens tokens in seconds) into the cost model;
    refits when due. Returns whether the coefficients changed."""
    return _cost_observe(budget.cost, rows, tokens, seconds)


@njit(cache=True, inline="always")
def plan(budget, slots, output_lens, headroom, queued):
    """Each running row's critical weight (P(last of the batch to finish), against every running and queued
    request), the value of one of its accepted tokens, its class and budget, into budget.buffers' first
    slots.shape[0] rows. `queued`: the slots of requests waiting for the engine (started, nothing generated),
    tail candidates that get no budget. Marks the slots that just outlived their problem's lengths in
    `policy.outlived` and returns how many did.

    One accepted token is one step fewer for its request: its own share of that step (c_seq + c_tok) always,
    and the whole step (c_base) when the request is the batch's last. With requests queued, the engine is full
    and every slot a request frees admits the next one: a token accepted anywhere brings every later
    admission, the last one's too, about 1/running of a step closer."""
    policy, lengths, buffers = budget.policy, budget.lengths, budget.buffers
    slot_problem, accepted_rate, outlived = policy.slot_problem, policy.accepted_rate, policy.outlived
    max_length = policy.max_length
    length_count, quantile_table = lengths.count, lengths.quantiles
    weights, value, classes, budgets = buffers.weights, buffers.value, buffers.classes, buffers.budgets
    quantiles = buffers.tail_quantiles
    k = policy.max_tokens
    running = slots.shape[0]
    n = running + queued.shape[0]
    q = quantile_table.shape[1]
    outputs = np.empty(n)
    speeds = np.empty(n)
    caps = np.empty(n)
    rows = np.empty(n, np.int64)
    for i in range(n):
        s = slots[i] if i < running else queued[i - running]
        p = slot_problem[s]
        rows[i] = p if length_count[p] > 0 else 0  # problems without history take the pool's lengths
        for c in range(q):  # indexed: row views cost atomic reference counts
            quantiles[i, c] = quantile_table[rows[i], c]
        outputs[i] = output_lens[i] if i < running else 0.0
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
    c_base, c_seq, c_tok = (
        budget.cost.coefficients[0],
        budget.cost.coefficients[1],
        budget.cost.coefficients[2],
    )
    floor = 1.0 / running if running < n else 0.0
    promoted = 0
    for i in range(running):
        s = slots[i]
        # Outliving nearly every length expected of one's problem is the old "promotion" of a length class.
        if rows[i] > 0 and outputs[i] > quantiles[i, q - 1] and not outlived[s]:
            outlived[s] = True
            promoted += 1
        value[i] = max(weights[i], floor) * c_base + c_seq + c_tok
        if value[i] >= c_tok:
            classes[i] = LONG if weights[i] * n >= 1.0 else MEDIUM
            budgets[i] = min(max(headroom[i], 0), k)
        else:
            classes[i] = SHORT
            budgets[i] = 0
    return promoted


@njit(cache=True, inline="always")
def cut(budget, drafted, slots):
    """Each row's kept draft prefix (budget.buffers.kept) and its tokens' path acceptance probabilities
    (budget.buffers.predicted), for the rows of the last `plan` (`drafted`, a Drafted, row-aligned with
    `slots`): a token is kept while its probability times its row's value pays for its verification (c_tok).
    Stores what the next `learn` needs."""
    _truncate_kernel(
        drafted, slots, budget.policy, budget.acceptance, budget.cost.coefficients[2], budget.buffers
    )
