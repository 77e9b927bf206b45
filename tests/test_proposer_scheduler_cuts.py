"""Acceptance is counted against what vLLM's scheduler verified, not what the proposer drafted.

With fewer tokens per engine step (`max_num_batched_tokens`) than the rows' drafts need, vLLM's scheduler cuts
drafts to fit; the tokens it cut were never tried. A real CPU engine with a 12-token step budget and 8 rows
cuts drafts often: the proposer must count exactly the draft tokens vLLM verified and accepted (its own
spec-decode counters), and its budget must learn from those tokens only.
"""

from __future__ import annotations

from typing import Any

import pytest

from workers.rollout.worker import (
    EngineOptions,
    RolloutWorker,
    build_engine,
    builtin_problems,
    shutdown_engine,
)

pytestmark = pytest.mark.vllm

GREEDY = {"temperature": 0.0, "max_tokens": 96}
OPTIONS = {"max_num_seqs": 8, "max_model_len": 1024, "max_num_batched_tokens": 12}


@pytest.fixture(scope="module")
def epochs() -> list[dict[str, Any]]:
    """Two epochs (the second drafts from the first's history), with vLLM's counters and the proposer's."""
    llm = build_engine(EngineOptions(strategy="das", **OPTIONS))
    try:
        worker = RolloutWorker(llm, "das")
        problems = builtin_problems(llm.get_tokenizer(), 4)
        out = []
        for epoch in range(2):
            before = worker.spec_counters()
            report, _ = worker.run_epoch(problems, epoch, 2, GREEDY)
            after = worker.spec_counters()
            out.append({"vllm": {k: after[k] - before[k] for k in after}, "das": report.proposer})
        return out
    finally:
        shutdown_engine(llm)


def test_the_scheduler_cut_drafts(epochs) -> None:
    proposed = sum(e["das"]["draft_tokens"] for e in epochs)
    verified = sum(e["vllm"]["draft_tokens"] for e in epochs)
    assert proposed > verified > 0, "no draft was cut: the step budget is not tight enough to test anything"


def test_verified_and_accepted_draft_tokens_are_vllms_own(epochs) -> None:
    for epoch in epochs:
        das, vllm = epoch["das"], epoch["vllm"]
        assert das["verified_draft_tokens"] == vllm["draft_tokens"]
        assert das["accepted_tokens"] == vllm["accepted_tokens"]
        assert das["verified_drafts"] == vllm["drafts"]


def test_the_budget_learns_from_verified_tokens_only(epochs) -> None:
    # A token is a trial when every token before it was accepted: never more than the tokens verified.
    trials = epochs[-1]["das"]["policy"]["acceptance_trials"]
    assert 0 < trials <= sum(e["das"]["verified_draft_tokens"] for e in epochs)
