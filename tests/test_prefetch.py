"""`prefetch_row` is a hint: it compiles for the arena's tables and changes no value, even for rows past the
end (a prefetch never faults)."""

from __future__ import annotations

import numpy as np
from numba import njit

from history_store.automaton.kernels import prefetch_row


@njit
def _prefetch_then_sum(table, rows):
    for r in rows:
        prefetch_row(table, r)
    return table.sum()


def test_prefetch_changes_nothing() -> None:
    table = np.arange(60, dtype=np.int32).reshape(20, 3)
    before = table.copy()
    rows = np.array([0, 7, 19, 10_000_000], np.int64)
    assert _prefetch_then_sum(table, rows) == before.sum()
    assert _prefetch_then_sum(table, rows.astype(np.int32)) == before.sum()
    np.testing.assert_array_equal(table, before)
