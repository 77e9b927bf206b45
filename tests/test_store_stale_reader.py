"""A RocksDB secondary instance does not follow a primary that closed and reopened the store: it keeps reading
the old session and never sees the new writes, while a fresh instance does (found while moving the proposer's
ingest off the decode step, issue 47). `HistoryReader.catch_up` notices from the writer's sequence hint and
raises StoreStaleError, so its owner reopens it instead of drafting from a frozen history forever."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from _store_workload import Workload

from history_store.durable import store as store_module
from history_store.durable.store import HistoryStore
from history_store.errors import StoreStaleError

WORKLOAD = Workload(problems=3, epochs=2, samples=2, min_len=20, max_len=40)


def test_a_reader_of_a_reopened_writer_says_it_is_stale_and_a_fresh_one_sees_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "STALE_AFTER_S", 0.3)
    path = tmp_path / "history"
    stream = WORKLOAD.stream()
    with HistoryStore(path, window_epochs=3) as writer:
        writer.apply(stream[:4])
    reader = HistoryStore.open_secondary(path, tmp_path / "secondary")
    with HistoryStore(path, window_epochs=3) as writer:  # the writer restarted: followed while it writes
        for record in stream[4:-1]:
            writer.apply([record])
            reader.catch_up(force=True)
    with HistoryStore(path, window_epochs=3) as writer:  # and again
        writer.apply(stream[-1:])
        written = writer.next_sequence
    deadline = time.monotonic() + 10
    with pytest.raises(StoreStaleError, match="reopen"):
        while time.monotonic() < deadline:
            reader.catch_up(force=True)
            if not reader.behind_writer:
                break  # it did see the writes: nothing to detect (then the test below fails)
            time.sleep(0.05)
    assert reader.behind_writer
    reader.close()
    fresh = HistoryStore.open_secondary(path, tmp_path / "secondary-fresh")
    assert fresh.next_sequence == written and not fresh.behind_writer
    assert fresh.get(*stream[-1].key) is not None
    fresh.close()


def test_a_reader_that_keeps_up_is_never_called_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "STALE_AFTER_S", 0.1)
    path = tmp_path / "history"
    stream = WORKLOAD.stream()
    with HistoryStore(path, window_epochs=3) as writer:
        writer.apply(stream[:1])
        reader = HistoryStore.open_secondary(path, tmp_path / "secondary")
        for record in stream[1:]:
            writer.apply([record])
            time.sleep(0.15)
            assert [c.key for c in reader.catch_up(force=True).changes] == [record.key]
        reader.close()
