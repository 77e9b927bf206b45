"""Where a vLLM process keeps its RocksDB secondary instance of the node's history replica.

A secondary instance needs a folder of its own (its info log and options). Each proposer process makes one next
to the replica, `.<name>.secondary-<pid>`, on the replica's volume; vLLM servers restart with new pids, so
without a sweep these folders pile up on the volume forever. Before making its own, a process removes those of
processes that no longer run (the pid names a process of this node's containers: the servers of one Ray worker).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
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


def secondary_dir(replica: Path) -> Path:
    """This process's secondary folder for `replica` (not created), after removing those of dead processes."""
    pattern = re.compile(rf"^\.{re.escape(replica.name)}\.secondary-(\d+)$")
    for entry in replica.parent.glob(f".{replica.name}.secondary-*"):
        found = pattern.match(entry.name)
        if found and int(found[1]) != os.getpid() and not _running(int(found[1])):
            shutil.rmtree(entry, ignore_errors=True)
            logger.info("DAS: removed %s, the secondary folder of a process that has exited", entry)
    return replica.parent / f".{replica.name}.secondary-{os.getpid()}"
