"""Shared fixtures: the local Kafka brokers that `scripts/kafka.sh up` starts (make test starts them).

Tests that need Kafka fail, never skip, when the brokers are not configured: a green run must mean the
pipeline was exercised against real brokers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError, UnknownTopicOrPartitionError

from history_store.durable.store import HistoryStore
from pipeline.topics import admin_client, ensure_topics

REPO = Path(__file__).resolve().parent.parent

# Modules that start vLLM engines, longest first (measured by `--durations`): xdist hands modules out in
# collection order (scripts/run_tests.sh passes --no-loadscope-reorder), so the longest start at once and the
# many short modules fill the workers around them, instead of a long module starting last and running alone.
LONGEST_FIRST = (
    "test_sampling_distribution.py",
    "test_replay_fidelity.py",
    "test_proposer_engine.py",
    "test_priority_engine.py",
    "test_proposer_scheduler_cuts.py",
    "test_rollout_cli.py",
    "test_proposer_bench.py",
    "test_draft_threads.py",
    "test_logprobs_sources.py",
    "test_traces_learn.py",
    "test_demo.py",
    "test_bench_ceiling.py",
    "test_verl_fully_async.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long modules first, in LONGEST_FIRST's order; the rest keep theirs (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


SINGLE_ENV = "DAS_KAFKA_BOOTSTRAP"
CLUSTER_ENV = "DAS_KAFKA_CLUSTER_BOOTSTRAP"


def _servers(env: str) -> list[str]:
    value = os.environ.get(env)
    if not value:
        pytest.fail(
            f"{env} is not set: this test needs the local Kafka brokers. Start them with "
            "`bash scripts/kafka.sh up && source .kafka/env.sh` (make test does both), or point "
            f"{env} at a reachable broker list host:port[,host:port]."
        )
    return value.split(",")


@pytest.fixture(scope="session")
def kafka_servers() -> list[str]:
    """Bootstrap addresses of the single local broker."""
    return _servers(SINGLE_ENV)


@pytest.fixture(scope="session")
def kafka_cluster_servers() -> list[str]:
    """Bootstrap addresses of the local three-broker cluster."""
    return _servers(CLUSTER_ENV)


def make_topics(servers: list[str], name: str, partitions: int = 6, epochs: bool = False) -> tuple[str, str]:
    """Creates a fresh trajectory topic and its dead-letter topic for one test (with `epochs`, the control topic
    of epoch advances too: replicas then run on advances, not samples); returns their names."""
    base = f"test.{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:80]}.{uuid.uuid4().hex[:8]}"
    topic, dlq = base, f"{base}.dlq"
    ensure_topics(servers, topic=topic, dead_letter_topic=dlq, partitions=partitions, epochs=epochs)
    return topic, dlq


def drop_topics(servers: list[str], *topics: str) -> None:
    """Deletes a test's topics so the brokers do not accumulate them across runs. Retries for a while: right
    after a broker restart the controller may still be moving leadership and refuse the request."""
    deadline = time.monotonic() + 60
    while True:
        admin = admin_client(servers)
        try:
            admin.delete_topics(list(topics), timeout_ms=30_000)
            return
        except UnknownTopicOrPartitionError:
            return  # an earlier attempt deleted them before its answer was lost
        except KafkaError:
            if time.monotonic() > deadline:
                raise
        finally:
            admin.close()
        time.sleep(1)


@pytest.fixture
def kafka_topics(kafka_servers: list[str], request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """A fresh (topic, dead-letter topic) pair on the single broker, deleted after the test."""
    topic, dlq = make_topics(kafka_servers, request.node.name)
    yield topic, dlq
    drop_topics(kafka_servers, topic, dlq)


@pytest.fixture
def epoch_topics(kafka_servers: list[str], request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """A fresh (topic, dead-letter topic) pair on the single broker with the control topic of epoch advances
    (`<topic>.epochs`, as `das kafka init` makes it): its replicas move windows by advances only."""
    topic, dlq = make_topics(kafka_servers, request.node.name, epochs=True)
    yield topic, dlq
    drop_topics(kafka_servers, topic, dlq, f"{topic}.epochs")


def advance(servers: list[str], topic: str, epochs: dict[str, int], **settings: object) -> None:
    """Publishes epoch advances (problem -> epoch) as a trainer does, and waits for their acknowledgement."""
    from pipeline.epochs import EpochPublisher

    publisher = EpochPublisher(servers, topic=topic, **settings)
    try:
        publisher.advance(epochs)
    finally:
        publisher.close()


@pytest.fixture
def cluster_topics(
    kafka_cluster_servers: list[str], request: pytest.FixtureRequest
) -> Iterator[tuple[str, str]]:
    """A fresh (topic, dead-letter topic) pair on the three-broker cluster (RF 3, min.insync.replicas 2)."""
    topic, dlq = make_topics(kafka_cluster_servers, request.node.name)
    yield topic, dlq
    drop_topics(kafka_cluster_servers, topic, dlq)


def end_offsets(servers: list[str], topic: str) -> dict[tuple[str, int], int]:
    """(topic, partition) -> the partition's end offset: where a replica has read everything."""
    consumer = KafkaConsumer(bootstrap_servers=servers)
    try:
        partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        return {(tp.topic, tp.partition): offset for tp, offset in consumer.end_offsets(partitions).items()}
    finally:
        consumer.close()


def wait_caught_up(store_path: Path, want: dict[tuple[str, int], int], timeout_s: float, what: str) -> None:
    """Waits until the store that a replica process writes holds offsets `want` (read as a RocksDB secondary)."""
    reader = HistoryStore.open_secondary(store_path, store_path.parent / f"{store_path.name}.secondary")
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            reader.catch_up(force=True)
            have = reader.offsets()
            if all(have.get(tp, 0) >= offset for tp, offset in want.items()):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"{what} did not catch up in {timeout_s} s: has {have}, want {want}")
            time.sleep(0.2)
    finally:
        reader.close()


class DasProcesses:
    """Starts `das` commands as child processes (logs in files) and kills any left at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self, name: str, *args: str, preexec_fn: Callable[[], None] | None = None
    ) -> subprocess.Popen[bytes]:
        """Starts `das <args>` with output to `<name>.log`; `preexec_fn` runs in the child before exec."""
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (the child writes it; closed at stop)
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            preexec_fn=preexec_fn,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def start_producers(
        self, bus: str, topic: str, workers: int, count: int, rate: int, *load_args: str
    ) -> list[subprocess.Popen[bytes]]:
        """Starts `workers` `das kafka load` processes (`producer-<w>`), each publishing `count` records."""
        return [
            self.start(
                f"producer-{w}",
                *("kafka", "load", "--bus", bus, "--topic", topic),
                *("--count", str(count), "--worker", str(w), "--rate", str(rate)),
                *load_args,
            )
            for w in range(workers)
        ]

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def wait_ok(self, proc: subprocess.Popen[bytes], name: str, timeout_s: float) -> None:
        """Waits for a child to exit 0; fails the test with its log otherwise."""
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"{name} did not finish in {timeout_s} s; log:\n{self.log(name)[-3000:]}")
        assert code == 0, f"{name} exited {code}; log:\n{self.log(name)[-3000:]}"

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def das_processes(tmp_path: Path) -> Iterator[DasProcesses]:
    """Child `das` processes for a test; none outlives it."""
    processes = DasProcesses(tmp_path)
    yield processes
    processes.kill_all()


def topic_keys(servers: list[str], topic: str) -> list[bytes]:
    """Keys of every record (not tombstone) in the topic, in partition order; a record sent twice is there twice."""
    consumer = KafkaConsumer(bootstrap_servers=servers, enable_auto_commit=False, consumer_timeout_ms=3000)
    try:
        partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        return [m.key for m in consumer if m.value is not None]
    finally:
        consumer.close()
