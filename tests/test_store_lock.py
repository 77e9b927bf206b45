"""One writer per store, whatever happens to RocksDB's LOCK file: the writer also holds an flock on the store
folder itself, so a second writer is refused even after an operator deletes LOCK."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import REPO

from history_store.durable.store import HistoryStore
from history_store.errors import StoreLockedError
from pipeline.synthetic import SyntheticShape, synthetic_records

SHAPE = SyntheticShape(problems=4, epochs=2, prompt_tokens=8, response_tokens_median=16)


def test_a_second_writer_is_refused_even_after_lock_is_deleted(tmp_path):
    path = tmp_path / "store"
    with HistoryStore(path) as store:
        store.apply(list(synthetic_records(0, 50, SHAPE)))
        digest = store.content_digest()
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from history_store.durable.store import HistoryStore
            with HistoryStore({str(path)!r}):
                print("open", flush=True)
                sys.stdin.read()
        """)],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "open"
        (path / "LOCK").unlink()
        with pytest.raises(StoreLockedError, match="already open for writing"):
            HistoryStore(path)
        with pytest.raises(StoreLockedError):
            HistoryStore(path, create=False)
    finally:
        holder.communicate("", timeout=30)
    assert holder.returncode == 0
    with HistoryStore(path) as store:
        assert store.content_digest() == digest and store.stats().trajectories == 50


def test_two_writers_in_one_process_are_refused_and_close_releases_the_folder(tmp_path):
    store = HistoryStore(tmp_path / "store")
    with pytest.raises(StoreLockedError):
        HistoryStore(tmp_path / "store")
    store.close()
    HistoryStore(tmp_path / "store").close()


def test_a_path_containing_lock_is_not_mistaken_for_a_locked_store(tmp_path):
    path = tmp_path / "lock-dir" / "store"
    with HistoryStore(path) as store:
        store.apply(list(synthetic_records(0, 10, SHAPE)))
    (path / "CURRENT").write_text("MANIFEST-999999\n")  # points at a manifest that does not exist
    with pytest.raises(Exception) as info:
        HistoryStore(path)
    assert not isinstance(info.value, StoreLockedError)
    assert "already open" not in str(info.value)
