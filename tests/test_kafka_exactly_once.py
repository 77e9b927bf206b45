"""Exactly-once effect through crashes: 4 producer processes publish 10,000 trajectories to the real broker
while the replica process (`das indexer run`) is killed with SIGKILL 3 times at random points and restarted.
At the end the store holds every record exactly once: same keys, same content digest as a clean store fed
the same records directly, offsets at the topic's end, and no batch was ever applied twice.
Also: a store write failure (the disk refuses to grow a file) stops the replica with a clear error and no
offset commit beyond the store; a restart then applies everything exactly once."""

from __future__ import annotations

import os
import random
import re
import resource
import signal
import time

import pytest
from conftest import end_offsets, wait_caught_up

from history_store.durable.store import HistoryStore
from pipeline.bus import open_bus
from pipeline.synthetic import SyntheticShape, synthetic_records
from pipeline.topics import admin_client

pytestmark = pytest.mark.kafka
PRODUCERS = 4
PER_PRODUCER = 2_500
KILLS = 3
# Small trajectories keep the test near a minute on two shared cores; sizes do not change the offset logic.
SHAPE = SyntheticShape(
    problems=50, epochs=3, prompt_tokens=16, response_tokens_median=40, response_tokens_max=400
)
BATCH = re.compile(r"batch: messages=(\d+) applied=(\d+) duplicates=(\d+)")


def _stored_messages(store_path) -> int:
    """Messages the replica has durably consumed, read from its store as a RocksDB secondary."""
    reader = HistoryStore.open_secondary(store_path, store_path.parent / "probe.secondary")
    try:
        reader.catch_up(force=True)
        return sum(reader.offsets().values())
    finally:
        reader.close()


def test_replica_killed_three_times_ends_with_every_record_exactly_once(
    kafka_servers, kafka_topics, das_processes, tmp_path
):
    topic, dlq = kafka_topics
    bus = f"kafka://{','.join(kafka_servers)}"
    store_path = tmp_path / "replica"
    replica_args = (
        "indexer",
        "run",
        "--bus",
        bus,
        "--topic",
        topic,
        "--dlq-topic",
        dlq,
        "--data",
        str(store_path),
    )
    replica_args += ("--replica", "eo-replica", "--batch-records", "200", "--log-level", "debug")
    shape_args = ("--problems", "50", "--epochs", "3", "--prompt-tokens", "16", "--response-tokens", "40")
    producers = das_processes.start_producers(bus, topic, PRODUCERS, PER_PRODUCER, 250, *shape_args)
    rng = random.Random(20261130)
    replica = das_processes.start("replica-0", *replica_args)
    total = PRODUCERS * PER_PRODUCER
    for kill in range(KILLS):
        # Kill after a random number of applied batches, a few ms into the next one (maybe inside its RocksDB
        # write). At most 5 batches of 200 per run keeps every kill well before the 10,000th record.
        name, batches = f"replica-{kill}", rng.randint(1, 5)
        deadline = time.monotonic() + 120
        while das_processes.log(name).count("batch:") < batches:
            assert replica.poll() is None, das_processes.log(name)
            assert time.monotonic() < deadline, f"{name} applied fewer than {batches} batches in 120 s"
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.02))
        os.kill(replica.pid, signal.SIGKILL)
        replica.wait()
        assert _stored_messages(store_path) < total, "kill came after ingest ended; it proves nothing"
        replica = das_processes.start(f"replica-{kill + 1}", *replica_args)
    for w, producer in enumerate(producers):
        das_processes.wait_ok(producer, f"producer-{w}", timeout_s=180)
    ends = end_offsets(kafka_servers, topic)
    assert sum(ends.values()) == total  # idempotent producers: no duplicate on the topic either
    wait_caught_up(store_path, ends, timeout_s=120, what="restarted replica")
    replica.send_signal(signal.SIGTERM)
    das_processes.wait_ok(replica, f"replica-{KILLS}", timeout_s=30)

    duplicates = sum(
        int(m.group(3))
        for run in range(KILLS + 1)
        for m in BATCH.finditer(das_processes.log(f"replica-{run}"))
    )
    assert duplicates == 0, "a batch was applied twice across a crash"
    with HistoryStore(tmp_path / "reference") as reference:
        for w in range(PRODUCERS):
            reference.apply(list(synthetic_records(w, PER_PRODUCER, SHAPE)))
        want_digest = reference.content_digest()
    with HistoryStore(store_path) as store:
        assert store.stats().trajectories == total
        assert store.offsets() == ends
        assert store.content_digest() == want_digest


def _limit_file_size(limit: int):
    """preexec_fn: files may grow to `limit` bytes; beyond it writes fail with EFBIG, as a full disk fails."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the failing write returns an error instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    return apply


def test_store_write_failure_stops_the_replica_without_committing_and_a_restart_loses_nothing(
    kafka_servers, kafka_topics, das_processes, tmp_path
):
    topic, dlq = kafka_topics
    bus_url = f"kafka://{','.join(kafka_servers)}"
    records = list(
        synthetic_records(0, 600, SyntheticShape(problems=20, epochs=3, response_tokens_median=800))
    )
    bus = open_bus(bus_url, topic=topic)
    for record in records:
        bus.publish(record)
    bus.close()
    ends = end_offsets(kafka_servers, topic)
    store_path = tmp_path / "replica"
    args = ("indexer", "run", "--bus", bus_url, "--topic", topic, "--dlq-topic", dlq, "--data", str(store_path),
            "--replica", "full-disk", "--batch-records", "50")  # fmt: skip
    failing = das_processes.start("replica-full-disk", *args, preexec_fn=_limit_file_size(1_500_000))
    assert failing.wait(120) == 1, das_processes.log("replica-full-disk")
    log = das_processes.log("replica-full-disk")
    assert "write failed" in log and "stored offsets did not advance" in log, log[-2000:]
    with HistoryStore(store_path) as store:
        stored = store.offsets()
    assert sum(stored.values()) < sum(ends.values()), "the limit was never reached"
    admin = admin_client(kafka_servers)
    committed = admin.list_group_offsets({"full-disk": None})["full-disk"]
    admin.close()
    for tp, meta in committed.items():  # Kafka never learns of progress the store does not have
        assert meta.offset <= stored.get((tp.topic, tp.partition), 0)

    replica = das_processes.start("replica-after", *args)
    wait_caught_up(store_path, ends, timeout_s=120, what="restarted replica")
    replica.send_signal(signal.SIGTERM)
    das_processes.wait_ok(replica, "replica-after", timeout_s=30)
    with HistoryStore(tmp_path / "reference") as reference:
        reference.apply(records)
        want_digest = reference.content_digest()
    with HistoryStore(store_path) as store:
        assert store.stats().trajectories == len(records)
        assert store.content_digest() == want_digest
