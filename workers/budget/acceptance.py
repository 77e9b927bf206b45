"""The acceptance model: an online logistic model of each draft token's acceptance given the previous one was
accepted (`AcceptanceModel`), the features it reads (`_features_of`), the pay-off rule that keeps the draft
tokens worth verifying (`_truncate_kernel`) and the learning step on verified drafts (`_observe_kernel`)."""

from __future__ import annotations

import numpy as np
from numba import njit

from history_store.automaton.kernels import N_CANDIDATES, columns, hash_bucket
from history_store.native.bundles import gather
from workers.budget.config import BudgetConfig
from workers.budget.cost import solve_augmented
from workers.budget.state import AcceptanceState

# Features of a draft token (see `_features_of`), by column: an intercept per draft source (Source.HISTORY,
# LIVE and GLOBAL in that order), the tree's conditional ratio, match length, position, the request's, the
# problem's and the token's recent gain, the support, the other trees' agreement, and how sure the model was when
# it sampled the token in history (with whether that is known).
FEATURE_LAYOUT = (
    ("F_SOURCE", N_CANDIDATES),
    ("F_RATIO", 1),
    ("F_MATCH", 1),
    ("F_POSITION", 1),
    ("F_REQUEST", 1),
    ("F_PROBLEM", 1),
    ("F_SUPPORT", 1),
    ("F_AGREEMENT", 1),
    ("F_TOKEN", 1),
    ("F_REMEMBERED", 1),
    ("F_KNOWN", 1),
)
(
    F_SOURCE,
    F_RATIO,
    F_MATCH,
    F_POSITION,
    F_REQUEST,
    F_PROBLEM,
    F_SUPPORT,
    F_AGREEMENT,
    F_TOKEN,
    F_REMEMBERED,
    F_KNOWN,
    N_FEATURES,
) = columns(FEATURE_LAYOUT)
assert N_FEATURES == N_CANDIDATES + 10
# Buckets of the drafted tokens' recent outcomes (`token_outcomes`): token ids hashed into a table that stays
# in cache (a vocabulary-sized one would be a cache miss per draft token); collisions only blur it.
TOKEN_BUCKETS = 4096


@njit(cache=True)
def _log_odds_gain(outcomes, row):
    # Log odds of the accepted against the predicted share of tried tokens, from the (accepted, predicted,
    # tried) sums in outcomes[row]; half a pseudo-token each side keeps it finite, and no trials give 0.
    accepted, predicted, tried = outcomes[row, 0] + 0.5, outcomes[row, 1] + 0.5, outcomes[row, 2] + 1.0
    return np.log(accepted / (tried - accepted)) - np.log(predicted / (tried - predicted))


@njit(cache=True)
def _features_of(
    ratio, support, agreement, source, i, j, log_match, request_gain, problem_gain, token_gain, out, s
):
    """Features of row i's draft token j, into out[s, j], for its acceptance given token j-1 was accepted:
    which tree drafted it (one intercept per source: what the verifier taught about one source says nothing
    about another, e.g. siblings of epoch 0 about the history of epoch 1), logit of the tree's conditional
    ratio p_j / p_(j-1), log match length, log position, how much better or worse than predicted the request's
    and the problem's recent drafts did (0 without trials, so a request or problem that stopped drafting is
    not held to its old failures forever), and the log of the occurrences behind the token (a ratio of 1/2
    from one sighting is weaker evidence than one from 100), and half the number of the other trees whose own
    likeliest path drafts the token too (`agreement`: the row's two counts of draft tokens they repeat), and
    how much better or worse than predicted the same token did when drafted before (`token_gain`: how freely
    the model picks a token varies with the token, which no tree's counts say). `_remembered_features` adds the
    last two.
    ratio is the tree's p_j / p_(j-1) (0 without p_(j-1)) and log_match the row's log1p(match length) / 4. Every
    array is indexed by row rather than passed as a row view, and the drafts' arrays come one by one rather than
    as their Drafted bundle: a view costs two atomic reference counts and a bundle argument one per member per
    call, and this runs per draft token."""
    ratio = min(max(ratio, 0.02), 0.98)
    for c in range(N_CANDIDATES):  # source c + 1 (a Source) drafted from candidate tree c
        out[s, j, F_SOURCE + c] = 1.0 if source == c + 1 else 0.0
    out[s, j, F_RATIO] = np.log(ratio / (1.0 - ratio))
    out[s, j, F_MATCH] = log_match
    out[s, j, F_POSITION] = _LOG_POSITION[j] if j < _LOG_POSITION.shape[0] else np.log1p(j) / 2.0
    out[s, j, F_REQUEST] = request_gain
    out[s, j, F_PROBLEM] = problem_gain
    out[s, j, F_SUPPORT] = np.log1p(support[i, j]) / 4.0
    agreeing = 0
    for c in range(N_CANDIDATES - 1):
        agreeing += agreement[i, c] > j
    out[s, j, F_AGREEMENT] = agreeing / 2.0
    out[s, j, F_TOKEN] = token_gain


@njit(cache=True)
def _remembered_features(remembered, i, j, out, s):
    """The logit of the mean probability row i's draft token j was sampled with after the same context in
    history, and whether that is known (`remembered`, -1: unknown; then both are 0, so a model that never saw
    one predicts exactly as without them). Under rejection sampling a draft token is accepted with the target's
    probability of it, and a count of 1 after a token sampled at 0.04 looks the same as one after a token
    sampled at 0.97."""
    known = remembered[i, j]
    if known >= 0.0:
        known = min(max(known, 0.02), 0.98)
        out[s, j, F_REMEMBERED] = np.log(known / (1.0 - known))
        out[s, j, F_KNOWN] = 1.0
    else:
        out[s, j, F_REMEMBERED] = 0.0
        out[s, j, F_KNOWN] = 0.0


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


@njit(cache=True, inline="always")
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
    support, agreement, sources = drafted.support, drafted.agreement, drafted.sources
    remembered = drafted.remembered
    slot_problem, request_outcomes = policy.slot_problem, policy.request_outcomes
    problem_outcomes = policy.problem_outcomes
    token_outcomes, drafted_bucket, features = policy.token_outcomes, policy.drafted_bucket, policy.features
    kept_store = policy.kept
    model_p, path_p, first_past = policy.model_p, policy.path_p, policy.first_past
    accepted_rate, rate_decay = policy.accepted_rate, policy.rate_decay
    weights, recalibration = acceptance.weights, acceptance.recalibration
    path_recalibration = acceptance.path_recalibration
    value, predicted, kept = buffers.value, buffers.predicted, buffers.kept
    n, k = lengths.shape[0], predicted.shape[1]  # the buffers may hold more rows (queued requests)
    f = weights.shape[0]
    for i in range(n):
        s = slots[i]
        if lengths[i] == 0:
            for j in range(k):
                predicted[i, j] = 0.0
            kept[i] = kept_store[s] = 0
            accepted_rate[s] *= rate_decay
            continue
        source = sources[i]
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
            bucket = hash_bucket(tokens[i, j], TOKEN_BUCKETS - 1)
            drafted_bucket[s, j] = bucket
            token_gain = _log_odds_gain(token_outcomes, bucket)
            ratio = probs[i, j] / previous if previous > 0 else 0.0
            _features_of(
                ratio,
                support,
                agreement,
                source,
                i,
                j,
                log_match,
                request_gain,
                problem_gain,
                token_gain,
                features,
                s,
            )
            _remembered_features(remembered, i, j, features, s)
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


@njit(cache=True, inline="always")
def _observe_kernel(slots, accepted, policy, acceptance, step):
    """Learns from verified drafts: slots[i] had its first accepted[i] kept tokens accepted (`policy` is the
    PolicyState, `acceptance` the AcceptanceState, `step` the observe step's number). Token j is a trial
    of its conditional acceptance when tokens 0..j-1 were accepted (j <= accepted), a success when it was
    accepted too. Adds the log-likelihood gradient and curvature, and updates the slot's, its problem's and
    each tried token's (accepted, predicted, tried) sums and the slot's accepted tokens per step. Returns the
    trials."""
    kept_store, features, model_p = policy.kept, policy.features, policy.model_p
    slot_problem = policy.slot_problem
    request_outcomes, problem_outcomes = policy.request_outcomes, policy.problem_outcomes
    problem_stamp = policy.problem_stamp
    token_outcomes, drafted_bucket, path_p = policy.token_outcomes, policy.drafted_bucket, policy.path_p
    first_past, accepted_rate = policy.first_past, policy.accepted_rate
    request_decay, problem_decay = policy.request_decay, policy.problem_decay
    token_decay, rate_decay = policy.token_decay, policy.rate_decay
    recalibration, path_recalibration = acceptance.recalibration, acceptance.path_recalibration
    gradient, curvature = acceptance.gradient, acceptance.curvature
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


@njit(cache=True, inline="always")
def _acceptance_added(acceptance, trials):
    """`trials` more verified tokens are in the AcceptanceState's gradient and curvature: once min_trials are
    pending, folds them into the forgetting curvature and takes a Newton step on its weights in place.
    Returns whether it stepped."""
    state, forgetting, accumulated = acceptance.state, acceptance.forgetting, acceptance.accumulated
    curvature, gradient = acceptance.curvature, acceptance.gradient
    recalibration, path_recalibration = acceptance.recalibration, acceptance.path_recalibration
    weights = acceptance.weights
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
    solve_augmented(a, f, step)  # symmetric positive definite: the ridge
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
        self.weights[F_SOURCE : F_SOURCE + N_CANDIDATES], self.weights[F_RATIO] = -0.5, 1.0
        # Agreeing trees: each one added 0.4-0.5 to a first token's log odds of acceptance at the same ratio on
        # dev_rollouts and rl_t1.0 (the feature counts half a tree per unit).
        self.weights[F_AGREEMENT] = 0.8
        # A token's own record: on dev_rollouts and rl_t1.0 (ad hoc, replayed drafts) adding 0.5-0.75 of its log
        # odds gain to the model's log odds took the Brier score from 0.188 to 0.177 and 0.194 to 0.179.
        self.weights[F_TOKEN] = 0.5
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
        return gather(AcceptanceState, self, min_trials=self.MIN_TRIALS)

    def added(self, trials: int) -> None:
        """`trials` more verified tokens are in `gradient` and `curvature`: a Newton step once enough are."""
        _acceptance_added(self.kernel_state(), trials)
