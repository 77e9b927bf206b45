"""The speculation budget policy on its own: length classes, promotion, cost model fit, calibration, pay-off."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monitoring.metrics import CLASS_PROMOTIONS, COST_MODEL_COEFFICIENT
from workers.budget import LONG, MEDIUM, SHORT, BudgetConfig, BudgetPolicy, CostModel


def _policy_with_history(**overrides) -> BudgetPolicy:
    policy = BudgetPolicy(BudgetConfig(max_tokens=8, **overrides))
    for length in (20, 22, 25, 30):
        policy.lengths.observe("short-problem", length)
    for length in (400, 450, 500, 900):
        policy.lengths.observe("long-problem", length)
    return policy


def test_short_requests_get_no_budget_while_the_tail_gets_the_full_budget() -> None:
    policy = _policy_with_history()
    policy.start("a", "short-problem")
    policy.start("b", "long-problem")
    policy.start("c", None)
    budgets, classes = policy.budgets(["a", "b", "c"], np.array([0, 0, 0]), np.array([100, 100, 100]))
    assert classes.tolist() == [SHORT, LONG, MEDIUM]
    assert budgets.tolist() == [0, 8, 4]


def test_a_lone_request_with_history_is_the_tail_and_gets_the_full_budget() -> None:
    policy = _policy_with_history()
    policy.start("a", "short-problem")
    budgets, classes = policy.budgets(["a"], np.array([0]), np.array([100]))
    assert classes.tolist() == [LONG] and budgets.tolist() == [8]


def test_a_request_outliving_its_prediction_is_promoted() -> None:
    policy = _policy_with_history()
    policy.start("a", "short-problem")
    policy.start("b", "long-problem")
    before = CLASS_PROMOTIONS.labels(length_class="long")._value.get()
    _, classes = policy.budgets(["a", "b"], np.array([10, 10]), np.array([100, 100]))
    assert classes[0] == SHORT
    # Past p50 the prediction becomes p90 (30), past that twice the output so far (400 -> horizon 500).
    policy.budgets(["a", "b"], np.array([26, 26]), np.array([100, 100]))
    _, classes = policy.budgets(["a", "b"], np.array([400, 400]), np.array([100, 100]))
    assert classes[0] == LONG
    assert CLASS_PROMOTIONS.labels(length_class="long")._value.get() == before + 1


def test_budgets_never_exceed_headroom_and_zero_headroom_means_no_draft() -> None:
    policy = _policy_with_history()
    policy.start("a", "long-problem")
    policy.start("b", "long-problem")
    budgets, _ = policy.budgets(["a", "b"], np.array([0, 0]), np.array([3, -2]))
    assert budgets.tolist() == [3, 0]


def test_finished_requests_feed_their_problems_length_prediction() -> None:
    policy = BudgetPolicy()
    for i, length in enumerate((100, 120, 140)):
        policy.start(str(i), "p")
        policy.finish(str(i), length)
    assert policy.lengths.predict("p") == (120, 140)
    assert policy.lengths.predict("unknown") is None


def test_cost_model_recovers_the_step_time_coefficients_from_measured_steps() -> None:
    model = CostModel(BudgetConfig())
    rng = np.random.default_rng(0)
    for _ in range(200):
        active = int(rng.integers(1, 16))
        tokens = active + int(rng.integers(0, 8 * active + 1))
        model.observe(active, tokens, 0.03 + 0.002 * active + 0.0005 * tokens)
    np.testing.assert_allclose(model.coefficients, [0.03, 0.002, 0.0005], rtol=0.05, atol=2e-4)
    assert COST_MODEL_COEFFICIENT.labels(coefficient="c_tok")._value.get() == pytest.approx(0.0005, rel=0.05)


def test_cost_model_stays_defined_when_the_batch_size_never_changes() -> None:
    model = CostModel(BudgetConfig())
    for tokens in range(1, 60):
        model.observe(1, 1 + tokens % 9, 0.05 + 0.001 * (1 + tokens % 9))
    assert np.all(np.isfinite(model.coefficients)) and np.all(model.coefficients >= 0)
    assert model.predict(1, 5) == pytest.approx(0.055, rel=0.02)


def test_cost_model_rejects_impossible_steps() -> None:
    with pytest.raises(ValueError, match="invalid step"):
        CostModel(BudgetConfig()).observe(2, 1, 0.1)


def test_calibration_replaces_overconfident_tree_probabilities_with_observed_acceptance() -> None:
    policy = BudgetPolicy(BudgetConfig(max_tokens=4))
    # The tree says each next token follows with 0.9; the verifier rejects the first token of 40 drafts of 50
    # and accepts all four of the other 10: 80 conditional trials, 40 accepted.
    probs = np.tile(0.9 ** np.arange(1, 5), (50, 1))
    classes = np.full(50, LONG)
    accepted = np.where(np.arange(50) < 40, 0, 4)
    policy.observe_acceptance(probs, np.full(50, 4), classes, accepted)
    calibrated = policy.calibrator.calibrate(probs[:1], classes[:1])[0]
    conditional = (40 + 8 * 0.9) / (80 + 8)
    np.testing.assert_allclose(calibrated, conditional ** np.arange(1, 5))


def test_calibration_learns_deep_positions_from_shallow_ones_when_the_tree_is_underconfident() -> None:
    policy = BudgetPolicy(BudgetConfig(max_tokens=8))
    # Thin history: the tree halves its path probability each token, but the drafts are always right. Only
    # three positions were ever drafted; the pooled conditional still lifts all eight.
    probs = np.tile(0.5 ** np.arange(1, 9), (100, 1))
    classes = np.full(100, LONG)
    policy.observe_acceptance(probs, np.full(100, 3), classes, np.full(100, 3))
    calibrated = policy.calibrator.calibrate(probs[:1], classes[:1])[0]
    assert calibrated[-1] > 0.75
    assert np.all(np.diff(calibrated) <= 0)
    assert policy.truncate(np.array([8]), probs[:1], classes[:1]).tolist() == [8]


def test_truncate_keeps_only_tokens_whose_acceptance_pays_for_their_verification() -> None:
    policy = BudgetPolicy(BudgetConfig(max_tokens=4, prior_c_base=0.01, prior_c_seq=0.0, prior_c_tok=0.002))
    probs = np.array([[0.9, 0.5, 0.15, 0.1], [0.9, 0.5, 0.15, 0.1]])
    # Step of 2 requests verifying 2 + 8 tokens: 0.01 + 0.02 = 0.03 s. Long pays while p >= 0.002 / 0.03;
    # medium gets half the step's value, so it needs p >= 0.002 / 0.015.
    kept = policy.truncate(np.array([4, 4]), probs, np.array([LONG, MEDIUM]))
    assert kept.tolist() == [4, 3]
    assert policy.truncate(np.array([4]), probs[:1], np.array([SHORT])).tolist() == [0]


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
    keys = [str(i) for i in range(len(outputs))]
    for i, key in enumerate(keys):
        policy.start(key, f"p{i % 4}")
    budgets, classes = policy.budgets(keys, np.array(outputs), np.full(len(keys), headroom))
    assert np.all(budgets >= 0) and np.all(budgets <= min(k, max(headroom, 0)))
    probs = np.random.default_rng(len(outputs)).random((len(keys), k))
    probs = -np.sort(-probs, axis=1)
    kept = policy.truncate(budgets, probs, classes)
    assert np.all(kept >= 0) and np.all(kept <= budgets)


def test_invalid_configuration_is_rejected_with_the_reason() -> None:
    with pytest.raises(ValueError, match="short_fraction"):
        BudgetConfig(short_fraction=0.8, long_fraction=0.5)
    with pytest.raises(ValueError, match="max_tokens"):
        BudgetConfig(max_tokens=0)
