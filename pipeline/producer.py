"""The Kafka side of the bus for rollout workers: `KafkaBus`, opened with `open_bus("kafka://...")`.

`publish` only appends to a queue; one background thread encodes records and hands them to kafka-python's
producer, whose own IO thread batches, compresses and sends them. The caller's decode loop therefore never
waits on the network: at most `max_queue_records` records may be published and not yet acknowledged; when
the brokers are away that bound is reached and `publish` raises `BusBackpressureError` at once. Records that
fail delivery after the producer's own retries are reported by the next `publish`, `flush` or `close` as one
`BusError` with a count and the first cause.

Durability is not configurable down: acks=all with the idempotent producer (retries cannot duplicate or
reorder a partition's records), lz4 compression (token ids compress well and lz4 costs little CPU).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

from kafka import KafkaProducer
from kafka.errors import KafkaError, KafkaTimeoutError, MessageSizeTooLargeError

from monitoring.metrics import PRODUCER_QUEUE_DEPTH, PRODUCER_SEND_ERRORS, RECORDS_PUBLISHED
from pipeline.bus import DEFAULT_QUEUE_RECORDS, BusBackpressureError, BusError
from pipeline.kafka_config import client_settings
from pipeline.schemas import TrajectoryRecord
from pipeline.topics import MAX_MESSAGE_BYTES, TRAJECTORY_TOPIC, topic_partitions
from pipeline.wire import encode_record, partition_for, record_key

PRODUCER_DEFAULTS: dict[str, object] = {
    "acks": "all",
    "enable_idempotence": True,
    "compression_type": "lz4",
    # A few ms of lingering fills batches under load and adds little to freshness (target p99 < 1 s).
    "linger_ms": 5,
    # Trajectories are ~10 KB; 512 KB batches hold dozens, which is where lz4 and the broker work best.
    "batch_size": 512 * 1024,
    "max_request_size": MAX_MESSAGE_BYTES,
    # How long the sender thread may wait for a partition's metadata before a record fails; the bound on
    # unacknowledged records absorbs the wait, so the caller sees backpressure rather than a stall.
    "max_block_ms": 60_000,
    # Two minutes of retries covers a broker restart and a leader election on a loaded machine.
    "delivery_timeout_ms": 120_000,
    "client_id": "das-rollout",
}
_DURABILITY = {"acks": "all", "enable_idempotence": True}
_STOP = object()


class KafkaBus:
    """Publishes trajectory records to Kafka: key = record identity, partition = hash of the problem id.

    Raises BusError at construction if no broker answers or the topic does not exist, ValueError if
    `settings` try to weaken durability.
    """

    def __init__(
        self,
        servers: list[str],
        *,
        topic: str = TRAJECTORY_TOPIC,
        max_queue_records: int = DEFAULT_QUEUE_RECORDS,
        **settings: object,
    ) -> None:
        if max_queue_records < 1:
            raise ValueError(f"max_queue_records must be >= 1, got {max_queue_records}")
        settings = client_settings(settings)
        for key, required in _DURABILITY.items():
            if key in settings and settings[key] != required:
                raise ValueError(
                    f"{key}={settings[key]!r} would give up durability; the bus needs {required!r}"
                )
        self.servers = list(servers)
        self.topic = topic
        self._where = f"Kafka at {','.join(self.servers)}, topic {topic}"
        self._partitions = topic_partitions(self.servers, topic, **settings)
        self._settings = {**PRODUCER_DEFAULTS, **settings}
        self._producer = self._new_producer()
        # kafka-python 3.0.12 puts an idempotent producer into a permanent fatal state after any
        # non-retriable batch error (e.g. a record the broker refuses as too large); the sender thread then
        # replaces it, so one bad record costs that record, not every later one.
        self._replace_producer = False
        self.max_queue_records = max_queue_records
        self._queue: queue.Queue[object] = queue.Queue()
        self._lock = threading.Condition()
        self._pending = 0  # published, not yet acknowledged or failed
        self._failed = 0
        self._first_error: str | None = None
        self._closed = False
        self.wire_bytes = 0  # encoded bytes handed to the producer (before compression); for load reports
        self._thread = threading.Thread(target=self._send_loop, name="das-bus-sender", daemon=True)
        self._thread.start()

    def publish(self, record: TrajectoryRecord) -> None:
        """Queues one record; never blocks.

        Raises BusBackpressureError if `max_queue_records` records are already published and not yet
        acknowledged (the record is not taken), BusError if earlier records failed delivery (reported once)
        or the bus is closed, TypeError for a non-record.
        """
        if not isinstance(record, TrajectoryRecord):
            raise TypeError(f"publish takes a TrajectoryRecord, got {type(record).__name__}")
        if self._closed:
            raise BusError(f"bus to {self._where} is closed")
        self._raise_failures()
        with self._lock:
            # The bound counts records inside kafka-python too: its accumulator has no memory limit, so a
            # queue alone would drain into it without bound while the brokers are away.
            if self._pending >= self.max_queue_records:
                raise BusBackpressureError(
                    f"{self._pending} records wait for acknowledgement from {self._where}: the brokers are "
                    f"unreachable or slower than the rollouts (last error: {self._first_error or 'none'}); "
                    "record not taken"
                )
            self._queue.put_nowait((record, time.time()))
            self._pending += 1
            PRODUCER_QUEUE_DEPTH.set(self._pending)
        RECORDS_PUBLISHED.inc()

    def flush(self, timeout_s: float = 30) -> None:
        """Waits until every published record is acknowledged by the in-sync replicas.

        Raises BusError if some failed delivery or `timeout_s` passes first.
        """
        deadline = time.monotonic() + timeout_s
        while not self._queue.empty():
            if time.monotonic() >= deadline:
                raise BusError(
                    f"flush: {self._queue.qsize()} records still queued for {self._where} after {timeout_s} s"
                )
            time.sleep(0.005)
        # Sends lingering batches now. Its own errors (a batch aborted mid-flight) also reach each record's
        # callback, so what counts is the per-record tally below, not this call's outcome.
        with contextlib.suppress(KafkaError):
            self._producer.flush(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            # The queue can be empty while the sender still holds the last record; wait for its callback.
            if not self._lock.wait_for(lambda: self._pending == 0, max(0.0, deadline - time.monotonic())):
                raise BusError(
                    f"flush: {self._pending} records unacknowledged by {self._where} after {timeout_s} s"
                )
        self._raise_failures()

    def close(self, timeout_s: float = 30) -> None:
        """Flushes, stops the sender thread and closes the producer. Raises BusError if records were lost."""
        if self._closed:
            return
        try:
            self.flush(timeout_s)
        finally:
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join(timeout_s)
            self._producer.close(timeout=timeout_s)
            PRODUCER_QUEUE_DEPTH.set(0)

    def _new_producer(self) -> KafkaProducer:
        try:
            return KafkaProducer(bootstrap_servers=self.servers, **self._settings)
        except KafkaError as exc:
            raise BusError(f"cannot reach {self._where}: {exc}") from exc

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            record, published_at = item  # type: ignore[misc]
            if self._replace_producer:
                self._replace_producer = False
                self._producer.close(timeout=5)
                try:
                    self._producer = self._new_producer()
                except BusError as exc:
                    self._on_failure(exc)
                    self._replace_producer = True
                    continue
            try:
                value = encode_record(record)
            except (ValueError, TypeError, OverflowError) as exc:
                # A record built without validation (model_construct) can hold ids no encoding takes; it fails
                # alone and is reported like any undelivered record, and this thread lives on.
                self._on_failure(exc)
                continue
            self.wire_bytes += len(value)
            try:
                future = self._producer.send(
                    self.topic,
                    key=record_key(*record.key),
                    value=value,
                    partition=partition_for(record.problem_id, self._partitions),
                    timestamp_ms=int(published_at * 1000),
                )
            except (KafkaTimeoutError, MessageSizeTooLargeError) as exc:
                self._on_failure(exc)  # refused before sending: the producer itself is fine
                continue
            except KafkaError as exc:
                self._on_failure(exc)
                self._replace_producer = True
                continue
            future.add_callback(self._on_success)
            future.add_errback(self._on_delivery_failure)

    def _on_success(self, _metadata: object) -> None:
        with self._lock:
            self._pending -= 1
            PRODUCER_QUEUE_DEPTH.set(self._pending)
            self._lock.notify_all()

    def _on_delivery_failure(self, exc: BaseException) -> None:
        if not getattr(exc, "retriable", False):
            self._replace_producer = True
        self._on_failure(exc)

    def _on_failure(self, exc: BaseException) -> None:
        PRODUCER_SEND_ERRORS.inc()
        with self._lock:
            self._pending -= 1
            self._failed += 1
            if self._first_error is None:
                self._first_error = f"{type(exc).__name__}: {exc}"
            PRODUCER_QUEUE_DEPTH.set(self._pending)
            self._lock.notify_all()

    def _raise_failures(self) -> None:
        with self._lock:
            if not self._failed:
                return
            failed, cause = self._failed, self._first_error
            self._failed, self._first_error = 0, None
        raise BusError(
            f"{failed} records could not be delivered to {self._where} after retries; first cause: {cause}"
        )
