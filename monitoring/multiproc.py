"""Multi-process metrics set-up for launchers whose metrics are recorded in child processes (vLLM's engine core
and workers run the proposer). Imports no `prometheus_client`: the client picks single- or multi-process mode
once, when it is first imported, so the folder must be chosen before.

    from monitoring.multiproc import prepare_multiprocess_dir
    prepare_multiprocess_dir()            # first thing in the launcher, before `monitoring.metrics`
    from monitoring.server import start_metrics_server
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def prepare_multiprocess_dir(directory: str | Path | None = None) -> Path:
    """Selects and empties the folder all processes of this run write their metric values to, and exports it
    as PROMETHEUS_MULTIPROC_DIR so children inherit it.

    The folder is `directory`, else PROMETHEUS_MULTIPROC_DIR, else a new temporary folder. Values left from an
    earlier run are deleted (they would be added to this run's counters), so call this once per run, in the
    launching process only. Raises RuntimeError if `prometheus_client` is already imported: it has chosen its
    mode and opened its value files, which this would either miss or delete under it.
    """
    if "prometheus_client" in sys.modules:
        raise RuntimeError(
            "prometheus_client was imported before the multi-process folder was prepared: call "
            "prepare_multiprocess_dir() before importing monitoring.metrics or anything that imports it"
        )
    chosen = directory or os.environ.get(MULTIPROC_ENV)
    path = Path(chosen) if chosen else Path(tempfile.mkdtemp(prefix="das-metrics-"))
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()
    os.environ[MULTIPROC_ENV] = str(path)
    return path
