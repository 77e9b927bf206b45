"""`das bench pipeline --json` runs end to end on the real broker and prints one JSON object with every figure
docs/benchmarks.md reports (the figures themselves are measured by the command, not asserted here)."""

from __future__ import annotations

import json

import pytest

from workers.cli import main as das

pytestmark = pytest.mark.kafka


def test_bench_pipeline_prints_throughput_freshness_and_encoding(kafka_servers, capsys):
    bus = f"kafka://{','.join(kafka_servers)}"
    args = ["bench", "pipeline", "--bus", bus, "--json", "--records", "60", "--rate", "30", "--seconds", "1"]
    assert das([*args, "--response-tokens", "200"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["throughput"]["records"] == 60 and result["throughput"]["trajectories_per_s"] > 0
    assert result["rebuild"]["trajectories_per_s"] > 0
    assert result["freshness"]["records"] == 30
    assert 0 <= result["freshness"]["p50_s"] <= result["freshness"]["p99_s"] <= result["freshness"]["max_s"]
    for encoding in result["encoding"]:
        assert encoding["wire_bytes_per_token"] < encoding["json_bytes_per_token"]


def test_bench_pipeline_without_a_broker_says_how_to_start_one(monkeypatch, capsys):
    monkeypatch.delenv("DAS_BUS", raising=False)
    monkeypatch.delenv("DAS_KAFKA_BOOTSTRAP", raising=False)
    assert das(["bench", "pipeline", "--json"]) == 2
    assert "scripts/kafka.sh up" in capsys.readouterr().err
