"""A drafting server that loads a problem's history on its first request (`DAS_HISTORY_LOAD=lazy`) holds only
the trees of the problems it was asked for, and drafts exactly what a server that loaded the whole replica
drafts, through the replica's live additions, window slides and evictions (issue 37, item 6).

Both proposers are real `DasProposer`s on one real RocksDB replica (each its own secondary instance), driven
with the same requests and the same clock."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from _store_workload import Workload

from history_store.durable.store import HistoryStore
from workers.generator.proposer import DasProposer

K = 8
MAX_LEN = 2048
WORKLOAD = Workload(problems=6, epochs=3, samples=2, min_len=40, max_len=80)


def _proposer(replica: Path, load: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DasProposer:
    monkeypatch.setenv("DAS_HISTORY_DIR", str(replica))
    monkeypatch.setenv("DAS_SECONDARY_DIR", str(tmp_path / f"secondary-{load}"))
    monkeypatch.setenv("DAS_HISTORY_LOAD", load)
    monkeypatch.setenv("DAS_WINDOW_EPOCHS", "2")  # narrower than the store's: the index evicts on its own too
    proposer = DasProposer.standalone(K, MAX_LEN)
    proposer.load_model()
    ticks = iter(np.arange(1.0, 1e6, 0.01))  # one clock for both: the budget's step costs must agree
    proposer.clock = lambda: float(next(ticks))
    return proposer


def _eager_and_lazy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[DasProposer, DasProposer]:
    """Two proposers over one replica of WORKLOAD: one loads every problem's history at start, one on demand."""
    replica = tmp_path / "replica"
    with HistoryStore(replica, window_epochs=3) as store:
        store.apply(WORKLOAD.stream())
    return _proposer(replica, "eager", tmp_path, monkeypatch), _proposer(
        replica, "lazy", tmp_path, monkeypatch
    )


class Batch:
    """A decode batch as vLLM's runner hands it to the proposer: rows of prompt + committed tokens."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, list[int]]] = []
        self.requests: dict[str, SimpleNamespace] = {}

    def add(self, key: str, problem_id: str, prompt: list[int]) -> None:
        self.rows.append((key, list(prompt)))
        self.requests[key] = SimpleNamespace(
            num_prompt_tokens=len(prompt),
            sampling_params=SimpleNamespace(extra_args={"das_problem_id": problem_id}, max_tokens=512),
        )

    def remove(self, key: str) -> None:
        self.rows = [row for row in self.rows if row[0] != key]
        del self.requests[key]

    def step(self, proposers: list[DasProposer], commits: dict[str, list[int]]) -> list[list[list[int]]]:
        for key, tokens in self.rows:
            tokens.extend(commits.get(key, []))
        matrix = np.zeros((len(self.rows), MAX_LEN), np.int32)
        for i, (_, tokens) in enumerate(self.rows):
            matrix[i, : len(tokens)] = tokens
        lengths = np.array([len(tokens) for _, tokens in self.rows], np.int32)
        ids = [key for key, _ in self.rows]
        return [p.step(ids, lengths, matrix, self.requests) for p in proposers]


def _chunks(tokens: list[int], size: int = 3) -> Iterator[list[int]]:
    for start in range(0, len(tokens), size):
        yield tokens[start : start + size]


def test_a_problem_loaded_on_its_first_request_drafts_as_if_the_whole_history_was_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager, lazy = _eager_and_lazy(tmp_path, monkeypatch)
    problems = [f"problem-{p}" for p in range(WORKLOAD.problems)]

    # At start the lazy server knows every problem's window (the budget learns the same lengths) and holds the
    # same global tree, but no problem's tree.
    for problem_id in problems:
        stats = lazy.index.problem_stats(problem_id)
        assert stats["tokens"] == 0 and eager.index.problem_stats(problem_id)["tokens"] > 0
        assert stats["response_lengths"] == eager.index.problem_stats(problem_id)["response_lengths"]
    assert lazy.index.global_keys() == eager.index.global_keys()

    drafted = 0
    batch = Batch()
    prompt = WORKLOAD.record(1, 0, 0).prompt_ids
    batch.add("a", "problem-1", prompt)
    for chunk in _chunks(WORKLOAD.record(1, 2, 0).response_ids[:30]):
        first, second = batch.step([eager, lazy], {"a": chunk})
        assert first == second
        drafted += sum(map(len, first))
    assert lazy.index.problem_stats("problem-1") == eager.index.problem_stats("problem-1")

    # The writer goes on: a new epoch slides every window (epoch 1 leaves the proposers' two-epoch window),
    # then the store's own window evicts problem-2's oldest epoch. Problem 2 is loaded only after that.
    with HistoryStore(tmp_path / "replica", window_epochs=3) as store:
        store.apply([WORKLOAD.record(p, 3, s) for s in range(2) for p in range(WORKLOAD.problems)])
        for proposer in (eager, lazy):
            proposer.catch_up()
        store.apply([WORKLOAD.record(2, 5, s) for s in range(2)])
        for proposer in (eager, lazy):
            proposer.catch_up()
    assert eager.index.problem_stats("problem-2")["epochs"] == [5]

    batch.add("b", "problem-2", WORKLOAD.record(2, 0, 0).prompt_ids)
    batch.add("c", "problem-4", WORKLOAD.record(4, 0, 0).prompt_ids)
    batch.add("d", "fresh-problem", [5, 6, 7])  # no history anywhere: nothing to load
    responses = {
        "a": WORKLOAD.record(1, 3, 1).response_ids[:24],
        "b": WORKLOAD.record(2, 5, 1).response_ids[:24],
        "c": WORKLOAD.record(4, 3, 0).response_ids[:24],
        "d": [5, 6, 7] * 8,
    }
    chunked = {key: list(_chunks(tokens)) for key, tokens in responses.items()}
    for step in range(8):
        if step == 4:
            batch.remove("c")
        commits = {key: chunks[step] for key, chunks in chunked.items() if step < len(chunks)}
        first, second = batch.step([eager, lazy], commits)
        assert first == second
        drafted += sum(map(len, first))
    assert drafted > 40  # the history drafted: identical empty drafts would prove nothing

    # Problem 1 keeps its tree while its request runs; problem 4 (request done) moved to another server: its
    # tree goes, and a request that comes back builds it again, drafting as before.
    assert lazy.release(["problem-1"]) == 0
    assert lazy.release(["problem-4"]) == eager.index.problem_stats("problem-4")["tokens"] > 0
    assert lazy.index.problem_stats("problem-4")["tokens"] == 0
    batch.add("e", "problem-4", WORKLOAD.record(4, 0, 0).prompt_ids)
    for chunk in _chunks(WORKLOAD.record(4, 3, 1).response_ids[:24]):
        first, second = batch.step([eager, lazy], {"e": chunk})
        assert first == second
        drafted += sum(map(len, first))

    requested = {"problem-1", "problem-2", "problem-4"}
    for problem_id in problems:
        stats = lazy.index.problem_stats(problem_id)
        if problem_id in requested:
            assert stats == eager.index.problem_stats(problem_id)
        else:
            assert stats["tokens"] == 0
    assert lazy.index.global_keys() == eager.index.global_keys()
    loads = lazy.stats()["history_loads"]
    assert loads["problems"] == len(requested) + 1  # problem 4 twice
    assert 0 < loads["max_seconds"] <= loads["seconds"]
    assert eager.stats()["history_loads"]["problems"] == 0


def test_a_prefetched_problem_is_ready_before_its_first_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager, lazy = _eager_and_lazy(tmp_path, monkeypatch)
    assert lazy.prefetch(["problem-3", "problem-5", "no-history"]) == sum(
        eager.index.problem_stats(p)["tokens"] for p in ("problem-3", "problem-5")
    )
    assert lazy.prefetch(["problem-3"]) == 0  # resident already
    loaded = lazy.stats()["history_loads"]["problems"]
    batch = Batch()
    batch.add("a", "problem-3", WORKLOAD.record(3, 0, 0).prompt_ids)
    for chunk in _chunks(WORKLOAD.record(3, 2, 1).response_ids[:18]):
        first, second = batch.step([eager, lazy], {"a": chunk})
        assert first == second
    assert lazy.stats()["history_loads"]["problems"] == loaded  # the request built nothing
    assert lazy.index.problem_stats("problem-3") == eager.index.problem_stats("problem-3")
