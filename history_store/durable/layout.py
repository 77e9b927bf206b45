"""The RocksDB layout of the history store: column families and key encodings.

Keys sort by problem, then epoch, then sample, so one problem's window is one range scan and all epochs
below a bound are one `delete_range`. A problem's key prefix is its UTF-8 id behind a 2-byte big-endian
length: ids that are prefixes of each other ("p1", "p10") still get disjoint ranges.
"""

from __future__ import annotations

import struct

from history_store.errors import InvalidInput

# Bumped whenever a key or value encoding changes; a store with another version refuses to open.
LAYOUT_VERSION = 1

CF_TRAJECTORIES = "trajectories"  # problem prefix + epoch + sample -> codec.encode_trajectory
CF_WINDOWS = "windows"  # problem prefix -> codec.encode_window (keys and lengths of the window)
CF_OFFSETS = "offsets"  # topic + NUL + partition -> next offset to read (u64)
CF_SEQUENCE = "sequence"  # u64 sequence number -> change (added or removed key), for secondary readers
CF_QUARANTINE = "quarantine"  # trajectory key -> reason and the raw bytes that failed their check
CF_META = "meta"  # layout version, window size, next sequence number
# Records held back because their epoch is beyond their problem's reference epoch (what the trainer, or enough
# samples, confirmed): same keys and values as trajectories, not in any window, never drafted from.
CF_PENDING = "pending"
COLUMN_FAMILIES = (CF_TRAJECTORIES, CF_WINDOWS, CF_OFFSETS, CF_SEQUENCE, CF_QUARANTINE, CF_META, CF_PENDING)
# Families a store written before they existed may lack: readers treat a missing one as empty, and the writer
# creates it at its next open.
OPTIONAL_FAMILIES = frozenset({CF_PENDING})

# A file beside RocksDB's own: the writer rewrites its 8 bytes (next sequence number) after every write, so a
# reader learns "nothing new" with one pread instead of a RocksDB catch-up (milliseconds per column family).
# Only a hint: the sequence column family and meta stay the truth.
SEQUENCE_HINT_FILE = "DAS_SEQUENCE_HINT"

META_LAYOUT_VERSION = b"layout_version"
META_WINDOW_EPOCHS = b"window_epochs"
META_NEXT_SEQUENCE = b"next_sequence"
# + offset_key + u64 offset -> JSON {reason, error, at}: a message the replica rejected whose dead letter the
# dead-letter topic refused for good; its coordinates are all that is left of it.
META_UNDELIVERED = b"undelivered\x00"
# + problem prefix -> u64: the problem's reference epoch, the newest epoch an authorised epoch advance (or, without
# those, enough distinct samples) confirmed. Eviction follows it and nothing else; written with the offsets.
META_REFERENCE = b"reference\x00"

MAX_EPOCH = 2**32 - 1
MAX_SAMPLE = 2**32 - 1
_MAX_PROBLEM_ID_BYTES = 2**16 - 1
_EPOCH_SAMPLE = struct.Struct(">II")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")

OP_ADDED = b"+"
OP_REMOVED = b"-"
OP_QUARANTINED = b"!"
OP_NAMES = {OP_ADDED: "added", OP_REMOVED: "removed", OP_QUARANTINED: "quarantined"}


def problem_prefix(problem_id: str) -> bytes:
    """Key prefix of all of a problem's records. Raises ValueError for an empty or too long id."""
    if not isinstance(problem_id, str) or not problem_id:
        raise InvalidInput(f"problem_id must be a non-empty string, got {problem_id!r}")
    raw = problem_id.encode("utf-8")
    if len(raw) > _MAX_PROBLEM_ID_BYTES:
        raise InvalidInput(f"problem_id is {len(raw)} bytes in UTF-8; at most {_MAX_PROBLEM_ID_BYTES}")
    return _U16.pack(len(raw)) + raw


def check_epoch_sample(epoch: int, sample: int) -> None:
    """Raises ValueError unless epoch and sample are integers in 0..2**32-1."""
    for name, value in (("epoch", epoch), ("sample", sample)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_EPOCH:
            raise InvalidInput(f"{name} must be an integer in 0..{MAX_EPOCH}, got {value!r}")


def trajectory_key(problem_id: str, epoch: int, sample: int) -> bytes:
    """Key of one record in the trajectories column family. Raises ValueError on bad parts."""
    check_epoch_sample(epoch, sample)
    return problem_prefix(problem_id) + _EPOCH_SAMPLE.pack(epoch, sample)


def record_key(prefix: bytes, epoch: int, sample: int) -> bytes:
    """Key of a record under an already encoded problem prefix (epoch and sample already checked)."""
    return prefix + _EPOCH_SAMPLE.pack(epoch, sample)


def epoch_bound(prefix: bytes, epoch: int) -> bytes:
    """The smallest key of `epoch` under a problem prefix (range scans and delete_range ends)."""
    return prefix + _EPOCH_SAMPLE.pack(epoch, 0)


def problem_end(prefix: bytes) -> bytes:
    """A key above every record of the problem with this prefix, and below every other problem's."""
    return prefix + b"\xff" * (_EPOCH_SAMPLE.size + 1)


def decode_trajectory_key(key: bytes) -> tuple[str, int, int]:
    """(problem_id, epoch, sample) of a trajectories key. Raises ValueError on a malformed key."""
    if len(key) < 2 + _EPOCH_SAMPLE.size:
        raise InvalidInput(f"trajectory key too short: {key!r}")
    (n,) = _U16.unpack_from(key, 0)
    if len(key) != 2 + n + _EPOCH_SAMPLE.size:
        raise InvalidInput(f"trajectory key length mismatch: {key!r}")
    epoch, sample = _EPOCH_SAMPLE.unpack_from(key, 2 + n)
    return key[2 : 2 + n].decode("utf-8"), epoch, sample


def decode_problem_prefix(key: bytes) -> str:
    """The problem id of a windows-family key (a bare problem prefix)."""
    (n,) = _U16.unpack_from(key, 0)
    if len(key) != 2 + n:
        raise InvalidInput(f"problem key length mismatch: {key!r}")
    return key[2:].decode("utf-8")


def offset_key(topic: str, partition: int) -> bytes:
    """Key of a bus offset. Raises ValueError for an empty topic, one with NUL, or a bad partition."""
    if not isinstance(topic, str) or not topic or "\x00" in topic:
        raise InvalidInput(f"topic must be a non-empty string without NUL, got {topic!r}")
    if isinstance(partition, bool) or not isinstance(partition, int) or not 0 <= partition < 2**32:
        raise InvalidInput(f"partition must be an integer in 0..2**32-1, got {partition!r}")
    return topic.encode("utf-8") + b"\x00" + _U32.pack(partition)


def decode_offset_key(key: bytes) -> tuple[str, int]:
    """(topic, partition) of an offsets key."""
    return key[:-5].decode("utf-8"), _U32.unpack(key[-4:])[0]


def encode_u64(value: int) -> bytes:
    return _U64.pack(value)


def decode_u64(raw: bytes) -> int:
    return _U64.unpack(raw)[0]
