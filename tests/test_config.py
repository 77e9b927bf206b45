"""One home per default: the drafter's, the budget's and the proposer's tunables are validated dataclasses
whose fields document themselves, and everything else that offers a default reads it from them."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from history_store.automaton.config import DEFAULT_WINDOW_EPOCHS, DraftConfig
from history_store.automaton.problem_index import ProblemIndex
from workers.bench.cost_model import CostModel
from workers.budget.config import BUDGET_MIN_TOKEN_PROB, BudgetConfig
from workers.generator.settings import ProposerSettings

CONFIGS = (DraftConfig, BudgetConfig, ProposerSettings)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_every_tunable_is_documented(config: type) -> None:
    undocumented = [name for name, field in config.__pydantic_fields__.items() if not field.description]
    assert not undocumented, f"{config.__name__}: fields without a docstring: {undocumented}"


@pytest.mark.parametrize(
    ("config", "field", "value"),
    [
        (DraftConfig, "max_depth", 0),
        (DraftConfig, "min_token_prob", 1.5),
        (DraftConfig, "escape", -1.0),
        (BudgetConfig, "max_tokens", 0),
        (BudgetConfig, "rate_decay", 0.0),
        (BudgetConfig, "cost_window", 2),
        (ProposerSettings, "window_epochs", 0),
        (ProposerSettings, "history_load", "sometimes"),
        (ProposerSettings, "draft_threads", 0),
    ],
)
def test_out_of_range_values_are_refused_by_name(config: type, field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        config(**{field: value})
    with pytest.raises(ValueError, match="extra|unexpected"):
        config(not_a_setting=1)


def test_the_probability_floor_follows_the_budget() -> None:
    assert ProposerSettings().min_token_prob == BUDGET_MIN_TOKEN_PROB
    assert ProposerSettings(budget=False).min_token_prob == DraftConfig.min_token_prob
    assert ProposerSettings(budget=False, min_token_prob=0.3).drafting(4).min_token_prob == 0.3


def test_defaults_have_one_home() -> None:
    """The proposer's drafting, the index's window and the replay's flags default to the configs' values."""
    from workers.cli import build_cli

    args = build_cli().parser.parse_args(["bench", "replay", "trace.jsonl"])
    draft, cost = DraftConfig(), CostModel()
    assert (args.depth, args.min_token_prob, args.max_spec_factor, args.max_spec_offset, args.escape) == (
        draft.max_depth,
        draft.min_token_prob,
        draft.max_spec_factor,
        draft.max_spec_offset,
        draft.escape,
    )
    assert (args.max_draft, args.window) == (draft.max_spec_tokens, DEFAULT_WINDOW_EPOCHS)
    assert (args.c_base, args.c_seq, args.c_tok) == dataclasses.astuple(cost)
    assert ProposerSettings().window_epochs == ProblemIndex().window_epochs == DEFAULT_WINDOW_EPOCHS
    settings = ProposerSettings(budget=False)
    assert dataclasses.replace(settings.drafting(draft.max_spec_tokens)) == draft


def test_the_configs_import_no_numba() -> None:
    """`das` reads these defaults in processes that start vLLM's CPU engine, which fails to start once numba
    is imported."""
    code = (
        "import sys; import history_store.automaton.config, workers.budget.config, workers.generator.settings, "
        "workers.bench.cost_model; print('numba' in sys.modules)"
    )
    assert subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout == ("False\n")
