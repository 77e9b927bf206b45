"""The proposer's per-step bookkeeping in two native calls, over a table indexed by the index's request slots.

`verified` finds the rows whose previous-step draft was just verified and how many of its tokens were
accepted (a row commits accepted + 1 tokens); `record` remembers this step's drafts for the next step and
tallies what the metrics need (tokens drafted per position, drafts per source, draft lengths per budget
histogram bucket and length class). Python then adds each tally to its metric once per step: nothing is
counted per request in Python.
"""

from __future__ import annotations

import numpy as np
from numba import njit

N_SOURCES = 4
N_CLASSES = 3


@njit(cache=True)
def _verified(slots, new, drafted_at, length, step_no, rows, accepted, accepted_by_position):
    m = 0
    accepted_by_position[:] = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        if drafted_at[s] == step_no - 1 and length[s] > 0 and new[i] > 0:
            a = min(new[i] - 1, length[s])
            rows[m] = s
            accepted[m] = a
            m += 1
            for j in range(a):
                accepted_by_position[j] += 1
    return m


@njit(cache=True)
def _record(
    slots,
    lengths,
    probs,
    classes,
    sources,
    step_no,
    bounds,
    drafted_at,
    length,
    last_probs,
    length_class,
    drafted_by_position,
    by_source,
    by_bucket,
    sum_by_class,
):
    drafted_by_position[:] = 0
    by_source[:] = 0
    by_bucket[:] = 0
    sum_by_class[:] = 0
    k = probs.shape[1]
    for i in range(slots.shape[0]):
        s = slots[i]
        n = lengths[i]
        c = classes[i]
        drafted_at[s] = step_no
        length[s] = n
        length_class[s] = c
        for j in range(k):
            last_probs[s, j] = probs[i, j]
        for j in range(n):
            drafted_by_position[j] += 1
        if n > 0:
            by_source[sources[i]] += 1
        b = 0
        while n > bounds[b]:  # the histogram's bucket: the first upper bound >= n (the last one is +Inf)
            b += 1
        by_bucket[c, b] += 1
        sum_by_class[c] += n


class StepBook:
    """Per-slot state of the previous step's drafts and the per-step tallies (reused buffers)."""

    def __init__(self, size: int, k: int, bounds: np.ndarray) -> None:
        self.k = k
        self.bounds = np.asarray(bounds, np.float64)
        self.prompt_len = np.zeros(size, np.int64)
        self.drafted_at = np.full(size, -2, np.int64)  # the step that last drafted for the slot
        self.length = np.zeros(size, np.int64)
        self.probs = np.zeros((size, k), np.float32)
        self.length_class = np.zeros(size, np.int64)
        self._rows = np.zeros(size, np.int64)
        self._accepted = np.zeros(size, np.int64)
        self.accepted_by_position = np.zeros(k, np.int64)
        self.drafted_by_position = np.zeros(k, np.int64)
        self.by_source = np.zeros(N_SOURCES, np.int64)
        self.by_bucket = np.zeros((N_CLASSES, self.bounds.shape[0]), np.int64)
        self.sum_by_class = np.zeros(N_CLASSES, np.int64)

    def ensure(self, slot: int) -> None:
        """Makes room for `slot` (slots are dense: the table doubles when one lands past its end)."""
        size = self.prompt_len.shape[0]
        if slot < size:
            return
        grown = max(2 * size, slot + 1)
        for name in ("prompt_len", "drafted_at", "length", "probs", "length_class", "_rows", "_accepted"):
            old = getattr(self, name)
            new = np.full((grown, *old.shape[1:]), -2 if name == "drafted_at" else 0, old.dtype)
            new[:size] = old
            setattr(self, name, new)

    def start(self, slot: int, prompt_len: int) -> None:
        self.ensure(slot)
        self.prompt_len[slot] = prompt_len
        self.drafted_at[slot] = -2

    def verified(self, slots: np.ndarray, new: np.ndarray, step_no: int) -> tuple[np.ndarray, np.ndarray]:
        """Slots whose step-(step_no - 1) draft was verified now, and the tokens each got accepted; fills
        `accepted_by_position`. The arrays are views of reused buffers."""
        m = _verified(
            slots,
            new,
            self.drafted_at,
            self.length,
            step_no,
            self._rows,
            self._accepted,
            self.accepted_by_position,
        )
        return self._rows[:m], self._accepted[:m]

    def record(
        self,
        slots: np.ndarray,
        lengths: np.ndarray,
        probs: np.ndarray,
        classes: np.ndarray,
        sources: np.ndarray,
        step_no: int,
    ) -> None:
        """Remembers this step's drafts per slot and tallies them (see the module docstring)."""
        _record(
            slots,
            lengths,
            probs,
            classes,
            sources,
            step_no,
            self.bounds,
            self.drafted_at,
            self.length,
            self.probs,
            self.length_class,
            self.drafted_by_position,
            self.by_source,
            self.by_bucket,
            self.sum_by_class,
        )
