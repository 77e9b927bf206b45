"""Publishing from verl's agent loops never blocks or fails a rollout: the bus opens on a background thread
with backoff, an unreachable Kafka is logged once, and records wait in a bounded queue meanwhile."""

from __future__ import annotations

import logging
import time

import pytest

from pipeline.bus import embedded_bus
from pipeline.schemas import TrajectoryRecord
from workers.verl.agent_loop import trajectory_publisher
from workers.verl.publisher import BackgroundPublisher, check_bus_url

# Nothing listens on port 1: connections are refused at once, so the opener fails and retries.
UNREACHABLE = "kafka://127.0.0.1:1"


def _record(sample: int) -> TrajectoryRecord:
    return TrajectoryRecord(problem_id="p", epoch=0, sample=sample, prompt_ids=[1, 2], response_ids=[3, 4])


def _wait(condition, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_an_unreachable_kafka_neither_blocks_nor_fails_publishing_and_is_logged_once(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="workers.verl.publisher"):
        publisher = trajectory_publisher({"bus": UNREACHABLE, "bus_settings": {}})
        assert publisher is trajectory_publisher({"bus": UNREACHABLE})  # one per worker process
        for sample in range(5):
            publisher.publish(_record(sample))  # returns at once; the agent loop goes on
        assert not publisher.connected and publisher.pending() == 5
        assert _wait(lambda: publisher.attempts >= 2), "the opener does not retry"
    opens = [r for r in caplog.records if "cannot open the bus" in r.getMessage()]
    assert len(opens) == 1 and UNREACHABLE in opens[0].getMessage()
    assert not publisher.connected and publisher.pending() == 5


def test_a_full_queue_drops_the_oldest_records_and_counts_them(caplog) -> None:
    publisher = BackgroundPublisher(UNREACHABLE, max_queue_records=3)
    with caplog.at_level(logging.WARNING, logger="workers.verl.publisher"):
        for sample in range(5):
            publisher.publish(_record(sample))
    assert publisher.pending() == 3 and publisher.dropped == 2
    assert sum("dropping the oldest" in r.getMessage() for r in caplog.records) == 1


def test_records_reach_the_bus_once_it_is_open() -> None:
    subscription = embedded_bus().subscribe()
    try:
        publisher = BackgroundPublisher("embedded")
        for sample in range(4):
            publisher.publish(_record(sample))
        assert _wait(lambda: publisher.delivered == 4)
        messages = subscription.poll(max_records=10, timeout_s=5.0)
        assert [m.record.sample for m in messages] == [0, 1, 2, 3]
    finally:
        subscription.close()


def test_a_malformed_bus_url_fails_where_the_config_is_read() -> None:
    with pytest.raises(ValueError):
        check_bus_url("kafka:/broker:9092")
    assert trajectory_publisher({"bus": None}) is None
