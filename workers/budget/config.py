"""The budget policy's tunables, validated once (`BudgetConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

# The tree's probability floor for drafts the budget cuts: none. With the budget on, its calibrated pay-off rule
# decides where a draft ends, and a fixed floor on the tree's raw probabilities would cut first (one trajectory
# of history halves them per token). The proposer's default and the replay's budgeted strategies read it here.
BUDGET_MIN_TOKEN_PROB = 0.0


@dataclass(frozen=True)
class BudgetConfig:
    """Tunables of the policy. None is per model or per trace: costs and acceptance are fitted online."""

    # K: vLLM's num_speculative_tokens; no budget exceeds it (vLLM asserts accepted <= K).
    max_tokens: int = 8
    # Recent response lengths kept per problem: about three epochs of 16 samples, the history window.
    lengths_per_problem: int = 48
    # Cost model prior (seconds), used until enough steps are measured and as a weak ridge target. Only its
    # ratios matter before the fit, and it is deliberately pessimistic about drafting: a verified token costs
    # a fiftieth of a step (the CPU test model's order); GPU verifiers fit far cheaper tokens within steps.
    prior_c_base: float = 0.05
    prior_c_seq: float = 0.001
    prior_c_tok: float = 0.001
    # Steps kept for the fit: a few seconds of decoding, long enough to average noise, short enough to follow
    # load changes (other processes on the machine, batch size changes).
    cost_window: int = 256
    # Steps measured before the fit replaces the prior.
    min_fit_steps: int = 16
    # Steps between refits (a fit costs tens of microseconds; the window moves slowly).
    refit_every: int = 8
    # Ridge weight, relative to the data's scale; small: it only matters along directions the data leaves free.
    ridge: float = 1e-3
    # Acceptance model: per-step forgetting of its accumulated curvature (a few hundred steps of memory, so it
    # follows policy drift across epochs) and the ridge that keeps it defined along features never seen.
    acceptance_forgetting: float = 0.99
    acceptance_ridge: float = 1.0
    # Recent acceptance of a request decays by this factor per verified draft, of a problem per step.
    request_decay: float = 0.7
    problem_decay: float = 0.98
    # Recent acceptance of a drafted token (its bucket of `token_outcomes`) decays by this factor per trial.
    token_decay: float = 0.99
    # Decay of a request's running accepted tokens per step (its speed, for the tail probability).
    rate_decay: float = 0.8

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if min(self.prior_c_base, self.prior_c_seq, self.prior_c_tok) < 0:
            raise ValueError("cost model priors must be >= 0")
        if self.lengths_per_problem < 1 or self.cost_window < 3:
            raise ValueError("lengths_per_problem >= 1 and cost_window >= 3 are required")
        if self.min_fit_steps < 3 or self.refit_every < 1 or self.ridge <= 0 or self.acceptance_ridge <= 0:
            raise ValueError(
                "min_fit_steps >= 3, refit_every >= 1, ridge > 0 and acceptance_ridge > 0 are required"
            )
        for name in ("acceptance_forgetting", "request_decay", "problem_decay", "token_decay", "rate_decay"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
