"""Kill -9 of the history writer mid-ingest, several times: nothing acknowledged is lost, nothing is applied
twice (even though each restart re-delivers recent records), the store and its trees equal a clean rebuild
from the same records, and every checkpoint left behind restores to exactly the state at its offsets (real
RocksDB, real child processes)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from _store_workload import CRASH_BATCH, CRASH_TOPIC, CRASH_WINDOW, CRASH_WORKLOAD

from history_store.durable.checkpoints import list_checkpoints, read_manifest, restore_checkpoint
from history_store.durable.store import HistoryStore
from history_store.indexed_history import IndexedHistory

CHILD = Path(__file__).with_name("_store_workload.py")
KILLS = 5


def _run_child_until(path: Path, checkpoints: Path, kill_after_acks: int | None) -> tuple[int, int | None]:
    """Starts the ingesting child; SIGKILLs it after `kill_after_acks` acknowledged batches (None: let it
    finish). Returns (offset it started from, last acknowledged offset)."""
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(path), str(checkpoints)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=CHILD.parent.parent,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().split()
        assert first and first[0] == "start", f"child did not start: {first}"
        start, acked, acks = int(first[1]), None, 0
        for line in proc.stdout:
            if line.startswith("ack"):
                acked, acks = int(line.split()[1]), acks + 1
                if kill_after_acks is not None and acks >= kill_after_acks:
                    # A random short delay puts the kill anywhere inside the next batch's write.
                    time.sleep(random.uniform(0, 0.01))
                    os.kill(proc.pid, signal.SIGKILL)
                    break
        proc.wait(timeout=60)
        if kill_after_acks is None:
            assert proc.returncode == 0, f"child failed with {proc.returncode}"
        return start, acked
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _tree_summary(history: IndexedHistory) -> dict:
    index = history.index
    out = {}
    for problem in index.problem_ids():
        stats = index.problem_stats(problem)
        out[problem] = (stats["epochs"], stats["samples"], stats["tokens"], sorted(stats["response_lengths"]))
    return out


def test_sigkill_during_ingest_loses_nothing_applies_nothing_twice_and_equals_clean_rebuild(
    tmp_path: Path,
) -> None:
    random.seed(1234)
    crashed, checkpoints = tmp_path / "crashed", tmp_path / "checkpoints"
    total = len(CRASH_WORKLOAD.stream())
    batches = total // CRASH_BATCH
    last_acked = 0
    for _ in range(KILLS):
        start, acked = _run_child_until(
            crashed, checkpoints, kill_after_acks=random.randint(1, batches // (KILLS + 1))
        )
        assert start >= last_acked, f"restart resumed at {start}, before the acknowledged offset {last_acked}"
        last_acked = acked if acked is not None else last_acked
    start, _ = _run_child_until(crashed, checkpoints, kill_after_acks=None)
    assert start >= last_acked
    assert 0 < last_acked < total, "the kills must have hit the middle of the stream"

    clean = tmp_path / "clean"
    with IndexedHistory.open(clean, window_epochs=CRASH_WINDOW) as history:
        stream = CRASH_WORKLOAD.stream()
        history.apply(stream, {(CRASH_TOPIC, 0): len(stream)})
    with (
        IndexedHistory.open(crashed, window_epochs=CRASH_WINDOW) as a,
        IndexedHistory.open(clean, window_epochs=CRASH_WINDOW) as b,
    ):
        sa, sb = a.store.stats(), b.store.stats()
        assert sa.offsets == sb.offsets == {(CRASH_TOPIC, 0): total}
        # Sequence numbers count every add and eviction: equal counts mean no record was applied twice.
        assert (sa.trajectories, sa.response_tokens, sa.next_sequence) == (
            sb.trajectories,
            sb.response_tokens,
            sb.next_sequence,
        )
        assert a.store.content_digest() == b.store.content_digest()
        for problem in b.store.problem_ids():
            assert a.store.length_stats(problem) == b.store.length_stats(problem)
        assert _tree_summary(a) == _tree_summary(b)
        assert sa.trajectories == CRASH_WORKLOAD.problems * CRASH_WINDOW * CRASH_WORKLOAD.samples

    # Checkpoints written between kills (a kill may land mid-checkpoint) restore to the state at their offsets.
    finished = list_checkpoints(checkpoints)
    assert finished, "the child should have checkpointed"
    for checkpoint in finished:
        offset = read_manifest(checkpoint)["offsets"][0]["offset"]
        with HistoryStore(tmp_path / f"clean-{offset}", window_epochs=CRASH_WINDOW) as expected:
            expected.apply(CRASH_WORKLOAD.stream()[:offset], {(CRASH_TOPIC, 0): offset})
            restored = restore_checkpoint(checkpoint, tmp_path / f"restored-{offset}")
            with HistoryStore(restored.data_dir) as store:
                assert store.content_digest() == expected.content_digest()
                assert store.next_sequence == expected.next_sequence
