"""The DAS proposer inside a real vLLM (CPU) engine with the prepared SmolLM2 model, float32 greedy.

Three engines run one after another (plain decoding, vLLM's ngram, DAS), each once per module. Greedy float32,
because identity needs exact tokens; that sampled outputs follow the plain-sampling distribution is
tests/test_sampling_distribution.py's job.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from history_store.durable.store import HistoryStore
from pipeline.schemas import TrajectoryRecord
from workers.rollout.worker import (
    EngineOptions,
    Problem,
    RolloutWorker,
    build_engine,
    builtin_problems,
    shutdown_engine,
)

pytestmark = pytest.mark.vllm

GREEDY = {"temperature": 0.0, "max_tokens": 256}
PROBLEMS = 4
OPTIONS = {"max_num_seqs": 4, "max_model_len": 1024}


def _tokens(finished) -> list[list[int]]:
    return [list(f.record.response_ids) for f in finished]


def _one_epoch(strategy: str) -> tuple[Any, list[list[int]]]:
    llm = build_engine(EngineOptions(strategy=strategy, **OPTIONS))
    try:
        worker = RolloutWorker(llm, strategy)
        report, finished = worker.run_epoch(builtin_problems(llm.get_tokenizer(), PROBLEMS), 0, 1, GREEDY)
        return report, _tokens(finished)
    finally:
        shutdown_engine(llm)


@pytest.fixture(scope="module")
def plain() -> tuple[Any, list[list[int]]]:
    return _one_epoch("none")


@pytest.fixture(scope="module")
def ngram() -> tuple[Any, list[list[int]]]:
    return _one_epoch("ngram")


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """A node's history replica (distributed mode): this process writes it, the proposer reads it."""
    with HistoryStore(tmp_path_factory.mktemp("replica") / "history") as store:
        yield store


@pytest.fixture(scope="module")
def das(plain, ngram, replica):
    """The DAS engine (built after the other two have shut down), reading `replica`, and its worker."""
    previous = os.environ.get("DAS_HISTORY_DIR")
    # vLLM's engine process inherits the environment when it is spawned, i.e. inside build_engine.
    os.environ["DAS_HISTORY_DIR"] = str(replica.path)
    try:
        llm = build_engine(EngineOptions(strategy="das", **OPTIONS))
    finally:
        if previous is None:
            del os.environ["DAS_HISTORY_DIR"]
        else:
            os.environ["DAS_HISTORY_DIR"] = previous
    try:
        yield RolloutWorker(llm, "das")
    finally:
        shutdown_engine(llm)


@pytest.fixture(scope="module")
def das_epochs(das):
    """Two epochs of the same problems: the first builds history, the second drafts from it."""
    problems = builtin_problems(das.llm.get_tokenizer(), PROBLEMS)
    return [das.run_epoch(problems, epoch, 1, GREEDY) for epoch in (0, 1)]


def test_das_outputs_equal_plain_decoding_with_cold_and_warm_history(plain, das_epochs) -> None:
    _, reference = plain
    assert sum(map(len, reference)) >= PROBLEMS * 100, "references too short to prove anything"
    for report, finished in das_epochs:
        assert _tokens(finished) == reference, f"epoch {report.epoch} changed an output"
        assert report.proposer["errors"] == 0


def test_second_epoch_drafts_from_the_first_and_accepts_more_per_step_than_ngram(ngram, das_epochs) -> None:
    ngram_report, _ = ngram
    (first, _), (second, _) = das_epochs
    assert second.proposer["sources"]["history"] > 0, "epoch 1 never drafted from its problem's history"
    assert second.mean_accepted_per_step > first.mean_accepted_per_step
    assert second.mean_accepted_per_step > ngram_report.mean_accepted_per_step, (
        f"das {second.mean_accepted_per_step} vs ngram {ngram_report.mean_accepted_per_step} accepted per step"
    )


def test_budget_cost_model_is_fitted_from_measured_engine_steps(das_epochs) -> None:
    _, (second, _) = das_epochs
    policy = second.proposer["policy"]
    assert policy["cost_model_steps"] > 10
    assert policy["cost_model"]["c_base"] > 0
    assert second.proposer["budget_tokens"] > 0


def test_spec_counters_are_read_from_the_engines_own_logger(das, das_epochs) -> None:
    """`RolloutWorker.spec_counters` reads the engine's own Prometheus logger (the registry only holds the
    newest engine's metrics when a process builds several): with one engine alive both readings agree."""
    from workers.rollout.worker import _own_spec_counters, _registry_spec_counters

    own = _own_spec_counters(das.llm)
    assert own == _registry_spec_counters(das.llm) == das.spec_counters()
    assert 0 < own["accepted_tokens"] <= own["draft_tokens"]


MALFORMED = [
    {"das_problem_id": 5},
    {"das_problem_id": ""},
    {"das_problem_id": "p" * 1000},
    {"das_problem_id": "builtin-0", "das_epoch": "one"},
]


def test_requests_without_ids_or_with_malformed_ids_complete_unchanged(plain, das, das_epochs) -> None:
    _, reference = plain
    problems = builtin_problems(das.llm.get_tokenizer(), PROBLEMS)
    before = das.proposer_stats()["malformed_requests"]
    cases = [None, {}] + MALFORMED
    requests = [(problems[i % PROBLEMS], 9, i) for i in range(len(cases))]
    finished = das.run(requests, GREEDY, extra_args=lambda problem, epoch, sample: cases[sample])
    assert _tokens(finished) == [reference[i % PROBLEMS] for i in range(len(cases))]
    stats = das.proposer_stats()
    assert stats["malformed_requests"] - before == len(MALFORMED)
    assert stats["errors"] == 0


def test_a_problem_whose_history_is_evicted_mid_run_completes_unchanged(plain, das, das_epochs) -> None:
    _, reference = plain
    problems = builtin_problems(das.llm.get_tokenizer(), PROBLEMS)
    evicted: list[int] = []

    def evict_after_a_few_steps(step: int) -> None:
        if step == 8:
            evicted.extend(das.evict(p.problem_id, min_epoch=100) for p in problems)

    finished = das.run([(p, 20, 0) for p in problems], GREEDY, between_steps=evict_after_a_few_steps)
    assert sum(evicted) >= 2 * PROBLEMS, f"expected both epochs of history evicted, got {evicted}"
    assert _tokens(finished) == reference
    assert das.proposer_stats()["errors"] == 0


def test_trajectories_written_to_the_replica_become_draftable_without_a_restart(plain, das, replica) -> None:
    _, reference = plain
    prompt = builtin_problems(das.llm.get_tokenizer(), 1)[0].prompt_ids
    replica.apply(
        [
            TrajectoryRecord(
                problem_id="replica-0", epoch=0, sample=0, prompt_ids=list(prompt), response_ids=reference[0]
            )
        ]
    )
    before = das.proposer_stats()
    # The server's history thread takes it in between steps, within about a catch-up interval.
    deadline = time.monotonic() + 60
    while (
        das.proposer_stats()["history_problems"] == before["history_problems"] and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    finished = das.run([(Problem("replica-0", prompt), 1, 0)], GREEDY)
    after = das.proposer_stats()
    assert _tokens(finished) == [reference[0]]
    assert after["history_problems"] == before["history_problems"] + 1, (
        "the replica's new problem never arrived"
    )
    assert after["accepted_tokens"] - before["accepted_tokens"] >= len(reference[0]) // 2
    assert after["errors"] == 0


def test_an_engine_whose_replica_is_missing_starts_and_follows_it_once_it_appears(
    tmp_path, monkeypatch
) -> None:
    """vLLM calls `load_model` unguarded: a missing replica must leave the server up and drafting (issue 47)."""
    replica_path = tmp_path / "history"  # nothing there yet: the history service starts late
    monkeypatch.setenv("DAS_HISTORY_DIR", str(replica_path))
    monkeypatch.setenv("DAS_HISTORY_RETRY_S", "0.2")
    # The budget prices drafts by this machine's measured step times (a loaded machine drafts less); off, a draft
    # depends on history alone, which is what this test is about. The engine process reads it when it starts.
    monkeypatch.setenv("DAS_BUDGET", "off")
    llm = build_engine(EngineOptions(strategy="das", **OPTIONS))
    try:
        worker = RolloutWorker(llm, "das")
        stats = worker.proposer_stats()
        assert not stats["history_available"] and stats["history_outages"] == 1
        prompt = builtin_problems(llm.get_tokenizer(), 1)[0].prompt_ids
        (first,) = _tokens(worker.run([(Problem("own-0", prompt), 1, 0)], GREEDY))
        with HistoryStore(replica_path) as store:
            store.apply(
                [
                    TrajectoryRecord(
                        problem_id="late-0", epoch=0, sample=0, prompt_ids=list(prompt), response_ids=first
                    )
                ]
            )
        # The proposer's thread retries every 0.2 s; the first step after it opened the replica loads it.
        deadline = time.monotonic() + 120
        while not worker.proposer_stats()["history_available"] and time.monotonic() < deadline:
            time.sleep(0.2)
            worker.run([(Problem("poll", prompt), 0, 0)], {"temperature": 0.0, "max_tokens": 4})
        before = worker.proposer_stats()
        (again,) = _tokens(worker.run([(Problem("late-0", prompt), 1, 0)], GREEDY))
        after = worker.proposer_stats()
        assert again == first
        assert after["history_available"] and after["history_outages"] == 1
        assert after["history_problems"] >= 2 and after["errors"] == 0
        assert after["accepted_tokens"] - before["accepted_tokens"] >= len(first) // 2
    finally:
        shutdown_engine(llm)
