"""The history replica service: consumes the trajectory bus into a node's HistoryStore.

One loop, one batch at a time:
1. poll up to `batch_records` messages from every partition (`TrajectorySource`);
2. decode and validate each through the record model and against the replica's state (an epoch more than
   `max_epochs_ahead` beyond the newest one stored would evict whole problems' history; a sample id beyond
   `max_sample`); a message that fails goes to the dead-letter topic with its reason, and the dead letters
   are flushed (acknowledged by Kafka) before step 3, so a crash can repeat a dead letter but never lose one;
3. `HistoryStore.apply(records, offsets)`: records, length statistics, eviction and the next offsets in one
   RocksDB WriteBatch; the store, not Kafka, decides where a restart resumes, so nothing is lost or applied
   twice across a crash;
4. listeners (e.g. an in-memory ProblemIndex in embedded mode) learn the applied and evicted keys; records
   are draftable from here, which is where freshness is measured;
5. tombstones for evicted records go to the topic (compaction then drops them), and the offsets are copied
   to Kafka's committed offsets for lag monitoring.
A store write failure stops the service with the store's error and commits nothing. A broker outage does not:
`run` keeps the store, reports `das_consumer_up 0`, backs off, and resumes from the stored offsets when the
brokers answer again.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np

from history_store.automaton.problem_index import ProblemIndex
from history_store.durable.checkpoints import Checkpointer
from history_store.durable.store import HistoryStore, TrajectoryLike
from monitoring.metrics import CONSUMER_LAG, CONSUMER_UP, DEAD_LETTERED, FRESHNESS, STALE_RECORDS
from pipeline.bus import EMBEDDED_TOPIC, BusMessage, BusUnavailableError, TrajectorySource
from pipeline.consumer import ReplicaPublisher
from pipeline.wire import (
    DEFAULT_MAX_EPOCH,
    DEFAULT_MAX_EPOCHS_AHEAD,
    DEFAULT_MAX_RECORD_TOKENS,
    DEFAULT_MAX_SAMPLE,
    REASON_EPOCH_AHEAD,
    REASON_EPOCH_RANGE,
    REASON_SAMPLE_RANGE,
    WireError,
    check_key,
    check_logprobs,
    decode,
)

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
# Waiting out an outage: first retry after this, doubling up to the maximum.
OUTAGE_BACKOFF_S = (0.5, 10.0)


T = TypeVar("T")


def connect_waiting(connect: Callable[[], T], stop: threading.Event) -> T | None:
    """`connect()`'s result, calling it again while no broker answers (BusUnavailableError), with backoff and
    `das_consumer_up` 0 meanwhile; None if `stop` is set first. Other errors propagate."""
    backoff = OUTAGE_BACKOFF_S[0]
    while not stop.is_set():
        try:
            return connect()
        except BusUnavailableError as exc:
            CONSUMER_UP.set(0)
            log.warning("brokers unreachable at start; waiting %.1f s: %s", backoff, exc)
            stop.wait(backoff)
            backoff = min(2 * backoff, OUTAGE_BACKOFF_S[1])
    return None


def rebuild_store(
    path: Path,
    window_epochs: int | None,
    connect: Callable[[], tuple[TrajectorySource, ReplicaPublisher]],
    stop: threading.Event,
    **indexer_options: object,
) -> Path | None:
    """Rebuilds the (closed, damaged) store at `path` from the topic, which is the source of truth: replays it
    from the beginning into a fresh sibling folder until caught up, then swaps that folder in. The damaged one
    is kept beside it as `<name>.corrupt-<unix time>` for inspection. Returns the kept folder, or None if
    `stop` came first (the damaged store is then left in place)."""
    fresh = path.with_name(f".{path.name}.rebuild")
    shutil.rmtree(fresh, ignore_errors=True)
    clients = connect_waiting(connect, stop)
    if clients is None:
        return None
    source, publisher = clients
    started = time.monotonic()
    with HistoryStore(fresh, window_epochs=window_epochs) as store:
        # The topic's own tombstones already cover what this replay evicts: publish none.
        indexer = Indexer(source, store, publisher=publisher, publish_tombstones=False, **indexer_options)  # type: ignore[arg-type]
        indexer.run(stop, until_caught_up=True)
        if stop.is_set():
            return None
        records = store.stats().trajectories
    kept = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
    os.replace(path, kept)
    os.replace(fresh, path)
    log.warning(
        "rebuilt history store %s from topic %s: %d records in %.1f s, swapped in; the damaged store is kept at "
        "%s (delete it once inspected)",
        path,
        source.topic,
        records,
        time.monotonic() - started,
        kept,
    )
    return kept


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
        max_epochs_ahead: int = DEFAULT_MAX_EPOCHS_AHEAD,
        max_sample: int = DEFAULT_MAX_SAMPLE,
        max_epoch: int = DEFAULT_MAX_EPOCH,
    ) -> None:
        if batch_records < 1:
            raise ValueError(f"batch_records must be >= 1, got {batch_records}")
        if min(max_epochs_ahead, max_sample, max_epoch) < 0:
            raise ValueError(
                "max_epochs_ahead, max_sample and max_epoch must be >= 0, got "
                f"{max_epochs_ahead}, {max_sample}, {max_epoch}"
            )
        self.source = source
        self.store = store
        self.publisher = publisher
        self.listeners = list(listeners)
        self.max_record_tokens = max_record_tokens
        self.batch_records = batch_records
        self.poll_timeout_s = poll_timeout_s
        self.publish_tombstones = publish_tombstones
        self.checkpointer = checkpointer
        self.max_epochs_ahead = max_epochs_ahead
        self.max_sample = max_sample
        self.max_epoch = max_epoch
        self._newest_epoch = store.stats().max_epoch  # -1 for an empty store
        self._next_lag = 0.0

    def start(self) -> None:
        """Positions the source at the offsets stored with the data."""
        self.source.start(self.store.offsets())

    def step(self) -> BatchReport:
        """Polls and applies one batch. Raises StoreWriteError (nothing advanced) or BusError (dead letters
        not acknowledged; nothing advanced; BusUnavailableError when no broker answers)."""
        report = BatchReport()
        messages = self.source.poll(self.batch_records, self.poll_timeout_s)
        self._update_lag()
        if not messages:
            return report
        report.messages = len(messages)
        records: list[TrajectoryLike] = []
        published_ms: dict[Key, int] = {}
        offsets: dict[tuple[str, int], int] = {}
        candidates: list[tuple[BusMessage, TrajectoryLike]] = []
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
            elif record.response_logprobs is not None:
                # An embedded record arrives as an object, not wire bytes: the rule `decode` applies, here.
                try:
                    check_logprobs(np.asarray(record.response_logprobs, "<f4"), len(record.response_ids))
                except WireError as exc:
                    self._dead_letter(message, exc)
                    report.dead_lettered[exc.reason] += 1
                    continue
            candidates.append((message, record))
        # An empty replica has no newest epoch yet: the batch's lowest epoch stands in (a replica rebuilding a
        # compacted topic starts at whatever epochs the topic still holds).
        reference = self._newest_epoch
        if reference < 0 and candidates:
            reference = min(record.epoch for _, record in candidates)
        for message, record in candidates:
            try:
                self._check_identity(record, reference)
            except WireError as exc:
                self._dead_letter(message, exc)
                report.dead_lettered[exc.reason] += 1
                continue
            records.append(record)
            published_ms.setdefault((record.problem_id, record.epoch, record.sample), message.timestamp_ms)
        if report.dead_lettered:
            if self.publisher is not None:
                self.publisher.flush()
            log.warning(
                "dead-lettered %d messages: %s",
                sum(report.dead_lettered.values()),
                dict(report.dead_lettered),
            )
        result = self.store.apply(records, offsets)
        report.applied, report.duplicates = len(result.applied), result.duplicates
        report.stale, report.evicted = len(result.stale), len(result.evicted)
        if result.applied:
            self._newest_epoch = max(self._newest_epoch, max(key[1] for key in result.applied))
        if result.stale:
            STALE_RECORDS.inc(len(result.stale))
            log.info(
                "dropped %d stale records (their epoch is below their problem's window), e.g. %s",
                len(result.stale),
                result.stale[0],
            )
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
        if self.publish_tombstones and self.publisher is not None:
            # Every batch, evictions or not: it also sends again the tombstones an outage held back.
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

    def run(self, stop: threading.Event, until_caught_up: bool = False) -> None:
        """Starts, then applies batches until `stop` is set (or, with `until_caught_up`, until the source has
        nothing more); always closes the source and publisher.

        While no broker answers, it keeps the store, sets `das_consumer_up` to 0, backs off, and then resumes
        from the offsets stored with the data (a batch polled but not applied is read again).
        """
        try:
            self.start()
            CONSUMER_UP.set(1)
            backoff, down_since = OUTAGE_BACKOFF_S[0], None
            while not stop.is_set():
                try:
                    self.step()
                    if down_since is not None:
                        self.source.lag()  # an idle poll succeeds without brokers: ask them directly
                    # Close enough: the store holds its offsets, so whoever opens it next reads the rest.
                    if until_caught_up and (self.source.lag() or 0) < self.batch_records:
                        return
                except BusUnavailableError as exc:
                    if down_since is None:
                        down_since = time.monotonic()
                        CONSUMER_UP.set(0)
                        log.warning("brokers unreachable; keeping the store and waiting: %s", exc)
                    stop.wait(backoff)
                    backoff = min(2 * backoff, OUTAGE_BACKOFF_S[1])
                    self.source.rewind(self.store.offsets())
                    continue
                if down_since is not None:
                    log.warning(
                        "brokers reachable again after %.1f s; resumed from the stored offsets",
                        time.monotonic() - down_since,
                    )
                    CONSUMER_UP.set(1)
                    backoff, down_since = OUTAGE_BACKOFF_S[0], None
        finally:
            CONSUMER_UP.set(0)
            self.close()

    def close(self) -> None:
        """Flushes pending tombstones and releases the source and publisher (not the store)."""
        try:
            if self.publisher is not None:
                self.publisher.flush()
                self.publisher.close()
        finally:
            self.source.close()

    def _check_identity(self, record: TrajectoryLike, reference_epoch: int) -> None:
        """Raises WireError if the record's identity would harm the replica's history."""
        if record.sample > self.max_sample:
            raise WireError(
                REASON_SAMPLE_RANGE,
                f"sample {record.sample} is beyond this replica's limit {self.max_sample}",
            )
        if record.epoch > self.max_epoch:
            raise WireError(
                REASON_EPOCH_RANGE,
                f"epoch {record.epoch} is beyond this replica's limit {self.max_epoch} (--max-epoch)",
            )
        if record.epoch > reference_epoch + self.max_epochs_ahead:
            raise WireError(
                REASON_EPOCH_AHEAD,
                f"epoch {record.epoch} is {record.epoch - reference_epoch} beyond the newest epoch "
                f"{reference_epoch} of this replica (limit {self.max_epochs_ahead}, --max-epochs-ahead): "
                "storing it would evict its problem's history",
            )

    def _dead_letter(self, message: BusMessage, error: WireError) -> None:
        DEAD_LETTERED.labels(reason=error.reason).inc()
        if self.publisher is None:
            # The embedded bus: records come from this process, already validated; one that would harm the
            # history is dropped here, loudly, as there is no dead-letter topic to keep it.
            log.error("record at embedded offset %d dropped: %s", message.offset, error)
            return
        self.publisher.dead_letter(message, error.reason, error.detail)
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
