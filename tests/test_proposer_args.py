"""What a request carries in `SamplingParams.extra_args`, and the proposer's environment settings: malformed
input is named and falls back to own-context drafting, never an exception."""

from __future__ import annotations

import os

import pytest

from workers.generator.proposer import parse_extra_args
from workers.generator.settings import ProposerSettings


@pytest.mark.parametrize(
    ("extra_args", "expected"),
    [
        (None, (None, None, None)),
        ({}, (None, None, None)),
        ({"das_problem_id": "p1"}, ("p1", None, None)),
        ({"das_problem_id": "p1", "das_epoch": 3, "das_sample": 0, "other": "x"}, ("p1", 3, 0)),
    ],
)
def test_well_formed_extra_args_give_problem_epoch_and_sample(extra_args, expected) -> None:
    *parsed, problem = parse_extra_args(extra_args)
    assert tuple(parsed) == expected
    assert problem is None


@pytest.mark.parametrize(
    ("extra_args", "reason"),
    [
        ("p1", "not a dict"),
        ({"das_problem_id": 7}, "non-empty str"),
        ({"das_problem_id": ""}, "non-empty str"),
        ({"das_problem_id": "x" * 513}, "at most 512"),
        ({"das_problem_id": "p", "das_epoch": -1}, "das_epoch"),
        ({"das_problem_id": "p", "das_epoch": True}, "das_epoch"),
        ({"das_problem_id": "p", "das_sample": "0"}, "das_sample"),
    ],
)
def test_malformed_extra_args_are_named_and_fall_back_to_own_context(extra_args, reason) -> None:
    problem_id, epoch, sample, problem = parse_extra_args(extra_args)
    assert (problem_id, epoch, sample) == (None, None, None)
    assert reason in problem


def test_settings_come_from_das_environment_variables(monkeypatch) -> None:
    monkeypatch.setenv("DAS_BUDGET", "off")
    monkeypatch.setenv("DAS_MIN_TOKEN_PROB", "0.2")
    monkeypatch.setenv("DAS_HISTORY_DIR", "/tmp/replica")
    monkeypatch.setenv("DAS_REMEMBERED_PROBS", "on")
    settings = ProposerSettings.from_env()
    assert (settings.budget, settings.min_token_prob, settings.history_dir) == (False, 0.2, "/tmp/replica")
    assert settings.drafting(8).remembered_probs


def test_the_probability_floor_follows_the_budget_alike_in_code_and_in_the_environment(monkeypatch) -> None:
    # One rule: with the budget on, no floor on the tree's probabilities (its pay-off rule cuts drafts);
    # settings built in code (`das bench fidelity` does) must not contradict what the engine reads.
    for name in [n for n in os.environ if n.startswith("DAS_")]:
        monkeypatch.delenv(name)
    for budget in (True, False):
        monkeypatch.setenv("DAS_BUDGET", "on" if budget else "off")
        assert ProposerSettings.from_env() == ProposerSettings(budget=budget)
    assert (ProposerSettings().min_token_prob, ProposerSettings(budget=False).min_token_prob) == (0.0, 0.1)


def test_unparsable_settings_name_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("DAS_MIN_TOKEN_PROB", "high")
    with pytest.raises(ValueError, match="DAS_MIN_TOKEN_PROB"):
        ProposerSettings.from_env()
    monkeypatch.setenv("DAS_MIN_TOKEN_PROB", "0.1")
    monkeypatch.setenv("DAS_BUDGET", "maybe")
    with pytest.raises(ValueError, match="DAS_BUDGET"):
        ProposerSettings.from_env()
    monkeypatch.setenv("DAS_BUDGET", "on")
    monkeypatch.setenv("DAS_REMEMBERED_PROBS", "yes")
    with pytest.raises(ValueError, match="DAS_REMEMBERED_PROBS"):
        ProposerSettings.from_env()
    monkeypatch.setenv("DAS_REMEMBERED_PROBS", "off")
    monkeypatch.setenv("DAS_HISTORY_LOAD", "sometimes")
    with pytest.raises(ValueError, match="DAS_HISTORY_LOAD"):
        ProposerSettings.from_env()
    monkeypatch.setenv("DAS_HISTORY_LOAD", "lazy")
    monkeypatch.setenv(
        "DAS_WINDOW_EPOCHS", "0"
    )  # parses, but out of range: the field's rule, the variable's name
    with pytest.raises(ValueError, match="^DAS_WINDOW_EPOCHS: Input should be greater than or equal to 1"):
        ProposerSettings.from_env()
