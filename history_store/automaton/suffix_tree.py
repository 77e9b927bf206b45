"""Suffix trees for drafting: many trees in one native arena, so one call drafts for a whole decode batch.

A `SuffixTree` indexes a set of token sequences (a problem's recent rollouts, a request's own context, ...)
and drafts the likeliest continuation of a context. Sequences grow incrementally (`extend`) and leave whole
(`remove`, for epoch eviction). The native structure is a generalized suffix automaton (see `_kernels`),
which has the occurrence counts of a depth-bounded suffix tree with amortized O(1) insertion.

Inputs are validated here, once, at the boundary: token ids are integers in [0, 2**31 - 1].
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from history_store.automaton import kernels as K
from history_store.automaton import resident
from history_store.automaton.config import DraftConfig
from history_store.automaton.hash_growth import HASH_RESERVE, SPARE_HASHES_AT, HashGrowth
from history_store.automaton.resident import FILL_BYTES, Frontier, arena_rows_ahead
from history_store.errors import InvalidInput
from history_store.native.bundles import DraftOutputs, Forest, draft_params, gather

MAX_TOKEN_ID = 2**31 - 1
_SERIAL_MAGIC = b"DAST"
# 1: tokens only; 2: each sequence's tokens, then a flag and (when set) their sampling probability levels.
_SERIAL_VERSION = 2


@dataclass(frozen=True)
class Draft:
    """Draft tokens, the path probability and support (occurrence count) of each, the matched context length,
    the score (sum of probs), and each token's remembered sampling probability (-1: unknown)."""

    tokens: np.ndarray
    probs: np.ndarray
    support: np.ndarray
    match_len: int
    score: float
    remembered: np.ndarray


def as_levels(logprobs: Sequence[float] | np.ndarray | None, n: int) -> np.ndarray:
    """Sampling log probabilities as the pool keeps them (uint8, `kernels.PROB_LEVELS` units, 0: unknown);
    all unknown for None. NaN marks one unknown token.

    Raises ValueError when there is not one per token, or one is positive or infinite.
    """
    if logprobs is None:
        return np.zeros(n, np.uint8)
    lp = np.asarray(logprobs, np.float64)
    if lp.shape != (n,):
        raise InvalidInput(f"need one log probability per token ({n}), got shape {lp.shape}")
    known = ~np.isnan(lp)
    if np.isinf(lp).any() or (lp[known] > 0).any():
        raise InvalidInput("log probabilities must be finite and <= 0")
    levels = np.zeros(n, np.uint8)
    levels[known] = 1 + np.rint(np.exp(lp[known]) * K.PROB_LEVELS).astype(np.uint8)
    return levels


def as_tokens(tokens: Sequence[int] | np.ndarray, what: str = "tokens") -> np.ndarray:
    """Validates token ids and returns them as a contiguous 1-D int32 array.

    Raises TypeError for non-integer input and ValueError for other shapes or ids outside [0, 2**31 - 1].
    """
    arr = np.asarray(tokens)
    if arr.size == 0:
        return np.empty(0, np.int32)
    if arr.ndim != 1:
        raise InvalidInput(f"{what} must be one-dimensional, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{what} must be integer token ids, got dtype {arr.dtype}")
    if arr.dtype != np.int32:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            raise InvalidInput(f"{what} must be in [0, {MAX_TOKEN_ID}], got values in [{lo}, {hi}]")
        arr = arr.astype(np.int32)
    elif arr.min() < 0:
        raise InvalidInput(f"{what} must be non-negative token ids, got {int(arr.min())}")
    return np.ascontiguousarray(arr)


class Arena(NamedTuple):
    """The automaton arrays every kernel takes first, in this order (see `_kernels`)."""

    states: np.ndarray
    edges: np.ndarray
    hashes: np.ndarray
    meta: np.ndarray


class SuffixForest:
    """The arena: growable tables holding the automata of many trees and the tokens of their sequences.

    Trees never free states one by one; a tree that drops sequences is rebuilt into fresh states and its old
    states become garbage, which `compact()` reclaims once it outweighs the live part. Sequence tokens live
    in one pool (each sequence a segment with room to grow), so a kernel can read and extend any of them.

    Only a forest built with `remembered=True` keeps sampling probabilities (each state's PSUM and PKNOWN, a
    level per pooled token): they cost 8 bytes per state and 1 per token, and every tree on it may then
    draft with `DraftConfig.remembered_probs`. Without them the levels a tree is given are dropped, and its
    drafts are the same.
    """

    def __init__(self, capacity_tokens: int = 4096, remembered: bool = False) -> None:
        self.generation = 0
        self.remembered = bool(remembered)
        # The hash table's next size, built outside the decode step's hold (`populate_ahead`, `hash_growth`).
        self.hash_growth: HashGrowth | None = None
        # Work waits for that growth (`wait_for_hashes`): it is planned and begun now, whatever the table's fill.
        self.hashes_wanted = False
        self._allocate(capacity_tokens)
        self.trees = np.zeros((16, K.TREE_FIELDS), np.int64)
        self._free_trees: list[int] = list(range(15, -1, -1))
        self.live_trees: dict[int, SuffixTree] = {}
        self.seqs = np.zeros((64, K.SEQ_FIELDS), np.int64)
        self._free_seqs: list[int] = list(range(63, -1, -1))
        self.pool = resident.zeros((max(64, int(capacity_tokens)),), np.int32)
        # Each pooled token's `as_levels`; empty (one kernel type for both) when not remembered.
        self.levels = resident.zeros((self.pool.shape[0] if self.remembered else 0,), np.uint8)
        self._pool_used = 0
        self._pool_garbage = 0
        self._version = 0
        # Set by `tree_work.TreeWork`: compaction is then its business (`maybe_compact` only asks for it), and
        # while it compacts, `observer` hears of every tree and sequence that comes and goes.
        self.defer_compaction = False
        self.compaction_wanted = False
        self.observer: Any = None
        self._frontier = Frontier()

    def _allocate(self, capacity_tokens: int) -> None:
        n = max(64, int(capacity_tokens))
        width = K.STATE_FIELDS if self.remembered else K.BASE_STATE_FIELDS
        # Reserved (`resident.zeros`): they grow in place, without a copy (`grow`).
        self.states = resident.zeros((2 * n, width), np.int32)
        self.edges = resident.zeros((3 * n, K.EDGE_FIELDS), np.int32)
        self.drop_hash_growth()
        self.hashes = np.full(
            (pow2(2 * n), K.HASH_FIELDS), -1, np.int32
        )  # only high-degree states' edges are hashed
        self.meta = K.new_meta()
        self.garbage_states = 0
        self.replaced()

    @property
    def arena(self) -> Arena:
        return Arena(self.states, self.edges, self.hashes, self.meta)

    def tables(self) -> Forest:
        """The arena and its bookkeeping tables as the step kernels take them (read again after any growth:
        growing replaces arrays)."""
        return gather(Forest, self)

    def replaced(self) -> None:
        """Counts a replacement of one of the tables `tables()` returns (every growth calls it): whoever
        packed them is stale when `generation` moved."""
        self.generation += 1

    def next_version(self) -> int:
        self._version += 1
        return self._version

    @property
    def memory_bytes(self) -> int:
        """Bytes the arena, its tables and the token pool have allocated."""
        return sum(a.nbytes for a in (*self.arena, self.trees, self.seqs, self.pool, self.levels))

    # ---- trees and sequences -------------------------------------------------------------------------

    def new_tree(self, tree: SuffixTree) -> int:
        """A row in the tree table for `tree`, with a fresh root; returns its id."""
        if not self._free_trees:
            size = self.trees.shape[0]
            self.trees = resident.grown(self.trees, 2 * size)
            self.replaced()
            self._free_trees.extend(range(2 * size - 1, size - 1, -1))
        tid = self._free_trees.pop()
        self.live_trees[tid] = tree
        self.trees[tid] = 0
        self._new_root(tid)
        return tid

    def _new_root(self, tid: int) -> None:
        self.grow(states=1, edges=0)
        root = K.new_state(self.states, self.meta, 0, -1, 0, -1)
        version = self.next_version()
        self.trees[tid, [K.ROOT, K.VERSION, K.T_STATES, K.T_EDGES, K.T_HASHED, K.T_TOKENS]] = (
            root,
            version,
            1,
            0,
            0,
            0,
        )
        if self.observer is not None:
            self.observer.tree_reset(tid)

    def free_tree(self, tid: int) -> None:
        self.garbage_states += int(self.trees[tid, K.T_STATES])
        del self.live_trees[tid]
        self._free_trees.append(tid)
        if self.observer is not None:
            self.observer.tree_freed(tid)

    def new_seq(self, capacity: int) -> int:
        """A sequence row with room for `capacity` pooled tokens; returns its id."""
        if not self._free_seqs:
            size = self.seqs.shape[0]
            self.seqs = resident.grown(self.seqs, 2 * size)
            self.replaced()
            self._free_seqs.extend(range(2 * size - 1, size - 1, -1))
        q = self._free_seqs.pop()
        self.seqs[q] = 0
        self.seqs[q, K.Q_OFF] = self._reserve(capacity)
        self.seqs[q, K.Q_CAP] = capacity
        return q

    def free_seq(self, q: int) -> None:
        self._pool_garbage += int(self.seqs[q, K.Q_CAP])
        self._free_seqs.append(q)
        if self.observer is not None:
            self.observer.seq_freed(q)

    def seq_tokens(self, q: int) -> np.ndarray:
        off, length = int(self.seqs[q, K.Q_OFF]), int(self.seqs[q, K.Q_LEN])
        return self.pool[off : off + length]

    def seq_levels(self, q: int) -> np.ndarray:
        """Sequence q's probability levels (`as_levels`; all unknown where the forest does not remember them)."""
        off, length = int(self.seqs[q, K.Q_OFF]), int(self.seqs[q, K.Q_LEN])
        if not self.remembered:
            return np.zeros(length, np.uint8)
        return self.levels[off : off + length]

    @property
    def pool_used(self) -> int:
        """Tokens of the pool given out to segments (live ones and garbage)."""
        return self._pool_used

    @property
    def pool_garbage(self) -> int:
        """Tokens of the pool in segments no sequence uses any more."""
        return self._pool_garbage

    def free_seq_rows(self) -> list[int]:
        """Sequence rows not in use."""
        return self._free_seqs

    def install_pool(
        self, pool: np.ndarray, levels: np.ndarray, rows: np.ndarray, offsets: np.ndarray, used: int
    ) -> None:
        """Replaces the token pool (`pool_mirror`): sequence rows[i]'s tokens are at offsets[i] of `pool`
        (and `levels`), and `used` tokens of it are given out."""
        self.seqs[rows, K.Q_OFF] = offsets
        self.pool, self.levels = pool, levels
        self._pool_used, self._pool_garbage = int(used), 0
        self.replaced()

    def populate_ahead(self, tokens: int, spare: bool = True) -> int:
        """Maps the arena rows that the next `tokens` tokens of insertion may write (`resident`: without
        writing them, so a step may run meanwhile) and, with `spare`, does the next step of the hash table's
        growth that needs no hold (`hash_growth`, planning one once the table is `SPARE_HASHES_AT` of the way
        to growing); call it outside the decode step's hold. Returns the bytes asked for or written."""
        arrays = arena_rows_ahead(self.states, self.edges, self.meta, tokens)
        arrays.append(("pool", self.pool, self._pool_used, tokens))
        if self.remembered:
            arrays.append(("levels", self.levels, self._pool_used, tokens))
        asked = self._frontier.ahead(arrays)
        growth = self.hash_growth
        if spare and growth is None:
            if (
                2 * int(self.meta[K.N_HASHED]) <= SPARE_HASHES_AT * self.hashes.shape[0]
                and not self.hashes_wanted
            ):
                return asked
            growth = self.hash_growth = HashGrowth(4 * self.hashes.shape[0])
        return asked + (growth.ahead(self) if growth is not None else 0)

    @property
    def hash_growth_due(self) -> bool:
        """The hash table's growth wants the hold (`hash_piece`)."""
        return self.hash_growth is not None and self.hash_growth.due

    def hash_piece(self) -> None:
        """The hash table's growth's next step that needs the hold (hold the step off): beginning its copy,
        or installing the table it built."""
        growth = self.hash_growth
        if growth is None or not growth.due:
            return
        if growth.source is None:
            growth.begin(self)
            return
        self.hash_growth = None
        self.hashes = growth.finish(self)
        self.hashes_wanted = False
        self.replaced()

    def wait_for_hashes(self, tokens: int) -> bool:
        """Whether work that can wait (a piece's feeds and rebuilds, a lazy build) should stop before inserting
        `tokens` more tokens (three edges each at most): they would take the hash table past `HASH_RESERVE` of the
        way to growing while its next size is not yet copied beside the step and is more than a `FILL_BYTES`
        chunk to write. Growing it then would write it inside the caller's hold: 1.2-1.7 s for 96 MiB on these
        VMs, in the step of a lazy server's first requests (`das bench ingest`, batch 256, profiled). When it
        must wait, it asks for the growth (`hashes_wanted`), so that the history thread builds it now."""
        size = self.hashes.shape[0]
        if 2 * (int(self.meta[K.N_HASHED]) + 3 * int(tokens)) <= HASH_RESERVE * size:
            return False
        if 4 * size * K.HASH_FIELDS * 4 <= FILL_BYTES:  # the next table: cheap enough to write here
            return False
        if self.hash_growth is not None and self.hash_growth.copied:
            return False
        self.hashes_wanted = True  # planned and begun now, however far the table is (`populate_ahead`)
        return True

    def drop_hash_growth(self) -> None:
        """Gives up the hash table's growth under way (the table is about to be replaced)."""
        growth, self.hash_growth = self.hash_growth, None
        self.hashes_wanted = False
        if growth is not None:
            growth.abandon(self)

    def make_room(self, q: int, length: int) -> None:
        """Moves sequence q to a segment that holds `length` tokens (doubling, so appends stay O(1))."""
        cap = int(self.seqs[q, K.Q_CAP])
        if length <= cap:
            return
        new_cap = max(length, 2 * cap, 16)
        off = self._reserve(new_cap)  # may compact the pool: read the old offset after it
        old, used = int(self.seqs[q, K.Q_OFF]), int(self.seqs[q, K.Q_LEN])
        self.pool[off : off + used] = self.pool[old : old + used]
        self.levels[off : off + used] = self.levels[old : old + used]
        self.seqs[q, K.Q_OFF] = off
        self.seqs[q, K.Q_CAP] = new_cap
        self._pool_garbage += cap

    def _reserve(self, size: int) -> int:
        if self._pool_used + size > self.pool.shape[0]:
            if self._pool_garbage > max(self._pool_used - self._pool_garbage, 1 << 16):
                self._compact_pool()
            if self._pool_used + size > self.pool.shape[0]:
                self.pool = resident.grown(self.pool, _grown(self.pool.shape[0], self._pool_used + size))
                if self.remembered:
                    self.levels = resident.grown(self.levels, self.pool.shape[0])
                self.replaced()
        off = self._pool_used
        self._pool_used += size
        return off

    def _compact_pool(self) -> None:
        live = sorted(
            (int(self.seqs[q, K.Q_OFF]), q) for tree in self.live_trees.values() for q in tree._seqs.values()
        )
        pos = 0
        for off, q in live:  # ascending offsets: every move goes left, over data already moved
            cap = int(self.seqs[q, K.Q_CAP])
            used = int(self.seqs[q, K.Q_LEN])
            self.pool[pos : pos + used] = self.pool[off : off + used]
            self.levels[pos : pos + used] = self.levels[off : off + used]
            self.seqs[q, K.Q_OFF] = pos
            pos += cap
        self._pool_used = pos
        self._pool_garbage = 0

    # ---- the automaton -------------------------------------------------------------------------------

    def extend_tree(self, tid: int, qs: Sequence[int]) -> None:
        """Feeds the pooled tokens of sequences qs not yet in tree `tid` into it, growing the arena as needed."""
        arr = np.asarray(qs, np.int64)
        i = 0
        while i < arr.shape[0]:
            i, status = K.extend_seqs(*self.arena, self.trees, self.seqs, self.pool, self.levels, tid, arr, i)
            if status != K.DONE:
                self.grow_for(tid, int(arr[i]))

    def grow_for(self, tid: int, q: int, tokens: int | None = None) -> None:
        """Grows the arena for the rest of sequence q's tokens going into tree tid (at most `tokens` of them:
        what a piece will insert, so that a long rollout does not grow the hash table before it must)."""
        left = int(self.seqs[q, K.Q_LEN] - self.seqs[q, K.Q_EXT])
        if tokens is not None:
            left = min(left, max(1, int(tokens)))
        last, root = int(self.seqs[q, K.Q_LAST]), int(self.trees[tid, K.ROOT])
        need = int(self.states[last, K.LEN]) + 2 + int(self.states[root, K.COUNT])
        self.grow(states=2 * left + 2, edges=need + 3 * left)

    def grow(self, states: int, edges: int) -> None:
        n_states, n_edges, n_hash = (int(x) for x in self.meta[: K.JOURNAL])
        if n_states + states > self.states.shape[0]:
            self.states = resident.grown(self.states, _grown(self.states.shape[0], n_states + states))
            self.replaced()
        if n_edges + edges > self.edges.shape[0]:
            self.edges = resident.grown(self.edges, _grown(self.edges.shape[0], n_edges + edges))
            self.replaced()
        if 2 * (n_hash + edges) > self.hashes.shape[0]:
            growth, self.hash_growth = self.hash_growth, None
            if growth is not None and growth.rows >= 4 * (n_hash + edges):
                hashes = growth.finish(self)  # built outside the hold as far as it got, the rest now
            else:
                if growth is not None:
                    growth.abandon(self)
                hashes = np.full((pow2(4 * (n_hash + edges)), K.HASH_FIELDS), -1, np.int32)
                K.copy_hashes(hashes, self.hashes)
            self.hashes = hashes
            self.hashes_wanted = False
            self.replaced()

    def rebuild(self, tid: int, count_garbage: bool) -> None:
        """Rebuilds tree tid from its sequences' pooled tokens into fresh states (a new version)."""
        if count_garbage:
            self.garbage_states += int(self.trees[tid, K.T_STATES])
        self._new_root(tid)
        qs = list(self.live_trees[tid]._seqs.values())
        self.seqs[qs, K.Q_LAST] = self.trees[tid, K.ROOT]
        self.seqs[qs, K.Q_EXT] = 0
        self.extend_tree(tid, qs)
        if count_garbage:
            self.maybe_compact()

    def maybe_compact(self) -> None:
        """Rebuilds every live tree into fresh arrays when garbage outweighs live states."""
        live = int(self.meta[0]) - self.garbage_states
        if self.garbage_states > max(live, 1 << 16):
            if self.defer_compaction:
                self.compaction_wanted = True
            else:
                self.compact()

    def compact(self) -> None:
        """Rebuilds every live tree into freshly allocated arrays, dropping all garbage."""
        self._allocate(int(self.trees[list(self.live_trees), K.T_TOKENS].sum()) if self.live_trees else 0)
        for tid in list(self.live_trees):
            self.rebuild(tid, count_garbage=False)

    def check_arena(self) -> None:
        """Checks the automaton's invariants on every live tree (as ArcticInference's `check_integrity`), for
        tests after any mutation: counters within the arrays; from each root, every reachable state's edges
        carry distinct tokens that its MASK and (when hashed) the hash find, and lead to longer states ending
        in that token whose counts sum to its TOTAL; its BEST is its most frequent continuation (ties: the
        smaller token); its known sampling probabilities (where the forest remembers them, and only there are
        there columns and levels for them) are at most its count and sum within range; its suffix link leads
        to a shorter state of the same tree; a root's COUNT is its degree; a sequence's inserted tokens fit its
        length and its length its capacity. Raises AssertionError naming the first broken invariant."""
        states, edges, hashes, meta = self.states, self.edges, self.hashes, self.meta
        width, levels = (K.STATE_FIELDS, self.pool.shape[0]) if self.remembered else (K.BASE_STATE_FIELDS, 0)
        assert states.shape[1] == width and self.levels.shape[0] == levels, (
            f"remembered={self.remembered}: states {states.shape[1]} wide, {self.levels.shape[0]} levels"
        )
        assert 0 <= meta[0] <= states.shape[0] and 0 <= meta[1] <= edges.shape[0], (
            f"meta {meta[: K.META_FIELDS]} out of bounds"
        )
        assert 2 * meta[2] <= hashes.shape[0], f"hash table over half full: {meta[2]} entries"
        held = int((hashes[:, K.H_STATE] >= 0).sum())
        assert held == meta[2], f"hash table holds {held} entries, meta counts {meta[2]}"
        for tid, tree in self.live_trees.items():
            root = int(self.trees[tid, K.ROOT])
            assert states[root, K.LINK] == -1 and states[root, K.TOKEN] == -1, f"tree {tid}: bad root {root}"
            children: dict[int, list[tuple[int, int]]] = {}
            todo = [root]
            while todo:
                s = todo.pop()
                out = children[s] = []
                e = int(states[s, K.EDGE])
                while e != -1:
                    assert e < meta[1], f"state {s}: edge {e} past the edges in use"
                    tok, to = int(edges[e, K.TOK]), int(edges[e, K.TO])
                    assert K.find_edge(states, edges, hashes, s, tok) == e, (
                        f"state {s}: token {tok} not found"
                    )
                    assert states[to, K.TOKEN] == tok, f"state {s}: edge {tok} leads to another token's state"
                    assert states[to, K.LEN] > states[s, K.LEN], (
                        f"state {s}: edge {tok} leads to a shorter state"
                    )
                    out.append((tok, to))
                    if to not in children:
                        children[to] = []
                        todo.append(to)
                    e = int(edges[e, K.NEXT])
            for s, out in children.items():
                tokens = [tok for tok, _ in out]
                assert len(set(tokens)) == len(tokens), f"state {s}: duplicate continuations"
                hashed = bool(states[s, K.MASK] < 0)
                assert hashed == (len(out) > K.HASHED_DEGREE), (
                    f"state {s}: hashed {hashed} at degree {len(out)}"
                )
                total = sum(int(states[to, K.COUNT]) for _, to in out)
                assert states[s, K.TOTAL] == total, (
                    f"state {s}: TOTAL {states[s, K.TOTAL]}, children sum {total}"
                )
                best = max(out, key=lambda c: (states[c[1], K.COUNT], -c[0]))[1] if out else -1
                assert states[s, K.BEST] == best, f"state {s}: BEST {states[s, K.BEST]}, expected {best}"
                if s == root:
                    assert states[s, K.COUNT] == len(out), f"tree {tid}: the root's COUNT is not its degree"
                    continue
                if self.remembered:
                    known, psum = int(states[s, K.PKNOWN]), int(states[s, K.PSUM])
                    assert 0 <= known <= states[s, K.COUNT] and 0 <= psum <= known * K.PROB_LEVELS, (
                        f"state {s}: {known} known probabilities summing to {psum} at count {states[s, K.COUNT]}"
                    )
                link = int(states[s, K.LINK])
                assert link in children, f"state {s}: suffix link {link} leaves tree {tid}"
                assert states[link, K.LEN] < states[s, K.LEN], f"state {s}: suffix link {link} is not shorter"
            for q in tree._seqs.values():
                row = self.seqs[q]
                ext, length, cap = int(row[K.Q_EXT]), int(row[K.Q_LEN]), int(row[K.Q_CAP])
                assert 0 <= ext <= length <= cap, (
                    f"sequence {q}: {ext} inserted, {length} held, room for {cap}"
                )


def pow2(n: int) -> int:
    """The power of two at or above n (at least 64): a hash table's rows."""
    return 1 << max(6, (int(n) - 1).bit_length())


def _grown(current: int, needed: int) -> int:
    return max(needed, 2 * current)


class SuffixTree:
    """A set of token sequences indexed for drafting.

    extend(seq_id, tokens) appends to a sequence (created on first use); remove(seq_id) drops it whole;
    speculate(context) drafts the likeliest continuation of the context's best-scoring matching suffix.
    Trees built on the same `SuffixForest` can be drafted from in one batched native call.
    """

    def __init__(self, config: DraftConfig | None = None, forest: SuffixForest | None = None) -> None:
        """A tree on `forest` (a new one of its own when None, remembering probabilities as the config asks).
        Raises ValueError when the config asks for remembered probabilities and the forest keeps none."""
        self.config = config or DraftConfig()
        if forest is None:
            forest = SuffixForest(remembered=self.config.remembered_probs)
        elif self.config.remembered_probs and not forest.remembered:
            raise ValueError("remembered_probs needs a forest that keeps them: SuffixForest(remembered=True)")
        self.forest = forest
        self._seqs: dict[int, int] = {}  # seq_id -> the forest's sequence row
        self.tid = self.forest.new_tree(self)

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    @property
    def root(self) -> int:
        return int(self.forest.trees[self.tid, K.ROOT])

    @property
    def version(self) -> int:
        return int(self.forest.trees[self.tid, K.VERSION])

    @property
    def num_tokens(self) -> int:
        return int(self.forest.trees[self.tid, K.T_TOKENS])

    @property
    def num_states(self) -> int:
        return int(self.forest.trees[self.tid, K.T_STATES])

    @property
    def memory_bytes(self) -> int:
        """Arena bytes this tree uses (a row of `states`, `edges` or `hashes` per state, edge and hashed edge)
        plus its stored tokens."""
        f = self.forest
        row = f.trees[self.tid]
        return int(
            f.states.strides[0] * row[K.T_STATES]
            + f.edges.strides[0] * row[K.T_EDGES]
            + f.hashes.strides[0] * row[K.T_HASHED]
            + (f.pool.itemsize + (f.levels.itemsize if f.remembered else 0)) * row[K.T_TOKENS]
        )

    def seq_row(self, seq_id: int) -> int:
        """The forest's sequence row of `seq_id` (a kernel's handle on it). Raises KeyError if unknown."""
        return self._seqs[seq_id]

    def add_seq(self, seq_id: int, capacity: int) -> int:
        """Creates an empty sequence with room for `capacity` tokens; returns its row."""
        if not isinstance(seq_id, int | np.integer):
            raise TypeError(f"seq_id must be an int, got {type(seq_id).__name__}")
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        q = self.forest.new_seq(capacity)
        self.forest.seqs[q, K.Q_LAST] = self.root
        self._seqs[seq_id] = q
        if self.forest.observer is not None:
            self.forest.observer.seq_added(self.tid, q)
        return q

    def extend(
        self,
        seq_id: int,
        tokens: Sequence[int] | np.ndarray,
        levels: np.ndarray | None = None,
    ) -> None:
        """Appends tokens to sequence `seq_id` (creating it), with their sampling probabilities as `as_levels`
        gives them (None: unknown; dropped where the forest does not remember them). Raises ValueError/TypeError
        on bad tokens."""
        toks = as_tokens(tokens)
        if levels is not None and np.shape(levels) != toks.shape:
            raise ValueError(
                f"need one probability level per token ({toks.shape[0]}), got {np.shape(levels)}"
            )
        q = self._seqs.get(seq_id)
        if q is None:
            q = self.add_seq(seq_id, toks.shape[0])
        if toks.shape[0] == 0:
            return
        f = self.forest
        length = int(f.seqs[q, K.Q_LEN])
        f.make_room(q, length + toks.shape[0])
        off = int(f.seqs[q, K.Q_OFF])
        f.pool[off + length : off + length + toks.shape[0]] = toks
        if f.remembered:
            f.levels[off + length : off + length + toks.shape[0]] = 0 if levels is None else levels
        f.seqs[q, K.Q_LEN] = length + toks.shape[0]
        f.extend_tree(self.tid, [q])

    def invalidate_matches(self) -> None:
        """Makes requests re-match against this tree (new sequences may offer longer matches)."""
        self.forest.trees[self.tid, K.VERSION] = self.forest.next_version()

    def remove(self, seq_id: int) -> None:
        """Drops a whole sequence. Raises KeyError for an unknown seq_id."""
        self.remove_many([seq_id])

    def remove_many(self, seq_ids: Iterable[int]) -> None:
        """Drops several sequences with one rebuild. Raises KeyError (and removes nothing) on an unknown id."""
        ids = list(seq_ids)
        missing = [s for s in ids if s not in self._seqs]
        if missing:
            raise KeyError(f"unknown seq_id(s) {missing[:5]}")
        if not ids:
            return
        for s in ids:
            self.forest.free_seq(self._seqs.pop(s))
        self.forest.rebuild(self.tid, count_garbage=True)

    def speculate(self, context: Sequence[int] | np.ndarray, max_tokens: int | None = None) -> Draft:
        """Drafts a continuation of `context` (its last max_depth tokens are matched).

        Returns a Draft; an empty one when no suffix of the context has a continuation in the tree.
        """
        cfg = self.config
        budget = max(cfg.max_spec_tokens if max_tokens is None else int(max_tokens), 0)
        ctx = as_tokens(context, "context")[-cfg.max_depth :]
        f = self.forest
        root = self.root
        state, length = K.advance_match(
            f.states, f.edges, f.hashes, root, root, 0, ctx, 0, ctx.shape[0], cfg.max_depth
        )
        out = DraftOutputs(
            tok=np.empty((1, budget), np.int32),
            prob=np.empty((1, budget), np.float32),
            sup=np.empty((1, budget), np.int32),
            mem=np.empty((1, budget), np.float32),
            info=np.empty((1, K.INFO_FIELDS), np.int32),
            score=np.empty(1),
        )
        n, match_len, score, origin = K.draft_best(
            f.states,
            (root, state, length),
            budget,
            draft_params(cfg),
            0.0,
            out.tok,
            out.prob,
            out.sup,
            0,
            np.empty(budget, np.int32),
            np.empty(budget, np.float32),
            np.empty(budget, np.int32),
        )
        K.remembered_path(f.states, origin, n, cfg.remembered_probs, out.mem, 0)
        return Draft(
            out.tok[0, :n].copy(),
            out.prob[0, :n].copy(),
            out.sup[0, :n].copy(),
            int(match_len),
            float(score),
            out.mem[0, :n].copy(),
        )

    def to_bytes(self) -> bytes:
        """Compact serialized form: the sequences and their probability levels (the automaton is rebuilt on
        load)."""
        parts = [_SERIAL_MAGIC, struct.pack("<HI", _SERIAL_VERSION, len(self._seqs))]
        for seq_id, q in self._seqs.items():
            toks = self.forest.seq_tokens(q)
            levels = self.forest.seq_levels(q)
            known = bool(levels.any())
            parts.append(struct.pack("<qI", seq_id, toks.shape[0]))
            parts.append(toks.astype("<i4", copy=False).tobytes())
            parts.append(struct.pack("<B", known))
            if known:
                parts.append(levels.tobytes())
        return b"".join(parts)

    @classmethod
    def from_bytes(
        cls, data: bytes, config: DraftConfig | None = None, forest: SuffixForest | None = None
    ) -> SuffixTree:
        """Rebuilds a tree from `to_bytes()` output. Raises ValueError on a malformed or truncated buffer."""
        view = memoryview(data)
        if len(view) < 10 or bytes(view[:4]) != _SERIAL_MAGIC:
            raise InvalidInput("not a serialized suffix tree (bad magic)")
        version, n_seqs = struct.unpack_from("<HI", view, 4)
        if version not in (1, _SERIAL_VERSION):
            raise InvalidInput(f"unsupported suffix tree serialization version {version}")
        tree = cls(config, forest)
        pos = 10
        for _ in range(n_seqs):
            if pos + 12 > len(view):
                raise InvalidInput("truncated suffix tree buffer")
            seq_id, n = struct.unpack_from("<qI", view, pos)
            pos += 12
            if pos + 4 * n > len(view):
                raise InvalidInput("truncated suffix tree buffer")
            tokens = np.frombuffer(view[pos : pos + 4 * n], "<i4").astype(np.int32)
            pos += 4 * n
            levels = None
            if version >= 2:
                if pos + 1 > len(view):
                    raise InvalidInput("truncated suffix tree buffer")
                known = view[pos]
                pos += 1
                if known:
                    if pos + n > len(view):
                        raise InvalidInput("truncated suffix tree buffer")
                    levels = np.frombuffer(view[pos : pos + n], np.uint8).copy()
                    if int(levels.max(initial=0)) > K.PROB_LEVELS + 1:
                        raise InvalidInput("probability level out of range in suffix tree buffer")
                    pos += n
            tree.extend(seq_id, tokens, levels)
        if pos != len(view):
            raise InvalidInput("trailing bytes after serialized suffix tree")
        return tree

    def close(self) -> None:
        """Releases the tree's place in the arena (its states and tokens become garbage)."""
        for q in self._seqs.values():
            self.forest.free_seq(q)
        self._seqs.clear()
        self.forest.free_tree(self.tid)
        self.forest.maybe_compact()
