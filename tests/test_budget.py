"""The speculation budget policy on its own: critical path, cost model fit, acceptance model, pay-off rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from history_store.automaton.kernels import Source
from monitoring.metrics import CLASS_PROMOTIONS, COST_MODEL_COEFFICIENT
from workers.budget.config import BudgetConfig
from workers.budget.cost import FittedCostModel
from workers.budget.policy import BudgetPolicy
from workers.budget.step import LONG, SHORT
from workers.budget.tail_weights import critical_weights


def _weights(
    candidates: list[list[float]],
    outputs: list[float],
    speeds: list[float] | None = None,
    pool: list[float] | None = None,
    atypical: float = 0.0,
    caps: list[float] | None = None,
) -> np.ndarray:
    """critical_weights over rows whose equally likely lengths are given (an empty list: unknown), with
    every problem's lengths `pool` (none by default)."""
    pool = pool or [0.0]
    width = max(len(pool), *(len(c) for c in candidates))
    pool = np.sort(np.resize(np.asarray(pool, float), width))
    quantiles = np.zeros((len(candidates), width))
    for i, c in enumerate(candidates):
        if c:
            # Repeat to the common width: the same distribution.
            quantiles[i] = np.sort(np.resize(np.asarray(c, float), width))
    out = np.empty(len(candidates))
    speeds = np.ones(len(candidates)) if speeds is None else np.asarray(speeds, float)
    caps = np.zeros(len(candidates)) if caps is None else np.asarray(caps, float)
    critical_weights(
        quantiles, pool, atypical, np.asarray(outputs, float), speeds, caps, 64, out, *_scratch(quantiles, 64)
    )
    return out


def _scratch(quantiles: np.ndarray, n_bins: int) -> tuple[np.ndarray, ...]:
    """critical_weights' scratch (remaining, mass, below), filled with NaN: nothing may be read unwritten."""
    n, q = quantiles.shape
    return np.full((n, 4 * q), np.nan), np.full((n, 4 * q), np.nan), np.full((n, n_bins), np.nan)


def test_the_request_sure_to_run_longest_is_the_critical_one() -> None:
    w = _weights([[100, 110], [400, 420], [90, 90]], [0, 0, 0])
    assert w[1] == pytest.approx(1.0) and w.sum() == pytest.approx(1.0)


def test_identical_or_unknown_requests_share_the_tail_evenly() -> None:
    np.testing.assert_allclose(_weights([[200, 300]] * 4, [0] * 4), 0.25)
    np.testing.assert_allclose(_weights([[]] * 32, [0] * 32), 1 / 32)


def test_progress_and_speed_move_the_tail() -> None:
    # Same problem, but one request is far ahead: it finishes first, the other is the tail.
    w = _weights([[300, 310], [300, 310]], [250, 10])
    assert w[1] > 0.95
    # A request that drafts well (3 tokens per step) finishes its 300 tokens before a plain one's 400, even
    # should its drafts stop passing.
    w = _weights([[300], [400]], [0, 0], speeds=[3.0, 1.0])
    assert w[1] > 0.95
    # Against a plain one's 200, only if its drafts keep passing: its speed is a guess, so either may be last.
    w = _weights([[300], [200]], [0, 0], speeds=[3.0, 1.0])
    assert w[0] == pytest.approx(0.5, abs=0.05)


def test_a_request_that_outlived_its_history_expects_to_run_as_long_again() -> None:
    # 150 tokens against a history of 100-120, and nothing longer anywhere: about 150 more, longer than the
    # fresh request's 130.
    w = _weights([[100, 120], [130]], [150, 0])
    assert w[0] == pytest.approx(1.0)
    w = _weights([[100, 120], [170]], [150, 0])
    assert w[1] == pytest.approx(1.0)


def test_a_request_that_outlived_its_problem_takes_the_lengths_of_all_problems() -> None:
    # Its problem's answers are short, but answers of other problems run to 500: at 150 tokens it is no
    # longer a short answer, and may well run to 500, past the fresh request's 300.
    # Of the lengths past 150, two of three (500) outrun the fresh request.
    w = _weights([[40, 44], [300, 300]], [150, 0], pool=[40, 300, 500, 500], atypical=0.1)
    assert w[0] == pytest.approx(2 / 3, abs=0.05)


def test_atypical_requests_keep_a_short_problems_request_on_the_tail_watch() -> None:
    # At 30 tokens a short problem's request (history 40-44) may still be one of the atypical long ones.
    typical = _weights([[40, 44], [300, 300]], [30, 0], pool=[40, 300, 500, 500], atypical=0.0)
    atypical = _weights([[40, 44], [300, 300]], [30, 0], pool=[40, 300, 500, 500], atypical=0.2)
    assert typical[0] == 0.0 and 0.05 < atypical[0] < 0.5


def test_among_requests_bound_for_their_cap_the_furthest_behind_is_the_tail() -> None:
    # Both problems' lengths run past the 384-token cap, the second's furthest: without the cap the second
    # request is the tail although it is ahead. With it, both stop at 384 at the latest, so the one behind
    # is the tail unless it stops at 300 (one chance in three).
    lengths = [[300, 500, 600], [300, 700, 900]]
    assert _weights(lengths, [250, 320])[1] == pytest.approx(1.0)
    w = _weights(lengths, [250, 320], caps=[384, 384])
    assert w[0] == pytest.approx(2 / 3)
    # Nearly tied, with the one behind drafting well: either may end last, neither surely.
    w = _weights([[500], [500]], [300, 302], speeds=[1.3, 1.0], caps=[384, 384])
    assert 0.2 < w[0] < 0.8


def _weights_by_definition(quantiles, pool, atypical, outputs, speeds, caps, n_bins):
    """critical_weights as its docstring defines it, dense and slow: each row's outcomes on the grid, then
    P(i last) proportional to the sum over its outcomes of their mass times every other row's P(ends in an
    earlier bin) + half P(ends in the same bin)."""
    rows = []
    horizon = 1.0  # the grid spans every remaining length considered, likely or not
    for i in range(len(outputs)):
        if quantiles[i, -1] <= 0.0:
            rows.append(None)
            continue
        lengths = [(x, 1.0 - atypical) for x in quantiles[i]] + [(x, atypical) for x in pool]
        if caps[i] > 0:
            lengths = [(min(x, caps[i]), m) for x, m in lengths]
        outcomes = [
            ((x - outputs[i]) / speed, m / 2)
            for x, m in lengths
            if x > outputs[i]
            for speed in (1.0, 2 * speeds[i] - 1)
        ]
        horizon = max([horizon] + [r for r, _ in outcomes])
        if sum(m for _, m in outcomes) <= 0.0:
            again = max(outputs[i], 1.0)
            if caps[i] > 0:
                again = max(min(again, caps[i] - outputs[i]), 1.0)
            outcomes = [(again / speeds[i], 1.0)]
            horizon = max(horizon, outcomes[0][0])
        total = sum(m for _, m in outcomes)
        rows.append([(r, m / total) for r, m in outcomes])
    pmfs = np.zeros((len(rows), n_bins))
    for i, row in enumerate(rows):
        if row is None:
            pmfs[i, -1] = 1.0
        for r, m in row or []:
            # The grid as the kernel lays it (r x n_bins / horizon, `_grid_bin`): an outcome exactly on a bin's edge
            # (161 steps of 322 in 4 bins) falls on either side by rounding, and both are the definition.
            pmfs[i, min(n_bins - 1, int(r * (n_bins / horizon)))] += m
    below = np.cumsum(pmfs, axis=1) - 0.5 * pmfs
    weights = np.array(
        [
            sum(pmfs[i, b] * np.prod(np.delete(below[:, b], i)) for b in range(n_bins) if pmfs[i, b] > 0)
            for i in range(len(rows))
        ]
    )
    return weights / weights.sum() if weights.sum() > 0 else np.full(len(rows), 1.0 / len(rows))


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(
        st.one_of(st.just([]), st.lists(st.integers(1, 400), min_size=4, max_size=4)), min_size=1, max_size=6
    ),
    data=st.data(),
    atypical=st.sampled_from([0.0, 0.1, 0.5]),
    n_bins=st.sampled_from([4, 32]),
)
def test_critical_weights_equal_the_definition(lengths, data, atypical, n_bins) -> None:
    # Rows whose outcomes span a few bins or all of them, unknown rows, ties and rows past every length.
    n = len(lengths)
    quantiles = np.array([sorted(x) if x else [0.0] * 4 for x in lengths], float)
    pool = np.sort(np.array(data.draw(st.lists(st.integers(1, 600), min_size=4, max_size=4)), float))
    outputs = np.array(data.draw(st.lists(st.integers(0, 500), min_size=n, max_size=n)), float)
    speeds = np.array(data.draw(st.lists(st.sampled_from([1.0, 1.5, 3.0]), min_size=n, max_size=n)))
    # No cap, or one the request has not reached yet (a request at its cap is finished).
    caps = np.array([data.draw(st.sampled_from([0.0, o + 1.0, o + 120.0])) for o in outputs])
    out = np.empty(n)
    critical_weights(
        quantiles, pool, atypical, outputs, speeds, caps, n_bins, out, *_scratch(quantiles, n_bins)
    )
    expected = _weights_by_definition(quantiles, pool, atypical, outputs, speeds, caps, n_bins)
    np.testing.assert_allclose(out, expected, rtol=1e-9, atol=1e-12)


def test_cost_model_recovers_the_step_time_coefficients_from_measured_steps() -> None:
    model = FittedCostModel(BudgetConfig())
    rng = np.random.default_rng(0)
    for _ in range(200):
        active = int(rng.integers(1, 16))
        tokens = active + int(rng.integers(0, 8 * active + 1))
        model.observe(active, tokens, 0.03 + 0.002 * active + 0.0005 * tokens)
    np.testing.assert_allclose(model.coefficients, [0.03, 0.002, 0.0005], rtol=0.05, atol=2e-4)
    assert COST_MODEL_COEFFICIENT.labels(coefficient="c_tok")._value.get() == pytest.approx(0.0005, rel=0.05)


def test_cost_model_takes_the_scale_from_the_data_even_when_the_prior_is_far_off() -> None:
    # A GPU-like verifier (8 ms a step, 35 us a token) against the CPU-like prior, with a batch size that never
    # changes and no drafts: only the scale is identified, and the split keeps the prior's proportions.
    model = FittedCostModel(BudgetConfig())
    for _ in range(40):
        model.observe(96, 96, 0.008 + 0.0001 * 96 + 0.000035 * 96)
    assert model.predict(96, 96) == pytest.approx(0.008 + 0.0001 * 96 + 0.000035 * 96, rel=0.01)
    assert np.all(model.coefficients > 0)


def test_cost_model_stays_defined_when_the_batch_size_never_changes() -> None:
    model = FittedCostModel(BudgetConfig())
    for tokens in range(1, 60):
        model.observe(1, 1 + tokens % 9, 0.05 + 0.001 * (1 + tokens % 9))
    assert np.all(np.isfinite(model.coefficients)) and np.all(model.coefficients >= 0)
    assert model.predict(1, 5) == pytest.approx(0.055, rel=0.02)


def _least_squares_from_scratch(rows: np.ndarray, config: BudgetConfig, previous: np.ndarray) -> np.ndarray:
    """The cost model's fit over a window, from the window's rows (1, active, tokens, seconds) and the
    previous fit alone."""
    prior = np.array([config.prior_c_base, config.prior_c_seq, config.prior_c_tok])
    x, y = rows[:, :3], rows[:, 3]
    if rows.shape[0] > config.min_fit_steps:
        target = previous  # after the first fit the ridge holds the current fit, not the prior
    else:
        target = prior * (y.sum() / max(float((x @ prior).sum()), 1e-12))
    if rows.shape[0] < config.min_fit_steps:
        return target
    gram = x.T @ x
    lam = config.ridge * np.diag(np.diag(gram))
    rhs = x.T @ y + lam @ target
    free = np.ones(3, dtype=bool)
    coef = np.zeros(3)
    while free.any():
        coef[:] = 0.0
        coef[free] = np.linalg.solve((gram + lam)[np.ix_(free, free)], rhs[free])
        if (coef >= 0).all():
            break
        free &= coef > 0
    return coef


@pytest.mark.parametrize("c_tok", [0.0005, -0.0004])  # the second's tokens "save" time: c_tok pinned at 0
def test_cost_model_incremental_fit_equals_a_fit_from_scratch(c_tok: float) -> None:
    config = BudgetConfig(cost_window=40, min_fit_steps=5, refit_every=3)
    model = FittedCostModel(config)
    rng = np.random.default_rng(1)
    rows: list[tuple[float, float, float, float]] = []
    fitted = model.coefficients
    for step in range(300):  # several laps of the window: rows leave it, and its sums are rebuilt
        active = int(rng.integers(1, 64))
        tokens = active + int(rng.integers(0, 8 * active + 1))
        seconds = max(0.02 + 0.001 * active + c_tok * tokens + rng.normal(0, 0.002), 1e-4)
        model.observe(active, tokens, seconds)
        rows = [*rows, (1.0, active, tokens, seconds)][-config.cost_window :]
        if len(rows) < config.min_fit_steps or (step + 1 - config.min_fit_steps) % config.refit_every == 0:
            fitted = _least_squares_from_scratch(np.array(rows), config, fitted.copy())
        np.testing.assert_allclose(model.coefficients, fitted, rtol=1e-9, atol=1e-15)
        assert model.steps == len(rows)
    assert np.all(model.coefficients >= 0)
    assert (model.coefficients[2] == 0.0) == (c_tok < 0)


def test_cost_model_rejects_impossible_steps() -> None:
    with pytest.raises(ValueError, match="invalid step"):
        FittedCostModel(BudgetConfig()).observe(2, 1, 0.1)


def _start(policy: BudgetPolicy, problems: list[str | None], first: int = 0) -> list[int]:
    """Starts one request per problem in slots first, first + 1, ..."""
    slots = list(range(first, first + len(problems)))
    for slot, problem in zip(slots, problems, strict=True):
        policy.start(slot, problem)
    return slots


def _tokens(n: int, k: int, first: int = 7) -> np.ndarray:
    """Draft token ids for n rows of k: first, first + 1, ... in every row."""
    return np.tile(np.arange(first, first + k, dtype=np.int32), (n, 1))


def _step(policy: BudgetPolicy, slots, outputs, probs, sources=Source.HISTORY, match=8):
    n = len(slots)
    budgets, _ = policy.budgets(np.asarray(slots), np.asarray(outputs), np.full(n, 100))
    probs = np.asarray(probs, float)
    lengths = np.minimum(budgets, (probs > 0).sum(axis=1))
    support = np.full(probs.shape, 3)
    kept = policy.truncate(
        lengths,
        probs,
        np.full(n, match),
        np.full(n, sources),
        support,
        np.zeros((n, 2), np.int32),
        _tokens(n, probs.shape[1]),
    )
    return budgets, kept


def test_acceptance_model_learns_that_overconfident_tree_ratios_are_rejected() -> None:
    policy = BudgetPolicy(BudgetConfig(max_tokens=4))
    slots = _start(policy, [f"p{i}" for i in range(50)])
    probs = np.tile(0.95 ** np.arange(1, 5), (50, 1))
    for active in range(1, 51):  # a GPU-like verifier: a drafted token costs little, so drafting goes on
        policy.observe_step(active, 3 * active, 0.008 + 0.0001 * active + 0.00003 * 3 * active)
    before = None
    rng = np.random.default_rng(0)
    for _ in range(30):
        _step(policy, slots, [0] * 50, probs)
        if before is None:
            before = policy.last_predicted[0, 0]
        # The verifier rejects the first token of a random 80% of the drafts and accepts the rest whole.
        policy.observe_acceptance(np.array(slots), np.where(rng.random(50) < 0.8, 0, 4))
    _, kept = _step(policy, slots, [0] * 50, probs)
    assert before > 0.6
    # From the tree's 0.95 to near the observed 0.2 (drafting, and so learning, slows as it gets there).
    assert policy.last_predicted[:, 0].mean() < 0.35
    assert kept.sum() < 0.2 * 50 * 4


def test_acceptance_model_learns_deep_positions_of_underconfident_thin_history() -> None:
    policy = BudgetPolicy(BudgetConfig(max_tokens=8))
    slots = _start(policy, ["p"] * 20)
    # One sighting each: the tree halves its path probability per token, yet every drafted token is right.
    probs = np.tile(0.5 ** np.arange(1, 9), (20, 1))
    for _ in range(30):
        _, kept = _step(policy, slots, [0] * 20, probs, sources=Source.LIVE, match=3)
        policy.observe_acceptance(np.array(slots), kept)
    _step(policy, slots, [0] * 20, probs, sources=Source.LIVE, match=3)
    assert policy.last_predicted[0, -1] > 0.7
    assert np.all(np.diff(policy.last_predicted[0]) <= 0)


def _rows_step(policy: BudgetPolicy, slots, probs, agreement=None, tokens=None) -> None:
    """A step of fresh rows (output 0) from one problem source, at match 8 and support 3: budgets, then
    truncate with the given agreement and token ids (none agreeing and `_tokens` by default)."""
    n, k = probs.shape
    budgets, _ = policy.budgets(np.asarray(slots), np.zeros(n), np.full(n, 100))
    policy.truncate(
        np.minimum(budgets, k),
        probs,
        np.full(n, 8),
        np.full(n, Source.HISTORY),
        np.full((n, k), 3),
        np.zeros((n, 2), np.int32) if agreement is None else agreement,
        _tokens(n, k) if tokens is None else tokens,
    )


def test_acceptance_model_learns_that_tokens_other_trees_agree_on_are_accepted() -> None:
    policy = BudgetPolicy(BudgetConfig(max_tokens=4))
    slots = _start(policy, [f"p{i}" for i in range(40)])
    probs = np.tile(0.5 ** np.arange(1, 5), (40, 1))
    rng = np.random.default_rng(0)

    def step(agree: np.ndarray) -> None:
        _rows_step(policy, slots, probs, agreement=np.column_stack([agree, agree]).astype(np.int32))

    for active in range(1, 41):
        policy.observe_step(active, 3 * active, 0.008 + 0.0001 * active + 0.00003 * 3 * active)
    half = np.arange(40) % 2
    step(half)
    prior_gap = policy.last_predicted[1, 0] - policy.last_predicted[0, 0]
    assert prior_gap > 0  # the prior already takes agreement as evidence
    # Each step a random half of the rows have a first token both other trees agree on, and only those are
    # accepted: every request fares alike on average, so only the agreement tells the rows apart.
    for _ in range(30):
        agree = rng.random(40) < 0.5
        step(agree)
        policy.observe_acceptance(np.array(slots), agree.astype(np.int64))
    step(half)
    assert policy.last_predicted[1, 0] > 0.6
    assert policy.last_predicted[0, 0] < 0.3
    assert policy.last_predicted[1, 0] - policy.last_predicted[0, 0] > prior_gap


def test_acceptance_model_learns_which_draft_tokens_are_accepted() -> None:
    policy = BudgetPolicy(BudgetConfig(max_tokens=4))
    slots = _start(policy, [f"p{i}" for i in range(40)])
    probs = np.tile(0.5 ** np.arange(1, 5), (40, 1))
    rng = np.random.default_rng(0)
    sure, whim = 1000, 2000  # first draft tokens: one the verifier always accepts, one it always rejects

    def step(first: np.ndarray) -> None:
        tokens = _tokens(40, 4)
        tokens[:, 0] = first
        _rows_step(policy, slots, probs, tokens=tokens)

    for active in range(1, 41):
        policy.observe_step(active, 3 * active, 0.008 + 0.0001 * active + 0.00003 * 3 * active)
    half = np.where(np.arange(40) % 2 == 1, sure, whim)
    step(half)
    assert policy.last_predicted[1, 0] == policy.last_predicted[0, 0]  # nothing known of either token yet
    # Each step a random half of the rows draft `sure` first, and only those are accepted: every request and
    # problem fares alike on average, so only the token tells the rows apart.
    for _ in range(30):
        first = np.where(rng.random(40) < 0.5, sure, whim)
        step(first)
        policy.observe_acceptance(np.array(slots), (first == sure).astype(np.int64))
    step(half)
    assert policy.last_predicted[1, 0] > 0.6
    assert policy.last_predicted[0, 0] < 0.3


def test_a_request_whose_drafts_keep_failing_stops_drafting_while_its_siblings_go_on() -> None:
    policy = BudgetPolicy(BudgetConfig(max_tokens=4))
    for length in (300, 310, 320, 330):
        policy.lengths.observe("p", length)
    slots = _start(policy, ["p"] * 8)
    probs = np.tile([0.6, 0.45, 0.35, 0.3], (8, 1))
    # Request 0 is far ahead of its siblings, so it is not the tail: its tokens save only its own share.
    outputs = [250] + [0] * 7
    kept_late, predicted_late = np.zeros(2), np.zeros(2)
    for step in range(40):
        policy.observe_step(8, 40, 0.05 + 0.001 * 8 + 0.001 * 40)
        _, kept = _step(policy, slots, outputs, probs)
        if step >= 20:
            # It retries now and then (old failures fade), so judge the second half, not one step.
            kept_late += kept[:2]
            predicted_late += policy.last_predicted[:2, 0]
        # Request 0 never gets a token accepted; the others get everything they draft.
        policy.observe_acceptance(np.array(slots), np.where(np.arange(8) == 0, 0, 4))
    assert predicted_late[0] < 0.5 * predicted_late[1]
    assert kept_late[0] < 0.25 * kept_late[1]


def test_on_a_verifier_where_tokens_cost_most_of_a_step_only_the_tail_drafts() -> None:
    # The CPU engine's case: 32 requests, each verified token costs as much as a tenth of the base step.
    policy = BudgetPolicy(BudgetConfig(max_tokens=8))
    for length in [180] * 12 + [192] * 4:
        policy.lengths.observe("p", length)
    slots = _start(policy, ["p"] * 32)
    rng = np.random.default_rng(0)
    for _ in range(64):
        active = int(rng.integers(8, 33))
        tokens = active + int(rng.integers(0, 8 * active))
        policy.observe_step(active, tokens, 0.03 + 0.0001 * active + 0.003 * tokens)
    probs = np.tile(0.7 ** np.arange(1, 9), (32, 1))
    _, kept = _step(policy, slots, [10] * 32, probs)
    assert kept.sum() == 0, "32 equal requests: each one's share of the tail does not pay for a 3 ms token"
    (lone,) = _start(policy, ["p"], first=32)
    _, kept = _step(policy, [lone], [150], probs[:1])
    assert kept[0] >= 2, "a lone request is the tail: its tokens save whole 30 ms steps"


def test_the_tail_gets_long_class_and_a_well_known_short_request_does_not() -> None:
    policy = BudgetPolicy(BudgetConfig(max_tokens=8))
    rng = np.random.default_rng(0)
    # Enough history that the short problem's answers are known to stay short (few ran past a prediction).
    for _ in range(40):
        policy.lengths.observe("short", int(rng.integers(20, 31)))
        policy.lengths.observe("long", int(rng.integers(400, 901)))
    for active in range(1, 40):
        policy.observe_step(active, 2 * active, 0.01 + 0.0001 * active + 0.0001 * 2 * active)
    slots = _start(policy, ["short", "long"])
    budgets, classes = policy.budgets(np.array(slots), np.array([0, 0]), np.array([100, 3]))
    assert classes[1] == LONG and budgets[1] == 3
    assert classes[0] != LONG


def test_outliving_every_recent_length_counts_a_promotion_once() -> None:
    policy = BudgetPolicy()
    for length in (100, 120):
        policy.lengths.observe("p", length)
    (slot,) = _start(policy, ["p"])
    before = CLASS_PROMOTIONS.labels(length_class="long")._value.get()
    for output in (50, 130, 140):
        policy.budgets(np.array([slot]), np.array([output]), np.array([8]))
    assert CLASS_PROMOTIONS.labels(length_class="long")._value.get() == before + 1
    assert policy.lengths.predict("p") == (100, 120)
    policy.lengths.forget("p")
    assert policy.lengths.predict("p") is None


@settings(max_examples=60, deadline=None)
@given(
    outputs=st.lists(st.integers(0, 2000), min_size=1, max_size=12),
    headroom=st.integers(-3, 20),
    k=st.integers(1, 16),
)
def test_budgets_and_truncation_stay_within_k_headroom_and_draft_length(outputs, headroom, k) -> None:
    policy = BudgetPolicy(BudgetConfig(max_tokens=k))
    for i, length in enumerate((5, 50, 500)):
        policy.lengths.observe(f"p{i}", length)
    slots = np.array(_start(policy, [f"p{i % 4}" for i in range(len(outputs))]))
    budgets, classes = policy.budgets(slots, np.array(outputs), np.full(len(slots), headroom))
    assert np.all(budgets >= 0) and np.all(budgets <= min(k, max(headroom, 0)))
    probs = np.random.default_rng(len(outputs)).random((len(slots), k))
    probs = -np.sort(-probs, axis=1)
    n = len(slots)
    kept = policy.truncate(
        budgets,
        probs,
        np.full(n, 4),
        np.full(n, Source.HISTORY),
        np.ones((n, k)),
        np.zeros((n, 2), np.int32),
        _tokens(n, k),
    )
    assert np.all(kept >= 0) and np.all(kept <= budgets)
    assert np.all((classes == SHORT) <= (budgets == 0))


def test_a_reused_slot_starts_fresh() -> None:
    policy = BudgetPolicy(BudgetConfig(max_tokens=4))
    (slot,) = _start(policy, ["p"])
    _step(policy, [slot], [5], [[0.9, 0.8, 0.7, 0.6]])
    policy.observe_acceptance(np.array([slot]), np.array([0]))
    policy.finish(slot)
    policy.start(slot, "q")
    assert policy.request_outcomes[slot].sum() == 0 and policy.kept[slot] == 0
    # A finished request's late answer teaches nothing.
    trials = policy.acceptance.trials
    policy.observe_acceptance(np.array([slot]), np.array([2]))
    assert policy.acceptance.trials == trials


def test_invalid_configuration_is_rejected_with_the_reason() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        BudgetConfig(max_tokens=0)
    with pytest.raises(ValueError, match="request_decay"):
        BudgetConfig(request_decay=1.5)


def test_cost_model_keeps_what_it_learned_when_drafting_stops_varying() -> None:
    """Once the window no longer separates requests from tokens (every row drafts nothing, so tokens equal
    active requests), the fit keeps the per-token cost it learned while drafts varied, instead of sliding back
    to the prior's split (a verified token as dear as a request)."""
    config = BudgetConfig()
    model = FittedCostModel(config)
    rng = np.random.default_rng(0)
    c_base, c_seq, c_tok = 0.008, 1e-4, 1e-5
    for step in range(2000):
        active = int(rng.integers(8, 64))
        drafted = int(rng.integers(0, 4 * active + 1)) if step < 300 else 0
        model.observe(active, active + drafted, c_base + c_seq * active + c_tok * (active + drafted))
    assert model.coefficients[2] == pytest.approx(c_tok, rel=0.2)
    assert model.predict(32, 32) == pytest.approx(c_base + (c_seq + c_tok) * 32, rel=0.01)


def test_tokens_drafted_past_the_match_length_are_priced_by_what_such_paths_did() -> None:
    """With max_spec_factor above 1 a draft runs past its match length. Whole paths of those tokens are
    learned on their own (`path_recalibration`: was every token up to j accepted?) and their path probability
    is shown through it, while tokens within the match keep the acceptance model's path. On real rollouts the
    model's paths overstated them (rl_t1.0 at factor 4: 0.39 predicted, 0.17 observed)."""
    policy = BudgetPolicy(BudgetConfig(max_tokens=8))
    slots = np.array(_start(policy, [f"p{i}" for i in range(20)]))
    for active in range(1, 51):  # a GPU-like verifier: a drafted token costs little, so drafting goes on
        policy.observe_step(active, 3 * active, 0.008 + 0.0001 * active + 0.00003 * 3 * active)
    match = np.where(np.arange(20) < 10, 2, 5)
    probs = np.tile(0.97 ** np.arange(1, 9), (20, 1))
    support = np.full(probs.shape, 3)

    def step() -> np.ndarray:
        budgets, _ = policy.budgets(slots, np.zeros(20, np.int64), np.full(20, 100))
        return policy.truncate(
            np.minimum(budgets, 8),
            probs,
            match,
            np.full(20, Source.HISTORY),
            support,
            np.zeros((20, 2), np.int32),
            _tokens(20, 8),
        )

    kept = step()
    assert np.all(kept == 8), "cheap tokens at paths near 0.8: every row drafts past its match"
    # Before any path past a match was verified, such a path is shown at its square (what the tables learned
    # on real rollouts); tokens within the match show the model's path as it is.
    shown, raw = policy.last_predicted, policy.path_p[slots]
    past = np.arange(8) >= match[:, None]
    assert np.array_equal(shown[~past], raw[~past])
    first_token_past = np.zeros_like(past)
    first_token_past[np.arange(20), match] = True
    np.testing.assert_allclose(shown[first_token_past], raw[first_token_past] ** 2, rtol=1e-6)
    # Every token within the match passes; odd rows pass their first token past it too, then fail.
    policy.observe_acceptance(slots, match + np.arange(20) % 2)
    table = policy.acceptance.path_recalibration
    tried, passed = table[:, 1].sum(), table[:, 0].sum()
    # (The acceptance model's Newton step, due after this many trials, forgets a hundredth of both.)
    assert 0.99 * (kept - match).sum() <= tried <= (kept - match).sum()
    assert passed / tried == pytest.approx(10 / (kept - match).sum())
    step()
    shown, raw = policy.last_predicted, policy.path_p[slots]
    within = np.arange(8) < match[:, None]
    assert np.array_equal(shown[within], raw[within])
    assert shown[~within].mean() < 0.7 * raw[~within].mean()
    assert np.all(np.diff(shown, axis=1) <= 0), "path probabilities never grow along a draft"
