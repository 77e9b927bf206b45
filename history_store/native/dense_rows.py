"""Dense rows shared by several owners: the one allocator of per-request slots (and of per-problem rows).

A request's state is spread over the parts that use it: the index's slot table, the budget policy's per-slot
arrays and the step book's. Each registers its arrays here, and this allocator alone hands out rows, grows
every registered array together (one doubling rule) and counts the growths in `version`. Whoever holds views
or packed copies of the arrays (the proposer's step tables) knows they are stale exactly when `version`
moved: starting or finishing a request that needs no growth replaces nothing.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

# Rows of a first allocation: growth copies every registered array, so start with room for a batch.
MIN_ROWS = 64


class DenseRows:
    """Row ids 0, 1, ... handed out and taken back, and the arrays of every owner indexed by them."""

    def __init__(self) -> None:
        self.capacity = 0
        self.version = 0  # growths so far: arrays registered before a growth were replaced by it
        self._next = 0  # rows below this have been handed out at least once
        self._free: list[int] = []
        self._arrays: list[tuple[weakref.ref, str, Any]] = []

    def register(
        self, owner: object, name: str, tail: tuple[int, ...] = (), dtype: Any = np.float64, fill: Any = 0
    ) -> None:
        """Gives `owner.name` a [capacity, *tail] array of `dtype` filled with `fill`, and grows it with the
        others from now on (while the owner lives: a replaced owner drops out by itself)."""
        setattr(owner, name, np.full((self.capacity, *tail), fill, dtype))
        self._arrays.append((weakref.ref(owner), name, fill))

    def reserve(self, rows: int) -> None:
        """Room for rows 0..rows-1 in every registered array: the only place they grow."""
        if rows <= self.capacity:
            return
        grown = max(MIN_ROWS, 2 * self.capacity, rows)
        live = []
        for entry in self._arrays:
            owner = entry[0]()
            if owner is None:
                continue
            old = getattr(owner, entry[1])
            new = np.full((grown, *old.shape[1:]), entry[2], old.dtype)
            new[: self.capacity] = old
            setattr(owner, entry[1], new)
            live.append(entry)
        self._arrays = live
        self.capacity = grown
        self.version += 1

    def take(self) -> int:
        """A free row: the one given back last, else the lowest never handed out."""
        if self._free:
            return self._free.pop()
        row = self._next
        self.reserve(row + 1)
        self._next += 1
        return row

    def release(self, row: int) -> None:
        """Gives a row back (`take` hands it out again; its contents are the next owner's to reset)."""
        self._free.append(row)
