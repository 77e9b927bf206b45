"""`das rollout` and `das traces generate` end to end: a real engine, the embedded bus into a local history
replica that the proposer reads, and trace files of valid trajectory records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from history_store.store import HistoryStore
from pipeline.schemas import TrajectoryRecord

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parent.parent
# Tiny runs: the engine start dominates; greedy, so a repeated epoch is drafted exactly from its history.
SMALL = [
    "--num-problems",
    "2",
    "--samples",
    "2",
    "--max-tokens",
    "24",
    "--temperature",
    "0",
    "--max-num-seqs",
    "4",
]


def _das(*args: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", *args, "--json"],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"das {' '.join(args)} failed:\n{result.stderr[-4000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_rollout_publishes_every_trajectory_into_the_embedded_replica(tmp_path) -> None:
    history = tmp_path / "history"
    out = _das("rollout", "--epochs", "2", "--history-dir", str(history), *SMALL)
    assert [e["epoch"] for e in out["epochs"]] == [0, 1]
    for epoch in out["epochs"]:
        assert epoch["requests"] == 4 and epoch["output_tokens"] > 0
        assert epoch["proposer_errors"] == 0
        assert epoch["latency_max_s"] >= epoch["latency_p50_s"] > 0
    # Epoch 1 repeats epoch 0's problems greedily: drafts from the replayed history are all accepted.
    assert out["epochs"][1]["mean_accepted_per_step"] > out["epochs"][0]["mean_accepted_per_step"]
    with HistoryStore(history) as store:
        keys = sorted((t.problem_id, t.epoch, t.sample) for t in store.iter_trajectories())
    assert keys == [(f"builtin-{p}", e, s) for p in range(2) for e in range(2) for s in range(2)]


def test_traces_generate_writes_one_valid_record_per_request(tmp_path) -> None:
    trace = tmp_path / "traces" / "run.jsonl"
    out = _das("traces", "generate", "--out", str(trace), "--epochs", "1", "--strategy", "none", *SMALL)
    assert out["epochs"][0]["requests"] == 4
    records = [TrajectoryRecord.model_validate_json(line) for line in trace.read_text().splitlines()]
    assert sorted((r.problem_id, r.sample) for r in records) == [
        (f"builtin-{p}", s) for p in range(2) for s in range(2)
    ]
    assert all(r.response_ids and r.prompt_ids and r.finish_reason in ("stop", "length") for r in records)
