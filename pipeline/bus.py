"""The trajectory bus: rollout workers publish finished trajectories, history replicas consume them.

Two implementations behind one small interface:
- `embedded` (the default, one machine): in-process queues; the indexer service in the same process subscribes.
- `kafka://host:port[,host:port][?key=value&...]`: Apache Kafka through kafka-python
  (`pipeline.producer.KafkaBus`), the durable, replayable source of truth for many nodes. TLS and SASL come
  from URL parameters, `open_bus(url, **settings)` or DAS_KAFKA_* variables (`pipeline.kafka_config`).

`publish` only puts the record on a bounded queue. While the Kafka bus's queue is full (the brokers are away
or too slow) it waits, up to a bounded `publish_timeout_s`, then raises `BusBackpressureError`: backpressure
slows the rollouts down for a while, and an outage longer than that fails loudly. The embedded bus, whose only
consumer is in the same process, refuses at once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from monitoring.metrics import PRODUCER_QUEUE_DEPTH, RECORDS_PUBLISHED
from pipeline.errors import DEFAULT_QUEUE_RECORDS, BusBackpressureError, BusError, InvalidInput
from pipeline.kafka_config import KAFKA_SCHEME, parse_bus_url
from pipeline.schemas import TrajectoryRecord

EMBEDDED_URL = "embedded"
EMBEDDED_TOPIC = "embedded"


class Bus(Protocol):
    """What a rollout worker needs: publish finished trajectories, flush them, close."""

    def publish(self, record: TrajectoryRecord) -> None:
        """Queues one record. Raises BusBackpressureError when the queue stays full for the bounded wait (the
        record is not taken) and BusError when the bus is closed."""
        ...

    def flush(self, timeout_s: float = 30) -> None:
        """Waits until every published record is delivered. Raises BusError (BusDeliveryError with exact
        counts from Kafka) when records were refused or are still unconfirmed at the timeout."""
        ...

    def close(self) -> None:
        """Flushes and releases the bus. Raises BusError if records could not be delivered."""
        ...


@dataclass(frozen=True, slots=True)
class BusMessage:
    """One message as a replica receives it.

    From Kafka: `value` holds the wire bytes (None for a tombstone) and `record` is None until decoded.
    From the embedded bus: `record` is the already validated record and `value` is None.
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    headers: tuple[tuple[str, bytes], ...] = ()
    record: TrajectoryRecord | None = None


class TrajectorySource(Protocol):
    """What a history replica consumes: every partition of the topic, from the offsets it stored."""

    topic: str

    def start(self, stored_offsets: Mapping[tuple[str, int], int]) -> None:
        """Assigns all partitions, each at its stored next offset (or the beginning)."""
        ...

    def poll(self, max_records: int, timeout_s: float) -> list[BusMessage]:
        """Up to `max_records` messages, in order within each partition; [] after `timeout_s` idle."""
        ...

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        """Records progress outside the replica (Kafka's committed offsets, for lag monitoring)."""
        ...

    def lag(self) -> int | None:
        """Messages not yet polled, summed over partitions; None when unknown. Raises BusUnavailableError
        when no broker answers (the replica's liveness probe)."""
        ...

    def partition_count(self) -> int:
        """Partitions of the topic (tombstones go to a problem's partition)."""
        ...

    def close(self) -> None: ...


class EmbeddedBus:
    """In-process bus: each subscriber gets every record published after it subscribed, in order.

    Records published while nobody subscribes wait (bounded) for the first subscriber, so a rollout worker
    may start before the in-process indexer.
    """

    def __init__(self, max_queue_records: int = DEFAULT_QUEUE_RECORDS) -> None:
        if max_queue_records < 1:
            raise InvalidInput(f"max_queue_records must be >= 1, got {max_queue_records}")
        self.max_queue_records = max_queue_records
        self._cond = threading.Condition()
        self._subscribers: list[EmbeddedSubscription] = []
        self._backlog: deque[BusMessage] = deque()
        self._next_offset = 0

    def publish(self, record: TrajectoryRecord) -> None:
        """Hands the record to every subscriber's queue. Raises BusBackpressureError if any queue is full."""
        if not isinstance(record, TrajectoryRecord):
            raise TypeError(f"publish takes a TrajectoryRecord, got {type(record).__name__}")
        with self._cond:
            queues = [s._queue for s in self._subscribers] or [self._backlog]
            if any(len(q) >= self.max_queue_records for q in queues):
                raise BusBackpressureError(
                    f"embedded bus: {self.max_queue_records} records wait for the in-process indexer "
                    "(is it running and keeping up?); record not taken"
                )
            message = BusMessage(
                EMBEDDED_TOPIC, 0, self._next_offset, None, None, int(time.time() * 1000), record=record
            )
            self._next_offset += 1
            for q in queues:
                q.append(message)
            PRODUCER_QUEUE_DEPTH.set(max(len(q) for q in queues))
            self._cond.notify_all()
        RECORDS_PUBLISHED.inc()

    def subscribe(self) -> EmbeddedSubscription:
        """A new consumer of this bus; the first one also receives records published before it existed."""
        with self._cond:
            subscription = EmbeddedSubscription(self)
            if not self._subscribers:
                subscription._queue.extend(self._backlog)
                self._backlog.clear()
            self._subscribers.append(subscription)
            return subscription

    def flush(self, timeout_s: float = 30) -> None:
        """Waits until subscribers have taken every published record (records waiting for a first subscriber
        do not count). Raises BusError on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while any(s._queue for s in self._subscribers):
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = sum(len(s._queue) for s in self._subscribers)
                    raise BusError(
                        f"embedded bus: {waiting} records not taken by subscribers in {timeout_s} s"
                    )
                self._cond.wait(left)

    def close(self) -> None:
        """Nothing to release: the embedded bus lives as long as the process (other publishers share it)."""

    def _unsubscribe(self, subscription: EmbeddedSubscription) -> None:
        with self._cond:
            if subscription in self._subscribers:
                self._subscribers.remove(subscription)
            self._cond.notify_all()


class EmbeddedSubscription:
    """A `TrajectorySource` over the embedded bus. Offsets mean nothing across restarts here: the queue dies
    with the process, and the store is the only durable copy."""

    topic = EMBEDDED_TOPIC

    def __init__(self, bus: EmbeddedBus) -> None:
        self._bus = bus
        self._queue: deque[BusMessage] = deque()

    def start(self, stored_offsets: Mapping[tuple[str, int], int]) -> None:
        """Nothing to assign: the embedded bus has one in-memory partition."""

    def poll(self, max_records: int, timeout_s: float) -> list[BusMessage]:
        """Up to `max_records` messages; waits at most `timeout_s` for the first."""
        with self._bus._cond:
            if not self._queue:
                self._bus._cond.wait_for(lambda: bool(self._queue), timeout_s)
            batch = [self._queue.popleft() for _ in range(min(max_records, len(self._queue)))]
            self._bus._cond.notify_all()
            return batch

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        """Nothing outside the process tracks embedded progress."""

    def lag(self) -> int | None:
        """Records waiting in this subscription's queue."""
        return len(self._queue)

    def partition_count(self) -> int:
        return 1

    def close(self) -> None:
        self._bus._unsubscribe(self)


_embedded: EmbeddedBus | None = None
_embedded_lock = threading.Lock()


def embedded_bus() -> EmbeddedBus:
    """The process's embedded bus, shared by every `open_bus("embedded")` caller and the in-process indexer."""
    global _embedded
    with _embedded_lock:
        if _embedded is None:
            _embedded = EmbeddedBus()
        return _embedded


def open_bus(url: str = EMBEDDED_URL, **settings: object) -> Bus:
    """Opens the bus named by `url`: "embedded" (in-process) or "kafka://host:port[,host:port][?key=value&...]".

    Kafka settings: `topic` (default das.trajectories), `max_queue_records`, `publish_timeout_s`, and any
    kafka-python `KafkaProducer` setting (security_protocol, ssl_*, sasl_*, linger_ms, ...), which override the
    URL's parameters and the DAS_KAFKA_* variables; durability (acks=all, idempotence) cannot be turned off.
    Raises ValueError for an unknown URL, BusError when Kafka or the topic cannot be reached.
    """
    if url == EMBEDDED_URL:
        if settings:
            raise InvalidInput(f"the embedded bus takes no settings, got {sorted(settings)}")
        return embedded_bus()
    if url.startswith(KAFKA_SCHEME):
        from pipeline.producer import KafkaBus

        servers, url_settings = parse_bus_url(url)
        return KafkaBus(servers, **{**url_settings, **settings})
    raise InvalidInput(f"unknown bus {url!r}: use 'embedded' or 'kafka://host:port[,host:port]'")
