"""`das demo` end to end on the CPU: a tiny run writes the report and keeps its history; a second run starts warm
from the stored history, says so, and serves /metrics while it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from workers.demo.report import PLOT_FILES, SUMMARY_FILE, format_table
from workers.demo.run import identical_status

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
    first = _finish(
        _demo(
            "--epochs", "2", "--strategies", "none,das", "--check-problems", "1",
            "--history-dir", str(history), "--report-dir", str(tmp_path / "report1"),
        )
    )  # fmt: skip
    assert "history: cold start" in first
    report = tmp_path / "report1"
    for name in PLOT_FILES:
        assert (report / name).read_bytes().startswith(PNG_MAGIC), name
    summary = json.loads((report / SUMMARY_FILE).read_text())
    assert sorted((e["strategy"], e["epoch"]) for e in summary["epochs"]) == [
        ("das", 0), ("das", 1), ("none", 0), ("none", 1),
    ]  # fmt: skip
    assert summary["identical_output"] == {"none": "reference", "das": "identical"}
    assert summary["temperature"] == 1.0 and "sampling: temperature 1.0" in first  # RL's, on the CPU too
    for epoch in summary["epochs"]:
        assert epoch["requests"] == 1 and epoch["output_tokens"] == sum(epoch["response_lengths"]) > 0
        assert epoch["latency_p50_s"] <= epoch["latency_p99_s"] <= epoch["latency_max_s"]
    # Only DAS rollouts feed the history: one problem, one sample, two epochs.
    assert summary["history"]["trajectories_at_end"] == 2
    assert "identical" in first and "reference" in first  # the table's status column

    second = _demo(
        "--epochs", "1", "--strategies", "das", "--check-problems", "0",
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


def test_identical_status_compares_each_strategy_with_plain_decoding() -> None:
    greedy = {"none": [[1, 2, 3], [4, 5]], "ngram": [[1, 2, 3], [4, 5]], "das": [[1, 2, 3], [4, 6]]}
    assert identical_status(greedy, 2) == {"none": "reference", "ngram": "identical", "das": "differs (1/2)"}
    assert identical_status({"das": [[1]]}, 1) == {"das": "not checked (needs the 'none' strategy)"}


def test_table_has_one_row_per_epoch_and_strategy_with_the_identity_status() -> None:
    row = {
        "wall_s": 2.0, "tokens_per_s": 10.0, "acceptance_rate": 0.5, "mean_accepted_per_step": 1.25,
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
