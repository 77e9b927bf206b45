"""A drafting server follows its node's replica off the decode step (`workers.generator.history_feed`, issue 47
item 1): while a writer appends and slides windows, the tree work runs on the feed's thread only, never inside
a step; a trajectory the server finished itself is inserted once (its replica copy is skipped); and once the
feed has caught up, the server drafts exactly what a server that loads the replica afresh drafts.

Real `DasProposer`s on one real RocksDB replica written by the real `HistoryStore`."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from _store_workload import Workload

from history_store.automaton.deferred_index import DeferredIndex
from history_store.durable.store import HistoryStore
from workers.generator.proposer import DasProposer

K = 8
MAX_LEN = 2048
WORKLOAD = Workload(problems=5, epochs=4, samples=3, min_len=40, max_len=90)


def _proposer(replica: Path, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DasProposer:
    monkeypatch.setenv("DAS_HISTORY_DIR", str(replica))
    monkeypatch.setenv("DAS_SECONDARY_DIR", str(tmp_path / f"secondary-{name}"))
    monkeypatch.setenv("DAS_CATCH_UP_INTERVAL_S", "0.02")
    monkeypatch.setenv("DAS_WINDOW_EPOCHS", "2")
    monkeypatch.setenv("DAS_BUDGET", "off")  # drafts then depend on the trees alone: two proposers compare
    proposer = DasProposer.standalone(K, MAX_LEN)
    proposer.load_model()
    return proposer


def _request(
    problem_id: str,
    prompt_len: int,
    epoch: int | None = None,
    sample: int | None = None,
    max_tokens: int = 512,
) -> Any:
    extra: dict[str, Any] = {"das_problem_id": problem_id}
    if epoch is not None:
        extra.update(das_epoch=epoch, das_sample=sample)
    return SimpleNamespace(
        num_prompt_tokens=prompt_len, sampling_params=SimpleNamespace(extra_args=extra, max_tokens=max_tokens)
    )


def _probes(proposer: DasProposer) -> list[list[int]]:
    """One fresh request per (problem, kept epoch) of the last records' prefixes: what the trees draft."""
    drafts = []
    for p in range(WORKLOAD.problems):
        for e in range(WORKLOAD.epochs - 2, WORKLOAD.epochs):
            record = WORKLOAD.record(p, e, 2)
            tokens = list(record.prompt_ids) + list(record.response_ids[:5])
            key = f"probe-{p}-{e}"
            matrix = np.zeros((1, MAX_LEN), np.int32)
            matrix[0, : len(tokens)] = tokens
            requests = {key: _request(record.problem_id, len(record.prompt_ids))}
            (draft,) = proposer.step([key], np.array([len(tokens)], np.int32), matrix, requests)
            drafts.append(draft)
            proposer.step([], np.zeros(0, np.int32), np.zeros((0, MAX_LEN), np.int32), {})
    return drafts


def test_the_feed_works_off_the_step_inserts_own_rollouts_once_and_ends_where_a_fresh_load_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    replica = tmp_path / "replica"
    stream = WORKLOAD.stream()
    first = [r for r in stream if r.epoch == 0]
    later = [r for r in stream if r.epoch > 0]
    # One writer session throughout: a RocksDB secondary does not follow a writer that reopens the store (the
    # reader then reopens itself: test_store_stale_reader).
    writer = HistoryStore(replica, window_epochs=3)
    writer.apply(first)
    server = _proposer(replica, "server", tmp_path, monkeypatch)
    assert isinstance(server.index, DeferredIndex)
    # Tree work done inside a step (none may be) and by which threads.
    in_step = threading.Event()
    inside: list[int] = []
    threads: set[str] = set()
    work, step = server.index.work, server._step

    def recorded_work(budget: int) -> int:
        threads.add(threading.current_thread().name)
        if in_step.is_set():
            inside.append(budget)
        return work(budget)

    def recorded_step(*args: Any) -> Any:
        in_step.set()
        try:
            return step(*args)
        finally:
            in_step.clear()

    server.index.work = recorded_work  # type: ignore[method-assign]
    server._step = recorded_step  # type: ignore[method-assign]

    # The server finishes one rollout itself (as a request carrying its key), then the writer publishes it.
    own = WORKLOAD.record(1, 1, 0)
    prompt, response = list(own.prompt_ids), list(own.response_ids)
    requests = {"own": _request(own.problem_id, len(prompt), own.epoch, own.sample, len(response))}
    for end in range(len(prompt) + 1, len(prompt) + len(response) + 1, 4):
        matrix = np.zeros((1, MAX_LEN), np.int32)
        matrix[0, :end] = (prompt + response)[:end]
        server.step(["own"], np.array([end], np.int32), matrix, requests)
    matrix = np.zeros((1, MAX_LEN), np.int32)
    matrix[0, : len(prompt) + len(response)] = prompt + response
    server.step(["own"], np.array([len(prompt) + len(response)], np.int32), matrix, requests)
    server.step([], np.zeros(0, np.int32), np.zeros((0, MAX_LEN), np.int32), {})  # it finished here

    # The writer goes on, epoch by epoch (windows slide, the index evicts), while the server keeps stepping.
    for start in range(0, len(later), 4):
        writer.apply(later[start : start + 4])
        _probes(server)
        time.sleep(0.05)  # the engine's forward pass: the feed's thread works meanwhile
    server.catch_up()  # everything the writer wrote, in the trees now (the thread would, within moments)
    writer.close()

    assert inside == [] and "das-history" in threads
    feed = server.stats()["history_feed"]
    assert feed["own_skipped"] == 1 and feed["errors"] == 0 and feed["available"]

    fresh = _proposer(replica, "fresh", tmp_path, monkeypatch)
    assert _probes(server) == _probes(fresh)
    assert sum(len(d) for d in _probes(fresh)) > 0
    for p in range(WORKLOAD.problems):
        problem_id = WORKLOAD.record(p, 0, 0).problem_id
        assert (
            server.index.problem_stats(problem_id)["epochs"]
            == fresh.index.problem_stats(problem_id)["epochs"]
        )
    server.close()
    fresh.close()
