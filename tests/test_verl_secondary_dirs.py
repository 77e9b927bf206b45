"""The proposer's secondary folders next to a replica do not pile up across vLLM server restarts, and one
container's sweep never removes another container's live folder on a shared volume."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from history_store.durable.store import HistoryStore
from pipeline.schemas import TrajectoryRecord

REPO = Path(__file__).resolve().parent.parent


def _replica(tmp_path: Path) -> Path:
    replica = tmp_path / "history"
    with HistoryStore(replica) as store:
        store.apply(
            [TrajectoryRecord(problem_id="p", epoch=0, sample=0, prompt_ids=[1], response_ids=[2])], {}
        )
    return replica


def test_opening_the_replica_removes_secondary_folders_of_exited_processes(tmp_path: Path) -> None:
    from workers.generator.replica_dirs import namespace_tag, secondary_dir

    replica = _replica(tmp_path)
    exited = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    tag = namespace_tag()
    dead = tmp_path / f".history.secondary-{tag}-{int(exited.stdout)}"
    alive = tmp_path / f".history.secondary-{tag}-{os.getppid()}"
    other = tmp_path / ".other.secondary-1"
    # Another container's folder (its own host name and PID namespace) whose pid does not run here.
    elsewhere = tmp_path / f".history.secondary-rollout-1-4026532248-{int(exited.stdout)}"
    for folder in (dead, alive, other, elsewhere):
        folder.mkdir()
    mine = secondary_dir(replica)
    assert mine == tmp_path / f".history.secondary-{tag}-{os.getpid()}"
    assert not dead.exists() and alive.exists() and other.exists() and elsewhere.exists()
    # The folder works as the proposer uses it: a RocksDB secondary of the replica.
    reader = HistoryStore.open_secondary(replica, mine)
    try:
        assert [r.key for r in reader.iter_trajectories()] == [("p", 0, 0)]
    finally:
        reader.close()


# Runs in a PID namespace of its own, as a container's vLLM process: forks until a process holds `target` (a pid
# that runs in no process of the test's namespace), which makes its secondary folder, says so, and stays alive
# until stdin closes.
_CONTAINER = """
import os, sys
from pathlib import Path
target = int(sys.argv[2])
while True:
    child = os.fork()
    if child == 0:
        if os.getpid() != target:
            os._exit(0)
        from workers.generator.replica_dirs import secondary_dir
        mine = secondary_dir(Path(sys.argv[1]))
        mine.mkdir()
        print(mine, flush=True)
        sys.stdin.read()
        os._exit(0)
    os.waitpid(child, 0)
    if child >= target:
        break
"""


def _free_pid() -> int:
    """A pid that no process of this namespace holds (above the few a fresh namespace's start uses)."""
    return next(pid for pid in range(300, 30000) if not Path(f"/proc/{pid}").exists())


@pytest.mark.parametrize("own_host_name", [True, False], ids=["own-host-name", "shared-host-name"])
def test_a_sweep_leaves_the_live_folder_of_another_pid_namespace_on_a_shared_volume(
    tmp_path: Path, own_host_name: bool
) -> None:
    from workers.generator.replica_dirs import secondary_dir

    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.fail("PID namespaces need util-linux's unshare and root (CI's machines have both)")
    replica = _replica(tmp_path)
    target = _free_pid()
    # compose's bench profile: rollout-0 and rollout-1 share the history volume, each with its own PID
    # namespace and host name; under network_mode: host they would share the host name.
    namespaces = ["--pid", "--fork", "--mount-proc"] + (["--uts"] if own_host_name else [])
    script = (
        _CONTAINER if not own_host_name else "import socket; socket.sethostname('rollout-1')\n" + _CONTAINER
    )
    container = subprocess.Popen(
        ["unshare", *namespaces, sys.executable, "-c", script, str(replica), str(target)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        theirs = Path(container.stdout.readline().strip())
        assert theirs.name.endswith(f"-{target}") and theirs.is_dir()
        assert not Path(f"/proc/{target}").exists()  # their pid names no process here
        mine = secondary_dir(replica)
        assert theirs.is_dir(), "the sweep removed the live folder of another container"
        assert mine != theirs
    finally:
        container.stdin.close()
        container.wait(30)
