"""`das bench proposer` runs the proposer's whole step on a real trace and accounts for where the time goes."""

from __future__ import annotations

from pathlib import Path

from workers.bench import proposer

TRACE = Path(__file__).resolve().parent.parent / "data" / "dev_rollouts.jsonl"


def test_the_proposer_bench_decodes_a_trace_and_splits_the_step_time() -> None:
    result = proposer.run(TRACE, k=8, steps=20, warmup=5, batches=(3,), repeats=2)
    [row] = result["batches"]
    assert row["batch"] == 3 and row["steps"] == 20
    assert row["tokens_per_step"] >= 1.0, "every step commits at least one token per row"
    assert 0.0 < row["native_share"] < 1.0
    parts = row["native_us_per_request"] + row["python_us_per_request"]
    assert abs(parts - row["step_us_per_request"]) < 0.01 * row["step_us_per_request"] + 0.01
    assert row["index_step_match_and_draft_best_us_per_request"] > 0
    assert row["allocated_bytes_per_step_peak"] > 0
    assert row["repeats"] == 2 and len(row["step_median_us_per_request_all_runs"]) == 2
