"""The history store's apply contract on real RocksDB: one atomic batch, idempotent keys, window eviction
reported for tombstones, offsets stored with the records, length statistics, and the secondary reader."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from _store_workload import Workload
from rocksdict import Options, Rdict

from history_store.durable import layout
from history_store.durable.codec import as_logprob_array, as_token_array, decode_trajectory, encode_trajectory
from history_store.durable.store import HistoryStore
from history_store.errors import CorruptRecordError, StoreOpenError
from pipeline.schemas import TrajectoryRecord

WORKLOAD = Workload(problems=3, epochs=4, samples=3)


def _record(problem: str, epoch: int, sample: int, response: list[int]) -> TrajectoryRecord:
    return TrajectoryRecord(
        problem_id=problem, epoch=epoch, sample=sample, prompt_ids=[5, 6], response_ids=response
    )


def test_applying_the_same_records_twice_changes_nothing(tmp_path: Path) -> None:
    with HistoryStore(tmp_path / "h") as store:
        stream = WORKLOAD.stream()[:9]
        first = store.apply(stream, {("t", 0): 9})
        digest, sequence = store.content_digest(), store.next_sequence
        again = store.apply(stream + stream[:2], {("t", 0): 9})
        assert len(first.applied) == 9 and first.duplicates == 0
        assert again.applied == [] and again.duplicates == 11
        assert (store.content_digest(), store.next_sequence) == (digest, sequence)


def test_a_key_repeated_inside_one_batch_is_applied_once(tmp_path: Path) -> None:
    with HistoryStore(tmp_path / "h") as store:
        result = store.apply([_record("p", 0, 0, [1, 2]), _record("p", 0, 0, [9, 9, 9])])
        assert result.applied == [("p", 0, 0)] and result.duplicates == 1
        assert store.get("p", 0, 0).response_ids.tolist() == [1, 2]


def test_new_epoch_evicts_epochs_outside_the_window_and_reports_their_keys(tmp_path: Path) -> None:
    with HistoryStore(tmp_path / "h", window_epochs=2) as store:
        store.apply([_record("p", e, s, [e, s]) for e in range(2) for s in range(2)])
        result = store.apply([_record("p", 2, 0, [7]), _record("q", 0, 0, [8])])
        assert result.evicted == [("p", 0, 0), ("p", 0, 1)]
        assert store.get("p", 0, 0) is None and store.get("p", 1, 1) is not None
        assert [t.key for t in store.iter_trajectories("p")] == [("p", 1, 0), ("p", 1, 1), ("p", 2, 0)]
        # A late record of an evicted epoch is not stored again (it would be evicted at once).
        late = store.apply([_record("p", 0, 5, [1])])
        assert late.applied == [] and late.stale == [("p", 0, 5)]


def test_offsets_are_stored_with_the_batch_and_readable_after_reopen(tmp_path: Path) -> None:
    with HistoryStore(tmp_path / "h") as store:
        store.apply([_record("p", 0, 0, [1])], {("topic", 0): 1, ("topic", 3): 17})
        store.apply([], {("topic", 0): 2})
    with HistoryStore(tmp_path / "h") as store:
        assert store.offsets() == {("topic", 0): 2, ("topic", 3): 17}


def test_invalid_record_in_a_batch_raises_and_writes_nothing(tmp_path: Path) -> None:
    class Bad:
        problem_id, epoch, sample, prompt_ids, response_ids = "p", 0, 1, [1], [-3]

    with HistoryStore(tmp_path / "h") as store:
        with pytest.raises(ValueError, match="response_ids token ids must be in"):
            store.apply([_record("p", 0, 0, [1]), Bad()], {("t", 0): 2})
        with pytest.raises(ValueError, match="offset"):
            store.apply([_record("p", 0, 0, [1])], {("t", 0): -1})
        assert store.stats().trajectories == 0 and store.offsets() == {}


def test_length_stats_follow_the_window(tmp_path: Path) -> None:
    with HistoryStore(tmp_path / "h", window_epochs=2) as store:
        assert store.length_stats("p") is None
        store.apply([_record("p", 0, s, list(range(n))) for s, n in enumerate([10, 20, 30, 40])])
        stats = store.length_stats("p")
        assert (stats.count, stats.mean, stats.p50, stats.p90, stats.max) == (4, 25.0, 20, 40, 40)
        store.apply([_record("p", 2, 0, list(range(100)))])
        stats = store.length_stats("p")
        assert (stats.count, stats.max, stats.min_epoch, stats.max_epoch) == (1, 100, 2, 2)


def test_tokens_are_stored_as_int32_with_a_checked_header_not_json(tmp_path: Path) -> None:
    response = list(range(1000, 3000))
    with HistoryStore(tmp_path / "h") as store:
        store.apply([_record("p", 0, 0, response)])
    families = {name: Options(raw_mode=True) for name in layout.COLUMN_FAMILIES}
    db = Rdict(str(tmp_path / "h"), Options(raw_mode=True), column_families=families)
    raw = db.get_column_family(layout.CF_TRAJECTORIES)[layout.trajectory_key("p", 0, 0)]
    db.close()
    assert len(raw) == 24 + 4 * (2 + len(response))
    assert decode_trajectory(raw).response_ids.tolist() == response


def test_content_digest_ignores_arrival_order(tmp_path: Path) -> None:
    stream = WORKLOAD.stream()
    with (
        HistoryStore(tmp_path / "a", window_epochs=4) as a,
        HistoryStore(tmp_path / "b", window_epochs=4) as b,
    ):
        a.apply(stream)
        for record in reversed(stream):
            b.apply([record])
        assert a.content_digest() == b.content_digest()
        b.apply([_record("extra", 0, 0, [1])])
        assert a.content_digest() != b.content_digest()


def test_reopening_with_a_smaller_window_evicts_at_open(tmp_path: Path) -> None:
    with HistoryStore(tmp_path / "h", window_epochs=4) as store:
        store.apply(WORKLOAD.stream())
        assert store.stats().trajectories == len(WORKLOAD.stream())
    with HistoryStore(tmp_path / "h", window_epochs=1) as store:
        assert store.window_epochs == 1
        assert store.stats().trajectories == WORKLOAD.problems * WORKLOAD.samples
        assert {t.epoch for t in store.iter_trajectories()} == {WORKLOAD.epochs - 1}


def test_unknown_layout_version_refuses_to_open(tmp_path: Path) -> None:
    with HistoryStore(tmp_path / "h") as store:
        store._family(layout.CF_META)[layout.META_LAYOUT_VERSION] = b"999"
    with pytest.raises(StoreOpenError, match="layout version 999"):
        HistoryStore(tmp_path / "h")


def test_secondary_reader_catches_up_with_added_and_evicted_keys(tmp_path: Path) -> None:
    with HistoryStore(tmp_path / "h", window_epochs=1) as store:
        store.apply([_record("p", 0, 0, [1, 2, 3])])
        with HistoryStore.open_secondary(tmp_path / "h", tmp_path / "sec") as reader:
            assert reader.get("p", 0, 0).response_ids.tolist() == [1, 2, 3]
            assert reader.catch_up().changes == []
            store.apply([_record("p", 1, 0, [4]), _record("p", 1, 1, [5])], {("t", 0): 3})
            caught = reader.catch_up()
            assert caught.added == [("p", 1, 0), ("p", 1, 1)] and caught.removed == [("p", 0, 0)]
            assert reader.get("p", 0, 0) is None and reader.offsets() == {("t", 0): 3}
            assert reader.length_stats("p").count == 2


def test_reader_behind_the_trimmed_sequence_log_is_told_to_reload(tmp_path: Path) -> None:
    with (
        HistoryStore(tmp_path / "h", sequence_retention=10) as store,
        HistoryStore.open_secondary(tmp_path / "h", tmp_path / "sec") as reader,
    ):
        for sample in range(40):
            store.apply([_record("p", 0, sample, [sample])])
        caught = reader.catch_up()
        assert caught.reset and caught.changes == []
        store.apply([_record("p", 0, 99, [1])])
        assert reader.catch_up().added == [("p", 0, 99)]


def test_token_arrays_round_trip_exactly(tmp_path: Path) -> None:
    prompt = np.array([0, 2**31 - 1, 7], np.int64)
    with HistoryStore(tmp_path / "h") as store:
        store.apply([_record("p", 0, 0, [])])
        store.apply(
            [
                TrajectoryRecord(
                    problem_id="ü/ß", epoch=2**20, sample=3, prompt_ids=prompt.tolist(), response_ids=[]
                )
            ]
        )
        got = store.get("ü/ß", 2**20, 3)
        assert got.prompt_ids.tolist() == prompt.tolist() and got.response_ids.size == 0
        assert store.get("p", 0, 0).response_ids.size == 0
        assert sorted(store.problem_ids()) == ["p", "ü/ß"]


def test_reader_sees_offset_only_writes_on_a_forced_catch_up(tmp_path: Path) -> None:
    with (
        HistoryStore(tmp_path / "h") as store,
        HistoryStore.open_secondary(tmp_path / "h", tmp_path / "sec", max_idle_s=3600) as reader,
    ):
        store.apply([], {("t", 1): 5})
        reader.catch_up()  # the sequence hint did not move: nothing pulled
        assert reader.offsets() == {}
        reader.catch_up(force=True)
        assert reader.offsets() == {("t", 1): 5}


def test_store_size_and_token_gauges_follow_applies_and_evictions(tmp_path):
    from prometheus_client import REGISTRY

    def gauge(name: str) -> float:
        return REGISTRY.get_sample_value(name) or 0.0

    with HistoryStore(tmp_path / "h", window_epochs=1) as store:
        first = [_record("p", 0, s, [5] * 10) for s in range(3)]
        store.apply(first)
        assert gauge("das_store_tokens") == 30
        assert gauge("das_store_size_bytes") > 0
        store.apply([_record("p", 1, 0, [6] * 4)])  # epoch 0 leaves the window of one epoch
        assert gauge("das_store_tokens") == 4
    with HistoryStore(tmp_path / "h") as reopened:
        assert gauge("das_store_tokens") == reopened.stats().response_tokens == 4


def _with_logprobs(problem: str, epoch: int, sample: int, n: int) -> TrajectoryRecord:
    values = -np.linspace(0.0, 7.5, n, dtype=np.float32)
    return TrajectoryRecord(
        problem_id=problem,
        epoch=epoch,
        sample=sample,
        prompt_ids=[5, 6],
        response_ids=list(range(100, 100 + n)),
        response_logprobs=values.tolist(),
    )


def test_response_logprobs_are_stored_as_float32_and_read_back_identical(tmp_path: Path) -> None:
    record = _with_logprobs("p", 0, 0, 300)
    with HistoryStore(tmp_path / "h") as store:
        store.apply([record, _record("p", 0, 1, [1, 2, 3])])
        digest = store.content_digest()
    with HistoryStore(tmp_path / "h") as store:
        got = store.get("p", 0, 0)
        assert got.response_logprobs.dtype == np.float32
        assert got.response_logprobs.tolist() == record.response_logprobs
        assert store.get("p", 0, 1).response_logprobs is None
        assert store.content_digest() == digest


def test_logprobs_enter_the_content_digest(tmp_path: Path) -> None:
    first, second = _with_logprobs("p", 0, 0, 10), _with_logprobs("p", 0, 0, 10)
    second = second.model_copy(update={"response_logprobs": [-1.0] * 10})
    digests = []
    for name, record in (
        ("a", first),
        ("b", second),
        ("c", first.model_copy(update={"response_logprobs": None})),
    ):
        with HistoryStore(tmp_path / name) as store:
            store.apply([record])
            digests.append(store.content_digest())
    assert len(set(digests)) == 3


def test_a_record_without_logprobs_is_stored_in_the_bytes_of_before_the_field(tmp_path: Path) -> None:
    # A store written before `response_logprobs` existed holds exactly these bytes, so it still opens and reads.
    with HistoryStore(tmp_path / "h") as store:
        store.apply([_record("p", 0, 0, [7, 8, 9])])
    families = {name: Options(raw_mode=True) for name in layout.COLUMN_FAMILIES}
    db = Rdict(str(tmp_path / "h"), Options(raw_mode=True), column_families=families)
    raw = db.get_column_family(layout.CF_TRAJECTORIES)[layout.trajectory_key("p", 0, 0)]
    db.close()
    head = struct.pack("<2sBBQII", b"DT", 1, 0, 0, 2, 3)
    body = np.array([5, 6, 7, 8, 9], "<i4").tobytes()
    assert raw == head + struct.pack("<I", zlib.crc32(body, zlib.crc32(head))) + body


@pytest.mark.parametrize(
    "values", [[-1.0, -2.0], [-1.0, 0.5, -1.0], [-1.0, float("nan"), -1.0], [-1.0, float("-inf"), -1.0]]
)
def test_invalid_logprobs_raise_and_write_nothing(tmp_path: Path, values: list[float]) -> None:
    bad = _record("p", 0, 1, [1, 2, 3]).model_copy(update={"response_logprobs": values})
    with HistoryStore(tmp_path / "h") as store:
        with pytest.raises(ValueError, match="response_logprobs"):
            store.apply([_record("p", 0, 0, [1]), bad])
        assert store.get("p", 0, 0) is None


def test_a_flipped_bit_in_the_logprobs_is_caught_by_the_checksum() -> None:
    raw = bytearray(
        encode_trajectory(
            3, as_token_array([1], "p"), as_token_array([2, 3], "r"), as_logprob_array([-1, -2], 2)
        )
    )
    raw[-1] ^= 0x10
    with pytest.raises(CorruptRecordError, match="checksum"):
        decode_trajectory(bytes(raw))
