"""`das bench ceiling`: the budget's acceptance predictions against the target model's own probabilities, on
half of the repo's engine-recorded trace (sampled by the prepared SmolLM2 at T=1.0)."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from workers.bench import replay
from workers.bench.ceiling import VerifiedTokens, ceiling, remembered_report, verified_tokens
from workers.generator.model import require_model

pytestmark = pytest.mark.vllm  # the prepared model

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO / "data" / "fidelity_das.jsonl.gz"


@pytest.fixture(scope="module")
def records() -> list:
    every = replay.load_traces(TRACE)
    problems = sorted({r.problem_id for r in every})[:4]
    return [r for r in every if r.problem_id in problems]


@pytest.fixture(scope="module")
def report(records) -> dict:
    return ceiling(records, dict.fromkeys({r.epoch for r in records}, 1.0), require_model())


def test_verified_tokens_are_the_replays_kept_and_accepted_draft_tokens(records) -> None:
    found, makespan = verified_tokens(records, 16)
    summary = replay.summarize(replay.simulate(records, "das", replay.DraftConfig()), replay.CostModel())
    # Every accepted draft token is verified; a row's tokens after its first rejection or past its response's
    # end are not.
    assert sum(found.accepted) == summary["accepted_tokens"]
    assert len(found.keys) <= summary["draft_tokens"]
    by_record = {f"{r.problem_id}/{r.epoch}/{r.sample}": r for r in records}
    for key, position, token, accepted in zip(
        found.keys, found.positions, found.tokens, found.accepted, strict=True
    ):
        assert position >= 1  # the first token comes from the prefill, undrafted
        assert accepted == (by_record[key].response_ids[position] == token)
    assert all(0.0 <= p <= 1.0 for p in found.predicted)
    assert makespan == summary["projected_makespan_s"]


def test_remembered_probabilities_are_reported_beside_the_counts_alone(report) -> None:
    """An unannotated trace has no remembered section; its annotated copy reports the remembered probability
    where history has one, by match length, and the budget's Brier score and makespan without it."""
    assert report["remembered"] is None
    every = replay.load_traces(REPO / "data" / "annotated" / "fidelity_das.jsonl.gz")
    problems = sorted({r.problem_id for r in every})[:4]
    annotated = [r for r in every if r.problem_id in problems]
    found, _ = verified_tokens(annotated, 16, remembered=True)
    section = remembered_report(annotated, 16)
    assert 0.1 < section["share"] < 1.0  # epoch 0 and the live trees have none
    assert sum(band["tokens"] for band in section["by_match_length"]) == round(
        section["share"] * len(found.keys)
    )
    for band in section["by_match_length"]:
        assert 0.0 < band["mean_remembered"] <= 1.0 and 0.0 <= band["brier_remembered"] <= 1.0
    assert 0.0 < section["brier_policy"] < 0.3 and 0.0 < section["brier_policy_without"] < 0.3
    assert section["makespan_s"]["without"] > 0 and section["makespan_s"]["with"] > 0


def test_the_target_models_probability_is_the_acceptance_rate_and_beats_the_policy(report) -> None:
    n = report["tokens"]
    assert n > 500
    # Rejection sampling accepts a draft token with the target's probability of it: equal in expectation, so
    # within a few standard errors (the variance of a mean of Bernoulli draws is at most 1 / (4n)).
    assert abs(report["mean_target_probability"] - report["acceptance"]) < 4 * math.sqrt(0.25 / n)
    brier = report["brier"]
    assert brier["target_probability"] < brier["policy"] / 2
    for name in ("policy_recalibrated", "with_draft_time_signals"):
        assert brier["target_probability"] < brier[name] < 0.25
    assert sum(row["tokens"] for row in report["by_draft_index"]) == n


def test_a_trace_epoch_without_a_temperature_is_refused(records) -> None:
    with pytest.raises(ValueError, match="no sampling temperature for epoch"):
        ceiling(records, {0: 1.0}, require_model())


def test_conditional_predictions_divide_each_path_by_the_previous_one() -> None:
    step = replay.VerifiedStep(
        epoch=0,
        keys=["p/0/0", "p/0/1"],
        positions=np.array([3, 5]),
        tokens=np.array([[7, 8, 9], [4, 4, 4]]),
        kept=np.array([3, 0]),
        accepted=np.array([1, 0]),
        remaining=np.array([10, 10]),
        predicted=np.array([[0.8, 0.4, 0.1], [0.9, 0.9, 0.9]]),
        sources=np.array([1, 2]),
        remembered=np.array([[0.7, 0.2, 0.1], [-1.0, -1.0, -1.0]], np.float32),
        match_lens=np.array([5, 2]),
    )
    found = VerifiedTokens()
    found.add(step)
    # Row 0 tried its first two tokens (the second was rejected, the third never tried); row 1 kept none.
    assert found.positions == [3, 4] and found.tokens == [7, 8] and found.accepted == [True, False]
    assert found.predicted == pytest.approx([0.8, 0.5])
    assert found.remembered == pytest.approx([0.7, 0.2]) and found.match_lens == [5, 5]
    # A response with one token left: the draft's second token lies past its end.
    found = VerifiedTokens()
    found.add(dataclasses.replace(step, accepted=np.array([1, 0]), remaining=np.array([1, 10])))
    assert found.positions == [3]


def test_the_cli_refuses_a_schedule_of_the_wrong_length() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", "bench", "ceiling", str(TRACE), "--temperatures", "1.0,0.5"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    assert "--temperatures gives 2 values for 3 epochs" in result.stderr


def test_a_trace_of_one_epoch_is_cross_fitted_by_sample(records) -> None:
    report = ceiling([r for r in records if r.epoch == 0], {0: 1.0}, require_model())
    assert report["tokens"] > 0
    assert report["brier"]["policy_recalibrated"] is not None
    assert report["brier"]["target_probability"] < report["brier"]["policy_recalibrated"]
