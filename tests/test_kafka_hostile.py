"""Hostile messages against history replicas, sent by a plain KafkaProducer (what any client that may write the
topic can send), through real brokers into real stores.

- A message whose dead letter cannot be written as is (a 20 MiB key) or at all (the dead-letter topic refuses it)
  never stops the replica: every legitimate record published after it lands.
- Hostile sequences (the table `ROWS`), against two replicas and a rebuild from the compacted topic, in two
  deployments, each row in both:
  - "control", the shipped configuration: the secure broker with the KRaft authorizer and its ACLs (rollout
    writers write the trajectory topic, the trainer alone writes epoch advances on `<topic>.epochs`, replicas
    read), the hostile writer logged in as the rollout principal;
  - "samples", a deployment without epoch advances (the single broker, no ACLs): windows move once three
    distinct samples confirm a newer epoch.
  Every row ends with the same checks: neither replica lost a legitimate record (by key, in its window), the two
  replicas hold the same records (key sets and content digests, held-back records too), the topic compacts, and
  a store rebuilt from the compacted topic holds exactly what the replicas hold; the topic's last word on every
  legitimate record is that record.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import end_offsets, wait_caught_up
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType

from history_store.durable.store import FolderLock, HistoryStore
from pipeline.consumer import (
    H_KEY,
    H_KEY_BYTES,
    H_KEY_SHA256,
    KafkaTrajectorySource,
    ReplicaPublisher,
    read_dead_letters,
)
from pipeline.schemas import TrajectoryRecord
from pipeline.synthetic import SyntheticShape, synthetic_records
from pipeline.topics import admin_client
from pipeline.wire import encode_record, partition_for, record_key
from workers.cli import main as das
from workers.replica.service import Indexer, rebuild_store

pytestmark = pytest.mark.kafka


def _plain_producer(servers: list[str]) -> KafkaProducer:
    # lz4 and a large request limit: the broker then takes a 20 MiB key, which compresses to almost nothing.
    return KafkaProducer(bootstrap_servers=servers, compression_type="lz4", max_request_size=64 << 20)


def _messages(servers: list[str], topic: str) -> list:
    consumer = KafkaConsumer(bootstrap_servers=servers, enable_auto_commit=False, consumer_timeout_ms=3000)
    try:
        partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        return list(consumer)
    finally:
        consumer.close()


def test_a_dead_letter_that_cannot_be_written_never_stops_the_replica(
    kafka_servers, kafka_topics, das_processes, tmp_path, capsys
):
    topic, dlq = kafka_topics
    bus = f"kafka://{','.join(kafka_servers)}"
    admin = admin_client(kafka_servers)
    try:  # a dead-letter topic with Kafka's default 1 MiB limit, under the trajectory topic's 16 MiB
        admin.alter_configs(
            [ConfigResource(ConfigResourceType.TOPIC, dlq, configs={"max.message.bytes": "1048576"})]
        )
    finally:
        admin.close()
    store = tmp_path / "store"
    replica = das_processes.start(
        "replica", "indexer", "run", "--bus", bus, "--topic", topic, "--dlq-topic", dlq, "--data", str(store),
        "--replica", "hostile-replica",
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while "replica hostile-replica: " not in das_processes.log("replica"):
        assert replica.poll() is None and time.monotonic() < deadline, das_processes.log("replica")
        time.sleep(0.1)
    # A 20 MiB key (lz4 on the wire: almost nothing) decompresses past the replica's bound: the batch is refused
    # whole, as `oversize`. A 2 MiB key decompresses, and its dead letter copies only the key's first KiB.
    huge_key, big_key = b"k" * (20 << 20), b"k" * (2 << 20)
    producer = _plain_producer(kafka_servers)
    huge = producer.send(topic, key=huge_key, value=b"garbage", partition=0).get(timeout=60)
    producer.send(topic, key=big_key, value=b"garbage", partition=0).get(timeout=60)
    # Random bytes do not compress: 2 MiB that the trajectory topic takes and the dead-letter topic refuses.
    refused = producer.send(topic, key=b"noise", value=os.urandom(2 << 20), partition=1).get(timeout=60)
    producer.close()
    shape = SyntheticShape(problems=16, epochs=3, prompt_tokens=20, response_tokens_median=60)
    assert das(["kafka", "load", "--bus", bus, "--topic", topic, "--count", "600", "--problems", "16",
                "--prompt-tokens", "20", "--response-tokens", "60"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["acknowledged"] == 600
    wait_caught_up(store, end_offsets(kafka_servers, topic), timeout_s=120, what="replica")
    assert replica.poll() is None, das_processes.log("replica")
    replica.send_signal(signal.SIGTERM)
    das_processes.wait_ok(replica, "replica", timeout_s=60)
    log = das_processes.log("replica")
    assert log.count("skipped without a dead letter") == 1 and "Traceback" not in log

    with HistoryStore(store) as opened:
        assert {t.key for t in opened.iter_trajectories()} == {
            r.key for r in synthetic_records(0, 600, shape)
        }
        [kept] = opened.undelivered()
        assert (kept.topic, kept.partition, kept.offset, kept.reason) == (
            topic,
            1,
            refused.offset,
            "encoding",
        )
        assert "MessageSizeTooLarge" in kept.error
        assert opened.stats().undelivered == 1
    [letter] = [m for m in _messages(kafka_servers, dlq) if m.value == b"garbage"]
    headers = dict(letter.headers)
    assert len(headers[H_KEY]) == 1024 and headers[H_KEY] == big_key[:1024]
    assert headers[H_KEY_BYTES] == str(2 << 20).encode()
    assert headers[H_KEY_SHA256] == hashlib.sha256(big_key).hexdigest().encode()
    [over] = [d for d in read_dead_letters(kafka_servers, dlq) if (d.partition, d.offset) == (0, huge.offset)]
    assert over.reason == "oversize" and "larger than" in over.detail


PARTITIONS = 6
WINDOW = 3
PROBLEMS = range(4)
SAMPLES = range(4)
SECURE_ENV = "DAS_KAFKA_SECURE_BOOTSTRAP"


def _record(
    problem: int | str, epoch: int, sample: int, response: list[int] | None = None
) -> TrajectoryRecord:
    pid = problem if isinstance(problem, str) else f"problem-{problem}"
    return TrajectoryRecord(
        problem_id=pid,
        epoch=epoch,
        sample=sample,
        prompt_ids=[len(pid), 1, 2, 3],
        response_ids=response or [epoch % 1000, sample % 1000, 7, 8, 9],
    )


def _same_partition(problem: int, count: int) -> list[str]:
    """`count` problem ids that hash to the partition of problem-`problem`: fakes an attacker picks to sit beside it."""
    want = partition_for(f"problem-{problem}", PARTITIONS)
    found = (f"fake-{i}" for i in range(10_000) if partition_for(f"fake-{i}", PARTITIONS) == want)
    return [next(found) for _ in range(count)]


# Steps: ("epoch", e) the trainer advances every legitimate problem to e, then rollouts publish its records;
# ("trickle", e) the same, one record per replica batch; ("hostile", [records]) one batch from the hostile writer;
# ("tombstone", [keys]) hostile tombstones; ("restart",) both replicas restart.
HISTORY = [("epoch", e) for e in range(4)]  # epochs 0..3, window 3: epoch 0 retired by the advance to 3
ROWS = {
    "one record at its problem's newest epoch + 1": [*HISTORY, ("hostile", [_record(1, 4, 100)])],
    "one record at its problem's newest epoch + 2": [*HISTORY, ("hostile", [_record(1, 5, 100)])],
    "outnumbering in one batch: 12 fake problems and a real one at epoch 50": [
        *HISTORY,
        ("hostile", [*(_record(p, 50, 100) for p in _same_partition(0, 12)), _record(0, 50, 100)]),
    ],
    "two fakes and a record after a restart": [
        *HISTORY,
        ("restart",),
        ("hostile", [*(_record(p, 5, 100) for p in _same_partition(2, 2)), _record(2, 5, 100)]),
    ],
    "the ratchet: +2 per round, after a restart": [
        *HISTORY,
        ("restart",),
        *(("hostile", [_record(3, 3 + 2 * r, 100 + r)]) for r in range(1, 6)),
    ],
    "an empty replica's first record at epoch 99,999, then a trickle": [
        ("hostile", [_record(0, 99_999, 100)]),
        *(("trickle", e) for e in range(4)),
    ],
    "a compacted hostile tombstone": [*HISTORY, ("tombstone", [("problem-1", 3, 0), ("problem-2", 2, 1)])],
    "another copy of a stored record": [*HISTORY, ("hostile", [_record(0, 3, 0, response=[9, 9, 9, 9])])],
    "a late record below its problem's window": [*HISTORY, ("hostile", [_record(0, 0, 50)])],
}


@dataclasses.dataclass
class Deployment:
    """Where a row runs: brokers, one login per role (empty settings: no security), and the epoch mode."""

    mode: str
    servers: list[str]
    admin: dict[str, object]
    rollout: dict[str, object]
    trainer: dict[str, object]
    replica: dict[str, object]


def _secure(user: str, password: str) -> dict[str, object]:
    return {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "PLAIN",
        "sasl_plain_username": user,
        "sasl_plain_password": password,
        "ssl_cafile": os.environ["DAS_KAFKA_SECURE_CAFILE"],
    }


@pytest.fixture(params=["control", "samples"])
def deployment(request, kafka_servers) -> Deployment:
    if request.param == "samples":
        return Deployment("samples", kafka_servers, {}, {}, {}, {})
    if not os.environ.get(SECURE_ENV):
        pytest.fail(
            f"{SECURE_ENV} is not set: the shipped configuration is the secure broker with its authorizer. Start it "
            "with `bash scripts/kafka.sh up-secure && source .kafka/secure/env.sh` (make test does both)."
        )
    env = os.environ
    return Deployment(
        "control",
        [env[SECURE_ENV]],
        _secure("admin", env["DAS_KAFKA_SECURE_ADMIN_PASSWORD"]),
        _secure("das", env["DAS_KAFKA_SECURE_PASSWORD"]),
        _secure("das-trainer", env["DAS_KAFKA_SECURE_TRAINER_PASSWORD"]),
        _secure("das-replica", env["DAS_KAFKA_SECURE_REPLICA_PASSWORD"]),
    )


class Replica:
    """One history replica (the service's Indexer over its own store), drained by the test."""

    def __init__(self, d: Deployment, topic: str, dlq: str, path: Path, name: str) -> None:
        self.d, self.topic, self.dlq, self.path, self.name = d, topic, dlq, path, name
        self.dead: collections.Counter[str] = collections.Counter()
        self.restored = 0
        self._open()

    def _open(self) -> None:
        self.store = HistoryStore(self.path, window_epochs=WINDOW)
        source = KafkaTrajectorySource(self.d.servers, topic=self.topic, group_id=self.name, **self.d.replica)
        publisher = ReplicaPublisher(
            self.d.servers, replica=self.name, dead_letter_topic=self.dlq, **self.d.replica
        )
        self.indexer = Indexer(source, self.store, publisher=publisher, poll_timeout_s=0.3)
        self.indexer.start()

    def restart(self) -> None:
        self.close()
        self._open()

    def drain(self, ends: dict[tuple[str, int], int]) -> None:
        if not getattr(self.indexer.source, "reads_epochs", False):  # a build that knows no epoch advances
            ends = {tp: end for tp, end in ends.items() if tp[0] == self.topic}
        for _ in range(400):
            if all(self.store.offsets().get(tp, 0) >= end for tp, end in ends.items()):
                return
            report = self.indexer.step()
            self.dead.update(report.dead_lettered)
            self.restored += getattr(report, "restored", 0)
        pytest.fail(f"{self.name} did not reach {ends}: {self.store.offsets()}")

    def close(self) -> None:
        self.indexer.close()
        self.store.close()


def _held(store) -> set:
    pending = getattr(store, "pending", None)
    return set(pending()) if pending else set()


def _ends(d: Deployment, topics: list[str]) -> dict[tuple[str, int], int]:
    consumer = KafkaConsumer(bootstrap_servers=d.servers, **d.replica)
    try:
        parts = [TopicPartition(t, p) for t in topics for p in sorted(consumer.partitions_for_topic(t) or ())]
        return {(tp.topic, tp.partition): o for tp, o in consumer.end_offsets(parts).items()}
    finally:
        consumer.close()


def _topic_messages(d: Deployment, topic: str) -> list:
    consumer = KafkaConsumer(
        bootstrap_servers=d.servers, enable_auto_commit=False, consumer_timeout_ms=3000, **d.replica
    )
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        return list(consumer)
    finally:
        consumer.close()


def _compact(d: Deployment, topic: str, producer: KafkaProducer, retired: set[bytes]) -> None:
    """Rolls every partition's segment (the active one is never compacted) and waits until the log cleaner has
    dropped the records of the retired epoch (their tombstones stay)."""
    time.sleep(1.5)  # segment.ms is 1000
    for p in range(PARTITIONS):
        producer.send(topic, key=b"roll", value=None, partition=p)
    producer.flush(timeout=30)
    deadline = time.monotonic() + 120
    while True:
        left = {m.key for m in _topic_messages(d, topic) if m.value is not None} & retired
        if not left:
            return
        assert time.monotonic() < deadline, (
            f"the log cleaner did not compact {topic}: {len(left)} retired records left"
        )
        time.sleep(2)


@pytest.mark.parametrize("row", list(ROWS))
def test_no_hostile_sequence_costs_a_legitimate_record(row, deployment, tmp_path):
    d = deployment
    name = f"test.hostile.{abs(hash(row)) % 10**8:08d}.{os.urandom(3).hex()}"
    topic, dlq = name, f"{name}.dlq"
    # Plain Kafka admin calls (what `das kafka init` amounts to), so the table runs against any build of DAS.
    _create_topics(d, topic, dlq)
    producer = KafkaProducer(
        bootstrap_servers=d.servers, linger_ms=5, **d.rollout
    )  # the hostile writer's kind
    trainer = KafkaProducer(bootstrap_servers=d.servers, **d.trainer) if d.mode == "control" else None
    topics = [topic, f"{topic}.epochs"] if d.mode == "control" else [topic]
    replicas = [Replica(d, topic, dlq, tmp_path / n, f"das-replica-{n}") for n in ("a", "b")]
    legit: list[TrajectoryRecord] = []
    hostile: list[TrajectoryRecord] = []

    def send(records: list[TrajectoryRecord]) -> None:
        for r in records:
            producer.send(
                topic,
                key=record_key(*r.key),
                value=encode_record(r),
                partition=partition_for(r.problem_id, PARTITIONS),
            ).get(timeout=30)  # a refused write fails here, not as records missing at the end

    def drain() -> None:
        ends = _ends(d, topics)
        for replica in replicas:
            replica.drain(ends)

    for step in ROWS[row]:
        kind = step[0]
        if kind in ("epoch", "trickle"):
            epoch = step[1]
            if (
                trainer is not None
            ):  # the trainer's epoch advances: key problem id, value JSON (pipeline.epochs)
                for p in PROBLEMS:
                    pid = f"problem-{p}"
                    value = f'{{"problem_id":"{pid}","epoch":{epoch}}}'.encode()
                    trainer.send(
                        f"{topic}.epochs",
                        key=pid.encode(),
                        value=value,
                        partition=partition_for(pid, PARTITIONS),
                    ).get(timeout=30)
            records = [_record(p, epoch, s) for p in PROBLEMS for s in SAMPLES]
            legit += records
            for batch in [records] if kind == "epoch" else [[r] for r in records]:
                send(batch)
                drain()
        elif kind == "hostile":
            hostile += step[1]
            send(step[1])
            drain()
        elif kind == "tombstone":
            for key in step[1]:
                producer.send(
                    topic, key=record_key(*key), value=None, partition=partition_for(key[0], PARTITIONS)
                )
            producer.flush(timeout=30)
            drain()
        elif kind == "restart":
            for replica in replicas:
                replica.restart()
    drain()  # what the replicas sent back (tombstones, restored records) is read too

    newest = max(r.epoch for r in legit)
    kept = {r.key: r for r in legit if r.epoch > newest - WINDOW}
    hostile_keys = {r.key for r in hostile}
    late = {
        r.key for r in hostile if r.epoch <= newest - WINDOW
    }  # a legitimate writer's late record: not kept
    views = []
    for replica in replicas:
        window = {t.key for t in replica.store.iter_trajectories()}
        missing = set(kept) - window
        assert not missing, (
            f"{replica.name} lost {len(missing)} legitimate records, e.g. {sorted(missing)[:3]}"
        )
        assert window - set(kept) <= hostile_keys - late
        for key, record in kept.items():  # the legitimate content, not another copy of the key
            assert replica.store.get(*key).response_ids.tolist() == record.response_ids
        views.append((window, replica.store.content_digest(), _held(replica.store)))
    assert views[0] == views[1], "the two replicas hold different history"
    for replica in replicas:
        replica.close()

    retired = {record_key(*r.key) for r in legit if r.epoch <= newest - WINDOW}
    _compact(d, topic, producer, retired)
    last = {}
    for m in _topic_messages(d, topic):
        last[m.key] = m
    # The compacted topic's last word on each legitimate record is that record.
    for key in kept:
        m = last.get(record_key(*key))
        assert m is not None and m.value is not None, f"the compacted topic lost {key}"
    rebuilt_path = tmp_path / "rebuilt"
    lock = FolderLock(rebuilt_path)

    def connect():
        return (
            KafkaTrajectorySource(d.servers, topic=topic, group_id="das-replica-rebuild", **d.replica),
            ReplicaPublisher(d.servers, replica="das-replica-rebuild", dead_letter_topic=dlq, **d.replica),
        )

    lock = rebuild_store(rebuilt_path, lock, WINDOW, connect, threading.Event())
    assert lock is not None
    with HistoryStore(rebuilt_path, lock=lock) as rebuilt:
        # The rebuild stops within a batch of the end ("close enough"); the replica it serves reads on from there.
        source, publisher = connect()
        rest = Indexer(source, rebuilt, publisher=publisher, poll_timeout_s=0.3, publish_tombstones=False)
        rest.start()
        ends = _ends(d, topics)
        if not getattr(source, "reads_epochs", False):
            ends = {tp: end for tp, end in ends.items() if tp[0] == topic}
        for _ in range(100):
            if all(rebuilt.offsets().get(tp, 0) >= end for tp, end in ends.items()):
                break
            rest.step()
        rest.close()
        view = ({t.key for t in rebuilt.iter_trajectories()}, rebuilt.content_digest(), _held(rebuilt))
    lock.release()
    assert view == views[0], (
        "a rebuild from the compacted topic holds other history than the running replicas"
    )

    letters = collections.Counter(x.reason for x in read_dead_letters(d.servers, dlq, **d.replica))
    if late:
        assert letters["stale"] >= 1
    if "another copy" in row:
        assert letters["duplicate"] >= 1
    if trainer is not None:
        trainer.close()
    producer.close()


def _create_topics(d: Deployment, topic: str, dlq: str) -> None:
    from kafka.admin import (
        ACL,
        ACLFilter,
        ACLOperation,
        ACLPermissionType,
        ACLResourcePatternType,
        NewTopic,
        ResourcePattern,
        ResourcePatternFilter,
    )
    from kafka.admin import ResourceType as R

    compacted = {"cleanup.policy": "compact", "segment.ms": "1000", "min.cleanable.dirty.ratio": "0.01",
                 "max.message.bytes": str(16 << 20)}  # fmt: skip
    names = {topic: compacted, dlq: {"cleanup.policy": "compact,delete"}}
    if d.mode == "control":
        names[f"{topic}.epochs"] = {"cleanup.policy": "compact"}
    admin = admin_client(d.servers, **d.admin)
    try:
        admin.create_topics(
            [NewTopic(n, PARTITIONS, 1, topic_configs=c) for n, c in names.items()], timeout_ms=30_000
        )
        admin.wait_for_topics(list(names), timeout_ms=30_000)
        if d.mode == "control":  # the shipped grants (docs/operations.md, Access control)

            def allow(who: str, op: ACLOperation, kind: R, name: str, prefixed: bool = False) -> ACL:
                pattern = ACLResourcePatternType.PREFIXED if prefixed else ACLResourcePatternType.LITERAL
                return ACL(
                    f"User:{who}", "*", op, ACLPermissionType.ALLOW, ResourcePattern(kind, name, pattern)
                )

            result = admin.create_acls([
                allow("das", ACLOperation.WRITE, R.TOPIC, topic),
                allow("das-trainer", ACLOperation.WRITE, R.TOPIC, f"{topic}.epochs"),
                *(allow("das-replica", ACLOperation.READ, R.TOPIC, n) for n in names),
                allow("das-replica", ACLOperation.WRITE, R.TOPIC, topic),
                allow("das-replica", ACLOperation.WRITE, R.TOPIC, dlq),
                allow("das-replica", ACLOperation.READ, R.GROUP, "das-replica-", prefixed=True),
            ])  # fmt: skip
            assert not result["failed"], result
            # The broker's authorizer applies new ACLs from the metadata log a moment after create_acls
            # returns; a write before that is refused (a first row once lost every record that way).
            deadline = time.monotonic() + 30
            while True:
                listed, _ = admin.describe_acls(
                    ACLFilter(None, None, ACLOperation.ANY, ACLPermissionType.ANY,
                              ResourcePatternFilter(R.ANY, None, ACLResourcePatternType.ANY))
                )  # fmt: skip
                names_seen = {acl.resource_pattern.resource_name for acl in listed}
                if names_seen >= set(names):
                    break
                assert time.monotonic() < deadline, f"the ACLs of {topic} did not apply"
                time.sleep(0.2)
    finally:
        admin.close()


# A replica's peak resident memory while it reads a batch that decompresses to 1 GiB, and 600 records after it.
# Measured here: 221 MiB with the bound (a batch decompresses to at most 17 MiB).
RSS_BOUND_BYTES = 400 << 20


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def test_a_decompression_bomb_is_dead_lettered_and_the_replica_stays_small(
    kafka_servers, kafka_topics, das_processes, tmp_path, capsys
):
    topic, dlq = kafka_topics
    bus = f"kafka://{','.join(kafka_servers)}"
    store = tmp_path / "store"
    replica = das_processes.start(
        "replica", "indexer", "run", "--bus", bus, "--topic", topic, "--dlq-topic", dlq, "--data", str(store),
        "--replica", "das-replica-bomb",
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while "replica das-replica-bomb: " not in das_processes.log("replica"):
        assert replica.poll() is None and time.monotonic() < deadline, das_processes.log("replica")
        time.sleep(0.1)
    # 1 GiB of zeros: about 4.4 MB of lz4, which every compressed-size limit of the broker and the fetch lets by.
    producer = KafkaProducer(
        bootstrap_servers=kafka_servers, compression_type="lz4", max_request_size=(1 << 30) + (1 << 20)
    )
    bomb = producer.send(topic, key=b"bomb", value=bytes(1 << 30), partition=0).get(timeout=300)
    producer.close()
    assert das(["kafka", "load", "--bus", bus, "--topic", topic, "--count", "600", "--problems", "16",
                "--prompt-tokens", "20", "--response-tokens", "60"]) == 0  # fmt: skip
    capsys.readouterr()
    wait_caught_up(store, end_offsets(kafka_servers, topic), timeout_s=180, what="replica")
    peak = _peak_rss(replica.pid)
    replica.send_signal(signal.SIGTERM)
    das_processes.wait_ok(replica, "replica", timeout_s=60)
    print(f"replica peak RSS {peak / 2**20:.0f} MiB (bound {RSS_BOUND_BYTES / 2**20:.0f} MiB)")
    assert peak < RSS_BOUND_BYTES, f"replica peak RSS {peak / 2**20:.0f} MiB"
    shape = SyntheticShape(problems=16, epochs=3, prompt_tokens=20, response_tokens_median=60)
    with HistoryStore(store) as opened:
        assert {t.key for t in opened.iter_trajectories()} == {
            r.key for r in synthetic_records(0, 600, shape)
        }
    [letter] = [
        d for d in read_dead_letters(kafka_servers, dlq) if d.partition == 0 and d.offset == bomb.offset
    ]
    assert letter.reason == "oversize" and "larger than 17825792 bytes" in letter.detail, letter
