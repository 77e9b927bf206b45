"""All three brokers of the cluster stopped for longer than every client timeout, while `das kafka load` publishes
and `das indexer run` replicates:

- the replica keeps running and its store, shows `das_consumer_up 0` on /metrics, and resumes when the brokers
  return, ending with exactly the records published (same digest as a clean store);
- the load's summary counts are exact: acknowledged + refused + unknown = published, and the topic holds
  every acknowledged record (and nothing refused);
- a publisher whose queue is full blocks for its bounded wait, then fails with BusBackpressureError, and what
  it took before is delivered after the outage.

Client timeouts are cut to seconds through the bus URL and --kafka-setting, so the test takes about a minute.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import REPO, end_offsets, topic_keys, wait_caught_up

from history_store.durable.store import HistoryStore
from pipeline.bus import BusBackpressureError, open_bus
from pipeline.synthetic import SyntheticShape, synthetic_records

pytestmark = pytest.mark.kafka
SHAPE = SyntheticShape(problems=20, epochs=3, prompt_tokens=16, response_tokens_median=40)
SHAPE_ARGS = ("--problems", "20", "--epochs", "3", "--prompt-tokens", "16", "--response-tokens", "40")
# Every client gives up on a request after 3 s and on a batch after 8 s; the outage lasts 15 s.
CLIENT_TIMEOUTS = "request_timeout_ms=3000&reconnect_backoff_max_ms=1000"
PRODUCER_TIMEOUTS = ("delivery_timeout_ms=8000", "max_block_ms=5000")
OUTAGE_S = 15
# The script that runs the cluster (a worktree can point at the checkout whose brokers are up).
KAFKA_SH = os.environ.get("DAS_KAFKA_SH", str(REPO / "scripts" / "kafka.sh"))


def _brokers(action: str) -> None:
    """stop-broker / start-broker on all three at once (a restarting broker waits for a controller quorum)."""

    def one(n: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", KAFKA_SH, action, str(n)],
            capture_output=True,
            text=True,
            timeout=180,
        )

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(one, (1, 2, 3)))
    failed = [r.stderr for r in results if r.returncode != 0 and "is not running" not in r.stderr]
    assert not failed, f"kafka.sh {action}: {failed}"


def _metric(url: str, name: str) -> float | None:
    try:
        body = urllib.request.urlopen(url, timeout=2).read().decode()
    except OSError:
        return None
    match = re.search(rf"^{name} (\S+)$", body, re.MULTILINE)
    return float(match.group(1)) if match else None


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.2)


def test_a_full_cluster_outage_is_waited_out_and_every_count_is_exact(
    kafka_cluster_servers, cluster_topics, das_processes, tmp_path
):
    topic, dlq = cluster_topics
    bus_url = f"kafka://{','.join(kafka_cluster_servers)}?{CLIENT_TIMEOUTS}"
    store_path = tmp_path / "replica"
    replica = das_processes.start(
        "replica", "indexer", "run", "--bus", bus_url, "--topic", topic, "--dlq-topic", dlq,
        "--data", str(store_path), "--replica", "outage-replica", "--metrics-port", "0", "--log-level", "info",
    )  # fmt: skip
    count, rate = 2_000, 100
    settings = [arg for s in PRODUCER_TIMEOUTS for arg in ("--kafka-setting", s)]
    [producer] = das_processes.start_producers(
        bus_url, topic, 1, count, rate, *SHAPE_ARGS, *settings, "--close-timeout-s", "120"
    )
    _wait_for(lambda: "metrics on http" in das_processes.log("replica"), 60, "the replica's metrics server")
    metrics_url = re.search(r"metrics on (http://\S+)", das_processes.log("replica")).group(1)
    _wait_for(
        lambda: (_metric(metrics_url, "das_records_ingested_total") or 0) > 0, 60, "first records applied"
    )
    blocked = open_bus(
        f"kafka://{','.join(kafka_cluster_servers)}?{CLIENT_TIMEOUTS}", topic=topic, max_queue_records=5,
        publish_timeout_s=1.0, delivery_timeout_ms=8000, max_block_ms=5000,
    )  # fmt: skip
    extra = synthetic_records(7, 100, SHAPE)
    down = False
    try:
        _brokers("stop-broker")
        down = True
        outage_started = time.monotonic()
        taken = 0
        with pytest.raises(BusBackpressureError, match="waited 1 s"):
            for record in extra:
                started = time.monotonic()
                blocked.publish(record)
                taken += 1
        assert taken == 5 and time.monotonic() - started >= 1.0, "a full queue blocks for the bounded wait"
        _wait_for(lambda: _metric(metrics_url, "das_consumer_up") == 0.0, 30, "das_consumer_up 0")
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - outage_started)))
        assert replica.poll() is None, das_processes.log("replica")[-3000:]
        assert producer.poll() is None, "the load ended during the outage: " + das_processes.log("producer-0")
    finally:
        if down:
            _brokers("start-broker")
    report = blocked.close(timeout_s=120)
    assert (report.acknowledged, report.refused, report.unknown) == (5, 0, 0)
    das_processes.wait_ok(producer, "producer-0", timeout_s=240)
    summary = json.loads(
        [line for line in das_processes.log("producer-0").splitlines() if line.startswith("{")][-1]
    )
    assert summary["published"] == count and summary["not_taken"] == 0
    assert summary["acknowledged"] + summary["refused"] + summary["unknown"] == count
    assert (summary["acknowledged"], summary["refused"], summary["unknown"]) == (count, 0, 0)
    keys = topic_keys(kafka_cluster_servers, topic)
    # Records sent again after the outage may be in the topic twice; each key is one record.
    assert len(set(keys)) == count + 5
    ends = end_offsets(kafka_cluster_servers, topic)
    wait_caught_up(store_path, ends, timeout_s=120, what="replica")
    _wait_for(lambda: _metric(metrics_url, "das_consumer_up") == 1.0, 30, "das_consumer_up 1")
    log = das_processes.log("replica")
    assert "brokers unreachable; keeping the store and waiting" in log
    assert "brokers reachable again" in log and "Traceback" not in log
    replica.terminate()
    das_processes.wait_ok(replica, "replica", timeout_s=30)
    with HistoryStore(store_path) as store, HistoryStore(tmp_path / "reference") as reference:
        reference.apply(list(synthetic_records(0, count, SHAPE)) + list(synthetic_records(7, 100, SHAPE))[:5])
        assert store.stats().trajectories == count + 5
        assert store.content_digest() == reference.content_digest()
