"""The Kafka pipeline against the real local broker: topic administration, producer to replica with offsets
and tombstones, dead letters for every kind of malformed message, and clear errors when Kafka is away."""

from __future__ import annotations

import collections
import json
import random
import struct
import time

import numpy as np
import pytest
from conftest import advance, drop_topics, end_offsets
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource
from kafka.errors import KafkaTimeoutError

from history_store.automaton.problem_index import ProblemIndex
from history_store.durable.store import HistoryStore
from pipeline.bus import BusBackpressureError, BusError, open_bus
from pipeline.consumer import (
    H_OFFSET,
    H_PARTITION,
    H_TRUNCATED,
    KafkaTrajectorySource,
    ReplicaPublisher,
    read_dead_letters,
)
from pipeline.synthetic import SyntheticShape, synthetic_record, synthetic_records
from pipeline.topics import admin_client
from pipeline.wire import encode_record, partition_for, record_key
from workers.cli import main as das
from workers.replica.service import Indexer, ProblemIndexListener, RecordLimits

pytestmark = pytest.mark.kafka
SMALL = SyntheticShape(
    problems=20, epochs=5, prompt_tokens=16, response_tokens_median=40, response_tokens_max=200
)


def _indexer(servers, topic, dlq, store, **kwargs):
    source = KafkaTrajectorySource(servers, topic=topic, group_id=f"{topic}.replica")
    publisher = ReplicaPublisher(servers, replica=f"{topic}.replica", dead_letter_topic=dlq)
    indexer = Indexer(source, store, publisher=publisher, poll_timeout_s=0.5, **kwargs)
    indexer.start()
    return indexer


def _drain(indexer, store, servers, topic, max_steps=2000):
    """Steps until the store's offsets reach the topic's ends; returns the summed reports."""
    want = end_offsets(servers, topic)
    totals = {"applied": 0, "evicted": 0, "tombstones": 0, "dead": {}, "ends": want}
    for _ in range(max_steps):
        if all(store.offsets().get(tp, 0) >= end for tp, end in want.items()):
            return totals
        report = indexer.step()
        totals["applied"] += report.applied
        totals["evicted"] += report.evicted
        totals["tombstones"] += report.tombstones
        for reason, n in report.dead_lettered.items():
            totals["dead"][reason] = totals["dead"].get(reason, 0) + n
    pytest.fail(f"replica did not reach {want} in {max_steps} steps: {store.offsets()}")


def _read_all(servers, topic):
    consumer = KafkaConsumer(
        bootstrap_servers=servers, consumer_timeout_ms=1000, auto_offset_reset="earliest"
    )
    partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
    consumer.assign(partitions)
    consumer.seek_to_beginning(*partitions)
    messages = list(consumer)
    consumer.close()
    return messages


def test_kafka_init_is_idempotent_and_configures_compaction(kafka_servers, capsys):
    topic = f"test.init.{random.getrandbits(32):08x}"
    bus = f"kafka://{','.join(kafka_servers)}"
    try:
        assert (
            das(["kafka", "init", "--bus", bus, "--topic", topic, "--dlq-topic", f"{topic}.dlq", "--json"])
            == 0
        )
        first = json.loads(capsys.readouterr().out)
        assert (
            das(["kafka", "init", "--bus", bus, "--topic", topic, "--dlq-topic", f"{topic}.dlq", "--json"])
            == 0
        )
        second = json.loads(capsys.readouterr().out)
        assert [t["action"] for t in first["topics"]] == ["created", "created", "created"]
        assert [t["action"] for t in second["topics"]] == ["exists", "exists", "exists"]
        assert [t["name"] for t in first["topics"]] == [topic, f"{topic}.dlq", f"{topic}.epochs"]
        assert all(t["partitions"] == 6 and t["replication_factor"] == 1 for t in second["topics"])
        assert (
            das(
                [
                    "kafka",
                    "init",
                    "--bus",
                    bus,
                    "--topic",
                    topic,
                    "--dlq-topic",
                    f"{topic}.dlq",
                    "--partitions",
                    "3",
                ]
            )
            == 1
        )
        assert "exists with 6 partitions" in capsys.readouterr().err
        admin = admin_client(kafka_servers)
        configs = admin.describe_configs(
            [ConfigResource("TOPIC", name) for name in (topic, f"{topic}.dlq", f"{topic}.epochs")]
        )
        admin.close()
        assert configs["topic"][topic]["cleanup.policy"]["value"] == "compact"
        assert configs["topic"][f"{topic}.dlq"]["cleanup.policy"]["value"] == "compact,delete"
        assert configs["topic"][f"{topic}.epochs"]["cleanup.policy"]["value"] == "compact"
    finally:
        drop_topics(kafka_servers, topic, f"{topic}.dlq", f"{topic}.epochs")


def test_published_records_reach_the_replica_with_offsets_and_tombstones(
    kafka_servers, kafka_topics, tmp_path
):
    topic, dlq = kafka_topics
    records = list(synthetic_records(0, 300, SMALL))
    bus = open_bus(f"kafka://{','.join(kafka_servers)}", topic=topic)
    for record in records:
        bus.publish(record)
    bus.close()
    index = ProblemIndex(window_epochs=2)
    with HistoryStore(tmp_path / "store", window_epochs=2) as store:
        indexer = _indexer(kafka_servers, topic, dlq, store, listeners=[ProblemIndexListener(index)])
        totals = _drain(indexer, store, kafka_servers, topic)
        indexer.close()
        kept = {r.key for r in records if r.epoch >= 3}
        for problem_id in {r.problem_id for r in records}:  # the drafting trees hold exactly the window
            stats = index.problem_stats(problem_id)
            assert stats["samples"] == sum(1 for k in kept if k[0] == problem_id) and stats["epochs"] == [
                3,
                4,
            ]
        assert {t.key for t in store.iter_trajectories()} == kept
        # One batch holds every epoch: a problem's early epochs are retired before they are ever drafted from.
        assert totals["applied"] >= len(kept) and totals["evicted"] == len(records) - len(kept)
        assert store.offsets() == totals["ends"]  # the tombstones this replica published come after
    messages = _read_all(kafka_servers, topic)
    tombstones = {m.key for m in messages if m.value is None}
    assert tombstones == {record_key(*r.key) for r in records if r.epoch < 3}
    for m in messages:  # records and their tombstones live in their problem's partition
        assert m.partition == partition_for(m.key.decode().split("\x00")[0], 6)


def test_tombstones_an_outage_held_back_are_sent_again_by_the_next_flush(kafka_servers, kafka_topics):
    # The store evicts and stores its offsets before tombstones are acknowledged; a tombstone whose delivery
    # fails transiently (an outage: KafkaTimeoutError is what kafka-python reports) is kept and sent again.
    topic, _ = kafka_topics
    publisher = ReplicaPublisher(kafka_servers, replica=f"{topic}.replica", dead_letter_topic=f"{topic}.dlq")
    held_back = (topic, record_key("problem-1", 0, 3), partition_for("problem-1", 6), None)
    publisher._tombstone_failed(held_back, KafkaTimeoutError("Expiring 1 record(s): 120000 ms has passed"))
    assert publisher.unsent_tombstones == 1
    publisher.tombstones(topic, 6, [("problem-2", 0, 1)])
    publisher.flush()
    publisher.close()
    assert publisher.unsent_tombstones == 0
    tombstones = {(m.partition, m.key) for m in _read_all(kafka_servers, topic) if m.value is None}
    assert tombstones == {
        (held_back[2], held_back[1]),
        (partition_for("problem-2", 6), record_key("problem-2", 0, 1)),
    }


def test_problem_partition_matches_kafkas_default_partitioner(kafka_servers, kafka_topics):
    topic, _ = kafka_topics
    producer = KafkaProducer(bootstrap_servers=kafka_servers)
    for i in range(60):
        problem_id = f"problem-{i}-\u00e9"
        sent = producer.send(topic, key=problem_id.encode(), value=b"x").get(timeout=30)
        assert sent.partition == partition_for(problem_id, 6)
    producer.close()


def _malformed(i: int, rng: random.Random) -> tuple[bytes | None, bytes, str]:
    """One malformed message (key, value, expected reason), cycling through every kind."""
    good = synthetic_record(9, i, 1000, SMALL)
    value = encode_record(good)
    key = record_key(*good.key)
    meta = json.dumps({"problem_id": good.problem_id, "epoch": 0, "sample": i}).encode()

    def frame(meta_raw: bytes, n_prompt: int = 0, n_response: int = 0, version: int = 1) -> bytes:
        return struct.pack("<2sBBIII", b"DR", version, 0, len(meta_raw), n_prompt, n_response) + meta_raw

    kinds = [
        (key, bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 200))), "encoding"),  # invalid encoding
        (key, value[: rng.randint(16, len(value) - 1)], "truncated"),  # truncated payload
        (key, value[:4] + b"\x00\x00\x00\x00" + value[8:], "truncated"),  # lengths disagree with payload
        (key, b"\x00\x01" + value[2:], "encoding"),  # bad magic
        (key, frame(meta, version=rng.choice([0, 2, 7, 255])), "schema_version"),  # unknown schema version
        (key, frame(json.dumps({"problem_id": 5, "epoch": "x", "sample": 0}).encode()), "invalid"),  # types
        (key, frame(meta, n_prompt=1) + struct.pack("<i", -rng.randint(1, 2**31)), "invalid"),  # negative id
        (
            key,
            frame(meta, n_response=1) + struct.pack("<I", rng.randint(2**31, 2**32 - 1)),
            "invalid",
        ),  # huge id
        (key, frame(meta, n_response=5000) + b"\x01\x00\x00\x00" * 5000, "oversize"),  # oversize record
        (record_key("other", 0, i), value, "key_mismatch"),  # key of another record
        (key, frame(b'{"problem_id": "p", "epoch": 0, "sam'), "encoding"),  # broken JSON
    ]
    return kinds[i % len(kinds)]


def test_malformed_messages_go_to_the_dead_letter_topic_and_valid_ones_apply(
    kafka_servers, kafka_topics, tmp_path, capsys
):
    topic, dlq = kafka_topics
    rng = random.Random(4)
    producer = KafkaProducer(bootstrap_servers=kafka_servers, max_request_size=1 << 24, linger_ms=5)
    expected: dict[tuple[int, int], str] = {}  # (partition, offset) -> reason
    futures = []
    valid = [synthetic_record(1, i, 1000, SMALL) for i in range(1000)]
    for i in range(1000):  # interleaved: a valid record, then a malformed one, in the same partitions
        partition = partition_for(valid[i].problem_id, 6)
        futures.append(
            (
                None,
                producer.send(
                    topic, key=record_key(*valid[i].key), value=encode_record(valid[i]), partition=partition
                ),
            )
        )
        key, value, reason = _malformed(i, rng)
        futures.append((reason, producer.send(topic, key=key, value=value, partition=i % 6)))
    for reason, future in futures:
        meta = future.get(timeout=60)
        if reason is not None:
            expected[(meta.partition, meta.offset)] = reason
    producer.close()
    with HistoryStore(tmp_path / "store", window_epochs=5) as store:
        indexer = _indexer(
            kafka_servers, topic, dlq, store, limits=RecordLimits(max_record_tokens=4096, batch_records=300)
        )
        totals = _drain(indexer, store, kafka_servers, topic)  # the replica never stops on bad input
        indexer.close()
        assert {t.key for t in store.iter_trajectories()} == {r.key for r in valid}
    assert sum(totals["dead"].values()) == 1000
    letters = read_dead_letters(kafka_servers, dlq)
    assert {(d.partition, d.offset): d.reason for d in letters} == expected
    assert all(d.topic == topic and d.detail and d.key is not None for d in letters)
    assert len(letters) == 1000
    for m in _read_all(kafka_servers, dlq):  # keyed by origin, so replicas' copies compact to one
        headers = dict(m.headers)
        assert m.key == f"{topic}/{int(headers[H_PARTITION])}/{int(headers[H_OFFSET])}".encode()
    assert (
        das(["kafka", "dlq", "--bus", f"kafka://{','.join(kafka_servers)}", "--dlq-topic", dlq, "--json"])
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["dead_letters"] == 1000
    assert summary["by_reason"] == dict(collections.Counter(expected.values()))


def test_records_that_would_destroy_history_go_to_the_dead_letter_topic(
    kafka_servers, kafka_topics, tmp_path
):
    # One plain producer, no DAS code on the sending side: what any client that may write the topic could send.
    # No control topic here: epochs move by samples (three distinct ones confirm a newer epoch).
    topic, dlq = kafka_topics
    producer = KafkaProducer(bootstrap_servers=kafka_servers, linger_ms=5)

    def send(record, partition=None) -> None:
        partition = partition_for(record.problem_id, 6) if partition is None else partition
        producer.send(
            topic, key=record_key(*record.key), value=encode_record(record), partition=partition
        ).get(timeout=30)

    def record(epoch: int, sample: int):
        return synthetic_record(1, 0, 0, SMALL).model_copy(update={"epoch": epoch, "sample": sample})

    with HistoryStore(tmp_path / "store", window_epochs=2) as store:
        indexer = _indexer(kafka_servers, topic, dlq, store, limits=RecordLimits(max_sample=63))
        send(record(2**32 - 1, 0))  # the first record an empty replica sees: beyond any run's epochs
        totals = _drain(indexer, store, kafka_servers, topic)
        assert totals["dead"] == {"epoch_range": 1} and store.stats().trajectories == 0
        for epoch in (0, 1):
            for sample in range(4):
                send(record(epoch, sample))
        send(record(5, 0))  # one record far ahead: held back, evicts nothing
        send(record(6, 0))
        send(record(6, 1))  # two samples of a newer epoch: still not enough to move the window
        send(record(1, 64))  # sample id out of range
        wrong = (partition_for(record(1, 5).problem_id, 6) + 1) % 6
        send(record(1, 5), partition=wrong)  # outside its problem's partition
        totals = _drain(indexer, store, kafka_servers, topic)
        assert totals["dead"] == {"sample_range": 1, "partition": 1} and totals["evicted"] == 0
        assert sorted(k[1:] for k in store.pending()) == [(5, 0), (6, 0), (6, 1)]
        for sample in range(3):
            send(record(2, sample))  # three samples of the next epoch move the window
        totals = _drain(indexer, store, kafka_servers, topic)
        indexer.close()
        assert totals["evicted"] == 4 and totals["dead"] == {}
        assert sorted(k[1:] for k in (t.key for t in store.iter_trajectories())) == [
            (1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2)
        ]  # fmt: skip
    producer.close()
    assert sorted(d.reason for d in read_dead_letters(kafka_servers, dlq)) == [
        "epoch_range", "partition", "sample_range"
    ]  # fmt: skip


def test_publish_reports_backpressure_when_its_bounded_wait_runs_out(kafka_servers, kafka_topics):
    topic, _ = kafka_topics
    bus = open_bus(
        f"kafka://{','.join(kafka_servers)}", topic=topic, max_queue_records=2, publish_timeout_s=0
    )
    refused = 0
    for record in synthetic_records(2, 300, SMALL):
        try:
            bus.publish(record)
        except BusBackpressureError as exc:
            assert "record not taken" in str(exc)
            refused += 1
    bus.flush()
    bus.close()
    assert refused > 0
    assert sum(end_offsets(kafka_servers, topic).values()) == 300 - refused
    with pytest.raises(BusError, match="closed"):
        bus.publish(next(synthetic_records(2, 1, SMALL)))


def test_replacing_a_stuck_producer_settles_every_record_it_held(kafka_servers, kafka_topics):
    # The bus replaces its kafka-python producer when one stops answering (after a full outage); closing the old
    # one fails whatever it still held ("closed forcefully"). Those records must be sent again, not reported
    # unknown, and their errors must not condemn the next producer in turn (a cascade seen after outages).
    topic, _ = kafka_topics
    bus = open_bus(f"kafka://{','.join(kafka_servers)}", topic=topic)
    records = list(synthetic_records(4, 400, SMALL))
    for i, record in enumerate(records):
        bus.publish(record)
        time.sleep(0.01)  # steady traffic: sends continue while abandoned records come due again
        if i % 50 == 25:
            with bus._lock:  # what the stuck-producer check does
                bus._abandon_producer()
    report = bus.close(timeout_s=60)
    assert (report.acknowledged, report.refused, report.unknown) == (400, 0, 0)
    consumer = KafkaConsumer(
        bootstrap_servers=kafka_servers, enable_auto_commit=False, consumer_timeout_ms=3000
    )
    partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
    consumer.assign(partitions)
    consumer.seek_to_beginning(*partitions)
    keys = {m.key for m in consumer}
    consumer.close()
    assert keys == {record_key(*r.key) for r in records}


def test_opening_the_bus_fails_clearly_without_a_broker_or_topic(kafka_servers):
    with pytest.raises(BusError, match="127.0.0.1:1"):
        open_bus("kafka://127.0.0.1:1", bootstrap_timeout_ms=2000)
    with pytest.raises(BusError, match="das kafka init"):
        open_bus(f"kafka://{','.join(kafka_servers)}", topic="test.no-such-topic")
    with pytest.raises(ValueError, match="durability"):
        open_bus(f"kafka://{','.join(kafka_servers)}", acks=1)


def test_records_the_broker_refuses_are_reported_by_the_next_flush(kafka_servers, kafka_topics):
    topic = f"{kafka_topics[0]}.small"
    admin = admin_client(kafka_servers)
    # Configured at creation: a later config change reaches the broker's log asynchronously.
    admin.create_topics(
        {topic: {"num_partitions": 1, "replication_factor": 1, "configs": {"max.message.bytes": "20000"}}}
    )
    admin.wait_for_topics([topic], timeout_ms=30_000)
    admin.close()
    try:
        bus = open_bus(f"kafka://{','.join(kafka_servers)}", topic=topic)
        small, large = synthetic_record(3, 0, 2, SMALL), synthetic_record(3, 1, 2, SMALL)
        large = large.model_copy(update={"response_ids": list(range(70_000, 80_000))})  # ~40 KB on the wire
        bus.publish(small)
        bus.flush()
        bus.publish(large)
        with pytest.raises(BusError, match="1 records could not be delivered") as info:
            bus.flush()
        assert "MessageSizeTooLarge" in str(info.value)
        bus.publish(small.model_copy(update={"sample": 7, "response_ids": [-1]}))  # unencodable, unvalidated
        with pytest.raises(BusError, match="1 records could not be delivered"):
            bus.flush()
        bus.publish(small.model_copy(update={"sample": 8}))  # each failure is reported once; the bus works on
        bus.close()
        assert sum(end_offsets(kafka_servers, topic).values()) == 2
    finally:
        drop_topics(kafka_servers, topic)


def test_a_dead_letter_too_large_for_its_topic_keeps_a_prefix_and_its_size(
    kafka_servers, kafka_topics, tmp_path
):
    topic, dlq = kafka_topics
    # Just under the trajectory topic's 16 MiB limit, so it is accepted there but no longer fits the dead-letter
    # topic together with its headers.
    value = b"DR" + bytes(16_750_000)
    producer = KafkaProducer(bootstrap_servers=kafka_servers, max_request_size=1 << 24)
    producer.send(topic, key=b"big", value=value, partition=0).get(timeout=60)
    producer.close()
    with HistoryStore(tmp_path / "store") as store:
        indexer = _indexer(kafka_servers, topic, dlq, store)
        totals = _drain(indexer, store, kafka_servers, topic)
        indexer.close()
    assert sum(totals["dead"].values()) == 1
    [letter] = _read_all(kafka_servers, dlq)
    headers = dict(letter.headers)
    assert int(headers[H_TRUNCATED]) == len(value)
    assert value.startswith(letter.value) and len(letter.value) < len(value)


def test_response_logprobs_travel_to_the_store_and_invalid_ones_are_dead_lettered(
    kafka_servers, epoch_topics, tmp_path
):
    topic, dlq = epoch_topics
    plain = [synthetic_record(0, i, 1000, SMALL) for i in range(12)]
    # float32 values, as the engine computes them: they come back bit for bit.
    valid = [
        r.model_copy(
            update={"response_logprobs": (-np.arange(len(r.response_ids), dtype=np.float32) / 7).tolist()}
        )
        for r in plain[:6]
    ]
    bad_values = (
        lambda n: [-0.5] * (n - 1),  # one short
        lambda n: [-0.5] * n + [-0.5],  # one too many
        lambda n: [-0.5] * (n - 1) + [0.75],  # a probability above 1
        lambda n: [float("nan")] + [-0.5] * (n - 1),
        lambda n: [-0.5] * (n - 1) + [float("-inf")],
    )
    invalid = [
        r.model_copy(update={"response_logprobs": make(len(r.response_ids))})
        for r, make in zip(plain[6:11], bad_values, strict=True)
    ]
    without = plain[11:]
    # One sample each: too few to confirm an epoch, so the trainer's word moves the windows.
    advance(kafka_servers, topic, {r.problem_id: r.epoch for r in plain})
    producer = KafkaProducer(bootstrap_servers=kafka_servers, linger_ms=5)
    expected = {}
    for record in valid + invalid + without:
        meta = producer.send(
            topic,
            key=record_key(*record.key),
            value=encode_record(record),
            partition=partition_for(record.problem_id, 6),
        ).get(timeout=60)
        if record in invalid:
            expected[(meta.partition, meta.offset)] = "logprobs"
    producer.close()
    with HistoryStore(tmp_path / "store", window_epochs=5) as store:
        indexer = _indexer(kafka_servers, topic, dlq, store)
        totals = _drain(indexer, store, kafka_servers, topic)
        indexer.close()
        assert totals["dead"] == {"logprobs": len(invalid)}
        for record in valid:
            assert store.get(*record.key).response_logprobs.tolist() == record.response_logprobs
        for record in without:
            stored = store.get(*record.key)
            assert stored.response_logprobs is None and stored.response_ids.tolist() == record.response_ids
        assert {t.key for t in store.iter_trajectories()} == {r.key for r in valid + without}
    letters = read_dead_letters(kafka_servers, dlq)
    assert {(d.partition, d.offset): d.reason for d in letters} == expected
    assert all("response log probabilit" in d.detail for d in letters)


def test_the_trainers_epoch_advances_reach_the_replica_from_a_batch_of_rows(
    kafka_servers, epoch_topics, tmp_path
):
    # What verl's DAS managers do per rollout batch: each row's problem and epoch (validation rows carry -1), the
    # newest per problem sent in the background, never blocking the trainer.
    from pipeline.epochs import BackgroundEpochPublisher, advance_rows, newest_epochs

    topic, dlq = epoch_topics
    rows = (["a", "a", "b", None, "c"], [2, 3, 0, 5, -1])
    assert newest_epochs(*rows) == {"a": 3, "b": 0}
    publisher = BackgroundEpochPublisher(f"kafka://{','.join(kafka_servers)}", topic)
    advance_rows(publisher, *rows)
    assert publisher.flush(60) and not publisher.disabled and publisher.sent == 2
    with HistoryStore(tmp_path / "store", window_epochs=2) as store:
        indexer = _indexer(kafka_servers, topic, dlq, store)
        _drain(indexer, store, kafka_servers, topic)
        want = end_offsets(kafka_servers, f"{topic}.epochs")
        for _ in range(50):
            if all(store.offsets().get(tp, 0) >= end for tp, end in want.items()):
                break
            indexer.step()
        indexer.close()
        assert store.references() == {"a": 3, "b": 0}
    # Without a control topic (a plain-data deployment), the publisher turns itself off.
    plain = BackgroundEpochPublisher(f"kafka://{','.join(kafka_servers)}", f"{topic}.none")
    plain.advance({"a": 1})
    assert plain.flush(60) and plain.disabled
