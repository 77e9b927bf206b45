"""Binary values of the history store: token arrays and window entries behind a checked header.

A trajectory value is a 24-byte header (magic, format, flags, sequence number, prompt and response lengths,
CRC-32) followed by the prompt and response token ids as little-endian int32: 4 bytes a token before RocksDB's
block compression, against 6 to 8 for JSON, and decodable with one `np.frombuffer`. Flag bit 0 says the response
tokens' sampling log probabilities follow, one little-endian float32 per response token (what the engines compute
and the bus carries: the stored values are the sampled ones, bit for bit); a record without them keeps flags 0 and
the exact bytes of stores written before the field existed. The CRC covers the header, the tokens and the log
probabilities, so a flipped bit anywhere is found on read and the record is quarantined instead of drafted from.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from history_store.errors import CorruptRecordError, InvalidInput

MAX_TOKEN_ID = 2**31 - 1

_TRAJ_MAGIC = b"DT"
_TRAJ_FORMAT = 1
# magic, format, flags, sequence, prompt length, response length; the CRC-32 follows.
_TRAJ_HEAD = struct.Struct("<2sBBQII")
_TRAJ_LOGPROBS = 1  # flag bit: response log probabilities (float32) follow the token ids
_CRC = struct.Struct("<I")
TRAJ_HEADER_BYTES = _TRAJ_HEAD.size + _CRC.size

_WIN_MAGIC = b"DW"
_WIN_FORMAT = 1
_WIN_HEAD = struct.Struct("<2sBBI")  # magic, format, flags, entry count; the CRC-32 follows
# One entry per stored record of the window: the lengths let statistics and counts come without token reads.
WINDOW_ENTRY = np.dtype([("epoch", "<u4"), ("sample", "<u4"), ("prompt_len", "<u4"), ("response_len", "<u4")])


def as_token_array(tokens: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    """Token ids as a contiguous little-endian int32 array.

    Raises ValueError if the ids are not a flat sequence of integers in 0..2**31-1.
    """
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{what} must be a sequence of integer token ids: {exc}") from exc
    if arr.ndim != 1:
        raise InvalidInput(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<i4")
    if arr.dtype.kind not in "iu":
        raise InvalidInput(f"{what} must hold integer token ids, got dtype {arr.dtype}")
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high > MAX_TOKEN_ID:
        raise InvalidInput(f"{what} token ids must be in 0..{MAX_TOKEN_ID}, got range {low}..{high}")
    return np.ascontiguousarray(arr, dtype="<i4")


def as_logprob_array(logprobs: Sequence[float] | np.ndarray, response_tokens: int) -> np.ndarray:
    """Response log probabilities as a contiguous little-endian float32 array.

    Raises ValueError unless they are a flat sequence of one finite value <= 0 per response token.
    """
    try:
        arr = np.ascontiguousarray(logprobs, dtype="<f4")
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"response_logprobs must be a sequence of floats: {exc}") from exc
    if arr.ndim != 1 or arr.size != response_tokens:
        raise InvalidInput(
            f"response_logprobs has shape {arr.shape}; one value per response token ({response_tokens}) is needed"
        )
    if not (np.isfinite(arr) & (arr <= 0)).all():
        raise InvalidInput("response_logprobs must all be finite and <= 0 (log probabilities)")
    return arr


def encode_trajectory(
    sequence: int, prompt: np.ndarray, response: np.ndarray, logprobs: np.ndarray | None = None
) -> bytes:
    """The stored value of one record; `prompt` and `response` come from `as_token_array`, `logprobs` (None:
    the record has none) from `as_logprob_array`."""
    flags = 0 if logprobs is None else _TRAJ_LOGPROBS
    head = _TRAJ_HEAD.pack(_TRAJ_MAGIC, _TRAJ_FORMAT, flags, sequence, prompt.size, response.size)
    body = prompt.tobytes() + response.tobytes() + (b"" if logprobs is None else logprobs.tobytes())
    crc = zlib.crc32(body, zlib.crc32(head))
    return head + _CRC.pack(crc) + body


@dataclass(frozen=True, slots=True)
class DecodedTrajectory:
    sequence: int
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_logprobs: np.ndarray | None


def decode_trajectory(raw: bytes) -> DecodedTrajectory:
    """Parses and checks a stored record. Raises CorruptRecordError with the reason on any mismatch."""
    if len(raw) < TRAJ_HEADER_BYTES:
        raise CorruptRecordError(
            f"value of {len(raw)} bytes is shorter than the {TRAJ_HEADER_BYTES}-byte header", "size"
        )
    magic, fmt, flags, sequence, n_prompt, n_response = _TRAJ_HEAD.unpack_from(raw, 0)
    if magic != _TRAJ_MAGIC:
        raise CorruptRecordError(f"bad magic {magic!r}", "header")
    if fmt != _TRAJ_FORMAT:
        raise CorruptRecordError(f"unknown record format {fmt}", "header")
    if flags & ~_TRAJ_LOGPROBS:
        raise CorruptRecordError(f"unknown flag bits {flags:#04x}", "header")
    n_logprobs = n_response if flags & _TRAJ_LOGPROBS else 0
    expected = TRAJ_HEADER_BYTES + 4 * (n_prompt + n_response + n_logprobs)
    if len(raw) != expected:
        raise CorruptRecordError(f"value is {len(raw)} bytes; its header says {expected}", "size")
    (stored_crc,) = _CRC.unpack_from(raw, _TRAJ_HEAD.size)
    body = memoryview(raw)[TRAJ_HEADER_BYTES:]
    crc = zlib.crc32(body, zlib.crc32(memoryview(raw)[: _TRAJ_HEAD.size]))
    if crc != stored_crc:
        raise CorruptRecordError(
            f"checksum mismatch: stored {stored_crc:#010x}, computed {crc:#010x}", "checksum"
        )
    tokens = np.frombuffer(raw, dtype="<i4", count=n_prompt + n_response, offset=TRAJ_HEADER_BYTES)
    logprobs = None
    if flags & _TRAJ_LOGPROBS:
        logprobs = np.frombuffer(raw, dtype="<f4", offset=TRAJ_HEADER_BYTES + 4 * (n_prompt + n_response))
    return DecodedTrajectory(sequence, tokens[:n_prompt], tokens[n_prompt:], logprobs)


def encode_window(entries: np.ndarray) -> bytes:
    """The stored value of a problem's window (a WINDOW_ENTRY array sorted by epoch, sample)."""
    body = np.ascontiguousarray(entries, dtype=WINDOW_ENTRY).tobytes()
    head = _WIN_HEAD.pack(_WIN_MAGIC, _WIN_FORMAT, 0, len(entries))
    return head + _CRC.pack(zlib.crc32(body, zlib.crc32(head))) + body


def decode_window(raw: bytes) -> np.ndarray:
    """Parses a window value into a writable WINDOW_ENTRY array. Raises CorruptRecordError on mismatch."""
    size = _WIN_HEAD.size + _CRC.size
    if len(raw) < size:
        raise CorruptRecordError(f"window value of {len(raw)} bytes is shorter than its header", "size")
    magic, fmt, _flags, count = _WIN_HEAD.unpack_from(raw, 0)
    if magic != _WIN_MAGIC or fmt != _WIN_FORMAT:
        raise CorruptRecordError(f"bad window header {magic!r} format {fmt}", "header")
    if len(raw) != size + count * WINDOW_ENTRY.itemsize:
        raise CorruptRecordError(f"window value is {len(raw)} bytes for {count} entries", "size")
    (stored_crc,) = _CRC.unpack_from(raw, _WIN_HEAD.size)
    body = memoryview(raw)[size:]
    if zlib.crc32(body, zlib.crc32(memoryview(raw)[: _WIN_HEAD.size])) != stored_crc:
        raise CorruptRecordError("window checksum mismatch", "checksum")
    return np.frombuffer(raw, dtype=WINDOW_ENTRY, offset=size).copy()
