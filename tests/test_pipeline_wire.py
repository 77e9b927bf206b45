"""The wire encoding: lossless, smaller than JSON, and every kind of malformed message rejected with its reason."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.schemas import MAX_TOKEN_ID, TrajectoryRecord
from pipeline.synthetic import SyntheticShape, synthetic_record
from pipeline.wire import (
    HEADER_BYTES,
    REASON_ENCODING,
    REASON_INVALID,
    REASON_KEY_MISMATCH,
    REASON_LOGPROBS,
    REASON_OVERSIZE,
    REASON_SCHEMA_VERSION,
    REASON_TRUNCATED,
    WireError,
    check_key,
    decode,
    decode_record,
    encode_record,
    measure_encoding,
    parse_record_key,
    partition_for,
    record_key,
)

tokens = st.lists(st.integers(0, MAX_TOKEN_ID), max_size=50) | st.lists(st.integers(0, 0xFFFF), max_size=50)


def _record(**overrides: object) -> TrajectoryRecord:
    fields: dict[str, object] = dict(
        problem_id="p", epoch=1, sample=2, prompt_ids=[1, 2, 3], response_ids=[70000, 5]
    )
    fields.update(overrides)
    return TrajectoryRecord(**fields)


@settings(max_examples=200, deadline=None)
@given(
    problem_id=st.text(min_size=1, max_size=40),
    epoch=st.integers(0, 2**32 - 1),
    sample=st.integers(0, 2**32 - 1),
    prompt=tokens,
    response=tokens,
    reason=st.sampled_from([None, "stop", "length", "abort"]),
    started=st.none() | st.floats(0, 2e9),
)
def test_decode_inverts_encode_for_any_valid_record(
    problem_id, epoch, sample, prompt, response, reason, started
):
    record = TrajectoryRecord(
        problem_id=problem_id,
        epoch=epoch,
        sample=sample,
        prompt_ids=prompt,
        response_ids=response,
        finish_reason=reason,
        started_at=started,
        policy_version=7,
        worker="w",
    )
    assert decode_record(encode_record(record)) == record
    assert parse_record_key(record_key(*record.key)) == record.key


def test_wire_is_at_most_half_of_json_for_realistic_vocabularies():
    shape_large = SyntheticShape(vocab=151_000)
    shape_small = SyntheticShape(vocab=49_152)
    large = [measure_encoding(synthetic_record(0, i, 100, shape_large)) for i in range(20)]
    small = [measure_encoding(synthetic_record(0, i, 100, shape_small)) for i in range(20)]
    assert sum(m.wire_bytes for m in large) * 1.5 < sum(m.json_bytes for m in large)
    # Vocabularies under 65,536 ids use 2 bytes a token.
    assert sum(m.wire_bytes for m in small) * 2.5 < sum(m.json_bytes for m in small)


def _header(version=1, flags=0, meta=b"{}", n_prompt=0, n_response=0):
    return struct.pack("<2sBBIII", b"DR", version, flags, len(meta), n_prompt, n_response) + meta


def _meta(**fields):
    base = {"problem_id": "p", "epoch": 0, "sample": 0}
    base.update(fields)
    return json.dumps(base).encode()


MALFORMED = {
    "random bytes": (b"\x00\x01garbage-bytes-not-a-record", REASON_ENCODING),
    "empty": (b"", REASON_ENCODING),
    "header cut short": (b"DR\x01\x00", REASON_TRUNCATED),
    "json instead of binary": (
        b'{"problem_id":"p","epoch":0,"sample":0,"prompt_ids":[],"response_ids":[]}',
        REASON_ENCODING,
    ),
    "unknown schema version": (_header(version=2, meta=_meta()), REASON_SCHEMA_VERSION),
    "unknown flags": (_header(flags=8, meta=_meta()), REASON_ENCODING),
    "truncated tokens": (_header(meta=_meta(), n_prompt=4) + b"\x00" * 10, REASON_TRUNCATED),
    "trailing bytes": (_header(meta=_meta()) + b"xx", REASON_TRUNCATED),
    "bad utf-8": (_header(meta=b"\xff\xfe{}"), REASON_ENCODING),
    "json array": (_header(meta=b"[1,2]"), REASON_ENCODING),
    "tokens in json": (_header(meta=_meta(prompt_ids=[1])), REASON_ENCODING),
    "string epoch": (_header(meta=_meta(epoch="1")), REASON_INVALID),
    "negative sample": (_header(meta=_meta(sample=-1)), REASON_INVALID),
    "missing problem id": (_header(meta=json.dumps({"epoch": 0, "sample": 0}).encode()), REASON_INVALID),
    "unknown finish reason": (_header(meta=_meta(finish_reason="boom")), REASON_INVALID),
    "negative token id": (_header(meta=_meta(), n_prompt=1) + struct.pack("<i", -1), REASON_INVALID),
    "huge token id": (_header(meta=_meta(), n_response=1) + struct.pack("<I", 2**31), REASON_INVALID),
    "oversize": (_header(meta=_meta(), n_response=5000) + b"\x00" * 20000, REASON_OVERSIZE),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_values_are_rejected_with_their_reason(case):
    value, reason = MALFORMED[case]
    with pytest.raises(WireError) as info:
        decode_record(value, max_tokens=4096)
    assert info.value.reason == reason, info.value.detail


def test_validation_detail_does_not_echo_token_arrays():
    value = _header(meta=_meta(), n_response=10_000) + struct.pack("<I", 2**31) * 10_000
    with pytest.raises(WireError) as info:
        decode_record(value)
    assert len(info.value.detail) < 1000


def test_key_must_match_the_records_identity():
    record = _record()
    check_key(record_key("p", 1, 2), record.key)
    for key in (None, b"p", record_key("p", 1, 3), record_key("q", 1, 2)):
        with pytest.raises(WireError) as info:
            check_key(key, record.key)
        assert info.value.reason == REASON_KEY_MISMATCH


def test_problem_ids_with_separators_survive_the_key():
    assert parse_record_key(record_key("a\x00b\x001", 4, 5)) == ("a\x00b\x001", 4, 5)
    with pytest.raises(WireError):
        parse_record_key(b"\xff\xfe")


def test_partition_of_a_bad_partition_count_is_refused():
    with pytest.raises(ValueError):
        partition_for("p", 0)


def test_header_size_is_fixed():
    assert len(encode_record(_record(prompt_ids=[], response_ids=[]))) == HEADER_BYTES + len(
        json.dumps({"problem_id": "p", "epoch": 1, "sample": 2}, separators=(",", ":"))
    )


logprob = st.floats(max_value=0.0, width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(response=st.lists(st.integers(0, MAX_TOKEN_ID), max_size=50), data=st.data())
def test_response_logprobs_survive_the_wire_bit_for_bit(response, data):
    values = data.draw(st.lists(logprob, min_size=len(response), max_size=len(response)))
    record = _record(response_ids=response, response_logprobs=values)
    decoded = decode(encode_record(record))
    assert decoded.response_logprobs.dtype == np.float32
    assert decode_record(encode_record(record)) == record


def test_a_record_without_logprobs_keeps_the_bytes_it_had_before_the_field():
    # The format as it was: header, JSON of the scalar fields, u16 prompt, u32 response (70000 > 0xFFFF).
    meta = b'{"problem_id":"p","epoch":1,"sample":2}'
    before = (
        struct.pack("<2sBBIII", b"DR", 1, 1, len(meta), 3, 2)
        + meta
        + np.array([1, 2, 3], "<u2").tobytes()
        + np.array([70000, 5], "<u4").tobytes()
    )
    assert encode_record(_record()) == before
    assert decode(before).response_logprobs is None and decode_record(before) == _record()


@pytest.mark.parametrize(
    ("values", "detail"),
    [
        ([-0.5], "1 response log probabilities for 2 response tokens"),
        ([-0.5, -0.1, -0.2], "3 response log probabilities for 2 response tokens"),
        ([-0.5, 0.25], "0.25 at token 1"),
        ([float("nan"), -1.0], "nan at token 0"),
        ([-1.0, float("-inf")], "-inf at token 1"),
        ([float("inf"), -1.0], "inf at token 0"),
    ],
)
def test_logprobs_not_finite_not_negative_or_not_one_per_token_are_rejected(values, detail):
    with pytest.raises(WireError) as caught:
        decode(encode_record(_record(response_logprobs=values)))
    assert caught.value.reason == REASON_LOGPROBS and detail in caught.value.detail


def test_logprobs_in_the_json_part_are_misplaced():
    meta = b'{"problem_id":"p","epoch":1,"sample":2,"response_logprobs":[-1.0]}'
    value = struct.pack("<2sBBIII", b"DR", 1, 3, len(meta), 0, 1) + meta + b"\x05\x00"
    with pytest.raises(WireError) as caught:
        decode(value)
    assert caught.value.reason == REASON_ENCODING and "response_logprobs" in caught.value.detail
