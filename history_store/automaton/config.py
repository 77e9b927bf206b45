"""The drafter's tunables, validated once (`DraftConfig`): every other home of a drafting default (the
proposer's settings, the replay's flags) reads it from here. No numba here: the CLI reads these defaults in
processes that start vLLM's CPU engine, which fails to start when numba was imported first."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

# Epochs of history kept per problem, the sliding window: about three epochs of a problem's rollouts predict
# the next well while the policy moves slowly; the store's, the index's and the proposer's default.
DEFAULT_WINDOW_EPOCHS = 3

# K, the engine's num_speculative_tokens, by default: 8 keeps a rejected draft cheap on a CPU verifier (vLLM's
# n-gram examples use 5-10); the budget (its cap), the rollout and demo engines and the benchmarks of the step
# read it here. The replay drafts up to `DraftConfig.max_spec_tokens` instead, a GPU verifier's freer K.
DEFAULT_ENGINE_K = 8

# Each field's docstring is its documentation (pydantic keeps it as the field's description).
DOCUMENTED = ConfigDict(use_attribute_docstrings=True, extra="forbid")


@dataclass(frozen=True, config=DOCUMENTED)
class DraftConfig:
    """Drafting parameters: SuffixDecoding's, with its defaults where they fit RL rollouts."""

    max_depth: Annotated[int, Field(ge=1)] = 64
    """Longest context suffix matched: 64 covers repeated reasoning phrases without tying drafts to whole
    paragraphs (SuffixDecoding uses 24-64)."""

    max_spec_tokens: Annotated[int, Field(ge=0)] = 16
    """Hard cap on draft tokens per step (the engine's K)."""

    max_spec_factor: Annotated[float, Field(ge=0.0)] = 1.0
    """A match of length m drafts at most factor x m + offset tokens, so short, weak matches draft little
    (SuffixDecoding's rule and default)."""

    max_spec_offset: float = 0.0
    """See `max_spec_factor`."""

    min_token_prob: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1
    """Drafting stops where the path probability of the next token falls below this (SuffixDecoding's 0.1).
    With the length-aware budget on, its own pay-off rule ends drafts instead (`BUDGET_MIN_TOKEN_PROB`)."""

    escape: Annotated[float, Field(ge=0.0)] = 1.0
    """Pseudo-count of "a continuation not seen yet" in each probability, count / (total + escape): raw count
    ratios are overconfident on thin history (one sighting reads as certainty); 1.0 is PPM's method-A escape
    estimate, 0.0 SuffixDecoding's raw ratios."""

    all_matches: bool = True
    """Draft from every match length along the suffix links and keep the best-scoring draft
    (SuffixDecoding's rule); False drafts from the longest match that has a continuation only."""

    remembered_probs: bool = False
    """Hand the budget each draft token's remembered sampling probability: the mean probability its
    occurrences after the matched context were sampled with, where history carries them (`response_logprobs`).
    Drafts do not change. Off by default: on the annotated traces it moved the projected makespan by well
    under 1% (docs/benchmarks.md, "Remembered probabilities"), and only with it on does the arena keep them
    (`SuffixForest(remembered=True)`: two int32 columns per state and a byte per token, 95.1 bytes per stored
    token instead of 83.3 in `das bench tree`)."""
