"""The one allocator of per-request slots: every owner's arrays grow together, keep their rows, and
`version` moves exactly when an array was replaced (what the proposer's packed tables rely on)."""

from __future__ import annotations

import gc

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from history_store.automaton.problem_index import ProblemIndex
from history_store.native.dense_rows import DenseRows
from workers.budget.config import BudgetConfig
from workers.budget.policy import BudgetPolicy
from workers.generator.step_book import StepBook


class _Owner:
    pass


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.just("take"), st.integers(0, 300)), max_size=200))
def test_rows_match_a_brute_force_model(ops) -> None:
    """Takes and releases against a plain free list: the same rows, registered arrays keep every row's
    value through growth, fresh rows hold the fill, and `version` counts replacements."""
    rows, a, b = DenseRows(), _Owner(), _Owner()
    rows.register(a, "x", dtype=np.int64, fill=-2)
    rows.register(b, "y", (3,))
    live: list[int] = []
    free: list[int] = []
    fresh = 0
    written: dict[int, int] = {}
    for op in ops:
        if op == "take" or not live:
            expected = free.pop() if free else fresh
            fresh += expected == fresh
            before = (rows.version, a.x)
            row = rows.take()
            assert row == expected
            assert (rows.version != before[0]) == (a.x is not before[1])
            assert a.x.shape[0] == b.y.shape[0] == rows.capacity > row
            if row not in written:
                assert a.x[row] == -2 and not b.y[row].any()
            a.x[row] = written[row] = 10 * row + 1
            live.append(row)
        else:
            row = live.pop(op % len(live))
            rows.release(row)
            free.append(row)
        for r, value in written.items():
            assert a.x[r] == value


def test_an_owner_that_is_gone_stops_growing() -> None:
    rows, kept = DenseRows(), _Owner()
    rows.register(kept, "x")
    gone = _Owner()
    rows.register(gone, "x")
    del gone
    gc.collect()
    rows.reserve(1000)
    assert kept.x.shape[0] >= 1000 and len(rows._arrays) == 1


def test_the_index_policy_and_book_grow_as_one() -> None:
    """Sharing the index's allocator, the policy's and the book's per-slot arrays grow in the same growth
    as the slot table, so starting a request in a fresh slot needs no growth of their own."""
    index = ProblemIndex(window_epochs=2)
    policy = BudgetPolicy(BudgetConfig(max_tokens=4), request_rows=index.request_rows)
    book = StepBook(4, request_rows=index.request_rows)
    for i in range(200):
        slot = index.start_request(f"r{i}", "p", [1, 2, 3])
        version = index.request_rows.version
        policy.start(slot, "p", 8)
        book.start(slot, 3)
        assert index.request_rows.version == version  # already grown with the slot table
        assert policy.kept.shape[0] == book.prompt_len.shape[0] == index.slots.shape[0] > slot
