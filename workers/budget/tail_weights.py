"""Critical-path weights: the probability that each request of a batch is the last to finish (`critical_weights`),
from its problem's recent lengths, what it has produced and its recent speed."""

from __future__ import annotations

import numpy as np
from numba import njit

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
