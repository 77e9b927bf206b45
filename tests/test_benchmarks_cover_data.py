"""Every trace in data/ has its replay JSON in benchmarks/, made from that very trace at the drafting
defaults: figures are reported on every trace, not only on the ones that flatter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from history_store.automaton.config import DraftConfig
from workers.bench.replay import load_traces

ROOT = Path(__file__).resolve().parents[1]
TRACES = sorted(p for p in (ROOT / "data").iterdir() if p.name.endswith((".jsonl", ".jsonl.gz")))


def _benchmark(trace: Path, prefix: str, command: str) -> dict:
    """The report `benchmarks/<prefix>_<trace stem>.json`, checked to be made from `trace`; `command` (what
    remakes it) is named when it is missing."""
    stem = trace.name.removesuffix(".gz").removesuffix(".jsonl")
    path = ROOT / "benchmarks" / f"{prefix}_{stem}.json"
    assert path.exists(), f"{trace.name} has no {path.relative_to(ROOT)} ({command})"
    report = json.loads(path.read_text())
    assert report["trace"] == f"data/{trace.name}"
    return report


def test_data_holds_traces() -> None:
    assert len(TRACES) >= 4


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.name)
def test_every_trace_has_its_replay_json(trace: Path) -> None:
    report = _benchmark(trace, "replay", f"das bench replay {trace} --json")
    assert report["records"] == len(load_traces(trace))
    defaults = DraftConfig()
    assert report["config"]["max_depth"] == defaults.max_depth
    assert report["config"]["max_spec_factor"] == defaults.max_spec_factor
    for cost_model in report["cost_models"].values():
        assert {"none", "suffix-problem", "das", "oracle"} <= set(cost_model["strategies"])


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.name)
def test_every_trace_has_its_slot_replay_and_predicted_first_is_never_slower_than_fcfs(trace: Path) -> None:
    report = _benchmark(
        trace,
        "replay_slots",
        f"das bench replay {trace} --strategies none,suffix-problem,das --cost-models default "
        "--max-num-seqs unlimited,1/4,1/16 --json",
    )
    assert set(report["max_num_seqs"]) == {"unlimited", "1/4", "1/16"}
    for label in ("1/4", "1/16"):
        table = report["max_num_seqs"][label]["makespan_s"]["default"]
        assert {"none", "suffix-problem", "das"} <= set(table)
        for strategy, by_order in table.items():
            assert by_order["predicted"] <= by_order["fcfs"], (label, strategy, by_order)
