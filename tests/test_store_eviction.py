"""Eviction under load: windows slide while new epochs arrive, evicted records leave RocksDB and the trees
together (writer and following reader alike), and no evicted token is ever drafted again."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from _store_workload import Workload, owner_of

from history_store.automaton.deferred_index import DeferredIndex
from history_store.automaton.problem_index import ProblemIndex
from history_store.indexed_history import IndexedHistory
from workers.generator.history_feed import HistoryFeed

WORKLOAD = Workload(problems=6, epochs=7, samples=4, min_len=40, max_len=120)
WINDOW = 2
PROBE_PREFIX = 8


def _probe(index: ProblemIndex, problem: int, epoch: int, sample: int, name: str) -> list[int]:
    """Draft for a request that has produced the first tokens of a given record's response."""
    record = WORKLOAD.record(problem, epoch, sample)
    key = f"probe-{name}-{problem}-{epoch}-{sample}"
    index.start_request(key, record.problem_id, record.prompt_ids + record.response_ids[:PROBE_PREFIX])
    try:
        return index.draft_batch([key], np.array([16], np.int32)).draft(0)
    finally:
        index.finish_request(key)


def test_sliding_windows_never_draft_an_evicted_token_from_writer_or_reader(tmp_path: Path) -> None:
    path = tmp_path / "h"
    evicted: set[tuple[int, int, int]] = set()
    with IndexedHistory.open(path, window_epochs=WINDOW) as history:
        # A drafting server's follower, driven by hand (`drain`) instead of by its thread.
        follower = DeferredIndex(window_epochs=WINDOW)
        feed = HistoryFeed(
            path,
            tmp_path / "secondary",
            follower,
            lambda *_: None,
            lambda _: None,
            lambda: None,
            publish=False,
        )
        assert feed.open()
        for epoch in range(WORKLOAD.epochs):
            # Problems arrive interleaved, in batches that straddle problems, like a bus partition.
            records = [
                WORKLOAD.record(p, epoch, s)
                for s in range(WORKLOAD.samples)
                for p in range(WORKLOAD.problems)
            ]
            for start in range(0, len(records), 5):
                result = history.apply(records[start : start + 5])
                evicted.update((int(pid.split("-")[1]), e, s) for pid, e, s in result.evicted)
                feed.drain()
                assert feed.reloads == 0 and feed.errors == 0
            oldest_kept = max(0, epoch - WINDOW + 1)
            expected = {
                (p, e, s)
                for p in range(WORKLOAD.problems)
                for e in range(oldest_kept)
                for s in range(WORKLOAD.samples)
            }
            assert evicted == expected
            for p in range(WORKLOAD.problems):
                assert history.store.length_stats(f"problem-{p}").min_epoch == oldest_kept
                assert history.index.problem_stats(f"problem-{p}")["epochs"] == list(
                    range(oldest_kept, epoch + 1)
                )
            for index, name in ((history.index, "writer"), (follower, "reader")):
                for p, e, s in sorted(evicted)[-12:]:
                    assert history.store.get(f"problem-{p}", e, s) is None
                    drafted = _probe(index, p, e, s, name)
                    owners = {owner_of(t, WORKLOAD) for t in drafted} - {None}
                    assert not owners & evicted, f"{name} drafted evicted tokens of {owners & evicted}"
                # Positive control: the same probe on a record inside the window drafts its continuation.
                live = _probe(index, 0, epoch, 1, name)
                assert live and owner_of(live[0], WORKLOAD) == (0, epoch, 1)
        feed.close()
