"""The proposer's secondary folders next to a replica do not pile up across vLLM server restarts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from history_store.durable.store import HistoryStore
from pipeline.schemas import TrajectoryRecord


def test_opening_the_replica_removes_secondary_folders_of_exited_processes(tmp_path: Path) -> None:
    from workers.generator.replica_dirs import secondary_dir

    replica = tmp_path / "history"
    with HistoryStore(replica) as store:
        store.apply(
            [TrajectoryRecord(problem_id="p", epoch=0, sample=0, prompt_ids=[1], response_ids=[2])], {}
        )
    exited = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = tmp_path / f".history.secondary-{int(exited.stdout)}"
    alive = tmp_path / f".history.secondary-{os.getppid()}"
    other = tmp_path / ".other.secondary-1"
    for folder in (dead, alive, other):
        folder.mkdir()
    mine = secondary_dir(replica)
    assert mine == tmp_path / f".history.secondary-{os.getpid()}"
    assert not dead.exists() and alive.exists() and other.exists()
    # The folder works as the proposer uses it: a RocksDB secondary of the replica.
    reader = HistoryStore.open_secondary(replica, mine)
    try:
        assert [r.key for r in reader.iter_trajectories()] == [("p", 0, 0)]
    finally:
        reader.close()
