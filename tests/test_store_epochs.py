"""`HistoryStore.apply_judged`: a problem's window moves only with its reference epoch (an epoch advance, or enough
distinct samples), never with a record's own epoch, and the outcome does not depend on the order in which records
and advances arrive: what a rebuild from a compacted topic relies on."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from history_store.durable.store import HistoryStore
from pipeline.schemas import TrajectoryRecord

WINDOW = 3


def _record(problem: int, epoch: int, sample: int, token: int = 7) -> TrajectoryRecord:
    return TrajectoryRecord(
        problem_id=f"p{problem}",
        epoch=epoch,
        sample=sample,
        prompt_ids=[1, 2],
        response_ids=[epoch, sample, token],
    )


def _view(store: HistoryStore) -> tuple:
    return (
        sorted(t.key for t in store.iter_trajectories()),
        sorted(store.pending()),
        store.content_digest(),
        store.references(),
    )


def _play(path: Path, events: list, confirm: int | None = None) -> tuple:
    with HistoryStore(path, window_epochs=WINDOW) as store:
        for kind, item in events:
            if kind == "advance":
                store.apply_judged([], advances=item, confirm_samples=confirm)
            else:
                store.apply_judged([item], confirm_samples=confirm)
        return _view(store)


LEGIT = [
    event
    for epoch in range(5)
    for event in [
        ("advance", {"p0": epoch, "p1": epoch}),
        *(("record", _record(p, epoch, s)) for p in range(2) for s in range(4)),
    ]
]
HOSTILE = [("record", _record(0, 7, 100)), ("record", _record(1, 99_999, 1)), ("record", _record(0, 0, 50))]


@pytest.mark.parametrize("confirm", [None, 3], ids=["advances", "samples"])
def test_the_outcome_does_not_depend_on_the_order_of_records_and_advances(tmp_path, confirm):
    events = LEGIT + HOSTILE if confirm is None else [e for e in LEGIT + HOSTILE if e[0] == "record"]
    window, pending, _, references = expected = _play(tmp_path / "in-order", events, confirm)
    assert window == sorted((f"p{p}", e, s) for p in range(2) for e in (2, 3, 4) for s in range(4))
    assert pending == [("p0", 7, 100), ("p1", 99_999, 1)] and references == {"p0": 4, "p1": 4}
    rng = random.Random(46)
    for n in range(6):
        shuffled = list(events)
        rng.shuffle(shuffled)
        assert _play(tmp_path / f"shuffled-{n}", shuffled, confirm) == expected


def test_no_record_evicts_and_an_advance_promotes_what_waited(tmp_path):
    with HistoryStore(tmp_path / "s", window_epochs=WINDOW) as store:
        store.apply_judged([], advances={"p0": 2})
        store.apply_judged([_record(0, e, s) for e in range(3) for s in range(2)])
        result = store.apply_judged([_record(0, 9, 0), _record(0, 9, 1), _record(0, 9, 2), _record(0, 3, 0)])
        assert result.evicted == [] and sorted(result.pending) == [
            ("p0", 3, 0),
            ("p0", 9, 0),
            ("p0", 9, 1),
            ("p0", 9, 2),
        ]
        assert len(list(store.iter_trajectories())) == 6
        result = store.apply_judged([], advances={"p0": 3})
        assert result.promoted == [("p0", 3, 0)] and result.evicted == [("p0", 0, 0), ("p0", 0, 1)]
        assert store.reference("p0") == 3 and store.stats().pending == 3
    with HistoryStore(tmp_path / "s") as reopened:  # the reference is stored: a restart judges the same
        result = reopened.apply_judged([_record(0, 0, 9)])
        assert result.stale == [("p0", 0, 9)] and reopened.reference("p0") == 3


def test_samples_confirm_an_epoch_only_once_there_are_enough(tmp_path):
    with HistoryStore(tmp_path / "s", window_epochs=WINDOW) as store:
        store.apply_judged([_record(0, e, s) for e in range(3) for s in range(3)], confirm_samples=3)
        assert store.reference("p0") == 2
        result = store.apply_judged([_record(0, 8, 0), _record(0, 8, 1)], confirm_samples=3)
        assert result.evicted == [] and store.reference("p0") == 2  # two samples of a far epoch: no move
        result = store.apply_judged([_record(0, 8, 1), _record(0, 8, 2)], confirm_samples=3)  # one repeated
        assert store.reference("p0") == 8 and len(result.evicted) == 9 and len(result.promoted) == 3


def test_a_different_copy_of_a_stored_key_is_reported_and_the_stored_one_kept(tmp_path):
    with HistoryStore(tmp_path / "s", window_epochs=WINDOW) as store:
        store.apply_judged([], advances={"p0": 0})
        store.apply_judged([_record(0, 0, 0), _record(0, 1, 0)])
        result = store.apply_judged([_record(0, 0, 0), _record(0, 0, 0, token=9), _record(0, 1, 0, token=9)])
        assert result.duplicates == 3 and result.conflicts == [("p0", 0, 0), ("p0", 1, 0)]
        assert store.get("p0", 0, 0).response_ids.tolist() == [0, 0, 7]
        assert store.get_pending("p0", 1, 0).response_ids.tolist() == [1, 0, 7]


def test_two_copies_of_a_key_in_one_batch_are_a_conflict_too(tmp_path):
    with HistoryStore(tmp_path / "s", window_epochs=WINDOW) as store:
        store.apply_judged([], advances={"p0": 0})
        result = store.apply_judged([_record(0, 0, 0), _record(0, 0, 0, token=9), _record(0, 0, 0)])
        assert result.applied == [("p0", 0, 0)] and result.conflicts == [("p0", 0, 0)]
        assert store.get("p0", 0, 0).response_ids.tolist() == [0, 0, 7]
