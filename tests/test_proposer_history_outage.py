"""A history replica that is missing, empty or does not open when vLLM calls `load_model` means fewer drafts, not
a server that fails to start (issue 47, item 4): the proposer starts without history, drafts from its own
requests, retries the replica on a thread of its own and follows it once it opens, drafting then exactly what a
proposer that found the replica at start drafts.

Real `DasProposer`s on a real RocksDB replica written by the real `HistoryStore`, driven as vLLM's runner drives
them (rows of prompt + committed tokens)."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from _store_workload import PROMPT_BASE, Workload

from history_store.durable.store import HistoryStore
from monitoring.metrics import PROPOSER_HISTORY_MISSING, PROPOSER_HISTORY_OUTAGES
from workers.generator.proposer import DasProposer

K = 8
MAX_LEN = 2048
WORKLOAD = Workload(problems=4, epochs=2, samples=2, min_len=40, max_len=80)


def _proposer(replica: Path, secondary: Path, monkeypatch: pytest.MonkeyPatch) -> DasProposer:
    monkeypatch.setenv("DAS_HISTORY_DIR", str(replica))
    monkeypatch.setenv("DAS_SECONDARY_DIR", str(secondary))
    monkeypatch.setenv("DAS_HISTORY_RETRY_S", "0.05")
    monkeypatch.setenv("DAS_BUDGET", "off")  # drafts then depend on the trees alone: two proposers compare
    proposer = DasProposer.standalone(K, MAX_LEN)
    proposer.load_model()
    ticks = iter(np.arange(1.0, 1e6, 0.5))  # every step is past the catch-up interval
    proposer.clock = lambda: float(next(ticks))
    return proposer


def _request(problem_id: str, prompt: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        num_prompt_tokens=len(prompt),
        sampling_params=SimpleNamespace(extra_args={"das_problem_id": problem_id}, max_tokens=512),
    )


def _drive(
    proposer: DasProposer, key: str, problem_id: str, prompt: list[int], response: list[int]
) -> list[int]:
    """One request alone in the batch, committing its response three tokens a step; every token drafted."""
    tokens, drafted = list(prompt), []
    requests = {key: _request(problem_id, prompt)}
    for start in range(0, len(response), 3):
        tokens.extend(response[start : start + 3])
        matrix = np.zeros((1, MAX_LEN), np.int32)
        matrix[0, : len(tokens)] = tokens
        (draft,) = proposer.step([key], np.array([len(tokens)], np.int32), matrix, requests)
        drafted.extend(draft)
    proposer.step([], np.zeros(0, np.int32), np.zeros((0, MAX_LEN), np.int32), {})  # it finished
    return drafted


def _break(replica: Path, how: str) -> None:
    if how == "empty":
        replica.mkdir()
    elif how == "damaged":
        replica.mkdir()
        (replica / "CURRENT").write_text("MANIFEST-999999\n")  # names a manifest that is not there


@pytest.mark.parametrize("how", ["missing", "empty", "damaged"])
def test_a_proposer_without_its_replica_starts_drafts_from_its_requests_and_follows_the_replica_once_it_opens(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    replica = tmp_path / "replica"
    _break(replica, how)
    outages = PROPOSER_HISTORY_OUTAGES._value.get()
    with caplog.at_level(logging.WARNING, logger="workers.generator.proposer"):
        proposer = _proposer(replica, tmp_path / "secondary", monkeypatch)  # vLLM's load_model: no raise
    warnings = [r.getMessage() for r in caplog.records if "history replica" in r.getMessage()]
    assert len(warnings) == 1 and "unavailable" in warnings[0] and str(replica) in warnings[0]
    assert not proposer.history_available
    assert proposer.stats()["history_outages"] == 1
    assert PROPOSER_HISTORY_MISSING._value.get() == 1
    assert PROPOSER_HISTORY_OUTAGES._value.get() == outages + 1

    # Without history it drafts from the request's own context: a response that repeats itself.
    own = _drive(proposer, "own", "problem-1", [7, 8, 9], [11, 12, 13, 14, 15, 16] * 6)
    assert len(own) > 10 and set(own) <= {11, 12, 13, 14, 15, 16}

    # The replica appears (the history service started late); the proposer's thread opens it and loads it
    # between steps.
    if how != "missing":
        shutil.rmtree(replica)
    with HistoryStore(replica, window_epochs=3) as store:
        store.apply(WORKLOAD.stream())
    deadline = time.monotonic() + 120
    while not proposer.history_available and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proposer.history_available
    proposer.catch_up()  # the thread's load finished now (it goes on in pieces otherwise)
    prompt = list(WORKLOAD.record(2, 0, 0).prompt_ids)
    response = list(WORKLOAD.record(2, 1, 1).response_ids)
    late = _drive(proposer, "late", "problem-2", prompt, response)
    assert proposer.history_available and proposer.stats()["history_outages"] == 1
    assert PROPOSER_HISTORY_MISSING._value.get() == 0
    assert any("opened" in r.getMessage() for r in caplog.records)

    # It drafts what a server that found the replica at start drafts: from history.
    reference = _proposer(replica, tmp_path / "secondary-reference", monkeypatch)
    assert reference.history_available
    assert late == _drive(reference, "late", "problem-2", prompt, response)
    assert sum(token < PROMPT_BASE for token in late) > 20

    # The replica goes on: the late proposer follows it (its thread within a catch-up interval; here at once).
    with HistoryStore(replica, window_epochs=3) as store:
        store.apply([WORKLOAD.record(3, 2, s) for s in range(2)])
    proposer.catch_up()
    reference.catch_up()
    prompt, response = list(WORKLOAD.record(3, 0, 0).prompt_ids), list(WORKLOAD.record(3, 2, 0).response_ids)
    assert _drive(proposer, "next", "problem-3", prompt, response) == _drive(
        reference, "next", "problem-3", prompt, response
    )
    assert 2 in proposer.index.problem_stats("problem-3")["epochs"]
