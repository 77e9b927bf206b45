"""The budget policy's tunables, validated once (`BudgetConfig`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from pydantic.dataclasses import dataclass

from history_store.automaton.config import DEFAULT_ENGINE_K, DOCUMENTED

# The tree's probability floor for drafts the budget cuts: none. With the budget on, its calibrated pay-off rule
# decides where a draft ends, and a fixed floor on the tree's raw probabilities would cut first (one trajectory
# of history halves them per token). The proposer's default and the replay's budgeted strategies read it here.
BUDGET_MIN_TOKEN_PROB = 0.0

_Decay = Annotated[float, Field(gt=0.0, le=1.0)]


@dataclass(frozen=True, config=DOCUMENTED)
class BudgetConfig:
    """Tunables of the policy. None is per model or per trace: costs and acceptance are fitted online."""

    max_tokens: Annotated[int, Field(ge=1)] = DEFAULT_ENGINE_K
    """K: vLLM's num_speculative_tokens; no budget exceeds it (vLLM asserts accepted <= K)."""

    lengths_per_problem: Annotated[int, Field(ge=1)] = 48
    """Recent response lengths kept per problem: about three epochs of 16 samples, the history window."""

    prior_c_base: Annotated[float, Field(ge=0.0)] = 0.05
    """Cost model prior (seconds per step), used until enough steps are measured and as a weak ridge target.
    Only the priors' ratios matter before the fit, and they are deliberately pessimistic about drafting: a
    verified token costs a fiftieth of a step (the CPU test model's order); GPU verifiers fit far cheaper
    tokens within steps."""

    prior_c_seq: Annotated[float, Field(ge=0.0)] = 0.001
    """Cost model prior (seconds per active request per step)."""

    prior_c_tok: Annotated[float, Field(ge=0.0)] = 0.001
    """Cost model prior (seconds per verified token)."""

    cost_window: Annotated[int, Field(ge=3)] = 256
    """Steps kept for the fit: a few seconds of decoding, long enough to average noise, short enough to
    follow load changes (other processes on the machine, batch size changes)."""

    min_fit_steps: Annotated[int, Field(ge=3)] = 16
    """Steps measured before the fit replaces the prior."""

    refit_every: Annotated[int, Field(ge=1)] = 8
    """Steps between refits (a fit costs tens of microseconds; the window moves slowly)."""

    ridge: Annotated[float, Field(gt=0.0)] = 1e-3
    """Ridge weight of the cost fit, relative to the data's scale; small: it only matters along directions
    the data leaves free."""

    acceptance_forgetting: _Decay = 0.99
    """Per-step forgetting of the acceptance model's accumulated curvature: a few hundred steps of memory,
    so it follows policy drift across epochs."""

    acceptance_ridge: Annotated[float, Field(gt=0.0)] = 1.0
    """Keeps the acceptance model defined along features never seen."""

    request_decay: _Decay = 0.7
    """Decay of a request's recent acceptance per verified draft."""

    problem_decay: _Decay = 0.98
    """Decay of a problem's recent acceptance per step."""

    token_decay: _Decay = 0.99
    """Decay of a drafted token's recent acceptance (its bucket of `token_outcomes`) per trial."""

    rate_decay: _Decay = 0.8
    """Decay of a request's running accepted tokens per step (its speed, for the tail probability)."""
