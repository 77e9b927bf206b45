"""A real Prometheus scrapes a real history replica (`das indexer run` against the local Kafka broker) while
trajectories and a malformed record are published, and the dashboard's history and pipeline panels show it."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from kafka import KafkaProducer
from monitoring_support import (
    DASHBOARDS,
    RATE_INTERVAL,
    PrometheusApi,
    free_port,
    running_prometheus,
    wait_for,
)

pytestmark = pytest.mark.kafka

RECORDS = 200
# Panels fed by the replica; the others come from rollout workers and producers, which this test does not run.
REPLICA_PANELS = {
    "Freshness p99 (publish to draftable)",
    "Ingest throughput",
    "Records ingested per second",
    "Consumer lag",
    "Stored tokens and evictions",
    "Store apply time",
    "Restore time at last start",
    "Dead-lettered records",
}


def replica_queries() -> list[tuple[str, str]]:
    queries = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            if panel["title"] in REPLICA_PANELS:
                queries += [(f"{panel['title']} {t['refId']}", t["expr"]) for t in panel["targets"]]
    return queries


def das(*args: str) -> list[str]:
    return [sys.executable, "-m", "workers.cli", *args]


def test_prometheus_scrapes_a_running_history_replica(
    kafka_servers: list[str], kafka_topics: tuple[str, str]
) -> None:
    topic, dlq = kafka_topics
    bus = "kafka://" + ",".join(kafka_servers)
    assert {title for title, _ in replica_queries()} >= {f"{title} A" for title in REPLICA_PANELS}
    with tempfile.TemporaryDirectory(prefix="das-live-") as tmp:
        workdir = Path(tmp)
        replica_port = free_port()
        with (workdir / "replica.log").open("w") as replica_log:
            replica = subprocess.Popen(
                das(
                    "indexer", "run", "--bus", bus, "--data", str(workdir / "history"), "--topic", topic,
                    "--dlq-topic", dlq, "--replica", f"monitoring-test-{uuid.uuid4().hex[:8]}",
                    "--metrics-port", str(replica_port),
                ),
                stdout=replica_log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            try:
                with running_prometheus(workdir, {"das-indexer": replica_port}) as api:
                    wait_for(
                        "the replica's /metrics to be up", lambda: api.query('up{job="das-indexer"} == 1')
                    )
                    publish(bus, topic, kafka_servers)
                    wait_for(
                        f"{RECORDS} records ingested and one dead letter, as scraped",
                        lambda: (
                            api.query(f"sum(das_records_ingested_total) >= {RECORDS}")
                            and api.query("sum(das_dead_lettered_records_total) >= 1")
                        ),
                    )
                    assert replica.poll() is None, (workdir / "replica.log").read_text()[-3000:]
                    check_replica_panels(api)
            finally:
                replica.terminate()
                replica.wait(timeout=60)


def publish(bus: str, topic: str, servers: list[str]) -> None:
    """RECORDS synthetic trajectories through `das kafka load`, then one message that is not a record."""
    subprocess.run(
        das("kafka", "load", "--bus", bus, "--topic", topic, "--count", str(RECORDS), "--problems", "8",
            "--epochs", "2", "--response-tokens", "200"),
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    producer = KafkaProducer(bootstrap_servers=servers)
    try:
        producer.send(topic, key=b"malformed", value=b"\x00not a trajectory record")
        producer.flush(timeout=30)
    finally:
        producer.close()


def check_replica_panels(api: PrometheusApi) -> None:
    for where, expr in replica_queries():
        result = api.query(expr.replace("$__rate_interval", RATE_INTERVAL))
        assert result, f"{where}: {expr} returned no series from the running replica"
    counts = {
        s["metric"]["reason"]: float(s["value"][1]) for s in api.query("das_dead_lettered_records_total")
    }
    assert counts.pop("encoding") == 1 and set(counts.values()) == {0.0}, counts
    # The first dead letter shows as an increase on the dashboard (its series existed at 0 before).
    panel = dict(replica_queries())["Dead-lettered records A"].replace("$__rate_interval", "1m")
    shown = {s["metric"]["reason"]: float(s["value"][1]) for s in api.query(panel)}
    assert shown["encoding"] > 0, shown
