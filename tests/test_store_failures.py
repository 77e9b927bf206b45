"""Failures of the environment around the history store: a second writer, and a write failure (the disk
refuses to grow a file) that must leave offsets where they were, so nothing is skipped on replay."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _store_workload import Workload

from history_store.durable.store import HistoryStore
from history_store.errors import StoreLockedError, StoreOpenError
from pipeline.schemas import TrajectoryRecord

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = Workload(problems=2, epochs=2, samples=2)


def test_second_writer_in_same_process_gets_store_locked_error(tmp_path: Path) -> None:
    with HistoryStore(tmp_path / "h") as store:
        store.apply([WORKLOAD.record(0, 0, 0)])
        with pytest.raises(StoreLockedError, match="already open for writing"):
            HistoryStore(tmp_path / "h")
        assert store.get("problem-0", 0, 0) is not None
    with HistoryStore(tmp_path / "h") as store:  # the lock is released on close
        assert store.stats().trajectories == 1


def test_second_writer_in_another_process_fails_at_once_with_store_locked_error(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {str(ROOT)!r})
        from history_store.errors import StoreLockedError
        from history_store.durable.store import HistoryStore
        try:
            HistoryStore({str(tmp_path / "h")!r})
        except StoreLockedError as exc:
            print("locked:", exc)
        """
    )
    with HistoryStore(tmp_path / "h"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "locked: history store" in out.stdout, out.stdout + out.stderr


def test_open_without_create_of_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StoreOpenError, match="not a history store"):
        HistoryStore(tmp_path / "missing", create=False)


_WRITE_FAILURE_CHILD = """
import os, resource, signal, sys
sys.path.insert(0, sys.argv[2])
from history_store.errors import StoreWriteError
from history_store.durable.store import HistoryStore
from pipeline.schemas import TrajectoryRecord

def record(sample, n):
    return TrajectoryRecord(problem_id="p", epoch=0, sample=sample, prompt_ids=[1], response_ids=list(range(n)))

path = sys.argv[1]
store = HistoryStore(path)
store.apply([record(0, 100)], {("t", 0): 1})
# A file-size limit makes the next WAL growth fail with EFBIG, as a full disk fails with ENOSPC.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
largest = max(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
resource.setrlimit(resource.RLIMIT_FSIZE, (largest + 200_000, resource.RLIM_INFINITY))
offset = 1
try:
    for sample in range(1, 100):
        store.apply([record(sample, 20_000)], {("t", 0): offset + 1})
        offset += 1
        print("ack", offset, flush=True)
except StoreWriteError as exc:
    print("error", exc, flush=True)
try:
    store.apply([record(1000, 1)], {("t", 0): 10_000})
    print("later write succeeded", flush=True)
except StoreWriteError:
    print("later write refused", flush=True)
store.close()
"""


def test_write_failure_raises_store_write_error_and_offsets_do_not_advance(tmp_path: Path) -> None:
    path = tmp_path / "h"
    out = subprocess.run(
        [sys.executable, "-c", _WRITE_FAILURE_CHILD, str(path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = out.stdout.splitlines()
    errors = [line for line in lines if line.startswith("error")]
    assert errors, out.stdout + out.stderr
    assert "nothing of this batch was applied and the stored offsets did not advance" in errors[0]
    assert "File too large" in errors[0]
    assert "later write refused" in lines
    acked = max((int(line.split()[1]) for line in lines if line.startswith("ack")), default=1)
    with HistoryStore(path) as store:
        # Offsets are exactly the last acknowledged batch: the failed batch is replayed, not skipped.
        assert store.offsets() == {("t", 0): acked}
        assert store.stats().trajectories == acked
        assert store.get("p", 0, acked) is None
        assert store.get("p", 0, 1000) is None
        # Replaying from the stored offset succeeds once the disk accepts writes again.
        replay = TrajectoryRecord(problem_id="p", epoch=0, sample=acked, prompt_ids=[1], response_ids=[7])
        result = store.apply([replay], {("t", 0): acked + 1})
        assert result.applied == [("p", 0, acked)]
        assert store.offsets() == {("t", 0): acked + 1}
