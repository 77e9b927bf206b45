"""The embedded bus (one machine, no broker): records published in-process reach the store and the drafting
index through the same Indexer the Kafka replica runs, and a full queue is refused, never waited on."""

from __future__ import annotations

import threading

import pytest

from history_store.automaton.problem_index import ProblemIndex
from history_store.durable.store import HistoryStore
from pipeline.bus import BusBackpressureError, BusError, EmbeddedBus, embedded_bus, open_bus
from pipeline.kafka_config import parse_bus_url
from pipeline.schemas import TrajectoryRecord
from pipeline.synthetic import SyntheticShape, synthetic_records
from workers.replica.service import Indexer, ProblemIndexListener, RecordLimits

SHAPE = SyntheticShape(problems=5, epochs=5, prompt_tokens=20, response_tokens_median=50)


def test_embedded_records_reach_store_and_index_with_eviction(tmp_path):
    bus = EmbeddedBus()
    index = ProblemIndex(window_epochs=2)
    records = list(synthetic_records(0, 100, SHAPE))
    for record in records[:10]:  # published before the indexer subscribes: kept for it
        bus.publish(record)
    with HistoryStore(tmp_path / "store", window_epochs=2) as store:
        indexer = Indexer(
            bus.subscribe(), store, listeners=[ProblemIndexListener(index)], poll_timeout_s=0.01
        )
        indexer.start()
        for record in records[10:]:
            bus.publish(record)
        evicted = 0
        while (report := indexer.step()).messages:
            evicted += report.evicted
        kept = {r.key for r in records if r.epoch >= 3}
        assert {t.key for t in store.iter_trajectories()} == kept
        assert evicted == sum(1 for r in records if r.epoch < 3)
        assert store.offsets() == {}  # the embedded queue is not durable; nothing to resume from
    for problem_id in {r.problem_id for r in records}:
        stats = index.problem_stats(problem_id)
        assert stats["epochs"] == [3, 4]
        assert stats["samples"] == sum(1 for k in kept if k[0] == problem_id)


def test_embedded_publish_refuses_when_the_queue_is_full():
    bus = EmbeddedBus(max_queue_records=3)
    bus.subscribe()
    records = list(synthetic_records(1, 4, SHAPE))
    for record in records[:3]:
        bus.publish(record)
    with pytest.raises(BusBackpressureError, match="record not taken"):
        bus.publish(records[3])
    with pytest.raises(BusError, match="not taken by subscribers"):
        bus.flush(timeout_s=0.05)


def test_embedded_flush_waits_for_the_indexer(tmp_path):
    bus = EmbeddedBus()
    subscription = bus.subscribe()
    for record in synthetic_records(2, 20, SHAPE):
        bus.publish(record)
    taken: list[int] = []
    thread = threading.Thread(target=lambda: taken.extend(m.offset for m in subscription.poll(100, 5)))
    thread.start()
    bus.flush(timeout_s=5)
    thread.join()
    assert taken == list(range(20))


def test_open_bus_names_the_embedded_bus_and_refuses_unknown_urls():
    assert open_bus() is embedded_bus() is open_bus("embedded")
    with pytest.raises(ValueError, match="unknown bus"):
        open_bus("redis://x")
    with pytest.raises(ValueError, match="host:port"):
        parse_bus_url("kafka://nohost")
    with pytest.raises(ValueError, match="no settings"):
        open_bus("embedded", topic="x")
    with pytest.raises(TypeError):
        embedded_bus().publish({"problem_id": "p"})  # type: ignore[arg-type]
    assert isinstance(next(synthetic_records(0, 1)), TrajectoryRecord)


def test_replica_checkpoints_at_epoch_boundaries_and_a_failed_checkpoint_never_stops_ingest(tmp_path, caplog):
    from history_store.durable.checkpoints import Checkpointer, list_checkpoints, read_manifest

    bus = EmbeddedBus()
    records = list(synthetic_records(0, 60, SHAPE))
    with HistoryStore(tmp_path / "store", window_epochs=5) as store:
        root = tmp_path / "checkpoints"
        indexer = Indexer(
            bus.subscribe(),
            store,
            poll_timeout_s=0.01,
            limits=RecordLimits(batch_records=4),
            checkpointer=Checkpointer(store, root, every_seconds=3600, keep=2),
        )
        indexer.start()
        for record in records:
            bus.publish(record)
        while indexer.step().messages:
            pass
        kept = list_checkpoints(root)
        assert 1 <= len(kept) <= 2, "epoch boundaries checkpoint, the oldest are pruned"
        assert read_manifest(kept[-1])["max_epoch"] <= max(r.epoch for r in records)
        stored = sum(1 for _ in store.iter_trajectories())
        root.rename(tmp_path / "moved")
        root.write_text("not a folder: every checkpoint now fails")
        indexer.checkpointer.every_seconds = 1e-9  # due at every batch from now on
        for record in synthetic_records(60, 40, SHAPE):
            bus.publish(record)
        while indexer.step().messages:
            pass
        assert sum(1 for _ in store.iter_trajectories()) > stored
        assert "automatic checkpoint" in caplog.text


def test_an_embedded_record_with_invalid_logprobs_is_dropped_and_the_replica_goes_on(tmp_path):
    bus = EmbeddedBus()
    # One epoch: the replica's epoch checks judge records against the epoch recent records agree on.
    good, bad, plain = list(synthetic_records(0, 3, SyntheticShape(problems=5, epochs=1, prompt_tokens=20)))
    good = good.model_copy(update={"response_logprobs": [-0.5] * len(good.response_ids)})
    bad = bad.model_copy(update={"response_logprobs": [0.5] * len(bad.response_ids)})
    with HistoryStore(tmp_path / "store") as store:
        indexer = Indexer(bus.subscribe(), store, poll_timeout_s=0.01)
        indexer.start()
        for record in (good, bad, plain):
            bus.publish(record)
        dead: dict[str, int] = {}
        while (report := indexer.step()).messages:
            for reason, n in report.dead_lettered.items():
                dead[reason] = dead.get(reason, 0) + n
        assert dead == {"logprobs": 1}
        assert {t.key for t in store.iter_trajectories()} == {good.key, plain.key}
        assert store.get(*good.key).response_logprobs.tolist() == good.response_logprobs
