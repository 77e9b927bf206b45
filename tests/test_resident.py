"""Arena memory made ready outside the hold (`resident`): pages become resident without their contents
changing, a frontier follows arrays that are replaced, large arrays grow in place instead of by a copy, and a
table's empty slots are written a chunk at a time (issue 47, item 1: a first write to fresh memory inside a piece of
history work held a decode step for 30-50 ms, and growing the arena by a copy for 1.2 s)."""

from __future__ import annotations

import resource

import numpy as np

from history_store.automaton import kernels as K
from history_store.automaton.config import DraftConfig
from history_store.automaton.resident import Filled, Frontier, capacity, grown, populate, zeros
from history_store.automaton.suffix_tree import SuffixForest, SuffixTree


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


def test_a_large_array_grows_in_place_and_a_small_one_by_a_copy() -> None:
    arr = zeros((1 << 16, 8), np.int32)  # 2 MiB: reserved
    arr[-1] = 5
    assert capacity(arr) > 4 * arr.shape[0]
    assert populate(arr, arr.shape[0], 2 * arr.shape[0]) > 0  # rows it will grow into map ahead already
    big = grown(arr, 3 * arr.shape[0])
    assert big.shape == (3 << 16, 8) and np.shares_memory(big, arr)  # nothing copied
    assert (big[(1 << 16) - 1] == 5).all() and not big[1 << 16 :].any()
    big[-1] = 9
    again = grown(big, capacity(big) + 1)  # past the reservation: a copy, contents kept
    assert not np.shares_memory(again, big) and again.shape[0] == capacity(big) + 1
    assert (again[big.shape[0] - 1] == 9).all() and not again[big.shape[0] : big.shape[0] + 4096].any()
    small = zeros((10, 3), np.int32)
    small[0] = 1
    more = grown(small, 20)
    assert more.shape == (20, 3) and not np.shares_memory(more, small) and (more[0] == 1).all()


def test_an_arena_grows_in_place() -> None:
    forest = SuffixForest(capacity_tokens=1 << 15)  # states and edges of 1 MiB and more: reserved
    tree = SuffixTree(DraftConfig(min_token_prob=0.0), forest)
    rng = np.random.default_rng(0)
    states, edges = forest.states, forest.edges
    seq = 0
    while forest.states.shape[0] == states.shape[0]:
        tree.extend(seq, rng.integers(0, 4000, 2000))
        seq += 1
    assert np.shares_memory(forest.states, states) and np.shares_memory(forest.edges, edges)  # grown in place
    forest.check_arena()


def test_filled_writes_its_value_a_chunk_at_a_time() -> None:
    table = Filled((1 << 12, K.HASH_FIELDS), np.int32, -1)
    chunks = 0
    while not table.ready:
        assert table.fill(4096) > 0
        chunks += 1
    rows_per_chunk = 4096 // table.array.strides[0]
    assert chunks == -(-table.array.shape[0] // rows_per_chunk)
    assert (table.array == -1).all() and table.fill(4096) == 0
    partly = Filled((1 << 12, K.HASH_FIELDS), np.int32, -1)
    partly.fill(4096)
    assert not partly.ready
    assert (partly.finish() == -1).all() and partly.ready  # whoever needs it writes the rest
