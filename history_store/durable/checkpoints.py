"""Checkpoints and backups of the history store, and restore into a fresh data folder.

A checkpoint is a folder `ckpt-<unix ms>-<next sequence>` under a checkpoint root, holding `db/` (the RocksDB
checkpoint: hard links, consistent across column families) and `manifest.json`. It is built under a temporary
name and renamed when complete, so a crash mid-checkpoint leaves no folder that looks finished; leftovers are
removed by the next checkpoint. Hard links share the store's files, and so any damage to them: a checkpoint
protects against a bad write or a lost folder, not against a bad disk.

A backup (`backup-<unix ms>-<next sequence>`) is a checkpoint read in full with every checksum verified, then
copied file by file (real copies, fsynced, ideally onto another disk) with each file's SHA-256 in its
manifest. Restore checks every file against its SHA-256 before using it, and reads the restored store in full
before reporting it good.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from history_store.durable import layout
from history_store.durable.store import HistoryStore, verify_store
from history_store.errors import InvalidInput, StoreCorruptionError, StoreError, StoreOpenError
from monitoring.metrics import CHECKPOINT_DURATION, LAST_CHECKPOINT

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_PREFIX = "ckpt-"
_TMP_PREFIX = ".tmp-ckpt-"
_BACKUP_PREFIX = "backup-"
_BACKUP_TMP_PREFIX = ".tmp-backup-"
_COPY_CHUNK = 1 << 20
# Files RocksDB never rewrites once written: safe to share by hard link between a checkpoint and a live store.
# Everything else (MANIFEST, CURRENT, OPTIONS, WAL) is appended to or replaced by the live store: copied.
_IMMUTABLE_SUFFIXES = (".sst", ".blob")


class CheckpointError(StoreError):
    """A checkpoint is missing, incomplete, or does not match its manifest; or restore has nowhere to go."""


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A finished checkpoint: its folder, manifest contents and how long it took to write."""

    path: Path
    manifest: dict[str, Any]
    seconds: float


@dataclass(frozen=True, slots=True)
class RestoreInfo:
    data_dir: Path
    manifest: dict[str, Any]
    seconds: float


def list_checkpoints(root: str | Path, prefix: str = _PREFIX) -> list[Path]:
    """Finished checkpoints (or backups, with prefix "backup-") under `root`, oldest first (empty if `root`
    does not exist)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(prefix) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name[len(prefix) :])


def read_manifest(checkpoint: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder. Raises CheckpointError if it is missing or unreadable."""
    path = Path(checkpoint) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{checkpoint} is not a finished checkpoint ({MANIFEST} unreadable: {exc})"
        ) from exc
    if manifest.get("layout_version") != layout.LAYOUT_VERSION:
        raise CheckpointError(
            f"{checkpoint} has layout version {manifest.get('layout_version')}; this build reads "
            f"{layout.LAYOUT_VERSION}"
        )
    return manifest


def create_checkpoint(store: HistoryStore, root: str | Path, keep: int = 3) -> CheckpointInfo:
    """Writes a checkpoint of `store` under `root` and deletes all but the newest `keep`.

    Raises ValueError if keep < 1, CheckpointError (or StoreError) if RocksDB cannot write the checkpoint.
    """
    if keep < 1:
        raise InvalidInput(f"keep must be >= 1, got {keep}")
    started = time.perf_counter()
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for leftover in root.glob(f"{_TMP_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    stats = store.stats()
    created_at = time.time()
    name = f"{_PREFIX}{int(created_at * 1000):013d}-{stats.next_sequence:012d}"
    tmp = root / f"{_TMP_PREFIX}{name[len(_PREFIX) :]}"
    try:
        tmp.mkdir()
        store.create_rocksdb_checkpoint(tmp / "db")
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"RocksDB checkpoint of {store.path} into {tmp} failed: {exc}") from exc
    manifest = {
        "layout_version": layout.LAYOUT_VERSION,
        "created_at": created_at,
        "source": str(store.path),
        **{k: v for k, v in stats.to_json().items() if k != "disk_bytes"},
        "checkpoint_bytes": sum(f.stat().st_size for f in (tmp / "db").iterdir() if f.is_file()),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    final = root / name
    os.replace(tmp, final)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    seconds = time.perf_counter() - started
    CHECKPOINT_DURATION.observe(seconds)
    LAST_CHECKPOINT.set(created_at)
    return CheckpointInfo(final, manifest, seconds)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder itself, or the newest finished one when `path` is a checkpoint root.

    Raises CheckpointError if there is none.
    """
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    found = sorted(
        list_checkpoints(path) + list_checkpoints(path, _BACKUP_PREFIX), key=lambda p: p.name.split("-", 1)[1]
    )
    if not found:
        raise CheckpointError(
            f"{path} is neither a checkpoint or backup nor a folder of finished checkpoints or backups"
        )
    return found[-1]


def _link_or_copy(src: Path, dst: Path) -> None:
    if src.suffix in _IMMUTABLE_SUFFIXES:
        try:
            os.link(src, dst)
            return
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
    shutil.copy2(src, dst)


def restore_checkpoint(checkpoint: str | Path, data_dir: str | Path) -> RestoreInfo:
    """Makes `data_dir` a copy of a checkpoint (a checkpoint folder, or a root: its newest), then opens it
    and checks it against the manifest.

    `data_dir` must not exist or be empty: restore never overwrites a store. Raises CheckpointError if the
    checkpoint is missing, incomplete or inconsistent with its manifest, or `data_dir` is not empty.
    """
    started = time.perf_counter()
    source = resolve_checkpoint(checkpoint)
    manifest = read_manifest(source)
    data_dir = Path(data_dir)
    if data_dir.exists() and (not data_dir.is_dir() or any(data_dir.iterdir())):
        raise CheckpointError(
            f"{data_dir} exists and is not an empty folder; restore never overwrites a store"
        )
    # Everything happens in a sibling folder, renamed to `data_dir` only once the copy verifies: a failed
    # restore leaves nothing behind (and a replica never opens a half-restored store).
    tmp = data_dir.with_name(f".{data_dir.name}.restoring")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        files = manifest.get("files")
        if files is None:
            for item in (source / "db").iterdir():
                _link_or_copy(item, tmp / item.name)
        else:
            _copy_verified(source / "db", tmp, files)
        _check_restored(tmp, source, manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if data_dir.exists():
        data_dir.rmdir()
    os.replace(tmp, data_dir)
    return RestoreInfo(data_dir, manifest, time.perf_counter() - started)


def _check_restored(folder: Path, source: Path, manifest: dict[str, Any]) -> None:
    """Raises CheckpointError unless the store in `folder` verifies (every file, every checksum) and holds what
    the manifest of `source` says."""
    try:
        report = verify_store(folder)
        if report.ok:
            with HistoryStore.open_read_only(folder) as reader:
                stats = reader.stats()
    except StoreOpenError as exc:
        raise CheckpointError(f"the copy of {source} does not open: {exc}") from exc
    if not report.ok:
        raise CheckpointError(
            f"{source} is damaged (files {', '.join(report.files) or 'none named'}, "
            f"{len(report.unreadable_records)} unreadable records): restore an older checkpoint or a backup"
        )
    expected = (manifest["trajectories"], manifest["next_sequence"], manifest["offsets"])
    restored = (stats.trajectories, stats.next_sequence, stats.to_json()["offsets"])
    if restored != expected:
        raise CheckpointError(
            f"the copy of {source} does not match its manifest: (trajectories, next sequence, offsets) "
            f"{restored} != {expected}"
        )


def create_backup(source: HistoryStore | str | Path, root: str | Path, keep: int = 3) -> CheckpointInfo:
    """Backs up a store (an open writer: a fresh checkpoint of it) or an existing checkpoint (a folder or a
    root: its newest) into `root` as verified real copies; keeps the newest `keep` backups there.

    Raises StoreCorruptionError if the source is damaged (nothing is backed up), CheckpointError or OSError
    if the copy fails (no partial backup is left looking finished).
    """
    if keep < 1:
        raise InvalidInput(f"keep must be >= 1, got {keep}")
    started = time.perf_counter()
    scratch: Path | None = None
    if isinstance(source, HistoryStore):
        # The checkpoint must be on the store's file system (hard links); it is removed once copied.
        scratch = source.path.parent / f".{source.path.name}.backup-checkpoints"
        checkpoint = create_checkpoint(source, scratch, keep=1).path
    else:
        checkpoint = resolve_checkpoint(source)
    try:
        manifest = read_manifest(checkpoint)
        report = verify_store(checkpoint / "db")  # the store's own files, when hard links of a live store
        if not report.ok:
            raise StoreCorruptionError(
                f"{checkpoint} is damaged (files {', '.join(report.files) or 'none named'}, "
                f"{len(report.unreadable_records)} unreadable records): not backed up"
            )
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob(f"{_BACKUP_TMP_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)
        name = _BACKUP_PREFIX + checkpoint.name.split("-", 1)[1]
        tmp = root / f"{_BACKUP_TMP_PREFIX}{name[len(_BACKUP_PREFIX) :]}"
        (tmp / "db").mkdir(parents=True)
        try:
            files = {
                item.name: _copy_with_digest(item, tmp / "db" / item.name)
                for item in sorted((checkpoint / "db").iterdir())
                if item.is_file()
            }
            manifest = {**manifest, "files": files, "backup_of": str(checkpoint)}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            _fsync_dir(tmp / "db")
            final = root / name
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in list_checkpoints(root, _BACKUP_PREFIX)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return CheckpointInfo(final, manifest, time.perf_counter() - started)


def _copy_with_digest(src: Path, dst: Path) -> dict[str, Any]:
    """Copies one file (fsynced) and returns its size and SHA-256, computed from the bytes read."""
    digest = hashlib.sha256()
    size = 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(_COPY_CHUNK):
            digest.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return {"bytes": size, "sha256": digest.hexdigest()}


def _copy_verified(src_dir: Path, dst_dir: Path, files: dict[str, dict[str, Any]]) -> None:
    """Copies a backup's files, each checked against the SHA-256 and size in its manifest.

    Raises CheckpointError naming the first file that is missing or differs.
    """
    present = {p.name for p in src_dir.iterdir() if p.is_file()}
    missing = sorted(set(files) - present)
    if missing:
        raise CheckpointError(f"backup {src_dir.parent} lacks files its manifest lists: {', '.join(missing)}")
    for name, expected in sorted(files.items()):
        got = _copy_with_digest(src_dir / name, dst_dir / name)
        if got != expected:
            raise CheckpointError(
                f"backup file {src_dir / name} fails its checksum (manifest: {expected['bytes']} bytes, sha256 "
                f"{expected['sha256'][:16]}...; read: {got['bytes']} bytes, sha256 {got['sha256'][:16]}...): "
                "the backup is damaged; restore another one"
            )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    """Automatic checkpoints for a running store: the service calls `maybe_checkpoint()` after each apply.

    A checkpoint is due when `every_seconds` passed since the last one, or (with `at_epoch_boundary`) when
    the newest epoch in the store grew: the first record of a new epoch means the previous one is complete.
    """

    def __init__(
        self,
        store: HistoryStore,
        root: str | Path,
        every_seconds: float = 600.0,
        keep: int = 3,
        at_epoch_boundary: bool = True,
    ) -> None:
        if every_seconds <= 0:
            raise InvalidInput(f"every_seconds must be > 0, got {every_seconds}")
        if keep < 1:
            raise InvalidInput(f"keep must be >= 1, got {keep}")
        self.store = store
        self.root = Path(root)
        self.every_seconds = every_seconds
        self.keep = keep
        self.at_epoch_boundary = at_epoch_boundary
        existing = list_checkpoints(self.root)
        self._last_time = time.monotonic()
        self._last_epoch = read_manifest(existing[-1])["max_epoch"] if existing else -1
        self._max_epoch = store.stats().max_epoch  # newest epoch applied so far (-1: empty store)

    def after_apply(self, applied: Sequence[tuple[str, int, int]]) -> CheckpointInfo | None:
        """What a running service calls after each apply with the keys it applied: checkpoints if one is
        due. A failure is logged, not raised: a checkpoint copies a consistent store, so failing one loses
        nothing and ingest goes on (the last-checkpoint age metric and its alert report it)."""
        if applied:
            self._max_epoch = max(self._max_epoch, max(epoch for _, epoch, _ in applied))
        try:
            return self.maybe_checkpoint(self._max_epoch)
        except (StoreError, OSError):
            log.exception(
                "automatic checkpoint of %s into %s failed; ingest goes on", self.store.path, self.root
            )
            return None

    def maybe_checkpoint(self, max_epoch: int | None = None) -> CheckpointInfo | None:
        """Checkpoints if one is due; returns it, or None. `max_epoch` is the newest epoch applied so far
        (the service knows it from its records; without it, epoch boundaries are not detected).

        Raises CheckpointError if a due checkpoint fails (the service decides whether to go on).
        """
        now = time.monotonic()
        due = now - self._last_time >= self.every_seconds
        if self.at_epoch_boundary and max_epoch is not None and max_epoch > self._last_epoch:
            due = due or self._last_epoch >= 0
            if self._last_epoch < 0:
                self._last_epoch = max_epoch  # the first epoch seen is a start, not a boundary
        if not due:
            return None
        info = create_checkpoint(self.store, self.root, self.keep)
        self._last_time = now
        if max_epoch is not None:
            self._last_epoch = max(self._last_epoch, max_epoch)
        return info
