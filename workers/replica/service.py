"""The history replica service: consumes the trajectory bus into a node's HistoryStore.

One loop, one batch at a time:
1. poll up to `batch_records` messages from every partition (`TrajectorySource`);
2. decode and validate each through the record model and against the replica's state, per problem (see
   `Indexer._judge`); a message that fails goes to the dead-letter topic with its reason, and the dead letters
   are flushed (acknowledged by Kafka) before step 3, so a crash can repeat a dead letter but never lose one.
   A dead letter the topic refuses for good is skipped, counted, logged and its coordinates kept in the store:
   no message can stop the replica;
3. `HistoryStore.apply(records, offsets)`: records, length statistics, eviction and the next offsets in one
   RocksDB WriteBatch; the store, not Kafka, decides where a restart resumes, so nothing is lost or applied
   twice across a crash;
4. listeners (e.g. an in-memory ProblemIndex in embedded mode) learn the applied and evicted keys; records
   are draftable from here, which is where freshness is measured;
5. tombstones for evicted and stale records go to the topic (compaction then drops them), and the offsets are
   copied to Kafka's committed offsets for lag monitoring.
A store write failure stops the service with the store's error and commits nothing. A broker outage does not:
`run` keeps the store, reports `das_consumer_up 0`, backs off, and resumes from the stored offsets when the
brokers answer again.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np

from history_store.automaton.problem_index import ProblemIndex
from history_store.durable.checkpoints import Checkpointer
from history_store.durable.store import (
    FolderLock,
    HistoryStore,
    TrajectoryLike,
    UndeliveredMessage,
    VerifyReport,
    exchange_folders,
    verify_store,
)
from history_store.errors import StoreCorruptionError, StoreError
from monitoring.metrics import (
    CONSUMER_LAG,
    CONSUMER_UP,
    DEAD_LETTERED,
    FRESHNESS,
    LAST_VERIFY,
    STALE_RECORDS,
    STORE_DAMAGED,
    STORE_VERIFY_DURATION,
    UNDELIVERED_DEAD_LETTERS,
)
from pipeline.bus import EMBEDDED_TOPIC, BusMessage, TrajectorySource
from pipeline.consumer import ReplicaPublisher
from pipeline.errors import BusUnavailableError
from pipeline.wire import (
    DEFAULT_MAX_EPOCH,
    DEFAULT_MAX_EPOCHS_AHEAD,
    DEFAULT_MAX_RECORD_TOKENS,
    DEFAULT_MAX_SAMPLE,
    REASON_EPOCH_AHEAD,
    REASON_EPOCH_JUMP,
    REASON_EPOCH_RANGE,
    REASON_SAMPLE_RANGE,
    REASON_STALE,
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
# While its epoch moves on, a partition's consensus (the median of its problems' newest epochs) trails the
# records of the new epoch by up to one: a record at most this far ahead of it may evict its problem's whole
# window (that problem's own next record would evict the same).
TRANSITION_EPOCHS = 1


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
            CONSUMER_LAG.set(math.nan)  # unknown, not 0: nothing says how far behind the replica is
            log.warning("brokers unreachable at start; waiting %.1f s: %s", backoff, exc)
            stop.wait(backoff)
            backoff = min(2 * backoff, OUTAGE_BACKOFF_S[1])
    return None


def rebuild_store(
    path: Path,
    lock: FolderLock,
    window_epochs: int | None,
    connect: Callable[[], tuple[TrajectorySource, ReplicaPublisher]],
    stop: threading.Event,
    **indexer_options: object,
) -> FolderLock | None:
    """Rebuilds the (closed, damaged) store at `path`, whose folder lock the caller holds in `lock`, from the
    topic, which is the source of truth: replays it from the beginning into a fresh sibling folder until caught
    up, then exchanges the two folders in one step (`exchange_folders`). The damaged one is kept beside it as
    `<name>.corrupt-<unix time>` for inspection.

    Both folders stay locked throughout, so no second writer can open either, even mid-swap. Returns the lock of
    the rebuilt store now at `path` (the damaged folder's lock is released), or None if `stop` came first (the
    damaged store is then left in place, still locked by `lock`).
    """
    fresh = path.with_name(f".{path.name}.rebuild")
    shutil.rmtree(fresh, ignore_errors=True)  # a crashed rebuild's leftover: only `lock`'s holder rebuilds
    clients = connect_waiting(connect, stop)
    if clients is None:
        return None
    source, publisher = clients
    started = time.monotonic()
    fresh_lock = FolderLock(fresh)
    try:
        with HistoryStore(fresh, window_epochs=window_epochs, lock=fresh_lock) as store:
            # The topic's own tombstones already cover what this replay evicts: publish none.
            indexer = Indexer(source, store, publisher=publisher, publish_tombstones=False, **indexer_options)  # type: ignore[arg-type]
            indexer.run(stop, until_caught_up=True)
            if stop.is_set():
                fresh_lock.release()
                return None
            records = store.stats().trajectories
        kept = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
        exchange_folders(fresh, path)
        os.replace(fresh, kept)  # the damaged folder, now under the fresh one's name
    except BaseException:
        fresh_lock.release()
        raise
    lock.release()
    log.warning(
        "rebuilt history store %s from topic %s: %d records in %.1f s, swapped in; the damaged store is kept at "
        "%s (delete it once inspected)",
        path,
        source.topic,
        records,
        time.monotonic() - started,
        kept,
    )
    return fresh_lock


class StoreVerifier:
    """Checks every file and checksum of a running replica's store, at start and then every `every_s` seconds
    in a background thread: the writer's own handles keep blocks they read long ago, so only a fresh read-only
    open (`verify_store`) notices damage done since. Sets das_store_damaged and the last-verify time; the
    replica's loop asks `damaged` after each batch and, on damage, goes down the rebuild path.

    A verification that fails for another reason than damage (a file compaction deleted while it was being
    opened) is logged and tried again at the next period. Damage is reported only when a second verification
    right after the first agrees, so a race never costs a rebuild.
    """

    def __init__(self, path: Path, every_s: float) -> None:
        if every_s <= 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self.path = path
        self.every_s = every_s
        self.damaged: VerifyReport | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="das-store-verifier", daemon=True)

    def check(self) -> VerifyReport | None:
        """One verification (two when the first finds damage); the report, or None if it could not run."""
        for attempt in range(2):
            started = time.perf_counter()
            try:
                report = verify_store(self.path)
            except StoreError as exc:
                log.warning(
                    "verifying history store %s did not complete (tried again later): %s", self.path, exc
                )
                return None
            STORE_VERIFY_DURATION.observe(time.perf_counter() - started)
            LAST_VERIFY.set(time.time())
            if report.ok or attempt:
                break
        STORE_DAMAGED.set(0 if report.ok else 1)
        if not report.ok:
            self.damaged = report
        return report

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s) and self.damaged is None:
            report = self.check()
            if report is not None and not report.ok:
                log.error(
                    "background verification: history store %s is damaged (files %s); stopping to rebuild it",
                    self.path,
                    ", ".join(report.files) or "none named",
                )


class _PartitionEpochs:
    """The newest epoch of each problem a replica has seen in one partition, and their median (the partition's
    consensus: where its problems are)."""

    __slots__ = ("newest", "_problems_at")

    def __init__(self) -> None:
        self.newest: dict[str, int] = {}
        self._problems_at: Tally[int] = Tally()  # epoch -> problems whose newest epoch it is

    def set(self, problem: str, epoch: int) -> None:
        self.forget(problem)
        self.newest[problem] = epoch
        self._problems_at[epoch] += 1

    def forget(self, problem: str) -> None:
        old = self.newest.pop(problem, None)
        if old is not None:
            self._problems_at[old] -= 1
            if not self._problems_at[old]:
                del self._problems_at[old]

    def consensus(self) -> int:
        """The lower median of the problems' newest epochs (few distinct epochs: a short walk)."""
        half, seen = (len(self.newest) + 1) // 2, 0
        for epoch in sorted(self._problems_at):
            seen += self._problems_at[epoch]
            if seen >= half:
                return epoch
        raise ValueError("no problem seen in this partition")


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
            self.index.add_trajectory(
                r.problem_id, r.epoch, r.sample, r.prompt_ids, r.response_ids, r.response_logprobs
            )

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
        self._window = store.window_epochs
        self._partitions: dict[tuple[str, int], _PartitionEpochs] = {}
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
        stale: list[Key] = []
        for message, record, error in self._judge(candidates):
            if error is not None:
                self._dead_letter(message, error)
                report.dead_lettered[error.reason] += 1
                if error.reason == REASON_STALE:
                    stale.append((record.problem_id, record.epoch, record.sample))
                continue
            records.append(record)
            published_ms.setdefault((record.problem_id, record.epoch, record.sample), message.timestamp_ms)
        if report.dead_lettered:
            self._flush_dead_letters()
            log.warning(
                "dead-lettered %d messages: %s",
                sum(report.dead_lettered.values()),
                dict(report.dead_lettered),
            )
        result = self.store.apply(records, offsets)
        report.applied, report.duplicates = len(result.applied), result.duplicates
        report.stale, report.evicted = len(stale) + len(result.stale), len(result.evicted)
        if report.stale:
            STALE_RECORDS.inc(report.stale)
            log.info(
                "dropped %d stale records (their epoch is below their problem's window), e.g. %s",
                report.stale,
                (stale or result.stale)[0],
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
            # Every batch, evictions or not: it also sends again the tombstones an outage held back. A stale
            # record gets one too: no replica stores it, so the compacted topic should not keep it either.
            self.publisher.tombstones(
                self.source.topic, self.source.partition_count(), [*result.evicted, *stale]
            )
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

    def run(
        self, stop: threading.Event, until_caught_up: bool = False, verifier: StoreVerifier | None = None
    ) -> None:
        """Starts, then applies batches until `stop` is set (or, with `until_caught_up`, until the source has
        nothing more); always closes the source and publisher.

        While no broker answers, it keeps the store, sets `das_consumer_up` to 0, backs off, and then resumes
        from the offsets stored with the data (a batch polled but not applied is read again). Raises
        StoreCorruptionError when `verifier` (checking the store in the background) found it damaged.
        """
        try:
            self.start()
            CONSUMER_UP.set(1)
            backoff, down_since = OUTAGE_BACKOFF_S[0], None
            while not stop.is_set():
                if verifier is not None and verifier.damaged is not None:
                    report = verifier.damaged
                    raise StoreCorruptionError(
                        f"history store {self.store.path} was damaged while running: files "
                        f"{', '.join(report.files) or 'none named'}, {len(report.unreadable_records)} unreadable "
                        "records"
                    )
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
                        CONSUMER_LAG.set(math.nan)  # unknown while no broker answers, not the last value
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
                self._flush_dead_letters()
                self.publisher.close()
        finally:
            self.source.close()

    def _judge(
        self, candidates: Sequence[tuple[BusMessage, TrajectoryLike]]
    ) -> Iterator[tuple[BusMessage, TrajectoryLike, WireError | None]]:
        """Each decoded record with the reason it must not be stored (None: store it), in batch order.

        A record is judged against its own problem's newest epoch and against its partition's consensus: the
        median of the newest epochs of the problems this replica has seen in that partition (a problem's
        records all share one partition, in order). So one record, or a few, cannot move the reference, and
        problems other than its own cannot either. Refused are: an epoch more than `max_epochs_ahead` beyond
        the consensus (`epoch_ahead`); one that would evict its problem's whole window while the consensus is
        not there (`epoch_jump`); one already below its problem's window (`stale`). A problem new to the
        replica counts with the lowest epoch its records in this batch carry, so an empty replica has a
        consensus too (one hostile first record of a problem is outvoted by the problem's own later records
        and by the other problems of its partition).
        """
        epochs: dict[str, list[int]] = {}
        for _, record in candidates:
            epochs.setdefault(record.problem_id, []).append(record.epoch)
        provisional: dict[str, _PartitionEpochs] = {}
        for message, record in candidates:
            part = self._partitions.setdefault((message.topic, message.partition), _PartitionEpochs())
            problem = record.problem_id
            if problem not in part.newest:
                self._reference(part, problem, epochs[problem], provisional)
            newest = None if problem in provisional else part.newest[problem]
            if newest is not None and record.epoch < newest - self._window + 1:
                newest = self._outvote(part, problem, record.epoch, epochs[problem], provisional)
            try:
                self._check_identity(record, newest, part.consensus())
            except WireError as exc:
                yield message, record, exc
                continue
            provisional.pop(problem, None)
            part.set(problem, record.epoch if newest is None else max(newest, record.epoch))
            yield message, record, None
        for problem, part in provisional.items():  # every record of it refused: it counts no more
            part.forget(problem)

    def _reference(
        self,
        part: _PartitionEpochs,
        problem: str,
        epochs: list[int],
        provisional: dict[str, _PartitionEpochs],
    ) -> None:
        """Enters a problem into its partition's consensus: at its newest stored epoch, else (new to this
        replica) provisionally at the lowest epoch its records in this batch carry."""
        window = self.store.window(problem)
        if len(window):
            part.set(problem, int(window["epoch"].max()))
        else:
            part.set(problem, min(epochs))
            provisional[problem] = part

    def _outvote(
        self,
        part: _PartitionEpochs,
        problem: str,
        epoch: int,
        epochs: list[int],
        provisional: dict[str, _PartitionEpochs],
    ) -> int | None:
        """A record would be stale: unless its problem's own newest epoch is the outlier. That is what one
        hostile record makes of itself when it is the first an empty replica reads (nothing to judge it against
        yet). Its stored records beyond the partition's consensus (counting the problem at `epoch`) are set aside
        (quarantined, kept) when this batch holds more records of the problem that agree with the consensus
        than there are of them. Returns the problem's newest epoch after that (None: no stored record left)."""
        newest = part.newest[problem]
        part.set(problem, epoch)
        consensus = part.consensus()
        part.set(problem, newest)
        limit = consensus + self.max_epochs_ahead
        window = self.store.window(problem)
        outliers = [
            (problem, int(e), int(s))
            for e, s in zip(window["epoch"], window["sample"], strict=True)
            if e > limit
        ]
        agreeing = sum(1 for e in epochs if e <= limit)
        if not outliers or len(outliers) >= agreeing or int(window["epoch"].max()) != newest:
            return newest
        moved = self.store.set_aside(
            outliers,
            f"outvoted: epoch beyond {limit}, where {agreeing} later records of its problem are",
            "epoch_outlier",
        )
        for listener in self.listeners:
            listener.on_evicted(moved)
        log.warning(
            "set aside %d records of problem %r at epochs %s (quarantined): %d later records of the problem are at "
            "or below epoch %d, its partition's consensus plus --max-epochs-ahead",
            len(moved),
            problem,
            sorted({k[1] for k in moved}),
            agreeing,
            limit,
        )
        part.forget(problem)
        self._reference(part, problem, epochs, provisional)
        return None if problem in provisional else part.newest[problem]

    def _check_identity(self, record: TrajectoryLike, newest: int | None, consensus: int) -> None:
        """Raises WireError if the record's identity would harm the replica's history; `newest` is its problem's
        newest stored epoch (None: none yet), `consensus` its partition's (see `_judge`)."""
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
        if record.epoch > consensus + self.max_epochs_ahead:
            raise WireError(
                REASON_EPOCH_AHEAD,
                f"epoch {record.epoch} is {record.epoch - consensus} beyond epoch {consensus}, where the problems "
                f"of its partition are (limit {self.max_epochs_ahead}, --max-epochs-ahead): storing it would "
                "evict its problem's history",
            )
        if newest is None:
            return
        if record.epoch < newest - self._window + 1:
            raise WireError(
                REASON_STALE,
                f"epoch {record.epoch} is below the window of its problem (newest epoch {newest}, "
                f"{self._window} epochs kept): a late or reordered record",
            )
        if record.epoch - newest >= self._window and record.epoch > consensus + TRANSITION_EPOCHS:
            raise WireError(
                REASON_EPOCH_JUMP,
                f"epoch {record.epoch} would evict every stored epoch of its problem (newest {newest}, window "
                f"{self._window}) while the problems of its partition are at epoch {consensus}",
            )

    def _flush_dead_letters(self) -> None:
        """Waits until the dead letters are acknowledged; those the topic refused for good are counted, logged
        once each and their coordinates kept in the store (nothing else would remember them)."""
        if self.publisher is None:
            return
        refused = self.publisher.flush()
        if not refused:
            return
        UNDELIVERED_DEAD_LETTERS.inc(len(refused))
        for letter in refused:
            log.error(
                "message %s/%d/%d (%s) is skipped without a dead letter: %s refused it (%s); its coordinates "
                "are kept in the store (das history stats)",
                letter.topic,
                letter.partition,
                letter.offset,
                letter.reason,
                self.publisher.dead_letter_topic,
                letter.error,
            )
        self.store.keep_undelivered(
            [UndeliveredMessage(x.topic, x.partition, x.offset, x.reason, x.error) for x in refused]
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
        CONSUMER_LAG.set(math.nan if lag is None else lag)
