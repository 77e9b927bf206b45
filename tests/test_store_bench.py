"""`das bench store --json` runs end to end on a small workload and prints one JSON object with every
figure docs/benchmarks.md reports."""

from __future__ import annotations

import json

from workers.cli import main as das


def test_bench_store_prints_ingest_disk_checkpoint_and_restore_figures(capsys) -> None:
    assert das(["bench", "store", "--json", "--tokens-per-size", "64000", "--startup-tokens", "64000"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [row["tokens_per_record"] for row in result["ingest"]] == [2000, 4000, 8000, 16000]
    assert all(row["trajectories_per_s"] > 0 and row["mb_per_s"] > 0 for row in result["ingest"])
    assert 0 < result["disk"]["bytes_per_token"] < 4
    assert result["checkpoint"]["checkpoint_seconds"] > 0
    assert result["startup"]["restore_seconds_per_million_tokens"] > 0
    assert result["startup"]["faster_history_tree_load"] in ("rebuild", "serialized")
    assert result["secondary"]["apply_to_readable_ms_p99"] > 0
