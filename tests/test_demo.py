"""`das demo` end to end on the CPU: a tiny run writes the report and keeps its history; a second run starts warm
from the stored history, says so, and serves /metrics while it runs. First-run work (the engines' first steps, the
history kernels) is done and reported before the timed epochs, and leaves nothing in them. The demo ends with two
projections under the replay's GPU cost models: of its own rollouts, and of a recorded multi-epoch trace unlimited
and at a quarter of an epoch's requests as slots, each exactly what the `das bench replay` command it prints
computes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from workers.bench.replay import load_traces
from workers.cli import main as das
from workers.demo.projection import (
    RECORDED_SLOTS,
    RECORDED_STRATEGIES,
    RECORDED_TRACE,
    TRACE_FILE,
    format_projection,
    format_recorded,
    project,
    project_recorded,
    write_trace,
)
from workers.demo.projection import STRATEGIES as PROJECTED
from workers.demo.report import PLOT_FILES, SUMMARY_FILE, format_table, write_report
from workers.demo.run import DemoConfig, identical_status

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["--problems", "1", "--samples", "1", "--max-tokens", "12", "--check-tokens", "12", "--no-progress"]


def _demo(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "demo", *TINY, *args],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str], head: str = "") -> str:
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"das demo did not finish in 600 s:\n{err[-3000:]}")
    assert proc.returncode == 0, f"das demo exited {proc.returncode}:\n{err[-4000:]}"
    return head + out


@pytest.mark.vllm
def test_tiny_demo_writes_the_report_and_a_second_run_starts_warm(tmp_path: Path) -> None:
    history = tmp_path / "history"
    recorded = _fidelity_subset(tmp_path / "recorded")
    first = _finish(
        _demo(
            "--epochs", "2", "--strategies", "none,das", "--check-problems", "1",
            "--history-dir", str(history), "--report-dir", str(tmp_path / "report1"),
            "--recorded-trace", str(recorded),
        )
    )  # fmt: skip
    assert "history: cold start" in first
    # First-run work is its own line per engine, before the engine's timed epochs, and outside them.
    for strategy in ("none", "das"):
        warm_up = first.index(f"[{strategy}] warm-up before the timed epochs: ")
        assert first.index(f"[{strategy}] starting the engine") < warm_up
    report = tmp_path / "report1"
    for name in PLOT_FILES:
        assert (report / name).read_bytes().startswith(PNG_MAGIC), name
    summary = json.loads((report / SUMMARY_FILE).read_text())
    assert set(summary["warmup_s"]) == {"none", "das"} and min(summary["warmup_s"].values()) > 0
    assert sorted((e["strategy"], e["epoch"]) for e in summary["epochs"]) == [
        ("das", 0), ("das", 1), ("none", 0), ("none", 1),
    ]  # fmt: skip
    assert summary["identical_output"] == {"none": "reference", "das": "identical"}
    assert summary["temperature"] == 1.0 and "sampling: temperature 1.0" in first  # RL's, on the CPU too
    for epoch in summary["epochs"]:
        assert (
            epoch["cpu_s"] > 0
            and epoch["requests"] == 1
            and epoch["output_tokens"] == sum(epoch["response_lengths"]) > 0
        )
        assert epoch["latency_p50_s"] <= epoch["latency_p99_s"] <= epoch["latency_max_s"]
    # Only DAS rollouts feed the history: one problem, one sample, two epochs.
    assert summary["history"]["trajectories_at_end"] == 2
    assert "identical" in first and "reference" in first  # the table's status column
    # The projection replays the first strategy's rollouts (none: 2 epochs x 1 sample) and is printed last.
    projection = summary["projection"]
    assert projection["rollouts_of"] == "none" and projection["records"] == 2
    rollouts = load_traces(report / TRACE_FILE)
    assert sorted(len(r.response_ids) for r in rollouts) == sorted(
        n for e in summary["epochs"] if e["strategy"] == "none" for n in e["response_lengths"]
    )
    assert [m["cost_model"] for m in projection["cost_models"]] == [
        "default",
        "memory-bound",
        "compute-bound",
    ]
    table = format_projection(projection)
    assert first.index(table) > first.index("identical output") and table.startswith("PROJECTION")
    # Then, last, the recorded trace: a size where history matters.
    ending = format_recorded(summary["recorded_projection"])
    assert summary["recorded_projection"]["records"] == 24
    assert first.index(ending) > first.index(table) and ending.startswith("PROJECTION of a recorded trace")

    second = _demo(
        "--epochs", "1", "--strategies", "das", "--check-problems", "0", "--no-recorded-trace",
        "--history-dir", str(history), "--report-dir", str(tmp_path / "report2"), "--metrics-port", "0",
    )  # fmt: skip
    # The metrics line comes before the engine starts; fetch /metrics while the run goes on.
    head = ""
    assert second.stdout is not None
    for line in second.stdout:
        head += line
        if line.startswith("metrics: "):
            with urllib.request.urlopen(line.split(" ", 1)[1].strip(), timeout=30) as response:
                assert response.status == 200 and b"# TYPE" in response.read()
            break
    else:
        pytest.fail(f"das demo printed no metrics address:\n{head}")
    out = _finish(second, head)
    assert "history: warm start" in out and "epochs start at 2" in out
    assert "2 stored trajectories loaded into the proposer's history" in out
    summary = json.loads((tmp_path / "report2" / SUMMARY_FILE).read_text())
    assert summary["history"]["warm"] is True and summary["history"]["trajectories_at_start"] == 2
    assert [e["epoch"] for e in summary["epochs"]] == [2]
    assert summary["history"]["trajectories_at_end"] == 3
    assert summary["recorded_projection"] is None and "PROJECTION of a recorded trace" not in out


def test_identical_status_compares_each_strategy_with_plain_decoding() -> None:
    greedy = {"none": [[1, 2, 3], [4, 5]], "ngram": [[1, 2, 3], [4, 5]], "das": [[1, 2, 3], [4, 6]]}
    assert identical_status(greedy, 2) == {"none": "reference", "ngram": "identical", "das": "differs (1/2)"}
    assert identical_status({"das": [[1]]}, 1) == {"das": "not checked (needs the 'none' strategy)"}


def test_table_has_one_row_per_epoch_and_strategy_with_the_identity_status() -> None:
    row = {
        "wall_s": 2.0, "cpu_s": 1.5, "tokens_per_s": 10.0, "acceptance_rate": 0.5, "mean_accepted_per_step": 1.25,
        "latency_p50_s": 1.0, "latency_p99_s": 1.9, "latency_max_s": 2.0,
    }  # fmt: skip
    summary = {
        "epochs": [{"epoch": 0, "strategy": "das", **row}, {"epoch": 0, "strategy": "none", **row}],
        "identical_output": {"none": "reference", "das": "identical"},
        "history": {"warm": True, "trajectories_at_start": 4, "trajectories_at_end": 6, "path": "h"},
    }
    lines = format_table(summary).splitlines()
    assert lines[0].split()[:2] == ["epoch", "strategy"]
    assert lines[2].split()[1:2] == ["das"] and lines[2].endswith("identical")
    assert "50.0%" in lines[2] and lines[3].endswith("reference")
    assert lines[-1].startswith("history: warm start with 4 trajectories")


def _fidelity_subset(folder: Path) -> Path:
    """Two problems of the repo's engine-made trace (4 samples x 3 epochs each): a demo's worth of rollouts."""
    records = load_traces(REPO / "data" / "fidelity_das.jsonl.gz")
    problems = sorted({r.problem_id for r in records})[:2]
    return write_trace([r for r in records if r.problem_id in problems], folder)


def test_projection_is_what_das_bench_replay_computes_on_the_same_rollouts(tmp_path: Path, capsys) -> None:
    trace = _fidelity_subset(tmp_path / "report")
    projection = project(trace, "das")
    assert projection["records"] == 24 and projection["rollouts_of"] == "das"
    assert das(projection["command"].split()[1:] + ["--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)["cost_models"]
    for model in projection["cost_models"]:
        block = replayed[model["cost_model"]]
        assert model["coefficients_s"] == block["coefficients"]
        for strategy in PROJECTED:
            expected = block["strategies"][strategy]["projected_makespan_s"]
            assert model["makespan_s"][strategy] == round(expected, 4)
        assert model["das_gap_closed"] == block["oracle_gap_closed"]["das"]
    # On these rollouts drafting pays under every model: das ends between the oracle and plain decoding.
    for model in projection["cost_models"]:
        makespan = model["makespan_s"]
        assert makespan["oracle"] <= makespan["das"] < makespan["none"] and 0 < model["das_gap_closed"] <= 1


def test_projection_table_is_labelled_and_the_report_plots_it(tmp_path: Path) -> None:
    projection = project(_fidelity_subset(tmp_path / "report"), "das")
    lines = format_projection(projection).splitlines()
    assert lines[0].startswith("PROJECTION, not a measurement: this run's 24 das rollouts")
    assert lines[-1] == f"re-run: {projection['command']}"
    default = next(line for line in lines if line.startswith("default "))
    figures = default.split()
    model = projection["cost_models"][0]
    assert figures[-1] == f"{model['das_gap_closed']:.0%}"
    assert figures[-5:-1] == [f"{model['makespan_s'][s]:.3f}" for s in PROJECTED]
    files = write_report({"epochs": [], "projection": projection}, tmp_path / "plots")
    plot = tmp_path / "plots" / "projected_makespan.png"
    assert plot in files and plot.read_bytes().startswith(PNG_MAGIC)


def test_recorded_projection_is_what_das_bench_replay_computes_on_the_trace(tmp_path: Path, capsys) -> None:
    trace = _fidelity_subset(tmp_path / "recorded")
    projection = project_recorded(trace)
    assert projection["records"] == 24 and projection["epochs"] == 3
    assert das(projection["command"].split()[1:] + ["--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)["max_num_seqs"]
    assert [row["slots"] for row in projection["rows"]] == list(RECORDED_SLOTS) == list(replayed)
    for row in projection["rows"]:
        block = replayed[row["slots"]]
        runs = block["runs"]["default"] if row["slots"] == "unlimited" else block["runs"]["fcfs"]["default"]
        strategies = runs["strategies"]
        assert list(row["makespan_s"]) == list(RECORDED_STRATEGIES)
        for strategy in RECORDED_STRATEGIES:
            assert row["makespan_s"][strategy] == round(strategies[strategy]["projected_makespan_s"], 4)
        epochs = zip(strategies["das"]["per_epoch"], strategies["none"]["per_epoch"], strict=True)
        assert row["das_vs_none_by_epoch"] == [
            round(d["projected_makespan_s"] / n["projected_makespan_s"] - 1, 4) for d, n in epochs
        ]


def test_recorded_table_is_labelled_and_ends_with_its_command(tmp_path: Path) -> None:
    projection = project_recorded(_fidelity_subset(tmp_path / "recorded"))
    lines = format_recorded(projection).splitlines()
    assert lines[0].startswith("PROJECTION of a recorded trace, not a measurement: ")
    assert "24 rollouts over 3 epochs" in lines[0]
    assert lines[-1] == f"re-run: {projection['command']}"
    for row in projection["rows"]:
        line = next(line for line in lines if line.startswith(f"{row['slots']} "))
        figures = line.split()
        assert figures[1:4] == [f"{row['makespan_s'][s]:.2f}" for s in RECORDED_STRATEGIES]


def test_the_readme_shows_what_the_demo_projects_on_the_shipped_trace() -> None:
    """The demo ends with a trace shipped in data/, and the README's copy of that table is what the code
    projects on it now (a change to the replay that moves these figures must move the README too)."""
    assert DemoConfig().recorded_trace == RECORDED_TRACE and RECORDED_TRACE.is_file()
    lines = format_recorded(project_recorded(RECORDED_TRACE)).splitlines()
    readme = (REPO / "README.md").read_text()
    rows = [line for line in lines if line.startswith(tuple(f"{label} " for label in RECORDED_SLOTS))]
    assert len(rows) == len(RECORDED_SLOTS)
    for line in rows:
        assert f"\n{line}\n" in readme, f"README's demo output lacks the recorded trace's row: {line}"
