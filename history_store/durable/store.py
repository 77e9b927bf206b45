"""The durable history store: trajectories, window length statistics and bus offsets in one RocksDB folder.

One process writes (`HistoryStore`, the node's history replica); any number of others read through RocksDB
secondary instances (`HistoryStore.open_secondary`, e.g. the generator's proposer), catching up with the
writer between decode steps. `verify_store` checks every file of a store, running or not, through a primary
opened read-only: a secondary instance treats a table file it cannot open as absent, and so cannot verify. `apply` writes a batch of records, the window statistics they change, the
eviction of epochs that left the window and the bus offsets in one WriteBatch: state and offsets advance
together or not at all, so a consumer that resumes from `offsets()` neither loses nor repeats a record.

Every write also appends to a sequence log (column family `sequence`) so a reader finds what changed since
its last look with one short range scan instead of rescanning the store. The layout is in `layout.py`,
the value encodings in `codec.py`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from rocksdict import (
    AccessType,
    DBCompressionType,
    DBRecoveryMode,
    Options,
    Rdict,
    ReadOptions,
    WriteBatch,
    WriteOptions,
)

from history_store.automaton.config import DEFAULT_WINDOW_EPOCHS
from history_store.durable import layout
from history_store.durable.codec import (
    WINDOW_ENTRY,
    as_logprob_array,
    as_token_array,
    decode_trajectory,
    decode_window,
    encode_trajectory,
    encode_window,
)
from history_store.durable.length_stats import LengthStats
from history_store.errors import (
    CorruptRecordError,
    InvalidInput,
    StoreCorruptionError,
    StoreError,
    StoreLockedError,
    StoreOpenError,
    StoreStaleError,
    StoreWriteError,
)
from monitoring.metrics import (
    BYTES_INGESTED,
    EVICTIONS,
    QUARANTINED,
    RECORDS_INGESTED,
    STORE_APPLY_DURATION,
    STORE_SIZE,
    STORE_TOKENS,
    STORE_WRITE_ERRORS,
)

log = logging.getLogger(__name__)

TrajectoryKey = tuple[str, int, int]

# The sequence log is what lets secondary readers catch up incrementally; a reader further behind than this
# reloads everything (CatchUp.reset). One entry is ~30 bytes, so a million is ~30 MB before compression.
DEFAULT_SEQUENCE_RETENTION = 1_000_000
# das_store_size_bytes walks the folder (a few dozen files): at most this often.
SIZE_INTERVAL_S = 5.0
# Seconds a reader may see the writer's hint ahead of what it reads, catch-up after catch-up, before it calls
# itself stale (`StoreStaleError`): a writer's hint is written once its batch is durable, so a live writer
# closes that gap within the next catch-up.
STALE_AFTER_S = 2.0


class TrajectoryLike(Protocol):
    """What `apply` needs of a record; pipeline's TrajectoryRecord satisfies it (no import of pipeline)."""

    @property
    def problem_id(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    @property
    def sample(self) -> int: ...
    @property
    def prompt_ids(self) -> Sequence[int]: ...
    @property
    def response_ids(self) -> Sequence[int]: ...
    @property
    def response_logprobs(self) -> Sequence[float] | np.ndarray | None: ...


@dataclass(frozen=True, slots=True)
class StoredTrajectory:
    """A record as stored: token ids as read-only int32 arrays; `sequence` is its position in apply order;
    `response_logprobs` a read-only float32 array, or None for a record stored without them."""

    problem_id: str
    epoch: int
    sample: int
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    sequence: int
    response_logprobs: np.ndarray | None = None

    @property
    def key(self) -> TrajectoryKey:
        return (self.problem_id, self.epoch, self.sample)


@dataclass(slots=True)
class ApplyResult:
    """Outcome of one `apply`.

    applied: keys newly stored, in input order. duplicates: records already stored (or repeated in the batch).
    evicted: keys removed because their epoch left the window (the bus publishes tombstones for them).
    stale: keys not stored because their epoch was already outside their problem's window.
    """

    applied: list[TrajectoryKey] = field(default_factory=list)
    duplicates: int = 0
    evicted: list[TrajectoryKey] = field(default_factory=list)
    stale: list[TrajectoryKey] = field(default_factory=list)
    # `apply_judged` only. pending: keys held back this batch (their epoch is beyond their problem's reference).
    # promoted: keys moved from pending into their window (also in `applied`). conflicts: keys already stored
    # whose incoming copy differs in content (the stored copy is kept). references: problems whose reference
    # epoch moved, with the new value.
    pending: list[TrajectoryKey] = field(default_factory=list)
    promoted: list[TrajectoryKey] = field(default_factory=list)
    conflicts: list[TrajectoryKey] = field(default_factory=list)
    references: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Change:
    """One entry of the sequence log: `op` is "added", "removed" (evicted: its epoch left the window) or
    "quarantined" (failed its checksum; its problem's other records are unaffected)."""

    sequence: int
    op: str
    key: TrajectoryKey


@dataclass(frozen=True, slots=True)
class CatchUp:
    """What a reader learns from `catch_up`: changes in write order, or `reset` when it fell so far behind
    the trimmed sequence log that it must reload everything (then `changes` is empty)."""

    changes: list[Change]
    reset: bool

    @property
    def added(self) -> list[TrajectoryKey]:
        return [c.key for c in self.changes if c.op == "added"]

    @property
    def removed(self) -> list[TrajectoryKey]:
        """Keys gone from the store: evicted or quarantined."""
        return [c.key for c in self.changes if c.op != "added"]


@dataclass(frozen=True, slots=True)
class QuarantinedRecord:
    key: TrajectoryKey
    reason: str
    code: str
    detected_at: float
    raw_bytes: int


@dataclass(frozen=True, slots=True)
class UndeliveredMessage:
    """A bus message the replica rejected and could not dead-letter (the dead-letter topic refused it for
    good): its coordinates, why it was rejected, what refused the dead letter, and when (unix seconds)."""

    topic: str
    partition: int
    offset: int
    reason: str
    error: str
    at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Totals over the whole store (from the per-problem window entries, no token reads)."""

    problems: int
    trajectories: int
    prompt_tokens: int
    response_tokens: int
    quarantined: int
    undelivered: int
    pending: int
    window_epochs: int
    next_sequence: int
    max_epoch: int
    disk_bytes: int
    offsets: dict[tuple[str, int], int]

    def to_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__slots__ if k != "offsets"}
        out["offsets"] = [
            {"topic": t, "partition": p, "offset": o} for (t, p), o in sorted(self.offsets.items())
        ]
        return out


@dataclass(frozen=True, slots=True)
class DamagedRange:
    """Part of a column family RocksDB cannot read: from after `after_key` (None: from the start), in `file`.
    `family` is None when the damage keeps the store from opening at all (a table file's footer, index or
    filter): RocksDB then names the file but not its column family."""

    family: str | None
    after_key: str | None
    file: str | None
    error: str


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What `verify` found: entries read per column family, the ranges and files RocksDB cannot read, and
    the trajectory records (listed by the windows) that are unreadable, missing, or fail their own checksum."""

    path: str
    entries: dict[str, int]
    damaged: list[DamagedRange]
    unreadable_records: list[TrajectoryKey]
    missing_records: list[TrajectoryKey]
    corrupt_records: list[TrajectoryKey]

    @property
    def ok(self) -> bool:
        return not (self.damaged or self.unreadable_records or self.missing_records or self.corrupt_records)

    @property
    def files(self) -> list[str]:
        """The damaged files RocksDB named, each once."""
        return sorted({d.file for d in self.damaged if d.file})

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "entries": self.entries,
            "damaged_files": self.files,
            "damaged": [
                {"family": d.family, "after_key": d.after_key, "file": d.file, "error": d.error}
                for d in self.damaged
            ],
            "unreadable_records": [list(k) for k in self.unreadable_records],
            "missing_records": [list(k) for k in self.missing_records],
            "corrupt_records": [list(k) for k in self.corrupt_records],
        }


def _options(create: bool, path: Path | None = None) -> tuple[Options, dict[str, Options]]:
    """Options of an open; a reader (`create` False) of the store at `path` leaves out the optional column
    families that store does not have yet (it was written before they existed)."""
    # raw_mode must be identical on every open, or rocksdict flips the stored configuration.
    db_opts = Options(raw_mode=True)
    db_opts.create_if_missing(create)
    db_opts.create_missing_column_families(create)
    db_opts.set_keep_log_file_num(3)
    # Two background jobs: this machine kind has two cores and the writer must not starve the proposer.
    db_opts.set_max_background_jobs(2)
    names = layout.COLUMN_FAMILIES
    if not create and path is not None:
        try:
            present = set(Rdict.list_cf(str(path), Options(raw_mode=True)))
        except Exception:  # the open itself reports what is wrong with the folder
            present = set(names)
        names = tuple(n for n in names if n in present or n not in layout.OPTIONAL_FAMILIES)
    families = {name: Options(raw_mode=True) for name in names}
    # zstd: token ids compress well (many repeated ids across samples of one problem) and ingest is I/O-light.
    families[layout.CF_TRAJECTORIES].set_compression_type(DBCompressionType.zstd())
    return db_opts, families


_SST_FILE = re.compile(r"\S+\.(?:sst|blob)\b")


def _is_corruption(exc: Exception) -> bool:
    return "Corruption:" in str(exc)


def _scan(
    family: Rdict, start: bytes | None = None, end: bytes | None = None
) -> Iterator[tuple[bytes, bytes]]:
    """Items with start <= key < end, every block's checksum verified; raises RocksDB's error at the end.

    rocksdict's own `items()` ends quietly at a block that fails its checksum (the rest of the range simply
    seems absent), so this walks a raw iterator and checks its status when it stops. Stops by comparing keys
    rather than with ReadOptions.set_iterate_upper_bound: rocksdict does not keep the bound alive, so a
    ReadOptions garbage-collected mid-iteration leaves a dangling bound (seen here: wrong scans).
    """
    options = ReadOptions()
    options.set_verify_checksums(True)
    it = family.iter(options)
    if start is None:
        it.seek_to_first()
    else:
        it.seek(start)
    while it.valid():
        key = it.key()
        if end is not None and key >= end:
            return
        yield key, it.value()
        it.next()
    it.status()  # raises if the iterator stopped on an error rather than at the end


def _keys(family: Rdict) -> Iterator[bytes]:
    """Keys of a column family in order, checksums verified."""
    for key, _ in _scan(family):
        yield key


def _disk_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                continue  # compaction removed it while we walked
    return total


def _open_error(path: Path, exc: Exception) -> StoreError:
    """The store error for a failed RocksDB open, told apart by RocksDB's own status words (never by the path,
    which may contain any of them)."""
    detail = str(exc)
    if "While lock file" in detail:
        return StoreLockedError(
            f"history store {path} is locked by a process outside DAS (RocksDB LOCK held). Detail: {detail}"
        )
    if "Corruption:" in detail:
        return StoreCorruptionError(
            f"history store {path} is corrupt and cannot be opened: {detail}. Restore a backup "
            "(das history restore) or let the replica rebuild it from the topic (move the folder away)"
        )
    return StoreOpenError(f"cannot open history store {path}: {detail}")


class _StoreReader:
    """Read methods shared by the writer and secondary readers."""

    _db: Rdict | None
    path: Path

    def _bind_families(self, families: Mapping[str, Options] | None = None) -> None:
        assert self._db is not None
        names = layout.COLUMN_FAMILIES if families is None else tuple(families)
        self._cf = {name: self._db.get_column_family(name) for name in names}
        self._handles = {name: self._db.get_column_family_handle(name) for name in names}

    def _family(self, name: str) -> Rdict | None:
        """The column family; None for an optional one this (older) store does not have yet."""
        if self._db is None:
            raise StoreOpenError(f"history store {self.path} is closed")
        family = self._cf.get(name)
        if family is None and name not in layout.OPTIONAL_FAMILIES:
            raise KeyError(name)
        return family

    def _get(self, name: str, key: bytes) -> bytes | None:
        """One value, its block's checksum verified. Raises StoreCorruptionError on a damaged block."""
        try:
            family = self._family(name)
            return None if family is None else family.get(key)
        except StoreError:
            raise
        except Exception as exc:
            if _is_corruption(exc):
                raise self._corruption(name, key, exc) from exc
            raise

    def _items(
        self, name: str, start: bytes | None = None, end: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """`_scan` over one column family; raises StoreCorruptionError on a damaged block, naming the family,
        the last key read before it and the file RocksDB reports."""
        last = start
        family = self._family(name)
        if family is None:
            return
        try:
            for key, value in _scan(family, start, end):
                last = key
                yield key, value
        except StoreError:
            raise
        except Exception as exc:
            if _is_corruption(exc):
                raise self._corruption(name, last, exc) from exc
            raise

    def _keys(self, name: str) -> Iterator[bytes]:
        for key, _ in self._items(name):
            yield key

    def _corruption(self, name: str, key: bytes | None, exc: Exception) -> StoreCorruptionError:
        where = f"after key {key!r}" if key is not None else "from its start"
        return StoreCorruptionError(
            f"history store {self.path}: column family {name} unreadable {where}: {exc}. "
            "Run `das history verify` for every damaged key and file; the replica rebuilds from the topic"
        )

    def _meta_int(self, key: bytes) -> int | None:
        raw = self._get(layout.CF_META, key)
        return None if raw is None else int(raw.decode("ascii"))

    @property
    def window_epochs(self) -> int:
        """Epochs kept per problem: the newest and the W-1 before it."""
        value = self._meta_int(layout.META_WINDOW_EPOCHS)
        if value is None:
            raise StoreOpenError(f"{self.path} has no window size in its metadata")
        return value

    @property
    def next_sequence(self) -> int:
        """Sequence number the next change will get (0 for an empty store)."""
        return self._meta_int(layout.META_NEXT_SEQUENCE) or 0

    def _on_corrupt(self, key: bytes, raw: bytes, error: CorruptRecordError) -> None:
        QUARANTINED.labels(reason=error.code).inc()
        log.warning("history store %s: skipping corrupt record %r: %s", self.path, key, error.reason)

    def _decode(self, key: bytes, raw: bytes) -> StoredTrajectory | None:
        """The record, or None if it fails its checks (then it goes to `_on_corrupt`)."""
        try:
            decoded = decode_trajectory(raw)
        except CorruptRecordError as error:
            self._on_corrupt(key, raw, error)
            return None
        problem_id, epoch, sample = layout.decode_trajectory_key(key)
        return StoredTrajectory(
            problem_id,
            epoch,
            sample,
            decoded.prompt_ids,
            decoded.response_ids,
            decoded.sequence,
            decoded.response_logprobs,
        )

    def get(self, problem_id: str, epoch: int, sample: int) -> StoredTrajectory | None:
        """The stored record, or None if absent, evicted or quarantined. Raises ValueError on a bad key."""
        key = layout.trajectory_key(problem_id, epoch, sample)
        raw = self._get(layout.CF_TRAJECTORIES, key)
        return None if raw is None else self._decode(key, raw)

    def get_pending(self, problem_id: str, epoch: int, sample: int) -> StoredTrajectory | None:
        """A record held back (see `pending`), or None if not held or unreadable."""
        key = layout.trajectory_key(problem_id, epoch, sample)
        raw = self._get(layout.CF_PENDING, key)
        if raw is None:
            return None
        try:
            decoded = decode_trajectory(raw)
        except CorruptRecordError:
            return None
        return StoredTrajectory(
            problem_id, epoch, sample, decoded.prompt_ids, decoded.response_ids, -1, decoded.response_logprobs
        )

    def iter_trajectories(self, problem_id: str | None = None) -> Iterator[StoredTrajectory]:
        """Records in key order (problem, epoch, sample), of one problem or all; corrupt ones are skipped
        (and quarantined by the writer).

        Exhaust or close the iterator before `close()`: a live RocksDB iterator keeps the folder locked.
        """
        if problem_id is None:
            items = self._items(layout.CF_TRAJECTORIES)
        else:
            prefix = layout.problem_prefix(problem_id)
            items = self._items(
                layout.CF_TRAJECTORIES, layout.epoch_bound(prefix, 0), layout.problem_end(prefix)
            )
        for key, raw in items:
            record = self._decode(key, raw)
            if record is not None:
                yield record

    def problem_ids(self) -> list[str]:
        """Ids of every problem with records in the store, sorted by key (length, then bytes)."""
        return [layout.decode_problem_prefix(k) for k in self._keys(layout.CF_WINDOWS)]

    def window(self, problem_id: str) -> np.ndarray:
        """The problem's window entries (epoch, sample, prompt_len, response_len), sorted; empty if none."""
        return self._window_entries(layout.problem_prefix(problem_id))

    def _window_entries(self, prefix: bytes) -> np.ndarray:
        raw = self._get(layout.CF_WINDOWS, prefix)
        if raw is None:
            return np.zeros(0, dtype=WINDOW_ENTRY)
        try:
            return decode_window(raw)
        except CorruptRecordError as error:
            QUARANTINED.labels(reason="window").inc()
            log.warning(
                "history store %s: window of %r is corrupt (%s); rebuilding it", self.path, prefix, error
            )
            return self._scan_window(prefix)

    def _scan_window(self, prefix: bytes) -> np.ndarray:
        """Window entries recomputed from the stored records (when the stored window value is corrupt)."""
        rows = []
        items = self._items(layout.CF_TRAJECTORIES, layout.epoch_bound(prefix, 0), layout.problem_end(prefix))
        for key, raw in items:
            try:
                decoded = decode_trajectory(raw)
            except CorruptRecordError:
                continue  # left for get/iter to quarantine: quarantining rewrites this very window
            _, epoch, sample = layout.decode_trajectory_key(key)
            rows.append((epoch, sample, decoded.prompt_ids.size, decoded.response_ids.size))
        return np.array(rows, dtype=WINDOW_ENTRY)

    def reference(self, problem_id: str) -> int | None:
        """The problem's reference epoch (see `HistoryStore.apply_judged`), None before the first."""
        value = self._reference(layout.problem_prefix(problem_id))
        return None if value < 0 else value

    def _reference(self, prefix: bytes) -> int:
        raw = self._get(layout.CF_META, layout.META_REFERENCE + prefix)
        return -1 if raw is None else layout.decode_u64(raw)

    def references(self) -> dict[str, int]:
        """Every problem's reference epoch."""
        start = layout.META_REFERENCE
        return {
            layout.decode_problem_prefix(key[len(start) :]): layout.decode_u64(raw)
            for key, raw in self._items(layout.CF_META, start, start[:-1] + b"\x01")
        }

    def _pending_keys(self, prefix: bytes) -> list[tuple[int, int]]:
        out = []
        for key, _ in self._items(
            layout.CF_PENDING, layout.epoch_bound(prefix, 0), layout.problem_end(prefix)
        ):
            _, epoch, sample = layout.decode_trajectory_key(key)
            out.append((epoch, sample))
        return out

    def pending(self, problem_id: str | None = None) -> list[TrajectoryKey]:
        """Keys of records held back (beyond their problem's reference epoch), of one problem or all."""
        if problem_id is not None:
            return [(problem_id, e, s) for e, s in self._pending_keys(layout.problem_prefix(problem_id))]
        return [layout.decode_trajectory_key(key) for key, _ in self._items(layout.CF_PENDING)]

    def length_stats(self, problem_id: str) -> LengthStats | None:
        """Response-length statistics over the problem's window, or None if it has no records."""
        return LengthStats.from_window(self.window(problem_id))

    def offsets(self) -> dict[tuple[str, int], int]:
        """Bus offsets stored with the records: (topic, partition) -> next offset to read."""
        return {layout.decode_offset_key(k): layout.decode_u64(v) for k, v in self._items(layout.CF_OFFSETS)}

    def quarantined(self) -> list[QuarantinedRecord]:
        """Records set aside because they failed their checks, with the reason."""
        out = []
        for key, raw in self._items(layout.CF_QUARANTINE):
            head, _, body = raw.partition(b"\n")
            info = json.loads(head)
            out.append(
                QuarantinedRecord(
                    layout.decode_trajectory_key(key),
                    info["reason"],
                    info["code"],
                    info["detected_at"],
                    len(body),
                )
            )
        return out

    def undelivered(self) -> list[UndeliveredMessage]:
        """Messages rejected without a dead letter (the topic refused it), oldest coordinates first."""
        start = layout.META_UNDELIVERED
        out = []
        for key, raw in self._items(layout.CF_META, start, start[:-1] + b"\x01"):
            topic, partition = layout.decode_offset_key(key[len(start) : -8])
            info = json.loads(raw)
            out.append(
                UndeliveredMessage(
                    topic, partition, layout.decode_u64(key[-8:]), info["reason"], info["error"], info["at"]
                )
            )
        return out

    def _verify(self) -> VerifyReport:
        """Reads every entry of every column family with checksums verified, then every record the windows
        list, one by one, so a damaged block is reported with exactly the records it held. Never repairs.
        Only as thorough as the open behind it: `verify_store` opens the store so that it is."""
        entries: dict[str, int] = {}
        damaged: list[DamagedRange] = []
        for name in layout.COLUMN_FAMILIES:
            count, last = 0, None
            family = self._family(name)
            if family is None:
                continue
            try:
                for key, _ in _scan(family):
                    count, last = count + 1, key
            except Exception as exc:
                if not _is_corruption(exc):
                    raise
                found = _SST_FILE.search(str(exc))
                damaged.append(
                    DamagedRange(
                        name, None if last is None else repr(last), found and found.group(0), str(exc)
                    )
                )
            entries[name] = count
        unreadable: list[TrajectoryKey] = []
        missing: list[TrajectoryKey] = []
        corrupt: list[TrajectoryKey] = []
        prefixes = []
        with contextlib.suppress(StoreCorruptionError):  # already listed above; check what can be read
            prefixes.extend(self._keys(layout.CF_WINDOWS))
        for prefix in prefixes:
            try:
                window = self._window_entries(prefix)
            except StoreCorruptionError:
                continue  # its block is listed in `damaged`
            problem_id = layout.decode_problem_prefix(prefix)
            for epoch, sample in zip(window["epoch"].tolist(), window["sample"].tolist(), strict=True):
                key = (problem_id, int(epoch), int(sample))
                try:
                    raw = self._get(layout.CF_TRAJECTORIES, layout.trajectory_key(*key))
                except StoreCorruptionError:
                    unreadable.append(key)
                    continue
                if raw is None:
                    missing.append(key)
                    continue
                try:
                    decode_trajectory(raw)
                except CorruptRecordError:
                    corrupt.append(key)
        return VerifyReport(str(self.path), entries, damaged, unreadable, missing, corrupt)

    def content_digest(self) -> str:
        """Order-independent SHA-256 digest of all stored records (keys, tokens and log probabilities where a
        record has them; not sequence numbers).

        Two stores hold the same records exactly when their digests match: convergence tests compare them.
        """
        total = 0
        for record in self.iter_trajectories():
            h = hashlib.sha256(layout.trajectory_key(*record.key))
            h.update(len(record.prompt_ids).to_bytes(4, "little"))
            h.update(record.prompt_ids.tobytes())
            h.update(record.response_ids.tobytes())
            if record.response_logprobs is not None:
                h.update(record.response_logprobs.tobytes())
            total = (total + int.from_bytes(h.digest(), "big")) % (1 << 256)
        return f"{total:064x}"

    def stats(self) -> StoreStats:
        """Totals of the store, from the window entries (one read per problem)."""
        problems = trajectories = prompt_tokens = response_tokens = 0
        max_epoch = -1
        for prefix in self._keys(layout.CF_WINDOWS):
            entries = self._window_entries(prefix)
            problems += 1
            trajectories += len(entries)
            prompt_tokens += int(entries["prompt_len"].sum())
            response_tokens += int(entries["response_len"].sum())
            if len(entries):
                max_epoch = max(max_epoch, int(entries["epoch"].max()))
        return StoreStats(
            problems=problems,
            trajectories=trajectories,
            prompt_tokens=prompt_tokens,
            response_tokens=response_tokens,
            quarantined=sum(1 for _ in self._keys(layout.CF_QUARANTINE)),
            undelivered=len(self.undelivered()),
            pending=sum(1 for _ in self._keys(layout.CF_PENDING)),
            window_epochs=self.window_epochs,
            next_sequence=self.next_sequence,
            max_epoch=max_epoch,
            disk_bytes=_disk_bytes(self.path),
            offsets=self.offsets(),
        )

    def close(self) -> None:
        """Releases the folder. Idempotent; never raises (a RocksDB error on close is logged)."""
        if self._db is None:
            return
        db, self._db = self._db, None
        # rocksdict keeps the LOCK while column-family views or handles are alive: drop them first.
        self._cf = {}
        self._handles = {}
        try:
            db.close()
        except Exception as exc:
            # After a failed write RocksDB refuses to flush on close; every acknowledged batch is already in
            # the WAL, so the next open recovers it. Raising here would hide the original write error.
            log.warning("history store %s: close after an earlier error: %s", self.path, exc)

    def __enter__(self) -> _StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FolderLock:
    """An exclusive flock on a store folder itself, besides RocksDB's LOCK file: an operator may delete LOCK (and
    a second writer would then corrupt the store), but not the folder it lives in. It belongs to the folder (the
    inode), whichever path names it: through a symlink, with a trailing slash, or after an exchange.

    Raises StoreLockedError at once if another process or handle holds it, StoreOpenError if it cannot be taken.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StoreLockedError(
                    f"history store {self.path} is already open for writing by another process or handle "
                    "(it holds the folder's lock; a replica holds it through a rebuild too). Only one writer "
                    "per folder: stop it, or read with HistoryStore.open_secondary"
                ) from exc
            raise StoreOpenError(f"cannot lock history store {self.path}: {exc.strerror}") from exc
        self._fd = fd

    def holds(self, path: str | Path) -> bool:
        """Whether this is the lock of the folder `path` names now."""
        mine, theirs = os.fstat(self._fd), os.stat(path)
        return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)

    def release(self) -> None:
        """Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_RENAME_EXCHANGE = 2  # linux/fs.h


def exchange_folders(a: Path, b: Path) -> None:
    """Swaps two folders in one step (renameat2 RENAME_EXCHANGE): at every instant each path names a folder,
    so nobody can slip a new folder in between two renames. Raises OSError where the kernel or file system
    cannot exchange."""
    renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_cwd = -100  # AT_FDCWD
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"cannot exchange {a} and {b}: {os.strerror(code)}", str(a))


# Errors of a file system that cannot exchange two folders, or rename a folder at all: an overlay's lower layer
# (EXDEV), some network and FUSE file systems (EINVAL, ENOTSUP, ENOSYS).
_NO_EXCHANGE = frozenset({errno.EXDEV, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})
SWAP_JOURNAL = ".{name}.swap"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_journal(journal: Path, state: dict[str, str]) -> None:
    tmp = journal.with_name(journal.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, journal)
    _fsync_dir(journal.parent)


def _move_entries(source: Path, target: Path) -> None:
    """Renames every entry of `source` into `target` (entries, not the folder: a file in an overlay's lower layer
    is copied up and renamed, where the folder itself cannot be renamed)."""
    for entry in sorted(os.listdir(source)):
        os.replace(source / entry, target / entry)
    _fsync_dir(target)
    _fsync_dir(source)


def swap_in(fresh: Path, path: Path, kept: Path) -> bool:
    """Makes the store built in `fresh` the one at `path`, and keeps the old one at `kept` (which must not exist).

    Exchanges the two folders in one step where the file system can (`exchange_folders`); returns True (the
    folder now at `path` is the one that was `fresh`). Where it cannot (EXDEV on an overlay's lower layer, EINVAL
    and the like), moves the entries instead: the old store's into `kept`, then the fresh one's into `path`, under
    a journal `.<name>.swap` beside `path`, so that a crash at any point is finished by `finish_swap` at the next
    start; `fresh` is removed at the end. Returns False (the folder at `path` is the same folder as before).
    Raises OSError for other failures."""
    try:
        exchange_folders(fresh, path)
    except OSError as exc:
        if exc.errno not in _NO_EXCHANGE:
            raise
        log.warning(
            "%s: the file system cannot exchange folders (%s); moving the stores' files instead",
            path,
            exc.strerror,
        )
    else:
        os.replace(fresh, kept)  # the damaged folder, now under the fresh one's name
        return True
    journal = path.with_name(SWAP_JOURNAL.format(name=path.name))
    _write_journal(journal, {"fresh": str(fresh), "kept": str(kept), "phase": "out"})
    finish_swap(path)
    return False


def finish_swap(path: Path) -> bool:
    """Completes a swap `swap_in` began by moving entries (a crash interrupted it), from its journal; returns
    whether there was one. Idempotent: each phase moves whatever its source folder still holds."""
    journal = path.with_name(SWAP_JOURNAL.format(name=path.name))
    try:
        state = json.loads(journal.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False
    fresh, kept = Path(state["fresh"]), Path(state["kept"])
    if state["phase"] == "out":
        kept.mkdir(exist_ok=True)
        _move_entries(path, kept)
        _write_journal(journal, {**state, "phase": "in"})
    if fresh.exists():
        _move_entries(fresh, path)
        fresh.rmdir()
    _fsync_dir(path.parent)
    journal.unlink()
    _fsync_dir(path.parent)
    log.warning("%s: swapped in the rebuilt store by moving its files; the old one is at %s", path, kept)
    return True


class _ReadOnlyStore(_StoreReader):
    """A store opened as a read-only primary: it replays the WAL in memory and opens every table file of every
    column family (footer, index and filter read and checksummed) before it answers, so what it cannot open is
    an error, never an absent file. It takes no lock: it may open a store its writer holds."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._db = None
        if not (self.path / "CURRENT").exists():
            raise StoreOpenError(f"{self.path} is not a history store (no RocksDB CURRENT file)")
        db_opts, families = _options(create=False, path=self.path)
        db_opts.set_max_open_files(-1)  # every table file opened now, not at its first read
        db_opts.set_paranoid_checks(True)
        try:
            self._db = Rdict(
                str(self.path), db_opts, column_families=families, access_type=AccessType.read_only()
            )
        except Exception as exc:
            raise _open_error(self.path, exc) from exc
        self._bind_families(families)

    def __enter__(self) -> _ReadOnlyStore:
        return self


def verify_store(path: str | Path) -> VerifyReport:
    """Checks every file of the store at `path` (a running replica's too): opens it read-only as a primary,
    which opens every table file, then reads every entry of every column family with its checksum verified
    (`VerifyReport`), and replays the write-ahead log as a normal open would (`_replay_wal`). A store that does
    not open for damage is reported, not raised: its report names the file.
    Raises StoreOpenError if `path` is not a store or cannot be opened for another reason."""
    try:
        reader = _ReadOnlyStore(path)
    except StoreCorruptionError as exc:
        cause = str(exc.__cause__ or exc)
        found = _SST_FILE.search(cause)
        return VerifyReport(
            str(path), {}, [DamagedRange(None, None, found and found.group(0), cause)], [], [], []
        )
    with reader:
        report = reader._verify()
    if report.ok:
        wal = _replay_wal(Path(path))
        if wal is not None:
            report.damaged.append(wal)
    return report


# What a normal open needs besides the table files: copied, not linked (an open may rewrite or append to them).
_OPEN_FILES = re.compile(r"^(CURRENT|IDENTITY|MANIFEST-\d+|OPTIONS-\d+|rocksdict-config\.json|\d+\.log)$")
_TABLE_FILES = re.compile(r"^\d+\.(sst|blob)$")


def _replay_wal(path: Path, attempts: int = 3) -> DamagedRange | None:
    """Replays the store's write-ahead log as a normal (writer) open does, in a scratch copy beside it (table
    files hard-linked, the rest copied; the store itself is never touched, so a running replica's store can be
    checked). The read-only open `verify_store` makes first reads the WAL leniently: a log damaged in the middle
    passes it while a writer's open refuses the store. Returns the damage, naming the log file, or None.
    Raises StoreOpenError if the copy cannot be made (a table file deleted by a compaction at every attempt)."""
    logs = sorted(f for f in os.listdir(path) if f.endswith(".log") and (path / f).stat().st_size)
    if not logs:
        return None
    for attempt in range(attempts):
        scratch = path.with_name(f".{path.name}.verify-wal-{os.getpid()}")
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            scratch.mkdir()
            for name in os.listdir(path):
                if _TABLE_FILES.match(name):
                    os.link(path / name, scratch / name)
                elif _OPEN_FILES.match(name):
                    shutil.copyfile(path / name, scratch / name)
        except FileNotFoundError:
            shutil.rmtree(scratch, ignore_errors=True)
            if attempt + 1 == attempts:
                raise StoreOpenError(
                    f"{path}: files changed while its WAL was being checked; try again"
                ) from None
            continue
        except OSError as exc:
            shutil.rmtree(scratch, ignore_errors=True)
            raise StoreOpenError(f"{path}: cannot make a scratch copy to replay its WAL: {exc}") from exc
        try:
            db_opts, families = _options(create=True)
            # A torn last record is what a crash (or a copy of a live store's log) leaves, and every open
            # tolerates it; a damaged record before the end means acknowledged writes are unreadable.
            db_opts.set_wal_recovery_mode(DBRecoveryMode.tolerate_corrupted_tail_records())
            try:
                Rdict(str(scratch), db_opts, column_families=families).close()
            except Exception as exc:
                if not _is_corruption(exc):
                    raise StoreOpenError(f"{path}: replaying its WAL failed: {exc}") from exc
                named = re.search(r"\d+\.log", str(exc))
                return DamagedRange(
                    None, None, str(path / (named.group(0) if named else logs[-1])), f"write-ahead log {exc}"
                )
            return None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return None


class HistoryStore(_StoreReader):
    """The single writer of a history folder.

    Raises StoreLockedError at once if another writer holds the folder, StoreOpenError if the folder is not a
    history store of this layout version (or does not exist and `create` is False).
    `window_epochs` None keeps the stored window (DEFAULT_WINDOW_EPOCHS for a new store); another value
    changes it at open, and problems shrink to a smaller window at once. `lock`: the folder's lock, already
    held by the caller (who keeps it past `close`, e.g. a replica across a rebuild); by default the store
    takes the lock itself and releases it at `close`.
    """

    def __init__(
        self,
        path: str | Path,
        window_epochs: int | None = None,
        create: bool = True,
        *,
        sync: bool = False,
        sequence_retention: int = DEFAULT_SEQUENCE_RETENTION,
        lock: FolderLock | None = None,
    ) -> None:
        if window_epochs is not None and (
            isinstance(window_epochs, bool) or not isinstance(window_epochs, int) or window_epochs < 1
        ):
            raise InvalidInput(f"window_epochs must be an integer >= 1, got {window_epochs!r}")
        if sequence_retention < 1:
            raise InvalidInput(f"sequence_retention must be >= 1, got {sequence_retention}")
        self.path = Path(path)
        self._db = None
        self._hint_fd = -1
        self._own_lock: FolderLock | None = None
        if not create and not (self.path / "CURRENT").exists():
            raise StoreOpenError(
                f"{self.path} is not a history store (no RocksDB CURRENT file) and create=False"
            )
        if lock is None:
            self._own_lock = FolderLock(self.path)
        elif not lock.holds(self.path):
            raise InvalidInput(f"the lock given for {self.path} is the lock of another folder")
        db_opts, families = _options(create)
        try:
            self._db = Rdict(str(self.path), db_opts, column_families=families)
        except Exception as exc:
            self.close()
            raise _open_error(self.path, exc) from exc
        self._bind_families()
        # Sync only matters for power loss: offsets live in the same atomic batch, so a lost WAL tail rewinds
        # the offsets with the records and the consumer re-reads it from the bus.
        self._write_opts = WriteOptions()
        self._write_opts.sync = sync
        self._sequence_retention = sequence_retention
        try:
            self._init_meta(window_epochs)
        except BaseException:
            self.close()
            raise
        self._next_sequence = self.next_sequence
        self._trimmed_below = self._first_sequence()
        self._response_tokens = self.stats().response_tokens  # das_store_tokens, kept current by apply
        self._next_size_update = 0.0
        self._publish_size()
        self._hint_fd = os.open(self.path / layout.SEQUENCE_HINT_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        self._publish_hint()

    def _publish_size(self) -> None:
        """Sets das_store_tokens (every write) and das_store_size_bytes (at most every SIZE_INTERVAL_S)."""
        STORE_TOKENS.set(self._response_tokens)
        now = time.monotonic()
        if now >= self._next_size_update:
            self._next_size_update = now + SIZE_INTERVAL_S
            STORE_SIZE.set(_disk_bytes(self.path))

    def _publish_hint(self) -> None:
        try:
            os.pwrite(self._hint_fd, layout.encode_u64(self._next_sequence), 0)
        except OSError as exc:
            # Readers fall back to their periodic full catch-up; the write itself is already durable.
            log.warning("history store %s: sequence hint not updated: %s", self.path, exc)

    def close(self) -> None:
        """Releases the folder. Idempotent; never raises (a RocksDB error on close is logged)."""
        if self._hint_fd >= 0:
            os.close(self._hint_fd)
            self._hint_fd = -1
        super().close()
        if self._own_lock is not None:
            self._own_lock.release()  # after RocksDB let go of the folder
            self._own_lock = None

    @staticmethod
    def open_secondary(path: str | Path, secondary_dir: str | Path, max_idle_s: float = 5.0) -> HistoryReader:
        """A read-only view of a store another process writes; see HistoryReader."""
        return HistoryReader(path, secondary_dir, max_idle_s)

    @staticmethod
    def open_read_only(path: str | Path) -> _StoreReader:
        """The store as of now, every file opened and checked (see `verify_store`); takes no lock. Raises
        StoreCorruptionError if a file does not open, StoreOpenError if `path` is not a store."""
        return _ReadOnlyStore(path)

    def _init_meta(self, window_epochs: int | None) -> None:
        version = self._meta_int(layout.META_LAYOUT_VERSION)
        if version is None:
            window_epochs = window_epochs or DEFAULT_WINDOW_EPOCHS
            if next(self._keys(layout.CF_TRAJECTORIES), None) is not None:
                raise StoreOpenError(f"{self.path} holds records but no layout version: not a history store")
            batch = WriteBatch(raw_mode=True)
            handle = self._handles[layout.CF_META]
            batch.put(layout.META_LAYOUT_VERSION, str(layout.LAYOUT_VERSION).encode(), handle)
            batch.put(layout.META_WINDOW_EPOCHS, str(window_epochs).encode(), handle)
            batch.put(layout.META_NEXT_SEQUENCE, b"0", handle)
            self._write(batch, "initialising metadata")
            return
        if version != layout.LAYOUT_VERSION:
            raise StoreOpenError(
                f"{self.path} has layout version {version}; this build reads version {layout.LAYOUT_VERSION}"
            )
        if window_epochs is not None and self.window_epochs != window_epochs:
            log.info("history store %s: window %d -> %d epochs", self.path, self.window_epochs, window_epochs)
            self._change_window(window_epochs)

    def _first_sequence(self) -> int:
        first = next(self._keys(layout.CF_SEQUENCE), None)
        return self._next_sequence if first is None else layout.decode_u64(first)

    def _write(self, batch: WriteBatch, what: str) -> None:
        assert self._db is not None
        try:
            self._db.write(batch, self._write_opts)
        except Exception as exc:
            STORE_WRITE_ERRORS.inc()
            raise StoreWriteError(
                f"history store {self.path}: write failed while {what}; nothing of this batch was applied and "
                f"the stored offsets did not advance. Detail: {exc}"
            ) from exc

    def apply(
        self, records: Sequence[TrajectoryLike], offsets: Mapping[tuple[str, int], int] | None = None
    ) -> ApplyResult:
        """Stores records and bus offsets in one atomic WriteBatch.

        Idempotent per (problem_id, epoch, sample): a stored key counts as a duplicate and changes nothing.
        Adding a newer epoch evicts the problem's epochs below `newest - window_epochs + 1` (reported in
        `evicted`); a record already below its problem's window is not stored (reported in `stale`).
        `offsets` maps (topic, partition) to the next offset to read, stored in the same batch.
        Raises ValueError on a malformed record or offset (nothing written), StoreWriteError if RocksDB fails
        to write (nothing written, offsets unchanged).
        """
        started = time.perf_counter()
        window = self.window_epochs
        result = ApplyResult()
        batch = WriteBatch(raw_mode=True)
        h_traj, h_seq = self._handles[layout.CF_TRAJECTORIES], self._handles[layout.CF_SEQUENCE]
        windows: dict[bytes, _PendingWindow] = {}
        sequence = self._next_sequence
        ingested_bytes = added_tokens = 0
        for record in records:
            prefix = layout.problem_prefix(record.problem_id)
            layout.check_epoch_sample(record.epoch, record.sample)
            prompt = as_token_array(record.prompt_ids, "prompt_ids")
            response = as_token_array(record.response_ids, "response_ids")
            logprobs = record.response_logprobs
            if logprobs is not None:
                logprobs = as_logprob_array(logprobs, response.size)
            pending = windows.get(prefix)
            if pending is None:
                pending = windows[prefix] = _PendingWindow(self._window_entries(prefix))
            key = (record.problem_id, record.epoch, record.sample)
            if (record.epoch, record.sample) in pending.keys:
                result.duplicates += 1
                continue
            if record.epoch < pending.newest - window + 1:
                result.stale.append(key)
                continue
            raw_key = layout.record_key(prefix, record.epoch, record.sample)
            batch.put(raw_key, encode_trajectory(sequence, prompt, response, logprobs), h_traj)
            batch.put(layout.encode_u64(sequence), layout.OP_ADDED + raw_key, h_seq)
            sequence += 1
            pending.add(record.epoch, record.sample, prompt.size, response.size)
            added_tokens += response.size
            result.applied.append(key)
            ingested_bytes += 4 * (prompt.size + response.size) + (0 if logprobs is None else logprobs.nbytes)
            if record.epoch > pending.newest:
                pending.newest = record.epoch
                min_epoch = record.epoch - window + 1
                if min_epoch > 0 and pending.oldest < min_epoch:
                    for epoch, sample in pending.evict_below(min_epoch):
                        evicted_key = layout.record_key(prefix, epoch, sample)
                        batch.put(layout.encode_u64(sequence), layout.OP_REMOVED + evicted_key, h_seq)
                        sequence += 1
                        result.evicted.append((record.problem_id, epoch, sample))
                    # One range tombstone per eviction instead of one per record.
                    batch.delete_range(
                        layout.epoch_bound(prefix, 0), layout.epoch_bound(prefix, min_epoch), h_traj
                    )
        h_win = self._handles[layout.CF_WINDOWS]
        for prefix, pending in windows.items():
            if pending.changed:
                batch.put(prefix, encode_window(pending.entries()), h_win)
        h_off = self._handles[layout.CF_OFFSETS]
        for (topic, partition), offset in (offsets or {}).items():
            if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < 2**64:
                raise InvalidInput(
                    f"offset of {topic}/{partition} must be an integer in 0..2**64-1, got {offset!r}"
                )
            batch.put(layout.offset_key(topic, partition), layout.encode_u64(offset), h_off)
        trim_below = sequence - self._sequence_retention
        # Trim in steps of a tenth of the retention so the log gets one range tombstone now and then, not per batch.
        trim = trim_below - self._trimmed_below >= max(1, self._sequence_retention // 10)
        if trim:
            batch.delete_range(layout.encode_u64(0), layout.encode_u64(trim_below), h_seq)
        if sequence != self._next_sequence:
            batch.put(layout.META_NEXT_SEQUENCE, str(sequence).encode(), self._handles[layout.CF_META])
        if batch.is_empty():
            return result
        self._write(batch, f"applying {len(result.applied)} records")
        self._next_sequence = sequence
        self._publish_hint()
        self._response_tokens += added_tokens - sum(p.evicted_tokens for p in windows.values())
        self._publish_size()
        if trim:
            self._trimmed_below = trim_below
        RECORDS_INGESTED.inc(len(result.applied))
        BYTES_INGESTED.inc(ingested_bytes)
        EVICTIONS.inc(len(result.evicted))
        STORE_APPLY_DURATION.observe(time.perf_counter() - started)
        return result

    def apply_judged(
        self,
        records: Sequence[TrajectoryLike],
        offsets: Mapping[tuple[str, int], int] | None = None,
        *,
        advances: Mapping[str, int] | None = None,
        confirm_samples: int | None = None,
        before_write: Callable[[ApplyResult], None] | None = None,
    ) -> ApplyResult:
        """Stores records against their problems' reference epochs, which no record moves: only `advances`
        (authorised epoch advances: problem -> epoch) or, with `confirm_samples`, that many distinct samples of
        one newer epoch. Records, references and `offsets` go in one atomic WriteBatch.

        With R a problem's reference epoch and W the window: a record with R - W + 1 <= epoch <= R is stored and
        draftable; one below is stale (not stored); one above R is held in the pending family (kept, in no
        window, never drafted from) until R reaches its epoch. When R moves to R', epochs below R' - W + 1 leave
        the window (`evicted`), and pending records up to R' enter it (`promoted`; those below the window are
        dropped and reported in `evicted` too). The outcome depends only on which records and advances were
        applied, not on their order, so a replay of the compacted topic gives what the live store holds.
        A key already stored is a duplicate; one whose content differs is reported in `conflicts` (the stored
        copy stays). `before_write(result)` runs once the outcome is known and before anything is written (the
        replica sends its dead letters there); what it raises propagates and nothing is written.
        Raises ValueError on a malformed record, advance or offset (nothing written), StoreWriteError if RocksDB
        fails to write (nothing written).
        """
        if confirm_samples is not None and confirm_samples < 1:
            raise InvalidInput(f"confirm_samples must be >= 1, got {confirm_samples}")
        started = time.perf_counter()
        window = self.window_epochs
        result = ApplyResult()
        batch = WriteBatch(raw_mode=True)
        h_traj, h_seq = self._handles[layout.CF_TRAJECTORIES], self._handles[layout.CF_SEQUENCE]
        h_pend, h_meta = self._handles[layout.CF_PENDING], self._handles[layout.CF_META]
        problems: dict[str, _ProblemState] = {}
        sequence = self._next_sequence
        ingested_bytes = added_tokens = 0

        def state(problem_id: str) -> _ProblemState:
            found = problems.get(problem_id)
            if found is None:
                prefix = layout.problem_prefix(problem_id)
                found = problems[problem_id] = _ProblemState(
                    prefix,
                    _PendingWindow(self._window_entries(prefix)),
                    self._reference(prefix),
                    {(e, s): None for e, s in self._pending_keys(prefix)},
                )
            return found

        for problem_id, epoch in (advances or {}).items():
            layout.check_epoch_sample(epoch, 0)
            st = state(problem_id)
            st.advance = max(st.advance, epoch)
        for record in records:
            layout.check_epoch_sample(record.epoch, record.sample)
            prompt = as_token_array(record.prompt_ids, "prompt_ids")
            response = as_token_array(record.response_ids, "response_ids")
            logprobs = record.response_logprobs
            if logprobs is not None:
                logprobs = as_logprob_array(logprobs, response.size)
            st = state(record.problem_id)
            key = (record.problem_id, record.epoch, record.sample)
            es = (record.epoch, record.sample)
            raw_key = layout.record_key(st.prefix, record.epoch, record.sample)
            if es in st.window.keys or es in st.pending:
                result.duplicates += 1
                if self._differs(st, es, raw_key, prompt, response, logprobs):
                    result.conflicts.append(key)
                continue
            if st.reference >= 0 and record.epoch < st.reference - window + 1:
                result.stale.append(key)
                continue
            if record.epoch <= st.reference:
                batch.put(raw_key, encode_trajectory(sequence, prompt, response, logprobs), h_traj)
                batch.put(layout.encode_u64(sequence), layout.OP_ADDED + raw_key, h_seq)
                sequence += 1
                st.window.add(record.epoch, record.sample, prompt.size, response.size)
                st.added[es] = (prompt, response, logprobs)
                added_tokens += response.size
                result.applied.append(key)
            else:
                batch.put(raw_key, encode_trajectory(0, prompt, response, logprobs), h_pend)
                st.pending[es] = (prompt, response, logprobs)
                result.pending.append(key)
            ingested_bytes += 4 * (prompt.size + response.size) + (0 if logprobs is None else logprobs.nbytes)

        for problem_id, st in problems.items():
            newest = max(st.reference, st.advance)
            if confirm_samples is not None:
                counts = Counter(e for e, _ in st.pending)
                confirmed = [e for e, n in counts.items() if n >= confirm_samples]
                if confirmed:
                    newest = max(newest, max(confirmed))
            if newest <= st.reference:
                continue
            result.references[problem_id] = newest
            batch.put(layout.META_REFERENCE + st.prefix, layout.encode_u64(newest), h_meta)
            min_epoch = newest - window + 1
            if min_epoch > 0 and len(st.window.entries()) and st.window.oldest < min_epoch:
                for epoch, sample in st.window.evict_below(min_epoch):
                    evicted_key = layout.record_key(st.prefix, epoch, sample)
                    batch.put(layout.encode_u64(sequence), layout.OP_REMOVED + evicted_key, h_seq)
                    sequence += 1
                    result.evicted.append((problem_id, epoch, sample))
                batch.delete_range(
                    layout.epoch_bound(st.prefix, 0), layout.epoch_bound(st.prefix, min_epoch), h_traj
                )
            for epoch, sample in sorted(es for es in st.pending if es[0] <= newest):
                raw_key = layout.record_key(st.prefix, epoch, sample)
                arrays = st.pending.pop((epoch, sample)) or self._pending_arrays(raw_key)
                batch.delete(raw_key, h_pend)
                if epoch < min_epoch or arrays is None:  # retired while it waited (or unreadable: dropped)
                    result.evicted.append((problem_id, epoch, sample))
                    continue
                prompt, response, logprobs = arrays
                batch.put(raw_key, encode_trajectory(sequence, prompt, response, logprobs), h_traj)
                batch.put(layout.encode_u64(sequence), layout.OP_ADDED + raw_key, h_seq)
                sequence += 1
                st.window.add(epoch, sample, prompt.size, response.size)
                added_tokens += response.size
                result.applied.append((problem_id, epoch, sample))
                result.promoted.append((problem_id, epoch, sample))

        h_win = self._handles[layout.CF_WINDOWS]
        for st in problems.values():
            if st.window.changed:
                entries = st.window.entries()
                if len(entries):
                    batch.put(st.prefix, encode_window(entries), h_win)
                else:
                    batch.delete(st.prefix, h_win)
        self._put_offsets(batch, offsets)
        if sequence != self._next_sequence:
            batch.put(layout.META_NEXT_SEQUENCE, str(sequence).encode(), h_meta)
        if before_write is not None:
            before_write(result)
        if batch.is_empty():
            return result
        self._write(batch, f"applying {len(result.applied)} records ({len(result.pending)} held back)")
        self._next_sequence = sequence
        self._publish_hint()
        self._response_tokens += added_tokens - sum(st.window.evicted_tokens for st in problems.values())
        self._publish_size()
        RECORDS_INGESTED.inc(len(result.applied))
        BYTES_INGESTED.inc(ingested_bytes)
        EVICTIONS.inc(len(result.evicted))
        STORE_APPLY_DURATION.observe(time.perf_counter() - started)
        return result

    def _put_offsets(self, batch: WriteBatch, offsets: Mapping[tuple[str, int], int] | None) -> None:
        h_off = self._handles[layout.CF_OFFSETS]
        for (topic, partition), offset in (offsets or {}).items():
            if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < 2**64:
                raise InvalidInput(
                    f"offset of {topic}/{partition} must be an integer in 0..2**64-1, got {offset!r}"
                )
            batch.put(layout.offset_key(topic, partition), layout.encode_u64(offset), h_off)

    def _pending_arrays(self, raw_key: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
        raw = self._get(layout.CF_PENDING, raw_key)
        if raw is None:
            return None
        try:
            decoded = decode_trajectory(raw)
        except CorruptRecordError as error:
            QUARANTINED.labels(reason=error.code).inc()
            log.warning(
                "history store %s: dropping corrupt pending record %r: %s", self.path, raw_key, error.reason
            )
            return None
        return decoded.prompt_ids, decoded.response_ids, decoded.response_logprobs

    def _differs(
        self,
        st: _ProblemState,
        es: tuple[int, int],
        raw_key: bytes,
        prompt: np.ndarray,
        response: np.ndarray,
        logprobs: np.ndarray | None,
    ) -> bool:
        """Whether a duplicate's content differs from the copy stored (or held, or earlier in the batch)."""
        held = st.pending.get(es) or st.added.get(es)
        if held is None:
            family = layout.CF_TRAJECTORIES if es in st.window.keys else layout.CF_PENDING
            raw = self._get(family, raw_key)
            if raw is None:
                return False
            try:
                decoded = decode_trajectory(raw)
            except CorruptRecordError:
                return False  # quarantined when read; not this record's concern
            held = (decoded.prompt_ids, decoded.response_ids, decoded.response_logprobs)
        stored_prompt, stored_response, stored_logprobs = held
        if (stored_logprobs is None) != (logprobs is None):
            return True
        return not (
            np.array_equal(stored_prompt, prompt)
            and np.array_equal(stored_response, response)
            and (logprobs is None or np.array_equal(stored_logprobs, logprobs))
        )

    def set_aside(self, keys: Sequence[TrajectoryKey], reason: str, code: str) -> list[TrajectoryKey]:
        """Moves stored records out of their windows into the quarantine family (kept, with `reason`), in one
        batch; readers learn it from the sequence log as for a corrupt record. Returns the keys that were
        stored. Raises StoreWriteError if RocksDB fails to write (nothing moved)."""
        batch = WriteBatch(raw_mode=True)
        info = json.dumps({"reason": reason, "code": code, "detected_at": time.time()}).encode() + b"\n"
        windows: dict[bytes, _PendingWindow] = {}
        sequence = self._next_sequence
        moved = []
        for problem_id, epoch, sample in keys:
            key = layout.trajectory_key(problem_id, epoch, sample)
            raw = self._get(layout.CF_TRAJECTORIES, key)
            if raw is None:
                continue
            prefix = layout.problem_prefix(problem_id)
            pending = windows.get(prefix)
            if pending is None:
                pending = windows[prefix] = _PendingWindow(self._window_entries(prefix))
            pending.remove(epoch, sample)
            batch.put(key, info + raw, self._handles[layout.CF_QUARANTINE])
            batch.delete(key, self._handles[layout.CF_TRAJECTORIES])
            batch.put(
                layout.encode_u64(sequence), layout.OP_QUARANTINED + key, self._handles[layout.CF_SEQUENCE]
            )
            sequence += 1
            moved.append((problem_id, epoch, sample))
        if not moved:
            return moved
        for prefix, pending in windows.items():
            entries = pending.entries()
            if len(entries):
                batch.put(prefix, encode_window(entries), self._handles[layout.CF_WINDOWS])
            else:
                batch.delete(prefix, self._handles[layout.CF_WINDOWS])
        batch.put(layout.META_NEXT_SEQUENCE, str(sequence).encode(), self._handles[layout.CF_META])
        self._write(batch, f"setting aside {len(moved)} records ({code})")
        self._next_sequence = sequence
        self._publish_hint()
        self._response_tokens -= sum(p.evicted_tokens for p in windows.values())
        self._publish_size()
        QUARANTINED.labels(reason=code).inc(len(moved))
        return moved

    def keep_undelivered(self, messages: Sequence[UndeliveredMessage]) -> None:
        """Keeps the coordinates of rejected messages whose dead letter could not be written (read them back with
        `undelivered`, `das history stats`). Keyed by coordinates: keeping one twice changes nothing.
        Raises StoreWriteError if RocksDB fails to write."""
        batch = WriteBatch(raw_mode=True)
        handle = self._handles[layout.CF_META]
        for m in messages:
            key = (
                layout.META_UNDELIVERED
                + layout.offset_key(m.topic, m.partition)
                + layout.encode_u64(m.offset)
            )
            info = {"reason": m.reason, "error": m.error, "at": m.at or time.time()}
            batch.put(key, json.dumps(info).encode(), handle)
        if not batch.is_empty():
            self._write(batch, f"keeping {len(messages)} undelivered dead letters")

    def _change_window(self, window: int) -> None:
        """Stores the new window size and, in the same batch, evicts every problem's epochs outside it."""
        batch = WriteBatch(raw_mode=True)
        batch.put(layout.META_WINDOW_EPOCHS, str(window).encode(), self._handles[layout.CF_META])
        sequence = self.next_sequence
        for prefix in list(self._keys(layout.CF_WINDOWS)):
            pending = _PendingWindow(self._window_entries(prefix))
            min_epoch = pending.newest - window + 1
            if pending.oldest >= min_epoch:
                continue
            for epoch, sample in pending.evict_below(min_epoch):
                evicted_key = layout.record_key(prefix, epoch, sample)
                batch.put(
                    layout.encode_u64(sequence),
                    layout.OP_REMOVED + evicted_key,
                    self._handles[layout.CF_SEQUENCE],
                )
                sequence += 1
            batch.delete_range(
                layout.epoch_bound(prefix, 0),
                layout.epoch_bound(prefix, min_epoch),
                self._handles[layout.CF_TRAJECTORIES],
            )
            batch.put(prefix, encode_window(pending.entries()), self._handles[layout.CF_WINDOWS])
        batch.put(layout.META_NEXT_SEQUENCE, str(sequence).encode(), self._handles[layout.CF_META])
        self._write(batch, f"changing the window to {window} epochs")

    def _on_corrupt(self, key: bytes, raw: bytes, error: CorruptRecordError) -> None:
        """Moves a corrupt record to the quarantine family (with the reason) and out of its window.

        Never raises: a failed quarantine write is logged and the record is still skipped.
        """
        super()._on_corrupt(key, raw, error)
        problem_id, epoch, sample = layout.decode_trajectory_key(key)
        prefix = layout.problem_prefix(problem_id)
        info = {"reason": error.reason, "code": error.code, "detected_at": time.time()}
        batch = WriteBatch(raw_mode=True)
        batch.put(key, json.dumps(info).encode() + b"\n" + raw, self._handles[layout.CF_QUARANTINE])
        batch.delete(key, self._handles[layout.CF_TRAJECTORIES])
        pending = _PendingWindow(self._window_entries(prefix))
        if pending.remove(epoch, sample):
            batch.put(prefix, encode_window(pending.entries()), self._handles[layout.CF_WINDOWS])
        batch.put(
            layout.encode_u64(self._next_sequence),
            layout.OP_QUARANTINED + key,
            self._handles[layout.CF_SEQUENCE],
        )
        batch.put(
            layout.META_NEXT_SEQUENCE, str(self._next_sequence + 1).encode(), self._handles[layout.CF_META]
        )
        try:
            self._write(batch, f"quarantining {key!r}")
        except StoreWriteError:
            log.exception("history store %s: could not quarantine %r; skipping it", self.path, key)
            return
        self._next_sequence += 1
        self._publish_hint()
        self._response_tokens -= pending.evicted_tokens
        self._publish_size()

    def create_rocksdb_checkpoint(self, target: str | Path) -> None:
        """A consistent hard-link copy of every column family at `target` (which must not exist)."""
        from rocksdict import Checkpoint

        assert self._db is not None
        self._db.flush_wal(True)
        Checkpoint(self._db).create_checkpoint(str(target))

    def compact(self) -> None:
        """Full manual compaction of every column family: drops range tombstones and evicted data."""
        for name in layout.COLUMN_FAMILIES:
            family = self._family(name)
            if family is not None:
                family.compact_range(None, None)

    def __enter__(self) -> HistoryStore:
        return self


class _PendingWindow:
    """A problem's window while a batch is being built: the window entries plus a key set for duplicates."""

    __slots__ = ("_entries", "keys", "newest", "oldest", "changed", "_added", "evicted_tokens")

    def __init__(self, entries: np.ndarray) -> None:
        self._entries = entries
        self._added: list[tuple[int, int, int, int]] = []
        self.keys = {(int(e), int(s)) for e, s in zip(entries["epoch"], entries["sample"], strict=True)}
        self.newest = int(entries["epoch"].max()) if len(entries) else -1
        self.oldest = int(entries["epoch"].min()) if len(entries) else -1
        self.changed = False
        self.evicted_tokens = 0  # response tokens of the entries evicted or removed since construction

    def add(self, epoch: int, sample: int, prompt_len: int, response_len: int) -> None:
        self._added.append((epoch, sample, prompt_len, response_len))
        self.keys.add((epoch, sample))
        self.oldest = epoch if self.oldest < 0 else min(self.oldest, epoch)
        self.changed = True

    def entries(self) -> np.ndarray:
        if self._added:
            added = np.array(self._added, dtype=WINDOW_ENTRY)
            self._entries = np.sort(np.concatenate([self._entries, added]), order=["epoch", "sample"])
            self._added = []
        return self._entries

    def evict_below(self, min_epoch: int) -> list[tuple[int, int]]:
        """Drops entries with epoch < min_epoch; returns their (epoch, sample) keys in order."""
        entries = self.entries()
        old = entries["epoch"] < min_epoch
        gone = [(int(e), int(s)) for e, s in zip(entries["epoch"][old], entries["sample"][old], strict=True)]
        self.evicted_tokens += int(entries["response_len"][old].sum())
        self._entries = entries[~old]
        self.keys.difference_update(gone)
        self.oldest = int(self._entries["epoch"].min()) if len(self._entries) else -1
        self.changed = True
        return gone

    def remove(self, epoch: int, sample: int) -> bool:
        entries = self.entries()
        keep = ~((entries["epoch"] == epoch) & (entries["sample"] == sample))
        if keep.all():
            return False
        self.evicted_tokens += int(entries["response_len"][~keep].sum())
        self._entries = entries[keep]
        self.keys.discard((epoch, sample))
        self.changed = True
        return True


@dataclass(slots=True)
class _ProblemState:
    """One problem while `apply_judged` builds its batch: window, reference epoch, the highest advance in this
    batch, and its pending keys (values: arrays of records held in this batch, None for those stored before)."""

    prefix: bytes
    window: _PendingWindow
    reference: int
    pending: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray | None] | None]
    advance: int = -1
    # Records this batch put in the window, for telling a repeated key in the same batch apart from another copy.
    added: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray | None]] = field(
        default_factory=dict
    )


class HistoryReader(_StoreReader):
    """A RocksDB secondary instance of a store that another process writes.

    It sees the writer's state as of its last `catch_up` (and of opening). `catch_up` returns the changes
    since the previous call from the sequence log, so a proposer can extend and prune its trees incrementally.
    A RocksDB catch-up costs milliseconds (about one per column family here), so `catch_up` first reads the
    writer's sequence hint file and skips it when nothing was written; at least every `max_idle_s` it
    catches up regardless (offsets-only writes do not move the hint).
    Raises StoreOpenError if `path` is not a history store.
    """

    def __init__(self, path: str | Path, secondary_dir: str | Path, max_idle_s: float = 5.0) -> None:
        self.path = Path(path)
        self._db = None
        if not (self.path / "CURRENT").exists():
            raise StoreOpenError(f"{self.path} is not a history store (no RocksDB CURRENT file)")
        Path(secondary_dir).mkdir(parents=True, exist_ok=True)
        db_opts, families = _options(create=False, path=self.path)
        # A secondary instance must keep every file open: the primary may delete them after compactions.
        db_opts.set_max_open_files(-1)
        try:
            self._db = Rdict(
                str(self.path),
                db_opts,
                column_families=families,
                access_type=AccessType.secondary(str(secondary_dir)),
            )
        except Exception as exc:
            raise _open_error(self.path, exc) from exc
        self._bind_families(families)
        version = self._meta_int(layout.META_LAYOUT_VERSION)
        if version != layout.LAYOUT_VERSION:
            self.close()
            raise StoreOpenError(
                f"{self.path} has layout version {version}; this build reads version {layout.LAYOUT_VERSION}"
            )
        self._seen = self.next_sequence
        self._max_idle_s = max_idle_s
        self._last_catch_up = time.monotonic()
        self._behind_since: float | None = None  # since when the hint is ahead and catch-ups bring nothing

    def _hinted_sequence(self) -> int | None:
        try:
            with open(self.path / layout.SEQUENCE_HINT_FILE, "rb") as f:
                raw = f.read(8)
        except OSError:
            return None
        return layout.decode_u64(raw) if len(raw) == 8 else None

    @property
    def behind_writer(self) -> bool:
        """Whether the writer's hint says it wrote more than this reader has caught up on."""
        hint = self._hinted_sequence()
        return hint is not None and hint > self._seen

    def _check_stale(self, end: int, now: float) -> None:
        """Raises StoreStaleError once the writer's hint has stayed ahead of `end` for STALE_AFTER_S."""
        hint = self._hinted_sequence()
        if hint is None or hint <= end:
            self._behind_since = None
            return
        if self._behind_since is None:
            self._behind_since = now
        elif now - self._behind_since >= STALE_AFTER_S:
            raise StoreStaleError(
                f"{self.path}: this reader stays at sequence {end} while the writer is at {hint} (a RocksDB "
                "secondary does not follow a writer that reopened the store); reopen the reader"
            )

    def catch_up(self, force: bool = False) -> CatchUp:
        """Pulls the writer's latest state and returns what changed since the last call (or since opening).

        Cheap when the writer's hint says nothing was written (unless `force` or `max_idle_s` elapsed).
        Raises StoreStaleError when catch-ups have brought nothing for STALE_AFTER_S while the writer's hint is
        ahead: only a fresh instance sees the writer's changes then.
        """
        assert self._db is not None
        now = time.monotonic()
        if (
            not force
            and now - self._last_catch_up < self._max_idle_s
            and self._hinted_sequence() == self._seen
        ):
            return CatchUp([], reset=False)
        self._db.try_catch_up_with_primary()
        self._last_catch_up = now
        end = self.next_sequence
        if end == self._seen:
            self._check_stale(end, now)
            return CatchUp([], reset=False)
        self._behind_since = None
        first = next(self._keys(layout.CF_SEQUENCE), None)
        if first is None or layout.decode_u64(first) > self._seen:
            self._seen = end
            return CatchUp([], reset=True)
        changes = []
        for raw_seq, value in self._items(
            layout.CF_SEQUENCE, layout.encode_u64(self._seen), layout.encode_u64(end)
        ):
            op = layout.OP_NAMES[value[:1]]
            changes.append(Change(layout.decode_u64(raw_seq), op, layout.decode_trajectory_key(value[1:])))
        self._seen = end
        return CatchUp(changes, reset=False)

    def __enter__(self) -> HistoryReader:
        return self
