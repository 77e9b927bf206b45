"""The Kafka side of the bus for rollout workers: `KafkaBus`, opened with `open_bus("kafka://...")`.

`publish` only appends to a queue; one background thread encodes records and hands them to kafka-python's
producer, whose own IO thread batches, compresses and sends them. At most `max_queue_records` records may be
published and not yet settled; when the brokers are away that bound is reached and `publish` waits up to
`publish_timeout_s` for room, then raises `BusBackpressureError` (the record is not taken).

Every record taken ends in exactly one count of the `DeliveryReport`:
- acknowledged: the brokers confirmed it;
- refused: definitely not in the topic (the broker refused it as too large or unauthorised, or it could not be
  encoded);
- unknown: neither, when the report is made. A record whose delivery failed for a transient reason (a broker
  outage, a delivery timeout) is sent again after a pause, for as long as the bus is open: records are keyed
  by (problem, epoch, sample) and replicas apply a key once, so a second copy of a record that did arrive
  costs a duplicate message, never a wrong history. Only what is still unsettled at `flush`/`close`'s
  deadline, or failed with an error that leaves its fate open, is unknown.

Durability is not configurable down: acks=all with the idempotent producer (retries cannot duplicate or
reorder a partition's records within one send), lz4 compression (token ids compress well, lz4 costs little).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from kafka import KafkaProducer
from kafka.errors import (
    AuthorizationError,
    InvalidTopicError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
)

from monitoring.metrics import PRODUCER_QUEUE_DEPTH, PRODUCER_SEND_ERRORS, RECORDS_PUBLISHED
from pipeline.errors import (
    DEFAULT_QUEUE_RECORDS,
    BusBackpressureError,
    BusDeliveryError,
    BusError,
    DeliveryReport,
    InvalidInput,
)
from pipeline.kafka_config import UNREACHABLE, client_settings
from pipeline.schemas import TrajectoryRecord
from pipeline.topics import MAX_MESSAGE_BYTES, TRAJECTORY_TOPIC, topic_partitions
from pipeline.wire import encode_record, partition_for, record_key

log = logging.getLogger(__name__)

PRODUCER_DEFAULTS: dict[str, object] = {
    "acks": "all",
    "enable_idempotence": True,
    "compression_type": "lz4",
    # A few ms of lingering fills batches under load and adds little to freshness (target p99 < 1 s).
    "linger_ms": 5,
    # Trajectories are ~10 KB; 512 KB batches hold dozens, which is where lz4 and the broker work best.
    "batch_size": 512 * 1024,
    "max_request_size": MAX_MESSAGE_BYTES,
    # How long the sender thread may wait for a partition's metadata before a send fails (and is retried);
    # the bound on unsettled records absorbs the wait, so the caller sees backpressure rather than a stall.
    "max_block_ms": 60_000,
    # Two minutes of kafka-python retries covers a broker restart and a leader election on a loaded machine;
    # past that the bus itself sends the record again.
    "delivery_timeout_ms": 120_000,
    "client_id": "das-rollout",
}
_DURABILITY = {"acks": "all", "enable_idempotence": True}
# A minute of backpressure: rollouts slow down through a broker restart, and a longer outage fails loudly
# instead of stalling training without a word.
DEFAULT_PUBLISH_TIMEOUT_S = 60.0
# Pause before a record whose delivery failed transiently is sent again: short against an outage's length,
# long enough not to spin while no broker answers.
RETRY_DELAY_S = 1.0
# Errors after which the broker has certainly not written the record.
_REFUSALS = (MessageSizeTooLargeError, RecordListTooLargeError, AuthorizationError, InvalidTopicError)


def _discard(producer: KafkaProducer, timeout_s: float = 0) -> None:
    """Closes a producer whatever it still holds. kafka-python 3.0.12's `close` flushes first and, when that
    times out, raises without closing (its `__del__` then prints the same error again); force it instead."""
    try:
        producer.close(timeout=timeout_s)
    except KafkaError:
        producer._sender.force_close()
        producer._closed = True


@dataclass(slots=True, eq=False)
class _Pending:
    """One record taken by `publish`, until it is settled (`done`). `attempt` counts abandoned sends: a
    callback of an older attempt no longer decides the record's fate (an acknowledgement still counts)."""

    record: TrajectoryRecord
    published_at: float
    attempt: int = 0
    sent_at: float = 0.0
    done: bool = False


class KafkaBus:
    """Publishes trajectory records to Kafka: key = record identity, partition = hash of the problem id.

    Raises BusError at construction if no broker answers or the topic does not exist, ValueError if
    `settings` try to weaken durability or are malformed.
    """

    def __init__(
        self,
        servers: list[str],
        *,
        topic: str = TRAJECTORY_TOPIC,
        max_queue_records: int = DEFAULT_QUEUE_RECORDS,
        publish_timeout_s: float = DEFAULT_PUBLISH_TIMEOUT_S,
        **settings: object,
    ) -> None:
        if max_queue_records < 1:
            raise InvalidInput(f"max_queue_records must be >= 1, got {max_queue_records}")
        if not publish_timeout_s >= 0:
            raise InvalidInput(f"publish_timeout_s must be >= 0, got {publish_timeout_s}")
        settings = client_settings(settings)
        for key, required in _DURABILITY.items():
            if key in settings and settings[key] != required:
                raise InvalidInput(
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
        self.publish_timeout_s = publish_timeout_s
        self._lock = threading.Condition()
        self._queue: deque[_Pending] = deque()
        self._retries: deque[tuple[float, _Pending]] = deque()  # (due, record), in due order
        self._published = self._acknowledged = self._refused = self._given_up = 0
        self._reported_refused = self._reported_given_up = 0
        self._first_refusal: str | None = None
        self._last_error: str | None = None
        self._in_flight: dict[int, _Pending] = {}  # id -> record handed to kafka-python, not yet answered
        self._stuck_after_s = float(self._settings["delivery_timeout_ms"]) / 1000 + 30  # type: ignore[arg-type]
        self._next_stuck_check = 0.0
        self._outage = False
        self._closed = False
        self._settled = False  # after close: late callbacks no longer change the report
        self.wire_bytes = 0  # encoded bytes handed to the producer (before compression); for load reports
        self._thread = threading.Thread(target=self._send_loop, name="das-bus-sender", daemon=True)
        self._thread.start()

    @property
    def _unsettled(self) -> int:
        return self._published - self._acknowledged - self._refused - self._given_up

    def report(self) -> DeliveryReport:
        """The counts as of now: every record taken is acknowledged, refused or unknown."""
        with self._lock:
            return DeliveryReport(
                published=self._published,
                acknowledged=self._acknowledged,
                refused=self._refused,
                unknown=self._unsettled + self._given_up,
                first_refusal=self._first_refusal,
                last_error=self._last_error,
            )

    def publish(self, record: TrajectoryRecord) -> None:
        """Queues one record, waiting up to `publish_timeout_s` while `max_queue_records` are unsettled.

        Raises BusBackpressureError if no room came in time (the record is not taken), BusError if the bus
        is closed, TypeError for a non-record.
        """
        if not isinstance(record, TrajectoryRecord):
            raise TypeError(f"publish takes a TrajectoryRecord, got {type(record).__name__}")
        with self._lock:
            if self._closed:
                raise BusError(f"bus to {self._where} is closed")
            # The bound counts records inside kafka-python too: its accumulator has no memory limit, so a
            # queue alone would drain into it without bound while the brokers are away.
            if not self._lock.wait_for(
                lambda: self._unsettled < self.max_queue_records or self._closed, self.publish_timeout_s
            ):
                raise BusBackpressureError(
                    f"{self._unsettled} records have waited {self.publish_timeout_s:g} s for acknowledgement "
                    f"from {self._where}: the brokers are unreachable or slower than the rollouts (last "
                    f"error: {self._last_error or 'none'}); record not taken"
                )
            if self._closed:
                raise BusError(f"bus to {self._where} is closed")
            self._queue.append(_Pending(record, time.time()))
            self._published += 1
            PRODUCER_QUEUE_DEPTH.set(self._unsettled)
            self._lock.notify_all()
        RECORDS_PUBLISHED.inc()

    def flush(self, timeout_s: float = 30) -> DeliveryReport:
        """Waits until every published record is settled (acknowledged or refused), up to `timeout_s`.

        Returns the report. Raises BusDeliveryError if records were refused since the last flush (each
        refusal is reported once) or some are still unconfirmed at the timeout (they keep being retried).
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._lock.notify_all()
        # Sends lingering batches now. Its own errors (a batch aborted mid-flight) also reach each record's
        # callback, so what counts is the per-record tally below, not this call's outcome.
        with contextlib.suppress(KafkaError):
            self._producer.flush(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._lock.wait_for(
                lambda: self._unsettled == 0 or self._settled, max(0.0, deadline - time.monotonic())
            )
            report = self.report()
            new_refused = self._refused - self._reported_refused
            new_given_up = self._given_up - self._reported_given_up
            self._reported_refused, self._reported_given_up = self._refused, self._given_up
            unsettled = self._unsettled
        if unsettled:
            raise BusDeliveryError(
                f"flush: {unsettled} records not confirmed by {self._where} after {timeout_s:g} s", report
            )
        if new_refused or new_given_up:
            raise BusDeliveryError(
                f"{new_refused + new_given_up} records could not be delivered to {self._where}", report
            )
        return report

    def close(self, timeout_s: float = 30) -> DeliveryReport:
        """Flushes, stops the sender thread and closes the producer; returns the final report.

        Raises BusDeliveryError (with the final report) if records were refused or are unknown.
        """
        if self._closed:
            return self.report()
        failed = False
        try:
            self.flush(timeout_s)
        except BusDeliveryError:
            failed = True
        with self._lock:
            self._closed = True
            report = self.report()
            self._settled = True
            self._lock.notify_all()
        self._thread.join(5)
        # Whatever kafka-python still holds is abandoned; the report already counts it as unknown.
        _discard(self._producer, timeout_s=1)
        PRODUCER_QUEUE_DEPTH.set(0)
        if failed:
            raise BusDeliveryError(f"closing the bus to {self._where}", report)
        return report

    def _new_producer(self) -> KafkaProducer:
        try:
            return KafkaProducer(bootstrap_servers=self.servers, **self._settings)
        except KafkaError as exc:
            raise BusError(f"cannot reach {self._where}: {UNREACHABLE}: {exc}") from exc

    def _next(self) -> _Pending | None:
        """The next record to send (a due retry first), or None once the bus is closed."""
        with self._lock:
            while True:
                if self._closed:
                    return None
                now = time.monotonic()
                self._check_stuck(now)
                if self._retries and self._retries[0][0] <= now:
                    item = self._retries.popleft()[1]
                    if not item.done:  # an earlier attempt may have been acknowledged meanwhile
                        return item
                    continue
                if self._queue:
                    return self._queue.popleft()
                self._lock.wait(min(self._retries[0][0] - now, 1.0) if self._retries else 1.0)

    def _check_stuck(self, now: float) -> None:
        """Gives up on a producer that has held a record far past its own delivery timeout without answering
        (seen with kafka-python 3.0.12 after a full outage: its idempotent state waits for a producer id that
        never comes). Its records are sent again through a fresh producer. Called with the lock held."""
        if now < self._next_stuck_check or not self._in_flight:
            return
        self._next_stuck_check = now + 1.0
        oldest = min(item.sent_at for item in self._in_flight.values())
        if now - oldest > self._stuck_after_s:
            log.warning(
                "%s: %d records unanswered for %.0f s; starting a fresh producer and sending them again",
                self._where,
                len(self._in_flight),
                now - oldest,
            )
            self._abandon_producer()

    def _abandon_producer(self) -> None:
        """Asks the sender to replace the producer, and moves every in-flight record to the retry queue now, so
        that the sender wakes for them even when nothing else is queued. Called with the lock held."""
        self._requeue_in_flight()
        self._replace_producer = True

    def _requeue_in_flight(self) -> None:
        """Moves every record in flight to the retry queue; their current attempt's callbacks are ignored from
        now on. Called with the lock held."""
        due = time.monotonic() + RETRY_DELAY_S
        for item in self._in_flight.values():
            item.attempt += 1
            self._retries.append((due, item))
        self._in_flight.clear()

    def _swap_producer(self) -> BusError | None:
        """Replaces the producer. Everything in flight was sent through the old one, including records sent
        after the replacement was asked for: all of it is queued again before the old producer is closed, so
        the errors that closing it gives them ("closed forcefully") belong to abandoned attempts and settle
        nothing. Returns the error if no new producer could be made (it is asked for again)."""
        with self._lock:
            self._replace_producer = False
            self._requeue_in_flight()
        _discard(self._producer)
        try:
            self._producer = self._new_producer()
        except BusError as exc:
            self._replace_producer = True
            return exc
        return None

    def _send_loop(self) -> None:
        while (item := self._next()) is not None:
            if self._replace_producer and (exc := self._swap_producer()) is not None:
                self._retry(item, item.attempt, exc)
                continue
            try:
                value = encode_record(item.record)
            except (ValueError, TypeError, OverflowError) as exc:
                # A record built without validation (model_construct) can hold ids no encoding takes; it is
                # refused alone, and this thread lives on.
                self._refuse(item, item.attempt, exc)
                continue
            self.wire_bytes += len(value)
            attempt = item.attempt
            with self._lock:
                item.sent_at = time.monotonic()
                self._in_flight[id(item)] = item
            try:
                future = self._producer.send(
                    self.topic,
                    key=record_key(*item.record.key),
                    value=value,
                    partition=partition_for(item.record.problem_id, self._partitions),
                    timestamp_ms=int(item.published_at * 1000),
                )
            except _REFUSALS as exc:
                self._refuse(item, attempt, exc)  # refused before sending: the producer itself is fine
                continue
            except KafkaError as exc:
                # Not sent at all (no metadata within max_block_ms, or a producer in its fatal state).
                if not getattr(exc, "retriable", False):
                    self._replace_producer = True
                self._retry(item, attempt, exc)
                continue
            future.add_callback(self._on_success, item, attempt)
            future.add_errback(self._on_delivery_failure, item, attempt)

    def _on_success(self, item: _Pending, _attempt: int, _metadata: object) -> None:
        with self._lock:
            # Any attempt's acknowledgement counts (the record is in the topic), but only once.
            if self._settled or item.done:
                return
            item.done = True
            self._in_flight.pop(id(item), None)
            self._acknowledged += 1
            if self._outage:
                self._outage = False
                log.warning("%s answers again; the records that waited are being delivered", self._where)
            PRODUCER_QUEUE_DEPTH.set(self._unsettled)
            self._lock.notify_all()

    def _current(self, item: _Pending, attempt: int) -> bool:
        """Whether this callback's attempt still decides the record's fate. Called with the lock held."""
        return not (self._settled or item.done or item.attempt != attempt)

    def _on_delivery_failure(self, item: _Pending, attempt: int, exc: BaseException) -> None:
        with self._lock:
            if not self._current(item, attempt):
                # An abandoned attempt (its producer was replaced): it must not replace the new producer too,
                # or every replacement would fail the records just sent through the next one.
                return
        if isinstance(exc, _REFUSALS):
            self._replace_producer = True
            self._refuse(item, attempt, exc)
        elif getattr(exc, "retriable", False):
            if isinstance(exc, KafkaTimeoutError):
                # The batch expired: kafka-python then resets its idempotent state, which it did not always
                # recover from here; a fresh producer always does.
                with self._lock:
                    if not self._replace_producer and self._current(item, attempt):
                        self._in_flight.pop(id(item), None)
                        self._abandon_producer()
            self._retry(item, attempt, exc)
        else:
            # Neither a refusal nor transient: the broker may or may not have written it. Report it as
            # unknown rather than guess, and start a fresh producer (this one is in its fatal state).
            PRODUCER_SEND_ERRORS.inc()
            with self._lock:
                if not self._current(item, attempt):
                    return
                self._replace_producer = True
                item.done = True
                self._in_flight.pop(id(item), None)
                self._given_up += 1
                self._last_error = f"{type(exc).__name__}: {exc}"
                self._lock.notify_all()
            log.error("record %s: delivery to %s failed, fate unknown: %s", item.record.key, self._where, exc)

    def _retry(self, item: _Pending, attempt: int, exc: BaseException) -> None:
        with self._lock:
            if not self._current(item, attempt):
                return  # acknowledged meanwhile, or this attempt was already abandoned and requeued
            item.attempt += 1
            self._in_flight.pop(id(item), None)
            self._last_error = f"{type(exc).__name__}: {exc}"
            if not self._outage:
                self._outage = True
                log.warning(
                    "%s does not answer (%s); %d records wait and are sent again every %g s until it does",
                    self._where,
                    self._last_error,
                    self._unsettled,
                    RETRY_DELAY_S,
                )
            self._retries.append((time.monotonic() + RETRY_DELAY_S, item))
            self._lock.notify_all()

    def _refuse(self, item: _Pending, attempt: int, exc: BaseException) -> None:
        PRODUCER_SEND_ERRORS.inc()
        with self._lock:
            if not self._current(item, attempt):
                return
            item.done = True
            self._in_flight.pop(id(item), None)
            self._refused += 1
            if self._first_refusal is None:
                self._first_refusal = f"{type(exc).__name__}: {exc}"
            PRODUCER_QUEUE_DEPTH.set(self._unsettled)
            self._lock.notify_all()
        log.warning("record refused by %s: %s: %s", self._where, type(exc).__name__, exc)
