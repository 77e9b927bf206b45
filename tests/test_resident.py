"""Arena memory mapped ahead of the hold (`resident`): pages become resident without their contents changing,
and a frontier follows arrays that are replaced (issue 47, item 1: a first write to fresh memory inside a piece
of history work held a decode step for 30-50 ms)."""

from __future__ import annotations

import resource

import numpy as np

from history_store.automaton.resident import Frontier, populate


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_populate_maps_rows_without_changing_them_so_the_writes_after_it_do_not_fault() -> None:
    # 64 MiB: above glibc's largest mmap threshold, so calloc maps fresh pages and none is mapped yet.
    arr = np.zeros((1 << 21, 8), np.int32)
    arr[:10] = 7
    asked = populate(arr, 10, arr.shape[0])
    assert asked >= (arr.shape[0] - 10) * arr.strides[0]
    assert (arr[:10] == 7).all() and not arr[10:].any()
    before = _minor_faults()
    arr[10:] = 1  # every page already mapped
    assert _minor_faults() - before < 16
    fresh = np.zeros((1 << 21, 8), np.int32)
    before = _minor_faults()
    fresh[:] = 1
    assert _minor_faults() - before > 64  # the same writes on unmapped memory fault page by page


def test_a_frontier_maps_in_chunks_ahead_of_use_and_starts_again_on_a_replaced_array() -> None:
    frontier = Frontier()
    arr = np.zeros(1 << 20, np.int32)
    assert frontier.ahead([("pool", arr, 0, 1000)]) > 0
    assert frontier.ahead([("pool", arr, 100, 1000)]) == 0  # still more than half mapped ahead
    assert frontier.ahead([("pool", arr, 600, 1000)]) > 0
    grown = np.zeros(1 << 21, np.int32)
    assert frontier.ahead([("pool", grown, 600, 1000)]) > 0  # a new array: mapped again from its used rows
    assert populate(arr, 5, 5) == 0 and populate(arr, arr.shape[0] + 10, arr.shape[0] + 20) == 0
