"""The Kafka side of a history replica: read every partition (a global table) and write back what it owes.

`KafkaTrajectorySource` assigns all partitions of the topic to itself (no consumer-group rebalancing: every
node needs every problem) and starts each one at the offset the replica stored with its data, so the store,
not Kafka, decides where reading resumes. Offsets are committed to Kafka only as a copy for lag monitoring,
after the store has them.

`ReplicaPublisher` writes what a replica sends back: rejected messages to the dead-letter topic (original
bytes, reason and origin in headers), and tombstones for records its store evicted or dropped as stale. A
dead letter the topic refuses for good is not an error: `flush` hands it back as an `UndeliveredLetter`, and
the replica keeps its coordinates in the store instead, so no message can stop a replica. `read_dead_letters`
reads the dead letters back (`das kafka dlq`), whatever headers a forged one carries.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError
from kafka.serializer import Deserializer
from kafka.structs import OffsetAndMetadata

from pipeline.bounded import install as install_bound
from pipeline.bus import BusMessage
from pipeline.errors import BusError, BusUnavailableError
from pipeline.kafka_config import UNREACHABLE, client_settings
from pipeline.topics import (
    DEAD_LETTER_TOPIC,
    MAX_MESSAGE_BYTES,
    TRAJECTORY_TOPIC,
    epochs_topic,
    shared_settings,
)
from pipeline.wire import partition_for, record_key

log = logging.getLogger(__name__)

# A compressed batch decompresses to at most this much in a replica (`pipeline.bounded`): the largest record a
# producer may send (its uncompressed size is what producers check against the limit) plus room for a batch's
# framing. A larger batch is refused whole and dead-lettered (`oversize`).
MAX_DECOMPRESSED_BATCH_BYTES = MAX_MESSAGE_BYTES + (1 << 20)
# What one poll may hand over in record values, decompressed: records past it wait for the next poll. The first
# record of a poll always comes, so a poll holds at most this plus one record.
POLL_VALUE_BUDGET_BYTES = 64 << 20
CONSUMER_DEFAULTS: dict[str, object] = {
    "enable_auto_commit": False,
    "auto_offset_reset": "earliest",
    # Small per-partition fetches keep partitions in step under a backlog (one big fetch would be drained
    # partition by partition, starving the others' freshness). Both limits are soft since Kafka 0.10.1: a
    # record larger than them (up to the topic's 16 MiB) still comes, alone.
    "max_partition_fetch_bytes": 1024 * 1024,
    "fetch_max_bytes": MAX_MESSAGE_BYTES,
    # The broker answers as soon as one record is there (fetch_min_bytes=1), so this only bounds idle polls.
    "fetch_max_wait_ms": 100,
}
# Header names on dead letters; values are UTF-8 text.
H_REASON = "das-dlq-reason"
H_DETAIL = "das-dlq-detail"
H_TOPIC = "das-dlq-topic"
H_PARTITION = "das-dlq-partition"
H_OFFSET = "das-dlq-offset"
H_TIMESTAMP = "das-dlq-timestamp-ms"
H_KEY = "das-dlq-key"
H_KEY_BYTES = "das-dlq-key-bytes"
H_KEY_SHA256 = "das-dlq-key-sha256"
H_REPLICA = "das-dlq-replica"
H_TRUNCATED = "das-dlq-truncated-from-bytes"
_MAX_DETAIL = 1000
# The key header copies bytes an unauthenticated producer chose (20 MiB keys compress to almost nothing on the
# wire): longer keys keep their first KiB, with their length and SHA-256 beside it to tell them apart.
_MAX_KEY_HEADER = 1024
# Room for our headers and the batch overhead under the dead-letter topic's max.message.bytes.
_MAX_DEAD_LETTER_VALUE = MAX_MESSAGE_BYTES - 64 * 1024


def _bus_error(message: str, exc: BaseException) -> BusError:
    """A BusUnavailableError for what waiting cures (no broker answers, a leader moves), else a BusError."""
    kind = BusUnavailableError if getattr(exc, "retriable", False) else BusError
    return kind(f"{message}: {type(exc).__name__}: {exc}")


@dataclass(frozen=True, slots=True)
class UndeliveredLetter:
    """A dead letter the dead-letter topic refused for good (too large, not authorised): where the rejected
    message is, why it was rejected, and the error that kept it out of the topic."""

    topic: str
    partition: int
    offset: int
    reason: str
    error: str


class _PollBudget(Deserializer):
    """Passes record values through until one poll has taken `budget` bytes of them, then hands `DEFERRED`
    instead (the bytes are dropped at once); `KafkaTrajectorySource.poll` reads those records again later."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0

    def deserialize(self, topic: str, headers: object, data: bytes | None) -> object:
        size = 0 if data is None else len(data)
        if self.used and self.used + size > self.budget:
            return DEFERRED
        self.used += size
        return data


DEFERRED = object()


class KafkaTrajectorySource:
    """Reads every partition of `topic`, and of its control topic `<topic>.epochs` (epoch advances,
    `pipeline.epochs`), from the offsets the replica stored.

    `epochs`: read the control topic (True), not (False), or when it exists (None). `group_id` names this
    replica for Kafka's committed offsets (lag dashboards); it never joins a group rebalance. Decompressed
    sizes are bounded per batch (`pipeline.bounded`) and per poll (`POLL_VALUE_BUDGET_BYTES`). Raises
    BusUnavailableError if no broker answers (transient: try again later), BusError for what waiting does
    not cure (refused credentials, bad settings).
    """

    def __init__(
        self,
        servers: list[str],
        *,
        topic: str = TRAJECTORY_TOPIC,
        group_id: str,
        epochs: bool | None = None,
        **settings: object,
    ) -> None:
        self.servers = list(servers)
        self.topic = topic
        self.epochs_topic = epochs_topic(topic)
        self._want_epochs = epochs
        self.reads_epochs = False
        self._where = f"Kafka at {','.join(self.servers)}, topic {topic}"
        install_bound(MAX_DECOMPRESSED_BATCH_BYTES)
        self._budget = _PollBudget(POLL_VALUE_BUDGET_BYTES)
        try:
            self._consumer = KafkaConsumer(
                bootstrap_servers=self.servers,
                group_id=group_id,
                client_id=group_id,
                **{**CONSUMER_DEFAULTS, **client_settings(settings), "value_deserializer": self._budget},
            )
        except KafkaError as exc:
            raise _bus_error(f"cannot reach {self._where}: {UNREACHABLE}", exc) from exc
        self._partitions: list[TopicPartition] = []
        self._data_partitions = 0

    def start(self, stored_offsets: Mapping[tuple[str, int], int], timeout_s: float = 30) -> None:
        """Assigns every partition and seeks each to its stored next offset (the beginning if none).

        Raises BusError if the topic does not appear within `timeout_s` (run `das kafka init`).
        """
        deadline = time.monotonic() + timeout_s
        partitions = self._consumer.partitions_for_topic(self.topic)
        while not partitions:
            if time.monotonic() >= deadline:
                raise BusError(
                    f"topic {self.topic} not found on {self._where}: create it with `das kafka init`"
                )
            time.sleep(0.5)
            partitions = self._consumer.partitions_for_topic(self.topic)
        self._partitions = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        self._data_partitions = len(self._partitions)
        control = (
            self._consumer.partitions_for_topic(self.epochs_topic) if self._want_epochs is not False else None
        )
        if self._want_epochs and not control:
            raise BusError(
                f"control topic {self.epochs_topic} not found on {self._where}: create it with `das kafka init`"
            )
        self.reads_epochs = bool(control)
        if control:
            self._partitions += [TopicPartition(self.epochs_topic, p) for p in sorted(control)]
        self._consumer.assign(self._partitions)
        for tp in self._partitions:
            stored = stored_offsets.get((tp.topic, tp.partition))
            if stored is None:
                self._consumer.seek_to_beginning(tp)
            else:
                self._consumer.seek(tp, stored)
        log.info(
            "consuming %s: %d partitions, resuming at %s; epoch advances: %s",
            self.topic,
            self._data_partitions,
            {
                tp.partition: stored_offsets.get((tp.topic, tp.partition), 0)
                for tp in self._partitions[: self._data_partitions]
            },
            self.epochs_topic if self.reads_epochs else f"none ({self.epochs_topic} does not exist)",
        )

    def rewind(self, stored_offsets: Mapping[tuple[str, int], int]) -> None:
        """Seeks every assigned partition back to the offset the replica stored (after a failed batch, whose
        polled messages were never applied); needs no broker."""
        for tp in self._partitions:
            stored = stored_offsets.get((tp.topic, tp.partition))
            if stored is None:
                self._consumer.seek_to_beginning(tp)
            else:
                self._consumer.seek(tp, stored)

    def poll(self, max_records: int, timeout_s: float) -> list[BusMessage]:
        """Up to `max_records` messages, in offset order within each partition.

        Raises BusUnavailableError while no broker answers (the position is unchanged: poll again later).
        """
        self._budget.used = 0
        try:
            batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        except KafkaError as exc:
            raise _bus_error(f"reading {self._where}", exc) from exc
        messages = []
        for tp, records in batches.items():
            for r in records:
                if (
                    r.value is DEFERRED
                ):  # over this poll's budget: read it, and the rest of its partition, next time
                    self._consumer.seek(tp, r.offset)
                    break
                messages.append(
                    BusMessage(
                        r.topic,
                        r.partition,
                        r.offset,
                        r.key,
                        r.value,
                        r.timestamp,
                        tuple((k, v if v is not None else b"") for k, v in r.headers or ()),
                    )
                )
        return messages

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        """Copies the stored offsets to Kafka (monitoring only: the store is authoritative). A failure is
        logged, not raised: the next commit carries the same information."""
        try:
            self._consumer.commit(
                {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()}
            )
        except KafkaError as exc:
            log.warning("committing offsets to %s failed (the store keeps them): %s", self._where, exc)

    def lag(self) -> int | None:
        """Messages between this replica's positions and the partitions' ends.

        It asks the partition leaders, so it doubles as the replica's liveness probe (an idle poll returns
        nothing whether or not a broker answers): raises BusUnavailableError when none answers, and returns
        None for other Kafka errors.
        """
        try:
            ends = self._consumer.end_offsets(self._partitions, timeout_ms=5000)
            return sum(max(0, ends[tp] - self._consumer.position(tp)) for tp in self._partitions)
        except KafkaError as exc:
            if getattr(exc, "retriable", False):
                raise _bus_error(f"no answer from {self._where}", exc) from exc
            return None

    def partition_count(self) -> int:
        """Partitions of the trajectory topic (the control topic's are not counted)."""
        return self._data_partitions

    def control_partition_count(self) -> int:
        """Partitions of the control topic (0 when it is not read)."""
        return len(self._partitions) - self._data_partitions

    def close(self) -> None:
        self._consumer.close(autocommit=False)


class ReplicaPublisher:
    """Dead letters and tombstones from one replica. Sends are asynchronous; `flush` makes them durable,
    and the replica flushes before it stores the offsets past the messages concerned."""

    def __init__(
        self,
        servers: list[str],
        *,
        replica: str,
        dead_letter_topic: str = DEAD_LETTER_TOPIC,
        **settings: object,
    ) -> None:
        self.replica = replica
        self.dead_letter_topic = dead_letter_topic
        self._where = f"Kafka at {','.join(servers)}"
        try:
            self._producer = KafkaProducer(
                bootstrap_servers=list(servers),
                acks="all",
                enable_idempotence=True,
                compression_type="lz4",
                linger_ms=5,
                max_request_size=MAX_MESSAGE_BYTES,
                client_id=f"{replica}-publisher",
                **shared_settings(client_settings(settings)),
            )
        except KafkaError as exc:
            raise _bus_error(f"cannot reach {self._where}: {UNREACHABLE}", exc) from exc
        self._failures: list[BaseException] = []
        self._undelivered: deque[UndeliveredLetter] = deque()
        # Tombstones whose send failed for a transient reason (an outage): the store has already evicted their
        # records and stored the offsets past them, so nothing would send them again; each flush does, until
        # the brokers take them (else compaction keeps evicted records in the topic for good).
        self._unsent_tombstones: deque[tuple[str, bytes, int, bytes | None]] = deque()

    def dead_letter(self, message: BusMessage, reason: str, detail: str) -> None:
        """Sends the original message bytes to the dead-letter topic with reason and origin headers.

        Keyed by origin (topic/partition/offset): replicas rejecting the same message compact to one copy. Every
        header is bounded (the key cut to its first KiB plus its length and SHA-256, the detail to 1000
        characters) and the value to the topic's limit less 64 KiB, so a hostile message fits; if the topic still
        refuses the letter, `flush` returns it instead of failing.
        """
        headers = [
            (H_REASON, reason.encode()),
            (H_DETAIL, detail[:_MAX_DETAIL].encode("utf-8", "replace")),
            (H_TOPIC, message.topic.encode()),
            (H_PARTITION, str(message.partition).encode()),
            (H_OFFSET, str(message.offset).encode()),
            (H_TIMESTAMP, str(message.timestamp_ms).encode()),
            (H_REPLICA, self.replica.encode()),
        ]
        if message.key is not None:
            headers.append((H_KEY, message.key[:_MAX_KEY_HEADER]))
            if len(message.key) > _MAX_KEY_HEADER:
                headers.append((H_KEY_BYTES, str(len(message.key)).encode()))
                headers.append((H_KEY_SHA256, hashlib.sha256(message.key).hexdigest().encode()))
        value = message.value
        if value is not None and len(value) > _MAX_DEAD_LETTER_VALUE:
            # The dead-letter topic has the same size limit as the source: keep a prefix rather than fail the
            # send and stop the replica on the same message at every restart.
            headers.append((H_TRUNCATED, str(len(value)).encode()))
            value = value[:_MAX_DEAD_LETTER_VALUE]
        origin = f"{message.topic}/{message.partition}/{message.offset}".encode()
        letter = UndeliveredLetter(message.topic, message.partition, message.offset, reason, "")
        try:
            future = self._producer.send(self.dead_letter_topic, key=origin, value=value, headers=headers)
        except KafkaError as exc:
            if getattr(exc, "retriable", False):
                raise _bus_error(f"cannot send to {self.dead_letter_topic} on {self._where}", exc) from exc
            self._letter_failed(letter, exc)
            return
        future.add_errback(self._letter_failed, letter)

    def _letter_failed(self, letter: UndeliveredLetter, exc: BaseException) -> None:
        if getattr(exc, "retriable", False):
            self._failures.append(exc)  # an outage: the replica applies nothing and reads the batch again
        else:
            # deque.append: safe from kafka-python's IO thread
            self._undelivered.append(
                UndeliveredLetter(
                    letter.topic, letter.partition, letter.offset, letter.reason, _error_text(exc)
                )
            )

    def tombstones(self, topic: str, partitions: int, keys: Iterable[tuple[str, int, int]]) -> None:
        """Publishes a tombstone (null value) for each evicted record, in its problem's partition, so
        compaction drops it from the topic; first sends again those an outage held back."""
        self._resend_tombstones()
        for problem_id, epoch, sample in keys:
            self._send_tombstone(
                (topic, record_key(problem_id, epoch, sample), partition_for(problem_id, partitions), None)
            )

    def restore(self, topic: str, partitions: int, key: tuple[str, int, int], value: bytes) -> None:
        """Sends a stored record again (its wire bytes `value`), in its problem's partition: after a message that
        compaction would let replace it (a tombstone no epoch advance justifies, a different copy of its key), the
        record is the last word on its key again. Delivered and retried like tombstones."""
        self._send_tombstone((topic, record_key(*key), partition_for(key[0], partitions), value))

    def flush(self, timeout_s: float = 30) -> list[UndeliveredLetter]:
        """Sends again the tombstones an outage held back, waits until everything sent is acknowledged, and
        returns the dead letters the topic refused for good since the last flush (the caller keeps their
        coordinates). Raises BusUnavailableError if sends timed out or no broker answered (transient; the
        tombstones are kept for the next flush), BusError if a tombstone was refused."""
        self._resend_tombstones()
        try:
            self._producer.flush(timeout=timeout_s)
        except KafkaError as exc:
            raise _bus_error(f"dead letters/tombstones not acknowledged by {self._where}", exc) from exc
        if self._failures:
            failures, self._failures = self._failures, []
            first = next((f for f in failures if not getattr(f, "retriable", False)), failures[0])
            raise _bus_error(f"{len(failures)} dead letters/tombstones failed on {self._where}", first)
        if self._unsent_tombstones:
            raise BusUnavailableError(
                f"{len(self._unsent_tombstones)} tombstones not acknowledged by {self._where}; kept for the next flush"
            )
        undelivered = list(self._undelivered)
        for _ in undelivered:
            self._undelivered.popleft()
        return undelivered

    @property
    def unsent_tombstones(self) -> int:
        """Tombstones held back by an outage, sent again by the next flush."""
        return len(self._unsent_tombstones)

    def _resend_tombstones(self) -> None:
        for _ in range(len(self._unsent_tombstones)):
            self._send_tombstone(self._unsent_tombstones.popleft())

    def _send_tombstone(self, tombstone: tuple[str, bytes, int, bytes | None]) -> None:
        topic, key, partition, value = tombstone
        try:
            future = self._producer.send(topic, key=key, value=value, partition=partition)
        except KafkaError as exc:
            if not getattr(exc, "retriable", False):
                raise _bus_error(f"cannot send to {topic} on {self._where}", exc) from exc
            self._unsent_tombstones.append(tombstone)
            return
        future.add_errback(self._tombstone_failed, tombstone)

    def _tombstone_failed(self, tombstone: tuple[str, bytes, int, bytes | None], exc: BaseException) -> None:
        if getattr(exc, "retriable", False):
            self._unsent_tombstones.append(tombstone)  # deque.append: safe from kafka-python's IO thread
        else:
            self._failures.append(exc)

    def close(self) -> None:
        self._producer.close(timeout=10)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:_MAX_DETAIL]


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One rejected message as the dead-letter topic keeps it. `partition` and `offset` are None when its
    headers do not say (anyone who may write to the topic can forge a letter)."""

    reason: str
    detail: str
    topic: str
    partition: int | None
    offset: int | None
    replica: str
    key: bytes | None
    value_bytes: int


def read_dead_letters(
    servers: list[str], dead_letter_topic: str = DEAD_LETTER_TOPIC, idle_s: float = 1.0, **settings: object
) -> list[DeadLetter]:
    """Every dead letter currently in the topic, oldest first per partition (reads until `idle_s` passes
    without a message). Raises BusError if Kafka is unreachable or the topic does not exist."""
    try:
        consumer = KafkaConsumer(
            bootstrap_servers=list(servers),
            enable_auto_commit=False,
            consumer_timeout_ms=int(idle_s * 1000),
            max_partition_fetch_bytes=1024 * 1024,
            **shared_settings(client_settings(settings)),
        )
    except KafkaError as exc:
        raise BusError(f"cannot reach Kafka at {','.join(servers)}: {UNREACHABLE}: {exc}") from exc
    try:
        partitions = consumer.partitions_for_topic(dead_letter_topic)
        if not partitions:
            raise BusError(
                f"dead-letter topic {dead_letter_topic} does not exist: create it with `das kafka init`"
            )
        assigned = [TopicPartition(dead_letter_topic, p) for p in sorted(partitions)]
        consumer.assign(assigned)
        consumer.seek_to_beginning(*assigned)
        letters = []
        for m in consumer:
            h = {k: v.decode("utf-8", "replace") for k, v in m.headers or () if k != H_KEY and v is not None}
            letters.append(
                DeadLetter(
                    reason=h.get(H_REASON, "?"),
                    detail=h.get(H_DETAIL, ""),
                    topic=h.get(H_TOPIC, "?"),
                    partition=_whole_number(h.get(H_PARTITION)),
                    offset=_whole_number(h.get(H_OFFSET)),
                    replica=h.get(H_REPLICA, "?"),
                    key=dict(m.headers or ()).get(H_KEY),
                    value_bytes=len(m.value or b""),
                )
            )
        return letters
    finally:
        consumer.close()


def _whole_number(text: str | None) -> int | None:
    return int(text) if text is not None and text.isascii() and text.isdigit() else None
