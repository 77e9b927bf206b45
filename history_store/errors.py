"""Errors raised by the durable history store. All derive from `StoreError` so callers can catch one type."""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every history store error."""


class InvalidInput(ValueError):
    """A value handed to the history store or its trees is invalid: a record's fields, a key, a setting. `das`
    prints it as one line (a plain ValueError is a bug and keeps its traceback)."""


class StoreLockedError(StoreError):
    """Another process (or another open store in this process) holds the folder's write lock."""


class StoreCorruptionError(StoreError):
    """RocksDB found a block or file that fails its checksum: part of the store cannot be read.

    `das history verify` lists what is unreadable; the replica rebuilds the store from the topic.
    """


class StoreWriteError(StoreError):
    """A write to RocksDB failed (full or read-only disk, I/O error); nothing of the failed batch was applied."""


class StoreStaleError(StoreError):
    """A secondary instance stopped seeing the writer's changes: the writer's sequence hint stayed ahead of what
    the instance reads, catch-up after catch-up (a RocksDB secondary does not follow a primary that closed and
    reopened, and may miss the last write before a close). Only a fresh instance sees them: reopen it."""


class StoreOpenError(StoreError):
    """The folder is not a history store, has an unknown layout version, or cannot be opened."""


class CorruptRecordError(StoreError):
    """A stored value failed its checksum or header check.

    `reason` is the human-readable detail; `code` a short fixed word (metric label): checksum, header, size.
    """

    def __init__(self, reason: str, code: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code
