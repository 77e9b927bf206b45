"""A history replica exports no checkpoint time before its first checkpoint (NaN, never the 0 that made
DASCheckpointStale fire at every start), and the real time after it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# A fresh single-process interpreter, as `das indexer run` is: the metric's value before and after a real
# checkpoint of a real store.
PROBE = """
import sys, tempfile
from prometheus_client import REGISTRY, generate_latest
from history_store.durable.checkpoints import create_checkpoint
from history_store.durable.store import HistoryStore

def exported():
    for line in generate_latest(REGISTRY).decode().splitlines():
        if line.startswith("das_last_checkpoint_timestamp_seconds "):
            return line.split()[1]

print(exported())
with tempfile.TemporaryDirectory() as tmp, HistoryStore(tmp + "/history") as store:
    create_checkpoint(store, tmp + "/checkpoints")
    print(exported())
"""


def test_checkpoint_time_is_nan_until_the_first_checkpoint() -> None:
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    env["PYTHONPATH"] = str(REPO)
    started = time.time()
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    before, after = result.stdout.split()
    assert math.isnan(float(before)), f"exported {before} before any checkpoint"
    assert started <= float(after) <= time.time()
