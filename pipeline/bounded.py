"""Decompression with a bound: a compressed record batch may not grow past `max_bytes` in a replica's memory.

kafka-python 3.0.12 decompresses a fetched record batch whole (`DefaultRecordBatch._maybe_uncompress`) and copies
the result into a bytearray, with no limit: 1 GiB of zeros is about 4.4 MB of lz4 on the wire, within every
compressed-size limit of the broker and the fetch, and took a replica to a 3.4 GB peak. Neither Kafka nor
kafka-python has a setting for this, so `install` replaces that one method: it decompresses incrementally into
one bytearray and stops at `max_bytes + 1`. A batch over the bound is replaced by a single marker record (no
key, empty value, header `OVER_BOUND_HEADER` saying what was refused) at the batch's last offset, so the consumer
moves past the whole batch and the replica dead-letters the marker with its reason (`oversize`).

The bound is per batch, which bounds every record in it; the replica's source bounds the sum over one poll
(`KafkaTrajectorySource`), so memory stays bounded per record and per fetch.
"""

from __future__ import annotations

import gzip
import io
import threading

from kafka.record import default_records
from kafka.record.util import encode_varint

from pipeline.errors import InvalidInput

OVER_BOUND_HEADER = "das-over-bound"

_lock = threading.Lock()
_installed: int | None = None


class OverBoundError(InvalidInput):
    """A compressed batch whose content is larger than the bound."""


def _lz4(data: memoryview, limit: int) -> bytearray:
    import lz4.frame

    out = bytearray()
    decompressor = lz4.frame.LZ4FrameDecompressor()
    chunk = bytes(data)
    while not decompressor.eof:
        piece = decompressor.decompress(chunk, max_length=min(1 << 20, limit + 1 - len(out)))
        chunk = b""
        out += piece
        if len(out) > limit:
            raise OverBoundError(f"lz4 content is larger than {limit} bytes")
        if not piece and decompressor.needs_input:
            raise ValueError("truncated lz4 frame")
    return out


def _zstd(data: memoryview, limit: int) -> bytearray:
    import zstandard

    out = bytearray()
    with zstandard.ZstdDecompressor().stream_reader(
        io.BytesIO(bytes(data)), read_across_frames=True
    ) as reader:
        while True:
            piece = reader.read(min(1 << 20, limit + 1 - len(out)))
            if not piece:
                return out
            out += piece
            if len(out) > limit:
                raise OverBoundError(f"zstd content is larger than {limit} bytes")


def _gzip(data: memoryview, limit: int) -> bytearray:
    out = bytearray()
    with gzip.GzipFile(fileobj=io.BytesIO(bytes(data)), mode="rb") as reader:
        while True:
            piece = reader.read(min(1 << 20, limit + 1 - len(out)))
            if not piece:
                return out
            out += piece
            if len(out) > limit:
                raise OverBoundError(f"gzip content is larger than {limit} bytes")


def _marker(offset_delta: int, detail: str) -> bytearray:
    """One v2 record: attributes 0, timestamp delta 0, `offset_delta`, no key, an empty value, one header."""
    body = bytearray([0])  # attributes
    encode_varint(0, body.append)  # timestamp delta
    encode_varint(offset_delta, body.append)
    encode_varint(-1, body.append)  # key: null
    encode_varint(0, body.append)  # value: empty (not null: a null value is a tombstone)
    encode_varint(1, body.append)  # one header
    name = OVER_BOUND_HEADER.encode()
    encode_varint(len(name), body.append)
    body += name
    value = detail.encode()[:1000]
    encode_varint(len(value), body.append)
    body += value
    record = bytearray()
    encode_varint(len(body), record.append)
    return record + body


def install(max_bytes: int) -> None:
    """Bounds every compressed record batch this process's Kafka consumers decompress to `max_bytes` (the
    largest bound asked for wins: it is process-wide). Snappy batches are refused outright (the bus never
    sends them)."""
    global _installed
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    with _lock:
        if _installed is not None:
            _installed = max(_installed, max_bytes)
            return
        _installed = max_bytes
        batch = default_records.DefaultRecordBatch
        decoders = {batch.CODEC_LZ4: _lz4, batch.CODEC_ZSTD: _zstd, batch.CODEC_GZIP: _gzip}

        def _maybe_uncompress(self: default_records.DefaultRecordBatch) -> None:
            if self._decompressed:
                return
            codec = self.compression_type
            if codec != self.CODEC_NONE:
                self._assert_has_codec(codec)
                data = memoryview(self._buffer)[self._pos :]
                limit = _installed or max_bytes
                try:
                    decoder = decoders.get(codec)
                    if decoder is None:
                        raise OverBoundError(f"compression codec {codec} is not accepted")
                    self._buffer = decoder(data, limit)
                except OverBoundError as exc:
                    detail = (
                        f"record batch at offsets {self.base_offset}..{self.last_offset} ({self.records_count} "
                        f"records, {len(data)} compressed bytes): {exc}; the whole batch is refused"
                    )
                    self._buffer = _marker(self.last_offset_delta, detail)
                    self._num_records = 1
                self._pos = 0
            self._decompressed = True

        batch._maybe_uncompress = _maybe_uncompress


def installed_bound() -> int | None:
    return _installed
