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

import contextlib
import logging
import math
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
from history_store.durable.store import (
    ApplyResult,
    FolderLock,
    HistoryStore,
    TrajectoryKey,
    TrajectoryLike,
    UndeliveredMessage,
    VerifyReport,
    finish_swap,
    swap_in,
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
from pipeline.bounded import OVER_BOUND_HEADER
from pipeline.bus import EMBEDDED_TOPIC, BusMessage, TrajectorySource
from pipeline.consumer import ReplicaPublisher
from pipeline.epochs import EpochAdvance, decode_advance
from pipeline.errors import BusUnavailableError
from pipeline.schemas import TrajectoryRecord
from pipeline.wire import (
    DEFAULT_CONFIRM_SAMPLES,
    DEFAULT_MAX_EPOCH,
    DEFAULT_MAX_RECORD_TOKENS,
    DEFAULT_MAX_SAMPLE,
    REASON_CONTROL,
    REASON_DUPLICATE,
    REASON_EPOCH_RANGE,
    REASON_OVERSIZE,
    REASON_PARTITION,
    REASON_SAMPLE_RANGE,
    REASON_STALE,
    WireError,
    check_key,
    check_logprobs,
    decode,
    encode_record,
    parse_record_key,
    partition_for,
)
from workers.errors import InvalidInput

log = logging.getLogger(__name__)

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
EPOCH_MODES = ("auto", "control", "samples", "trusted")
# A replica sends a record again at most this often per run (see `Indexer._restore`).
MAX_RESTORES_PER_KEY = 2


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
    up, then swaps it in (`swap_in`: one exchange of the two folders, or where the file system cannot, a journaled
    move of their files that a crash cannot leave half done). The damaged one is kept beside it as
    `<name>.corrupt-<unix time>` for inspection.

    Both folders stay locked throughout, so no second writer can open either, even mid-swap. Returns the lock of
    the rebuilt store now at `path` (the damaged folder's lock is released), or None if `stop` came first (the
    damaged store is then left in place, still locked by `lock`).
    """
    fresh = path.with_name(f".{path.name}.rebuild")
    if finish_swap(path):  # a crash interrupted the last swap: it is finished, not redone
        return lock
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
        exchanged = swap_in(fresh, path, kept)
    except BaseException:
        fresh_lock.release()
        raise
    if not exchanged:  # the files moved, not the folders: `path` is still the folder `lock` holds
        fresh_lock.release()
        fresh_lock = lock
    else:
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
            raise InvalidInput(f"every_s must be > 0, got {every_s}")
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


def _same_content(a: TrajectoryLike, b: TrajectoryLike) -> bool:
    """Whether two records hold the same tokens and log probabilities."""
    if (a.response_logprobs is None) != (b.response_logprobs is None):
        return False
    return (
        np.array_equal(np.asarray(a.prompt_ids), np.asarray(b.prompt_ids))
        and np.array_equal(np.asarray(a.response_ids), np.asarray(b.response_ids))
        and (
            a.response_logprobs is None
            or np.array_equal(np.asarray(a.response_logprobs, "<f4"), np.asarray(b.response_logprobs, "<f4"))
        )
    )


class ReplicaListener(Protocol):
    """Told about every change the replica applied, after it is durable."""

    def on_applied(self, records: Sequence[TrajectoryLike]) -> None:
        """Records now durable and draftable (records of the model, or decoded ones with token arrays)."""

    def on_evicted(self, keys: Sequence[TrajectoryKey]) -> None:
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

    def on_evicted(self, keys: Sequence[TrajectoryKey]) -> None:
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
    held: int = 0
    advances: int = 0
    restored: int = 0
    dead_lettered: Tally[str] = field(default_factory=Tally)
    freshness_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class RecordLimits:
    """What a replica takes in: records over `max_record_tokens` tokens, or with a sample or epoch beyond
    `max_sample` / `max_epoch`, are dead-lettered; `batch_records` messages are polled and written at a time."""

    max_record_tokens: int = DEFAULT_MAX_RECORD_TOKENS
    batch_records: int = DEFAULT_BATCH_RECORDS
    max_sample: int = DEFAULT_MAX_SAMPLE
    max_epoch: int = DEFAULT_MAX_EPOCH

    def __post_init__(self) -> None:
        if self.batch_records < 1:
            raise InvalidInput(f"batch_records must be >= 1, got {self.batch_records}")
        if min(self.max_sample, self.max_epoch) < 0:
            raise InvalidInput(
                f"max_sample and max_epoch must be >= 0, got {self.max_sample}, {self.max_epoch}"
            )


class Indexer:
    """Applies a trajectory source to a HistoryStore. `publisher` is required for Kafka sources (dead letters,
    tombstones and restores); the embedded bus delivers already validated records and needs none.

    `epochs` says what moves a problem's window (its reference epoch, `HistoryStore.apply_judged`):
    - "control": only epoch advances from the control topic (`pipeline.epochs`), which only the trainer's principal
      may write. A data record never evicts anything: one beyond its problem's reference is held back until the
      trainer gets there;
    - "samples": `confirm_samples` distinct samples of a newer epoch (a deployment without advances);
    - "trusted": every record, as it arrives (the embedded bus: one process, one trust domain);
    - "auto" (default): "control" when the source reads a control topic, "trusted" for the embedded bus,
      else "samples".
    The judgement is a function of which records and advances were read, not of their order, so a rebuild from the
    compacted topic holds what a running replica holds.
    """

    def __init__(
        self,
        source: TrajectorySource,
        store: HistoryStore,
        *,
        publisher: ReplicaPublisher | None = None,
        listeners: Sequence[ReplicaListener] = (),
        limits: RecordLimits = RecordLimits(),
        poll_timeout_s: float = POLL_TIMEOUT_S,
        publish_tombstones: bool = True,
        checkpointer: Checkpointer | None = None,
        epochs: str = "auto",
        confirm_samples: int = DEFAULT_CONFIRM_SAMPLES,
    ) -> None:
        if epochs not in EPOCH_MODES:
            raise InvalidInput(f"epochs must be one of {', '.join(EPOCH_MODES)}, got {epochs!r}")
        if confirm_samples < 1:
            raise InvalidInput(f"confirm_samples must be >= 1, got {confirm_samples}")
        self.source = source
        self.store = store
        self.publisher = publisher
        self.listeners = list(listeners)
        self.limits = limits
        self.poll_timeout_s = poll_timeout_s
        self.publish_tombstones = publish_tombstones
        self.checkpointer = checkpointer
        self.epochs = epochs
        self.confirm_samples = confirm_samples
        self._restores: Tally[TrajectoryKey] = Tally()
        self._next_lag = 0.0

    def start(self) -> None:
        """Positions the source at the offsets stored with the data and settles the epoch mode."""
        self.source.start(self.store.offsets())
        if self.epochs == "auto":
            if self.source.topic == EMBEDDED_TOPIC:
                self.epochs = "trusted"
            else:
                self.epochs = "control" if getattr(self.source, "reads_epochs", False) else "samples"
        log.info(
            "epochs of %s: %s",
            self.source.topic,
            {
                "control": "moved by epoch advances only",
                "samples": f"moved by {self.confirm_samples} distinct samples of a newer epoch",
                "trusted": "moved by every record (in-process bus)",
            }[self.epochs],
        )

    def step(self) -> BatchReport:
        """Polls and applies one batch. Raises StoreWriteError (nothing advanced) or BusError (dead letters
        not acknowledged; nothing advanced; BusUnavailableError when no broker answers)."""
        report = BatchReport()
        messages = self.source.poll(self.limits.batch_records, self.poll_timeout_s)
        self._update_lag()
        if not messages:
            return report
        report.messages = len(messages)
        records: list[TrajectoryLike] = []
        published_ms: dict[TrajectoryKey, int] = {}
        offsets: dict[tuple[str, int], int] = {}
        advances: dict[str, int] = {}
        tombstoned: list[TrajectoryKey] = []
        control_topic = getattr(self.source, "epochs_topic", None)
        partitions = self.source.partition_count()
        rejected: list[tuple[BusMessage, WireError]] = []
        by_key: dict[TrajectoryKey, list[tuple[BusMessage, TrajectoryLike]]] = {}
        for message in messages:
            if message.topic != EMBEDDED_TOPIC:
                offsets[(message.topic, message.partition)] = message.offset + 1
            if message.topic == control_topic:
                advance = self._advance(message, rejected)
                if advance is not None:
                    report.advances += 1
                    advances[advance.problem_id] = max(advance.epoch, advances.get(advance.problem_id, -1))
                continue
            record: TrajectoryLike | None = message.record
            if record is None:
                if message.value is None:
                    # A tombstone: from a replica, for a record an epoch advance retired (every replica drops it
                    # by itself), or from someone else, for a record still held: that one is sent again below.
                    report.tombstones += 1
                    with contextlib.suppress(WireError):
                        tombstoned.append(parse_record_key(message.key or b""))
                    continue
                try:
                    record = self._decode(message)
                except WireError as exc:
                    rejected.append((message, exc))
                    continue
            elif record.response_logprobs is not None:
                # An embedded record arrives as an object, not wire bytes: the rule `decode` applies, here.
                try:
                    check_logprobs(np.asarray(record.response_logprobs, "<f4"), len(record.response_ids))
                except WireError as exc:
                    rejected.append((message, exc))
                    continue
            try:
                self._check_range(record)
                if message.topic != EMBEDDED_TOPIC:
                    self._check_partition(message, record.problem_id, partitions)
            except WireError as exc:
                rejected.append((message, exc))
                continue
            records.append(record)
            key = (record.problem_id, record.epoch, record.sample)
            published_ms.setdefault(key, message.timestamp_ms)
            by_key.setdefault(key, []).append((message, record))
        for message, error in rejected:
            self._dead_letter(message, error)
            report.dead_lettered[error.reason] += 1

        def before_write(result: ApplyResult) -> None:
            # Dead letters are acknowledged before the offsets past them are stored: a crash may repeat one,
            # never lose one.
            for key in result.stale:
                self._dead_letter(by_key[key][0][0], self._stale_error(key))
                report.dead_lettered[REASON_STALE] += 1
            for key in result.conflicts:
                error = WireError(
                    REASON_DUPLICATE,
                    f"record {key!r:.120} is already stored with other content; the stored copy stays (and is sent "
                    "again, so that compaction keeps it)",
                )
                # The copy kept: stored by an earlier batch, else this batch's first.
                kept = self.store.get(*key) or self.store.get_pending(*key) or by_key[key][0][1]
                for message, record in by_key[key]:  # the copies that differ from it
                    if not _same_content(kept, record):
                        self._dead_letter(message, error)
                        report.dead_lettered[REASON_DUPLICATE] += 1
            if report.dead_lettered:
                self._flush_dead_letters()
                log.warning(
                    "dead-lettered %d messages: %s",
                    sum(report.dead_lettered.values()),
                    dict(report.dead_lettered),
                )

        if self.epochs == "trusted":
            result = self.store.apply(records, offsets)
            before_write(result)  # trusted records (the embedded bus) are never stale or conflicting here
        else:
            result = self.store.apply_judged(
                records,
                offsets,
                advances=advances,
                confirm_samples=self.confirm_samples if self.epochs == "samples" else None,
                before_write=before_write,
            )
        report.applied, report.duplicates = len(result.applied), result.duplicates
        report.stale, report.evicted, report.held = (
            len(result.stale),
            len(result.evicted),
            len(result.pending),
        )
        if report.stale:
            STALE_RECORDS.inc(report.stale)
            log.info(
                "dropped %d stale records (their epoch is below their problem's window), e.g. %s",
                report.stale,
                result.stale[0],
            )
        if report.held:
            log.info(
                "held back %d records beyond their problem's reference epoch (e.g. %s): stored, not drafted "
                "from, until the trainer's epoch gets there",
                report.held,
                result.pending[0],
            )
        if result.applied and self.listeners:
            for listener in self.listeners:
                listener.on_applied(self._applied_records(records, result))
        if result.evicted:
            for listener in self.listeners:
                listener.on_evicted(result.evicted)
        now_ms = time.time() * 1000
        for key in result.applied:
            if key in published_ms:
                seconds = max(0.0, (now_ms - published_ms[key]) / 1000)
                FRESHNESS.observe(seconds)
                report.freshness_s.append(seconds)
        if self.publish_tombstones and self.publisher is not None:
            # Every batch, evictions or not: it also sends again the tombstones an outage held back. Only records
            # an epoch advance (or, without advances, enough samples) retired get one.
            self.publisher.tombstones(self.source.topic, partitions, [*result.evicted, *result.stale])
            report.restored = self._restore([*tombstoned, *result.conflicts], partitions)
        if offsets:
            self.source.commit(offsets)
        if self.checkpointer is not None:
            self.checkpointer.after_apply(result.applied)
        log.debug(
            "batch: messages=%d applied=%d held=%d duplicates=%d stale=%d evicted=%d tombstones=%d advances=%d "
            "restored=%d dead_lettered=%d",
            report.messages,
            report.applied,
            report.held,
            report.duplicates,
            report.stale,
            report.evicted,
            report.tombstones,
            report.advances,
            report.restored,
            sum(report.dead_lettered.values()),
        )
        return report

    def _applied_records(
        self, records: Sequence[TrajectoryLike], result: ApplyResult
    ) -> list[TrajectoryLike]:
        """The records newly in windows, in the order applied: the batch's own, then those promoted from the
        held-back records (read back from the store)."""
        pending = set(result.applied)
        fresh: list[TrajectoryLike] = []
        for r in records:  # a key repeated in the batch was applied once, its first copy
            key = (r.problem_id, r.epoch, r.sample)
            if key in pending:
                pending.discard(key)
                fresh.append(r)
        for key in result.applied:
            if key in pending:
                stored = self.store.get(*key)
                if stored is not None:
                    fresh.append(stored)
        return fresh

    def _decode(self, message: BusMessage) -> TrajectoryLike:
        """The record in a Kafka message. Raises WireError."""
        headers = dict(message.headers)
        if OVER_BOUND_HEADER in headers:
            raise WireError(REASON_OVERSIZE, headers[OVER_BOUND_HEADER].decode("utf-8", "replace"))
        decoded = decode(message.value, self.limits.max_record_tokens)
        check_key(message.key, decoded.key)
        return decoded

    def _advance(
        self, message: BusMessage, rejected: list[tuple[BusMessage, WireError]]
    ) -> EpochAdvance | None:
        """The epoch advance a control-topic message carries, or None (dead-lettered: `control`)."""
        try:
            advance = decode_advance(message.key, message.value)
        except ValueError as exc:
            rejected.append((message, WireError(REASON_CONTROL, f"not an epoch advance: {exc}")))
            return None
        try:
            if advance.epoch > self.limits.max_epoch:
                raise WireError(
                    REASON_EPOCH_RANGE,
                    f"epoch advance to {advance.epoch} is beyond this replica's limit {self.limits.max_epoch} (--max-epoch)",
                )
            control_partitions = self.source.control_partition_count()  # type: ignore[attr-defined]
            self._check_partition(message, advance.problem_id, control_partitions)
        except WireError as exc:
            rejected.append((message, exc))
            return None
        return advance

    @staticmethod
    def _check_partition(message: BusMessage, problem_id: str, partitions: int) -> None:
        """Raises WireError(partition) unless the message is in its problem's partition: tombstones, restores and
        compaction work per partition, and a problem's records are ordered only within its own."""
        want = partition_for(problem_id, partitions)
        if message.partition != want:
            raise WireError(
                REASON_PARTITION,
                f"problem {problem_id!r:.80} belongs in partition {want} of {message.topic}, not {message.partition}",
            )

    def _stale_error(self, key: TrajectoryKey) -> WireError:
        reference = self.store.reference(key[0])
        window = self.store.window_epochs
        return WireError(
            REASON_STALE,
            f"epoch {key[1]} is below the window of its problem (reference epoch {reference}, {window} epochs "
            "kept): a late or reordered record",
        )

    def _restore(self, keys: Sequence[TrajectoryKey], partitions: int) -> int:
        """Sends again each record in `keys` that this replica holds (in a window, or held back) and that no epoch
        advance retired, after a message that compaction would let replace it. At most twice per key per run:
        two replicas that disagree on a record (one rebuilt while compaction had already dropped the first copy)
        then stop instead of answering each other forever. Returns how many were sent."""
        assert self.publisher is not None
        sent = 0
        for key in keys:
            if self._restores[key] >= MAX_RESTORES_PER_KEY:
                continue
            stored = self.store.get(*key) or self.store.get_pending(*key)
            if stored is None:
                continue
            record = TrajectoryRecord(
                problem_id=key[0],
                epoch=key[1],
                sample=key[2],
                prompt_ids=stored.prompt_ids.tolist(),
                response_ids=stored.response_ids.tolist(),
                response_logprobs=None
                if stored.response_logprobs is None
                else stored.response_logprobs.tolist(),
            )
            self.publisher.restore(self.source.topic, partitions, key, encode_record(record))
            self._restores[key] += 1
            sent += 1
        if sent:
            log.warning(
                "sent %d stored records again (e.g. %s): a tombstone no epoch advance justifies, or another copy "
                "of their key, would otherwise replace them when the topic is compacted",
                sent,
                keys[0],
            )
        return sent

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
                    if until_caught_up and (self.source.lag() or 0) < self.limits.batch_records:
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

    def _check_range(self, record: TrajectoryLike) -> None:
        """Raises WireError if the record's sample or epoch is beyond this replica's limits."""
        if record.sample > self.limits.max_sample:
            raise WireError(
                REASON_SAMPLE_RANGE,
                f"sample {record.sample} is beyond this replica's limit {self.limits.max_sample}",
            )
        if record.epoch > self.limits.max_epoch:
            raise WireError(
                REASON_EPOCH_RANGE,
                f"epoch {record.epoch} is beyond this replica's limit {self.limits.max_epoch} (--max-epoch)",
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
