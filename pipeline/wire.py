"""Wire encoding of trajectory records on the bus, and the record keys that partition and compact the topic.

A value is a 16-byte header, a small JSON object of the scalar fields, then the prompt and response token ids
as little-endian unsigned integers, 2 bytes a token when every id of the array fits (vocabularies up to 65,536,
e.g. SmolLM2's 49,152) and 4 bytes otherwise. JSON arrays take 6 to 8 bytes a token for today's 150k-token
vocabularies and cost several times more to parse; here decoding is one `np.frombuffer` per array. Decoding
validates the scalar fields through `TrajectoryRecord.model_validate` and the token arrays against the model's
token bound (vectorized), so the bus accepts exactly what the model accepts.

Header (little-endian): magic b"DR", schema version (u8), flags (u8: bit 0 prompt is u16, bit 1 response is
u16, bit 2 response log probabilities follow), JSON length (u32), prompt length (u32), response length (u32), in
tokens. The log probabilities, when present, are little-endian float32 after the token ids, as many as the bytes
left hold (the engines compute them in float32, so nothing is lost); decoding dead-letters a record whose count
differs from its response length, or whose values are not finite or above 0 (`REASON_LOGPROBS`). A record
without them has bit 2 clear and is byte for byte what it was before the field existed.

Record key: problem id, NUL, epoch, NUL, sample. Compaction works per key, so the key must be the record's
identity (a key of just the problem id would compact a problem's history down to its last record); the
partition is chosen from the problem id alone (see `partition_for`), so a problem stays in one partition, in
order.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import numpy as np
from kafka.partitioner.default import murmur2
from pydantic import ValidationError

from pipeline.errors import InvalidInput
from pipeline.schemas import MAX_EPOCH, MAX_TOKEN_ID, SCHEMA_VERSION, TrajectoryRecord

MAGIC = b"DR"
_HEAD = struct.Struct("<2sBBIII")
HEADER_BYTES = _HEAD.size
_PROMPT_U16 = 1
_RESPONSE_U16 = 2
_LOGPROBS = 4
_TOKEN_FIELDS = ("prompt_ids", "response_ids")
# Fields in the binary part of a value, not in its JSON object.
_BINARY_FIELDS = frozenset((*_TOKEN_FIELDS, "response_logprobs", "schema_version"))
# A record above this many tokens is refused before its arrays are read: 1M tokens is far past any context
# length in use, and it bounds the memory one malformed message can make a replica allocate.
DEFAULT_MAX_RECORD_TOKENS = 1 << 20

# Fixed reason codes of a rejected message (dead-letter headers and the metric label use exactly these).
REASON_ENCODING = "encoding"  # not our format: bad magic, bad UTF-8 or JSON, fields in the wrong place
REASON_TRUNCATED = "truncated"  # shorter or longer than its header says
REASON_SCHEMA_VERSION = "schema_version"  # a version this build does not read
REASON_INVALID = "invalid"  # decoded, but the model rejects it (types, token id range, required fields)
REASON_OVERSIZE = "oversize"  # more tokens than the replica accepts, or a batch decompressing past its bound
REASON_KEY_MISMATCH = "key_mismatch"  # the message key is not the record's identity
REASON_STALE = "stale"  # its epoch is already below its problem's window (a late or reordered record)
REASON_SAMPLE_RANGE = "sample_range"  # a sample id beyond the replica's limit
REASON_EPOCH_RANGE = "epoch_range"  # an epoch beyond any training run's (the empty replica's guard)
REASON_LOGPROBS = "logprobs"  # response log probabilities not one per token, not finite, or above 0
REASON_PARTITION = (
    "partition"  # in another partition than its problem's (compaction and order are per partition)
)
REASON_DUPLICATE = (
    "duplicate"  # a key already stored, with other content (the stored copy stays, and is resent)
)
REASON_CONTROL = "control"  # a message on the control topic that is not an epoch advance (pipeline.epochs)
# An absolute ceiling on epochs, far above any RL run's epoch count (passes over the problem set): a record
# beyond it is refused outright instead of being held until the trainer gets there.
DEFAULT_MAX_EPOCH = 100_000
# Sample ids need only be unique within a problem and epoch (synthetic load numbers them worker * 10**6 + i),
# so by default the key's u32 range is the limit; a deployment that knows its RL n can set a tighter one.
DEFAULT_MAX_SAMPLE = MAX_EPOCH
# Without epoch advances, a problem's window moves to a newer epoch only once this many distinct samples of
# that epoch arrived: no single record (nor two) moves it.
DEFAULT_CONFIRM_SAMPLES = 3
REASONS = (
    REASON_ENCODING,
    REASON_TRUNCATED,
    REASON_SCHEMA_VERSION,
    REASON_INVALID,
    REASON_OVERSIZE,
    REASON_KEY_MISMATCH,
    REASON_STALE,
    REASON_SAMPLE_RANGE,
    REASON_EPOCH_RANGE,
    REASON_LOGPROBS,
    REASON_PARTITION,
    REASON_DUPLICATE,
    REASON_CONTROL,
)


class WireError(InvalidInput):
    """A message that is not a valid trajectory record. `reason` is one of REASONS, `detail` says what."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _tokens(ids: list[int]) -> tuple[bytes, bool]:
    if not ids:
        return b"", True
    arr = np.asarray(ids, dtype="<u4")
    if int(arr.max()) <= 0xFFFF:
        return arr.astype("<u2").tobytes(), True
    return arr.tobytes(), False


def encode_record(record: TrajectoryRecord) -> bytes:
    """The wire value of a (validated) record. Log probabilities are written as they are (float32), even when
    they break the rule `decode` checks: the replica, not the producer, decides what to dead-letter."""
    meta = record.model_dump(exclude=_BINARY_FIELDS, exclude_none=True)
    meta_raw = json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode()
    prompt, prompt_u16 = _tokens(record.prompt_ids)
    response, response_u16 = _tokens(record.response_ids)
    flags = (_PROMPT_U16 if prompt_u16 else 0) | (_RESPONSE_U16 if response_u16 else 0)
    logprobs = b""
    if record.response_logprobs is not None:
        flags |= _LOGPROBS
        logprobs = np.asarray(record.response_logprobs, dtype="<f4").tobytes()
    head = _HEAD.pack(
        MAGIC, record.schema_version, flags, len(meta_raw), len(record.prompt_ids), len(record.response_ids)
    )
    return b"".join((head, meta_raw, prompt, response, logprobs))


def check_logprobs(logprobs: np.ndarray, response_tokens: int) -> None:
    """Raises WireError(logprobs) unless `logprobs` holds one finite value <= 0 per response token."""
    if logprobs.size != response_tokens:
        raise WireError(
            REASON_LOGPROBS,
            f"{logprobs.size} response log probabilities for {response_tokens} response tokens",
        )
    bad = ~np.isfinite(logprobs) | (logprobs > 0)
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        raise WireError(
            REASON_LOGPROBS,
            f"response log probability {float(logprobs[at])!r} at token {at}: each must be finite and <= 0",
        )


@dataclass(frozen=True, slots=True)
class DecodedRecord:
    """A validated record as the replica handles it: token ids stay numpy arrays (views of the message), so
    the store and the trees take them without a round trip through Python lists.

    `meta` is the record model validated with every scalar field and empty token lists; the token arrays
    passed the model's TokenId bound (0..MAX_TOKEN_ID) vectorized, and `response_logprobs` (float32, or None
    when the record has none) passed `check_logprobs`.
    """

    meta: TrajectoryRecord
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_logprobs: np.ndarray | None = None

    @property
    def problem_id(self) -> str:
        return self.meta.problem_id

    @property
    def epoch(self) -> int:
        return self.meta.epoch

    @property
    def sample(self) -> int:
        return self.meta.sample

    @property
    def key(self) -> tuple[str, int, int]:
        return self.meta.key

    def to_record(self) -> TrajectoryRecord:
        """The full record model, token ids as lists."""
        logprobs = None if self.response_logprobs is None else self.response_logprobs.tolist()
        return self.meta.model_copy(
            update={
                "prompt_ids": self.prompt_ids.tolist(),
                "response_ids": self.response_ids.tolist(),
                "response_logprobs": logprobs,
            }
        )


def decode(value: bytes | None, max_tokens: int = DEFAULT_MAX_RECORD_TOKENS) -> DecodedRecord:
    """Decodes and validates one wire value, keeping token ids as arrays.

    Raises WireError with the reason code (encoding, truncated, schema_version, oversize, invalid, logprobs).
    """
    if value is None:
        raise WireError(REASON_ENCODING, "empty value where a trajectory record was expected")
    if value[: len(MAGIC)] != MAGIC[: len(value)] or not value:
        raise WireError(
            REASON_ENCODING, f"starts {value[:8]!r}, not magic {MAGIC!r}: not a DAS trajectory record"
        )
    if len(value) < HEADER_BYTES:
        raise WireError(REASON_TRUNCATED, f"{len(value)} bytes, shorter than the {HEADER_BYTES}-byte header")
    _magic, version, flags, meta_len, n_prompt, n_response = _HEAD.unpack_from(value)
    if version != SCHEMA_VERSION:
        raise WireError(
            REASON_SCHEMA_VERSION, f"schema version {version}; this build reads version {SCHEMA_VERSION}"
        )
    if flags & ~(_PROMPT_U16 | _RESPONSE_U16 | _LOGPROBS):
        raise WireError(REASON_ENCODING, f"unknown flag bits {flags:#04x}")
    if n_prompt + n_response > max_tokens:
        raise WireError(
            REASON_OVERSIZE, f"{n_prompt} prompt + {n_response} response tokens, more than {max_tokens}"
        )
    prompt_width = 2 if flags & _PROMPT_U16 else 4
    response_width = 2 if flags & _RESPONSE_U16 else 4
    tokens_end = HEADER_BYTES + meta_len + n_prompt * prompt_width + n_response * response_width
    # The log probabilities' count is what the bytes after the tokens hold; check_logprobs compares it.
    logprob_bytes = len(value) - tokens_end if flags & _LOGPROBS else 0
    if logprob_bytes < 0 or logprob_bytes % 4 or (len(value) != tokens_end and not flags & _LOGPROBS):
        raise WireError(REASON_TRUNCATED, f"{len(value)} bytes where the header announces {tokens_end}")
    try:
        meta = json.loads(value[HEADER_BYTES : HEADER_BYTES + meta_len].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(REASON_ENCODING, f"scalar fields are not UTF-8 JSON: {exc}") from exc
    if not isinstance(meta, dict):
        raise WireError(REASON_ENCODING, f"scalar fields must be a JSON object, got {type(meta).__name__}")
    misplaced = sorted(name for name in _BINARY_FIELDS if name in meta)
    if misplaced:
        raise WireError(REASON_ENCODING, f"{misplaced} belong in the binary part, not the JSON object")
    start = HEADER_BYTES + meta_len
    middle = start + n_prompt * prompt_width
    prompt = np.frombuffer(value, f"<u{prompt_width}", n_prompt, start)
    response = np.frombuffer(value, f"<u{response_width}", n_response, middle)
    # Unsigned arrays are >= 0 by construction; only 4-byte ids can exceed the model's bound. Checking the
    # arrays here instead of validating a Python int per token makes decoding about three times faster.
    for name, arr in (("prompt_ids", prompt), ("response_ids", response)):
        if arr.itemsize == 4 and arr.size and int(arr.max()) > MAX_TOKEN_ID:
            bad = int(arr[arr > MAX_TOKEN_ID][0])
            raise WireError(REASON_INVALID, f"{name}: token id {bad} outside 0..{MAX_TOKEN_ID}")
    logprobs = None
    if flags & _LOGPROBS:
        logprobs = np.frombuffer(value, "<f4", logprob_bytes // 4, tokens_end)
        check_logprobs(logprobs, n_response)
    meta["prompt_ids"] = meta["response_ids"] = []
    meta["schema_version"] = version
    try:
        return DecodedRecord(TrajectoryRecord.model_validate(meta), prompt, response, logprobs)
    except ValidationError as exc:
        raise WireError(REASON_INVALID, _summarize(exc)) from exc


def decode_record(value: bytes | None, max_tokens: int = DEFAULT_MAX_RECORD_TOKENS) -> TrajectoryRecord:
    """Decodes and validates one wire value into the record model.

    Raises WireError with the reason code (encoding, truncated, schema_version, oversize, invalid, logprobs).
    """
    return decode(value, max_tokens).to_record()


def _summarize(exc: ValidationError, limit: int = 3) -> str:
    """The first few validation errors, without echoing token arrays back (they can be megabytes)."""
    parts = []
    for err in exc.errors()[:limit]:
        where = ".".join(str(p) for p in err["loc"])
        value = repr(err.get("input"))
        parts.append(f"{where}: {err['msg']} (got {value[:60]})")
    more = exc.error_count() - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def record_key(problem_id: str, epoch: int, sample: int) -> bytes:
    """The message key of a record: its identity, so compaction keeps each record and tombstones delete one."""
    return f"{problem_id}\x00{epoch}\x00{sample}".encode()


def parse_record_key(key: bytes) -> tuple[str, int, int]:
    """(problem_id, epoch, sample) from a message key. Raises WireError(key_mismatch) on a malformed key."""
    try:
        problem_id, epoch, sample = key.decode("utf-8").rsplit("\x00", 2)
        return problem_id, int(epoch), int(sample)
    except (AttributeError, UnicodeDecodeError, ValueError) as exc:
        raise WireError(
            REASON_KEY_MISMATCH, f"message key {key!r:.80} is not problem\\0epoch\\0sample"
        ) from exc


def check_key(key: bytes | None, identity: tuple[str, int, int]) -> None:
    """Raises WireError(key_mismatch) unless `key` is the key of the record `identity` (problem, epoch,
    sample): a mismatch means a partition or compaction mix-up upstream."""
    if key != record_key(*identity):
        raise WireError(
            REASON_KEY_MISMATCH, f"message key {key!r:.80} does not match record {identity!r:.120}"
        )


def partition_for(problem_id: str, partitions: int) -> int:
    """The partition of a problem: Kafka's default partitioner applied to the problem id, so a Java or Kafka
    Streams client keyed by problem id agrees, and all of a problem's records stay in order in one partition."""
    if partitions < 1:
        raise InvalidInput(f"a topic has at least one partition, got {partitions}")
    return (murmur2(problem_id.encode()) & 0x7FFFFFFF) % partitions


@dataclass(frozen=True, slots=True)
class EncodingSize:
    """Bytes of one record on the wire against the same record as a JSON object with token arrays."""

    wire_bytes: int
    json_bytes: int


def measure_encoding(record: TrajectoryRecord) -> EncodingSize:
    """Wire and JSON sizes of a record (the benchmark reports both)."""
    as_json = json.dumps(record.model_dump(exclude_none=True), separators=(",", ":")).encode()
    return EncodingSize(len(encode_record(record)), len(as_json))
