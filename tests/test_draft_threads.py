"""Drafting a large batch on several threads (numba's TBB layer): the drafts are exactly those of one thread,
the layer is the fork-safe one this venv installs, and a process forked after its parent drafted on threads
drafts on threads too (GNU OpenMP would abort it: vLLM forks its engine processes)."""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numba
import pytest

from history_store.automaton import kernels as K
from history_store.automaton.draft_threads import usable_draft_threads
from workers.bench.proposer import _build, _engine_for
from workers.bench.replay import load_traces
from workers.generator.settings import ProposerSettings

DRAFT_K = 8
TRACE = Path(__file__).resolve().parent.parent / "data" / "dev_rollouts.jsonl"


def _drafts(threads: int, batch: int, steps: int) -> list[list[list[int]]]:
    records = load_traces(TRACE)
    max_len = max(len(r.prompt_ids) + len(r.response_ids) for r in records) + DRAFT_K + 2
    with mock.patch.dict(os.environ, {"DAS_DRAFT_THREADS": str(threads)}):  # as vLLM's worker reads it
        proposer, live, history, last = _build(records, DRAFT_K, max_len)
    assert proposer.stats()["draft_threads"] == threads
    engine = _engine_for(proposer, live, history, last, batch, max_len)
    out = []
    for _ in range(steps):
        drafts = proposer.step(engine.req_ids(), engine.num_tokens, engine.token_ids, engine.requests)
        out.append(drafts)
        engine.verify(drafts)
    assert proposer.stats()["errors"] == 0
    return out


def test_this_venv_drafts_on_tbb_threads() -> None:
    assert usable_draft_threads(2) == 2, "requirements/project.txt installs tbb: two threads must be granted"
    assert numba.threading_layer() == "tbb"
    assert usable_draft_threads(1) == 1


def test_drafts_on_two_threads_are_exactly_those_of_one() -> None:
    batch = 2 * K.PARALLEL_MIN_ROWS  # large enough for the threaded pass
    one = _drafts(1, batch, 120)
    assert sum(len(d) for drafts in one for d in drafts) > 1000, "the workload must draft"
    assert _drafts(2, batch, 120) == one


def _child(queue: multiprocessing.Queue) -> None:
    queue.put(_drafts(2, K.PARALLEL_MIN_ROWS, 20))


def test_a_forked_process_drafts_on_threads_after_its_parent_did() -> None:
    parent = _drafts(2, K.PARALLEL_MIN_ROWS, 20)  # the parent's threads are running now
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(queue,))
    child.start()
    try:
        drafted = queue.get(timeout=300)  # before join: a child blocks on exit until its queue is read
    except queue_module.Empty:
        drafted = None
    child.join(timeout=60)
    assert child.exitcode == 0, f"the forked child died (exit code {child.exitcode})"
    assert drafted == parent


def test_the_thread_setting_parses_or_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("DAS_DRAFT_THREADS", "3")
    assert ProposerSettings.from_env().draft_threads == 3
    monkeypatch.delenv("DAS_DRAFT_THREADS")
    assert ProposerSettings.from_env().draft_threads == 1
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("DAS_DRAFT_THREADS", bad)
        with pytest.raises(ValueError, match="DAS_DRAFT_THREADS"):
            ProposerSettings.from_env()


def test_no_more_threads_than_cpus_the_process_may_run_on(monkeypatch, caplog) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    with caplog.at_level("WARNING", logger="history_store.automaton.draft_threads"):
        assert usable_draft_threads(4) == 1
    assert "drafting on 1 thread(s), not 4: this process may run on 1 CPU(s)" in caplog.text


STEP_SCRIPT = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from test_draft_threads import _drafts
print(sum(len(d) for drafts in _drafts(1, 2, 30) for d in drafts))
"""


def test_a_step_compiled_against_cached_kernels_links(tmp_path: Path) -> None:
    # `das bench replay` caches the drafting kernels; the proposer compiles its step against them; then a
    # proposer that must compile its step again (its caches deleted here) links against a cached `step_rows`
    # that carries no record of the threaded pass it calls. numba registers the threading layer's symbols only
    # when it launches the layer, which loading a cached kernel as a callee does not do, so `_kernels` starts
    # the layer at import. Without that the last run aborted ("LLVM ERROR: Symbol not found:
    # allocate_sched"); in other orders of runs it segfaulted.
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    replay = [
        sys.executable,
        "-m",
        "workers.cli",
        "bench",
        "replay",
        str(TRACE),
        "--strategies",
        "das",
        "--json",
    ]
    subprocess.run(replay, capture_output=True, text=True, env=env, timeout=600, check=True)
    step = [sys.executable, "-c", STEP_SCRIPT]
    first = subprocess.run(step, capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    step_caches = list(tmp_path.rglob("step.*.nb[ic]"))
    assert step_caches, "the first run must cache the step kernels"
    for path in step_caches:
        path.unlink()
    second = subprocess.run(step, capture_output=True, text=True, env=env, timeout=600)
    assert second.returncode == 0, f"exit {second.returncode}: {second.stderr[-2000:]}"
    assert second.stdout.split()[-1] == first.stdout.split()[-1]  # the same drafts
