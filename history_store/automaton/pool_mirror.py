"""The token pool packed (and, where it cannot grow in place, grown) beside the forest, a piece at a time, for
`TreeWork`.

Every sequence's tokens live in one flat array (`SuffixForest.pool`). The forest grows it in place when it is
reserved (`resident.grown`; by copying it whole otherwise), and packs it (`_compact_pool`) by moving every live
segment at once, inside whatever call runs out of room. For a drafting server that follows its replica, that
call is a piece of history work holding the decode step off: a whole copy of the pool took 258 ms of CPU there
(`das bench ingest`, batch 256 at 300k tokens/s, before the pool was reserved). A `PoolMirror` does the same in
pieces:
- its array is allocated and mapped (`resident`) outside the hold, sized for the live tokens with room;
- `begin` (in the hold) notes every used sequence's segment (offset, length, capacity) and gives each a place
  in the new array, packed in row order;
- `run` (in the hold) copies those segments a budget of tokens at a time;
- `finish` (in the hold) copies again what changed meanwhile, then installs the array: a sequence whose offset,
  length or capacity differs from its note (a request's appended tokens, a relocation, a new row, a pool the
  forest grew or packed itself) is copied from where it is now, to the end of the new array. Tokens only ever
  change by growing a sequence's length (`Q_LEN`) or moving it, so an unchanged note means unchanged tokens.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from history_store.automaton import kernels as K
from history_store.automaton.resident import populate, zeros
from history_store.automaton.suffix_tree import SuffixForest

# The new array's room: this many times the live tokens (the forest's own growth doubles).
POOL_HEADROOM = 2.0


@njit(cache=True, nogil=True)
def copy_segments(dst, src, src_offs, dst_offs, lens, i, budget):
    """Copies segments i, i+1, ... (src[src_offs[j] : + lens[j]] to dst[dst_offs[j] :]) until `budget` tokens
    are copied or none is left; returns (next segment, tokens copied)."""
    done = 0
    while i < lens.shape[0] and done < budget:
        n, a, b = lens[i], src_offs[i], dst_offs[i]
        dst[b : b + n] = src[a : a + n]
        done += n
        i += 1
    return i, done


class PoolMirror:
    """A packed copy of the forest's token pool, made in pieces (see the module)."""

    def __init__(self, forest: SuffixForest) -> None:
        """The new arrays, allocated and mapped here (no hold needed: nothing else sees them)."""
        self.forest = forest
        live = max(forest.pool_used - forest.pool_garbage, 1)
        size = max(int(POOL_HEADROOM * live), forest.pool_used + 1, 64)
        # Mapped as far as the copy writes (the live tokens, and what arrives meanwhile); the rest is mapped
        # ahead of use once installed (`SuffixForest.populate_ahead`), so unused room costs no memory.
        mapped = min(size, live + (live >> 2) + (1 << 16))
        self.pool = zeros((size,), np.int32)  # reserved: once installed, it grows in place (`resident`)
        populate(self.pool, 0, mapped)
        self.levels = zeros((size if forest.remembered else 0,), np.uint8)
        populate(self.levels, 0, min(mapped, self.levels.shape[0]))
        # Per used row when `begin` ran: its offset, length and capacity, and its place in the new array
        # (contiguous, so that every call of the copy kernel shares one compiled signature).
        self._rows = self._offs = self._lens = self._caps = self._places = np.empty(0, np.int64)
        # The copy kernel loaded (and compiled on a fresh clone) here, not in the first piece (13-23 ms).
        copy_segments(self.pool, forest.pool, self._offs, self._places, self._lens, 0, 0)
        self._next = 0  # the next segment to copy
        self._end = 0  # tokens of the new array given out
        self.begun = False

    def _used_rows(self) -> np.ndarray:
        f = self.forest
        used = np.ones(f.seqs.shape[0], bool)
        used[np.asarray(f.free_seq_rows(), np.int64)] = False
        return np.flatnonzero(used)

    def begin(self) -> bool:
        """Notes every used sequence and its place in the new array (hold the step off); False when they do not
        fit (the caller drops this mirror)."""
        f = self.forest
        self._rows = self._used_rows()
        self._offs, self._lens, self._caps = (f.seqs[self._rows, col] for col in (K.Q_OFF, K.Q_LEN, K.Q_CAP))
        self._places = np.cumsum(self._caps) - self._caps
        self._end = int(self._caps.sum())
        self.begun = True
        return self._end <= self.pool.shape[0]

    @property
    def copied(self) -> bool:
        """Every noted segment is in the new array."""
        return self._next >= self._rows.shape[0]

    def run(self, budget: int) -> int:
        """Copies noted segments, about `budget` tokens of them (hold the step off); returns the tokens copied."""
        f = self.forest
        start = self._next
        self._next, done = copy_segments(
            self.pool, f.pool, self._offs, self._places, self._lens, start, budget
        )
        if f.remembered:
            copy_segments(self.levels, f.levels, self._offs, self._places, self._lens, start, budget)
        return int(done)

    def finish(self) -> bool:
        """Copies what changed since `begin` and installs the new arrays (hold the step off; after `copied`).
        False when the changes do not fit (nothing is installed; the caller drops this mirror)."""
        f = self.forest
        rows = self._used_rows()
        place = np.full(f.seqs.shape[0], -1, np.int64)
        noted = self._rows
        same = (
            (f.seqs[noted, K.Q_OFF] == self._offs)
            & (f.seqs[noted, K.Q_LEN] == self._lens)
            & (f.seqs[noted, K.Q_CAP] == self._caps)
        )
        place[self._rows[same]] = self._places[same]
        moved = rows[place[rows] < 0]  # new, reused, grown or moved since `begin`
        caps = f.seqs[moved, K.Q_CAP]
        places = self._end + np.cumsum(caps) - caps
        end = self._end + int(caps.sum())
        if end > self.pool.shape[0]:
            return False
        offs, lens = f.seqs[moved, K.Q_OFF], f.seqs[moved, K.Q_LEN]
        copy_segments(self.pool, f.pool, offs, places, lens, 0, np.iinfo(np.int64).max)
        if f.remembered:
            copy_segments(self.levels, f.levels, offs, places, lens, 0, np.iinfo(np.int64).max)
        place[moved] = places
        f.install_pool(self.pool, self.levels, rows, place[rows], end)
        return True
