"""The replay agrees with the engine: a sampled trace recorded by the engine itself (vLLM's n-gram, and DAS
with a fixed drafter, the budget off), replayed with the same settings, gives the engine's accepted draft tokens
per step and acceptance within 10%. Also covers what the recording needs from `das traces generate`: a
per-epoch temperature schedule, gzip output and the engine report."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.schemas import TrajectoryRecord
from workers.bench.fidelity import compare, load_report

# Two recordings by real engines: minutes on two quiet cores, much longer on a loaded machine.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parent.parent
TEMPERATURES = [1.0, 0.8, 0.6]
RECORDING = [
    "--num-problems", "3", "--samples", "4", "--epochs", str(len(TEMPERATURES)),
    "--temperatures", ",".join(map(str, TEMPERATURES)), "--max-tokens", "96", "--max-num-seqs", "12",
    "--k", "8", "--budget", "off", "--json",
]  # fmt: skip


@pytest.fixture(scope="module", params=["ngram", "das"])
def recording(request, tmp_path_factory) -> tuple[Path, Path, dict]:
    folder = tmp_path_factory.mktemp(request.param)
    trace, report = folder / "trace.jsonl.gz", folder / "engine.json"
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", "traces", "generate", "--strategy", request.param,
         "--out", str(trace), "--report", str(report), *RECORDING],
        cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return trace, report, json.loads(result.stdout.strip().splitlines()[-1])


def test_traces_generate_follows_the_temperature_schedule_and_writes_gzip_and_the_engine_report(
    recording,
) -> None:
    trace, report, printed = recording
    with gzip.open(trace, "rt") as handle:
        records = [TrajectoryRecord.model_validate_json(line) for line in handle]
    assert len(records) == 3 * 4 * len(TEMPERATURES)
    # In the order the engine was given them (each epoch, problem by problem, samples in order), not finish order.
    problems = list(dict.fromkeys(r.problem_id for r in records))
    order = [(r.epoch, problems.index(r.problem_id), r.sample) for r in records]
    assert order == sorted(order) and len(problems) == 3
    assert load_report(report) == printed
    assert printed["settings"]["temperatures"] == TEMPERATURES
    assert [e["temperature"] for e in printed["epochs"]] == TEMPERATURES
    if printed["strategy"] == "das":  # each step's rows, held tokens and drafts: where a replay first parts
        assert all(len(e["step_trace"]) == len(e["step_costs"]) > 0 for e in printed["epochs"])


def test_the_replay_of_the_engines_own_trace_agrees_with_the_engine_within_10_percent(recording) -> None:
    trace, report, _ = recording
    result = compare(trace, load_report(report))
    engine = result["overall"]["engine"]
    assert engine["accepted_per_step"] > 0.05, "too few accepted drafts to compare anything"
    assert result["within_tolerance"], json.dumps(
        {k: result[k] for k in ("overall", "relative_difference", "per_epoch")}
    )
