"""The history replica service: consumes the trajectory bus into a node's HistoryStore.

One loop, one batch at a time:
1. poll up to `batch_records` messages from every partition (`TrajectorySource`);
2. decode and validate each through the record model; a message that fails goes to the dead-letter topic
   with its reason, and the dead letters are flushed (acknowledged by Kafka) before step 3, so a crash can
   repeat a dead letter but never lose one;
3. `HistoryStore.apply(records, offsets)`: records, length statistics, eviction and the next offsets in one
   RocksDB WriteBatch; the store, not Kafka, decides where a restart resumes, so nothing is lost or applied
   twice across a crash;
4. listeners (e.g. an in-memory ProblemIndex in embedded mode) learn the applied and evicted keys; records
   are draftable from here, which is where freshness is measured;
5. tombstones for evicted records go to the topic (compaction then drops them), and the offsets are copied
   to Kafka's committed offsets for lag monitoring.
A store write failure stops the service with the store's error and commits nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter as Tally
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from history_store.checkpoints import Checkpointer
from history_store.problem_index import ProblemIndex
from history_store.store import HistoryStore, TrajectoryLike
from monitoring.metrics import CONSUMER_LAG, DEAD_LETTERED, FRESHNESS
from pipeline.bus import EMBEDDED_TOPIC, BusError, BusMessage, TrajectorySource
from pipeline.consumer import ReplicaPublisher
from pipeline.wire import DEFAULT_MAX_RECORD_TOKENS, WireError, check_key, decode

log = logging.getLogger(__name__)

Key = tuple[str, int, int]
# Large enough to amortise one RocksDB write and one Kafka fetch over many records, small enough that a batch
# of 10 KB trajectories (~5 MB) is applied well within the one-second freshness target.
DEFAULT_BATCH_RECORDS = 500
# Polls return as soon as a record arrives; this only bounds how long an idle loop waits before it checks
# for shutdown.
POLL_TIMEOUT_S = 0.2
# Lag needs a round trip to every partition leader: once every few seconds is plenty for a dashboard.
LAG_INTERVAL_S = 5.0


class ReplicaListener(Protocol):
    """Told about every change the replica applied, after it is durable."""

    def on_applied(self, records: Sequence[TrajectoryLike]) -> None:
        """Records now durable and draftable (records of the model, or decoded ones with token arrays)."""

    def on_evicted(self, keys: Sequence[Key]) -> None:
        """Keys the store evicted because their epoch left the window."""


class ProblemIndexListener:
    """Keeps an in-memory ProblemIndex (drafting trees) in step with the replica."""

    def __init__(self, index: ProblemIndex) -> None:
        self.index = index

    def on_applied(self, records: Sequence[TrajectoryLike]) -> None:
        for r in records:
            self.index.add_trajectory(r.problem_id, r.epoch, r.sample, r.prompt_ids, r.response_ids)

    def on_evicted(self, keys: Sequence[Key]) -> None:
        self.index.evict_keys(keys)


@dataclass
class BatchReport:
    """What one `step` did. `freshness_s` holds publish-to-draftable seconds of each applied record."""

    messages: int = 0
    applied: int = 0
    duplicates: int = 0
    stale: int = 0
    evicted: int = 0
    tombstones: int = 0
    dead_lettered: Tally[str] = field(default_factory=Tally)
    freshness_s: list[float] = field(default_factory=list)


class Indexer:
    """Applies a trajectory source to a HistoryStore. `publisher` is required for Kafka sources (dead letters
    and tombstones); the embedded bus delivers already validated records and needs none."""

    def __init__(
        self,
        source: TrajectorySource,
        store: HistoryStore,
        *,
        publisher: ReplicaPublisher | None = None,
        listeners: Sequence[ReplicaListener] = (),
        max_record_tokens: int = DEFAULT_MAX_RECORD_TOKENS,
        batch_records: int = DEFAULT_BATCH_RECORDS,
        poll_timeout_s: float = POLL_TIMEOUT_S,
        publish_tombstones: bool = True,
        checkpointer: Checkpointer | None = None,
    ) -> None:
        if batch_records < 1:
            raise ValueError(f"batch_records must be >= 1, got {batch_records}")
        self.source = source
        self.store = store
        self.publisher = publisher
        self.listeners = list(listeners)
        self.max_record_tokens = max_record_tokens
        self.batch_records = batch_records
        self.poll_timeout_s = poll_timeout_s
        self.publish_tombstones = publish_tombstones
        self.checkpointer = checkpointer
        self._next_lag = 0.0

    def start(self) -> None:
        """Positions the source at the offsets stored with the data."""
        self.source.start(self.store.offsets())

    def step(self) -> BatchReport:
        """Polls and applies one batch. Raises StoreWriteError (nothing advanced) or BusError (dead letters
        not acknowledged; nothing advanced)."""
        report = BatchReport()
        messages = self.source.poll(self.batch_records, self.poll_timeout_s)
        self._update_lag()
        if not messages:
            return report
        report.messages = len(messages)
        records: list[TrajectoryLike] = []
        published_ms: dict[Key, int] = {}
        offsets: dict[tuple[str, int], int] = {}
        for message in messages:
            if message.topic != EMBEDDED_TOPIC:
                offsets[(message.topic, message.partition)] = message.offset + 1
            record: TrajectoryLike | None = message.record
            if record is None:
                if message.value is None:
                    # A tombstone another replica (or this one, earlier) published; our window evicts the same.
                    report.tombstones += 1
                    continue
                try:
                    decoded = decode(message.value, self.max_record_tokens)
                    check_key(message.key, decoded.key)
                    record = decoded
                except WireError as exc:
                    self._dead_letter(message, exc)
                    report.dead_lettered[exc.reason] += 1
                    continue
            records.append(record)
            published_ms.setdefault((record.problem_id, record.epoch, record.sample), message.timestamp_ms)
        if report.dead_lettered:
            assert self.publisher is not None  # _dead_letter raised otherwise
            self.publisher.flush()
            log.warning(
                "dead-lettered %d messages: %s",
                sum(report.dead_lettered.values()),
                dict(report.dead_lettered),
            )
        result = self.store.apply(records, offsets)
        report.applied, report.duplicates = len(result.applied), result.duplicates
        report.stale, report.evicted = len(result.stale), len(result.evicted)
        if result.applied and self.listeners:
            pending = set(result.applied)
            fresh = []
            for r in records:  # in batch order; a key repeated in the batch was applied once, its first copy
                key = (r.problem_id, r.epoch, r.sample)
                if key in pending:
                    pending.discard(key)
                    fresh.append(r)
            for listener in self.listeners:
                listener.on_applied(fresh)
        if result.evicted:
            for listener in self.listeners:
                listener.on_evicted(result.evicted)
        now_ms = time.time() * 1000
        for key in result.applied:
            seconds = max(0.0, (now_ms - published_ms[key]) / 1000)
            FRESHNESS.observe(seconds)
            report.freshness_s.append(seconds)
        if result.evicted and self.publish_tombstones and self.publisher is not None:
            self.publisher.tombstones(self.source.topic, self.source.partition_count(), result.evicted)
        if offsets:
            self.source.commit(offsets)
        if self.checkpointer is not None:
            self.checkpointer.after_apply(result.applied)
        log.debug(
            "batch: messages=%d applied=%d duplicates=%d stale=%d evicted=%d tombstones=%d dead_lettered=%d",
            report.messages,
            report.applied,
            report.duplicates,
            report.stale,
            report.evicted,
            report.tombstones,
            sum(report.dead_lettered.values()),
        )
        return report

    def run(self, stop: threading.Event) -> None:
        """Starts, then applies batches until `stop` is set; always closes the source and publisher."""
        try:
            self.start()
            while not stop.is_set():
                self.step()
        finally:
            self.close()

    def close(self) -> None:
        """Flushes pending tombstones and releases the source and publisher (not the store)."""
        try:
            if self.publisher is not None:
                self.publisher.flush()
                self.publisher.close()
        finally:
            self.source.close()

    def _dead_letter(self, message: BusMessage, error: WireError) -> None:
        if self.publisher is None:
            raise BusError(
                f"message {message.topic}/{message.partition}/{message.offset} is invalid ({error}) and this "
                "replica has no dead-letter publisher"
            )
        self.publisher.dead_letter(message, error.reason, error.detail)
        DEAD_LETTERED.labels(reason=error.reason).inc()
        log.debug(
            "dead letter %s/%d/%d: %s", message.topic, message.partition, message.offset, str(error)[:200]
        )

    def _update_lag(self) -> None:
        now = time.monotonic()
        if now < self._next_lag:
            return
        self._next_lag = now + LAG_INTERVAL_S
        lag = self.source.lag()
        if lag is not None:
            CONSUMER_LAG.set(lag)
