"""Where a vLLM process keeps its RocksDB secondary instance of the node's history replica.

A secondary instance needs a folder of its own (its info log and options). Each proposer process makes one next
to the replica, `.<name>.secondary-<host>-<pidns>-<pid>`, on the replica's volume; vLLM servers restart with new
pids, so without a sweep these folders pile up on the volume forever. Before making its own, a process removes
those of processes that no longer run.

A pid means something only inside its PID namespace, and one volume can be shared by containers that each have
their own (compose's bench profile runs rollout-0 and rollout-1 on one history volume): a process can tell
whether pid 57 still runs only for folders made in its own namespace. So each folder names its namespace: the
host name (containers get their own) and the PID namespace's inode (`/proc/self/ns/pid`, distinct for every
namespace of one kernel, so containers that share a host name, as under `network_mode: host`, still differ).
The sweep touches only folders of its own host and namespace; those of other containers, and folders in the
older `.<name>.secondary-<pid>` form, which cannot be told apart, are left alone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
from pathlib import Path

logger = logging.getLogger(__name__)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def namespace_tag() -> str:
    """This process's PID namespace as a folder-name part: `<host name>-<PID namespace inode>` (the inode is
    left out where /proc cannot tell it); characters outside [A-Za-z0-9_.] become `_`."""
    try:
        found = re.fullmatch(r"pid:\[(\d+)\]", os.readlink("/proc/self/ns/pid"))
    except OSError:
        found = None
    tag = socket.gethostname() + (f"-{found[1]}" if found else "")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", tag)


def secondary_dir(replica: Path) -> Path:
    """This process's secondary folder for `replica` (not created), after removing those of exited processes
    of this PID namespace."""
    tag = namespace_tag()
    pattern = re.compile(rf"^\.{re.escape(replica.name)}\.secondary-{re.escape(tag)}-(\d+)$")
    for entry in replica.parent.glob(f".{replica.name}.secondary-{tag}-*"):
        found = pattern.match(entry.name)
        if found and int(found[1]) != os.getpid() and not _running(int(found[1])):
            shutil.rmtree(entry, ignore_errors=True)
            logger.info("DAS: removed %s, the secondary folder of a process that has exited", entry)
    return replica.parent / f".{replica.name}.secondary-{tag}-{os.getpid()}"
