"""Hostile messages against a history replica, sent by a plain KafkaProducer (what any client that may write to
the topic can send), through the real single broker into real stores:

- a message whose dead letter cannot be written as is (a 20 MiB key) or at all (the dead-letter topic refuses
  it) never stops the replica: every legitimate record published after it lands;
- records at hostile epochs never cost a legitimate record: each is dead-lettered with its reason (or, the
  first record an empty replica reads, set aside when its problem's later records outvote it), and a late
  record below its window is dead-lettered and tombstoned.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import signal
import time

import pytest
from conftest import end_offsets, wait_caught_up
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType

from history_store.durable.store import HistoryStore
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
from workers.replica.service import Indexer

pytestmark = pytest.mark.kafka
PARTITIONS = 6
WINDOW = 3


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
    big_key = b"k" * (20 << 20)
    producer = _plain_producer(kafka_servers)
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
    assert headers[H_KEY_BYTES] == str(20 << 20).encode()
    assert headers[H_KEY_SHA256] == hashlib.sha256(big_key).hexdigest().encode()


def _record(problem: int, epoch: int, sample: int) -> TrajectoryRecord:
    return TrajectoryRecord(
        problem_id=f"problem-{problem}",
        epoch=epoch,
        sample=sample,
        prompt_ids=[problem, 1, 2, 3],
        response_ids=[epoch % 1000, sample % 1000, 7, 8, 9],
    )


def _legit(epochs, problems=range(4), samples=range(4)) -> list[TrajectoryRecord]:
    return [_record(p, e, s) for e in epochs for p in problems for s in samples]


HISTORY = _legit(range(3))  # four problems at epochs 0..2, four samples each: newest epoch 2, window 3
# Each row: phases of (records sent, hostile or not), the replica draining the topic after each phase as a
# running replica would; then the dead letters (by reason) and records set aside it must end with.
HOSTILE = {
    "problem-1 at its newest epoch + 8": (
        [(HISTORY, False), ([_record(1, 10, 100)], True), (_legit([3], [1]), False)],
        {"epoch_ahead": 1}, 0, {},
    ),
    "another problem at 18 raises no reference, a third follows": (
        [(HISTORY, False), ([_record(1, 10, 100), _record(2, 18, 100), _record(3, 18, 100)], True),
         (_legit([3]), False)],
        {"epoch_ahead": 3}, 0, {},
    ),
    "an empty replica's first record at epoch 99,999": (
        [([_record(0, 99_999, 100)], True), (HISTORY, False)],
        {}, 1, {},
    ),
    "a jump that a raised --max-epochs-ahead lets through would evict the whole window": (
        [(HISTORY, False), ([_record(1, 10, 100)], True), (_legit([3], [1]), False)],
        {"epoch_jump": 1}, 0, {"max_epochs_ahead": 8},
    ),
    "a late record below its problem's window": (
        [(_legit(range(4)), False), ([_record(0, 0, 50)], True)],
        {"stale": 1}, 0, {},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_epochs_never_cost_a_legitimate_record(name, kafka_servers, kafka_topics, tmp_path):
    phases, dead, set_aside, limits = HOSTILE[name]
    topic, dlq = kafka_topics
    producer = _plain_producer(kafka_servers)
    legit: list[TrajectoryRecord] = []
    hostile: list[TrajectoryRecord] = []
    with HistoryStore(tmp_path / "store", window_epochs=WINDOW) as store:
        source = KafkaTrajectorySource(kafka_servers, topic=topic, group_id=f"{topic}.replica")
        publisher = ReplicaPublisher(kafka_servers, replica=f"{topic}.replica", dead_letter_topic=dlq)
        indexer = Indexer(source, store, publisher=publisher, poll_timeout_s=0.5, **limits)
        indexer.start()
        for records, is_hostile in phases:
            for record in records:
                partition = partition_for(record.problem_id, PARTITIONS)
                producer.send(
                    topic, key=record_key(*record.key), value=encode_record(record), partition=partition
                )
            producer.flush(timeout=30)
            (hostile if is_hostile else legit).extend(records)
            want = end_offsets(kafka_servers, topic)
            for _ in range(200):
                if all(store.offsets().get(tp, 0) >= end for tp, end in want.items()):
                    break
                indexer.step()
            else:
                pytest.fail(f"replica did not reach {want}: {store.offsets()}")
        indexer.close()
        newest = collections.defaultdict(int)
        for r in legit:
            newest[r.problem_id] = max(newest[r.problem_id], r.epoch)
        kept = {r.key for r in legit if r.epoch > newest[r.problem_id] - WINDOW}
        assert {t.key for t in store.iter_trajectories()} == kept  # no legitimate record lost
        assert len(store.quarantined()) == set_aside
        assert {q.key for q in store.quarantined()} <= {r.key for r in hostile}
    producer.close()
    letters = read_dead_letters(kafka_servers, dlq)
    assert collections.Counter(d.reason for d in letters) == collections.Counter(dead)
    assert all(d.detail for d in letters)
    tombstoned = {m.key for m in _messages(kafka_servers, topic) if m.value is None}
    assert not tombstoned & {record_key(*k) for k in kept}  # the topic keeps every live record too
    if "stale" in dead:
        assert record_key(*hostile[0].key) in tombstoned
