"""The edge hash table's next size, built beside the decode step.

Growing the hash table re-inserts every entry into one four times as large: 75-130 ms at 0.9 M entries (`das bench
ingest`, issue 47), paid inside whatever call ran out of room, for a server following its replica a piece of
history work that holds the decode step off. Entries are only ever added, never moved or removed, so the next
table is built outside the hold from the one in use while the step keeps adding to it:

1. `ahead` (no hold), once the table is `SPARE_HASHES_AT` of the way to growing: the next table's empty slots,
   written a chunk at a time (`resident.Filled`); then, once it is `BEGIN_AT` of the way, a meta with a journal.
2. `begin` (hold): the forest runs with that meta, so the kernels journal every entry they add from now on.
3. `ahead` (no hold; releases the GIL): every complete entry of the table in use goes into the next one. A slot
   written meanwhile may be read half-written: a complete one is taken, a partial one skipped; both are in the
   journal.
4. `finish` (hold): the journal's entries go in where absent, and the next table and a plain meta are installed.

Whoever must grow the table first (`SuffixForest.grow`, in the hold) finishes it there: it waits for a copy under
way, or copies in the hold when none ran (what every growth cost before). Work that can wait does not get there:
a piece's feeds and rebuilds and a lazy build stop at `HASH_RESERVE` of the way while the copy is not done
(`SuffixForest.wait_for_hashes`), and the growth is then planned and begun at once, however full the table is.

The journal has room for an eighth of the table's rows: more than the entries added between `BEGIN_AT` and the
growth that `grow` forces at half full. One that overflows anyway (a growth begun earlier because work waits for
it, then held up) is given up on, and `finish` copies the whole table again, in the hold.
"""

from __future__ import annotations

import threading
from typing import Protocol

import numpy as np

from history_store.automaton import kernels as K
from history_store.automaton.resident import FILL_BYTES, Filled

# How far the table is on its way to growing (half full) when its next size is planned and its empty slots are
# written ahead: the next table is 4 times the table, memory it would take at the growth anyway. Planned at 75%,
# a burst of lazy loads outran it (`das bench ingest` at batch 256: a step wrote a 96 MiB table itself, 1.7 s).
SPARE_HASHES_AT = 0.5
# How far it is when the copy begins: from there to half full it takes a tenth of its rows in entries, which
# the journal has room for; a copy begun earlier installs a table whose next growth comes sooner.
BEGIN_AT = 0.8
# How far work that can wait (a piece's feeds and rebuilds, a lazy build) takes the table while its next size is
# not built yet (`SuffixForest.wait_for_hashes`): the rest of the way is the step's own tokens', so that they do not
# grow it inside a step either.
HASH_RESERVE = 0.9


class GrowingForest(Protocol):
    """What a growth reads and sets of its forest (`suffix_tree.SuffixForest`, which imports this module)."""

    hashes: np.ndarray
    edges: np.ndarray
    meta: np.ndarray
    hashes_wanted: bool

    def replaced(self) -> None: ...


class HashGrowth:
    """A forest's next hash table, from its planning to its install (the module docstring's steps)."""

    def __init__(self, rows: int) -> None:
        self.next = Filled((rows, K.HASH_FIELDS), np.int32, -1)
        self.journaled: np.ndarray | None = None  # the meta the forest runs with from `begin`
        self.source: np.ndarray | None = None  # the table in use at `begin`, which `ahead` copies
        self.copied = False
        self._plain: np.ndarray | None = None  # the forest's meta before `begin`, reused after `finish`
        self._lock = threading.Lock()  # the copy (history thread, no hold) against `finish` (the hold)

    @property
    def rows(self) -> int:
        return int(self.next.array.shape[0])

    @property
    def due(self) -> bool:
        """It wants a piece (the hold): to `begin`, or to `finish` after the copy."""
        return self.journaled is not None and (self.source is None or self.copied)

    def ahead(self, forest: GrowingForest) -> int:
        """The next step that needs no hold on the step (no more than one); returns the bytes written."""
        if not self.next.ready:
            return self.next.fill(FILL_BYTES)
        if self.journaled is None:
            table = forest.hashes.shape[0]
            if 2 * int(forest.meta[K.N_HASHED]) <= BEGIN_AT * table and not forest.hashes_wanted:
                return 0
            journaled = np.empty(K.META_FIELDS + max(1024, table // 8), np.int64)
            journaled.fill(0)  # written here, so `begin` and the kernels' journal writes find it resident
            self.journaled = journaled
            return journaled.nbytes
        with self._lock:
            if self.source is None or self.copied:
                return 0
            K.copy_hashes(self.next.array, self.source)
            self.copied = True
            return self.source.nbytes

    def begin(self, forest: GrowingForest) -> None:
        """Starts journaling the forest's hash entries (hold the step off)."""
        assert self.journaled is not None and self.source is None
        journaled, plain = self.journaled, forest.meta
        journaled[: K.JOURNAL] = plain[: K.JOURNAL]
        journaled[K.JOURNAL] = 0
        self._plain, self.source = plain, forest.hashes
        forest.meta = journaled
        forest.replaced()

    def finish(self, forest: GrowingForest) -> np.ndarray:
        """The next table with every entry of the table in use, and the forest back on a plain meta (hold the
        step off: the caller installs the table). Waits for a copy under way."""
        table = self.next.finish()  # its empty slots: written ahead, or the rest now
        with self._lock:
            if self.source is None:  # never begun: the table in use is complete here
                K.copy_hashes(table, forest.hashes)
                return table
            if not self.copied or forest.meta[K.JOURNAL] < 0:  # overflowed: copy again, now complete
                K.copy_hashes(table, self.source)
            else:
                K.replay_journal(table, forest.edges, forest.meta)
            self.copied = True
            self._end(forest)
        return table

    def abandon(self, forest: GrowingForest) -> None:
        """Gives it up (the table is replaced otherwise): the forest back on a plain meta if it had begun."""
        with self._lock:
            self.copied = True  # nothing more to copy
            if self.source is not None and forest.meta is self.journaled:
                self._end(forest)

    def _end(self, forest: GrowingForest) -> None:
        plain = self._plain
        assert plain is not None
        plain[: K.JOURNAL] = forest.meta[: K.JOURNAL]
        plain[K.JOURNAL] = -1
        forest.meta = plain
        forest.replaced()
