"""Tree work in bounded pieces: what a drafting server does with history that arrives while it decodes.

A `ProblemIndex` normally changes its trees at once: a rollout is inserted whole, an eviction rebuilds its
problem's tree, the global tree's cap rebuilds it from the newest rollouts, and the arena compacts itself
(rebuilding every tree) when garbage outweighs the live states. A server that follows a replica cannot afford
that inside a decode step (a rebuild of the global tree takes a second), so `DeferredIndex`
(`history_store.automaton.deferred_index`) hands the same changes to a `TreeWork`, which carries them out in
pieces of at most a given number of tokens (`TreeWork.run`), between decode steps:
- insertion: a rollout's tokens go into the token pool at once, and the automaton takes them in a piece at a
  time (`feed_seq`); a partly inserted rollout drafts what it has so far;
- removal: a tree that loses rollouts keeps serving as it is while a shadow tree in the same arena takes in the
  survivors a piece at a time (`ShadowRebuild`); the finished shadow replaces it in place (same tree id, new
  root and version, so requests re-match, as after any rebuild), and its old states become garbage;
- compaction: a `Mirror` rebuilds every live tree into fresh arrays a piece at a time, following what the
  trees do meanwhile (the forest reports new trees, rebuilds, new and freed sequences through its `observer`),
  and swaps them in when it has caught up: one swap of arrays, every request re-matching once. It reclaims
  garbage (`SuffixForest.maybe_compact`); the arena grows by itself, in place (`resident.grown`), with its hash
  table's next size written ahead (`SuffixForest.populate_ahead`), so no growth copies inside a piece.
Every piece is counted in tokens, not time, so the same work in the same order drafts the same.

The arena is one set of numpy tables that the decode step reads and mutates; whoever calls `run` must hold
the step off meanwhile (`workers.generator.history_feed`). The pieces' kernels release the GIL (`nogil`), so
the engine's own Python goes on while one runs. The mirror's fresh arrays are touched only here, so they grow
outside that hold (`Mirror.prepare`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba import njit

from history_store.automaton import kernels as K
from history_store.automaton import resident
from history_store.automaton.pool_mirror import PoolMirror
from history_store.automaton.resident import FILL_BYTES, Filled, Frontier, arena_rows_ahead
from history_store.automaton.suffix_tree import SuffixForest, SuffixTree, pow2


@njit(cache=True, nogil=True)
def feed_seq(states, edges, hashes, meta, trees, seqs, pool, levels, tid, q, upto, budget):
    """Feeds sequence q's pooled tokens from where tree `tid` stopped (Q_EXT) up to `upto` (at most `budget`
    of them) into the tree, reading the segment's place from `seqs` (Q_OFF). Keeps the tree's counters.
    Returns (tokens fed, DONE or NEED_ARENA: it stopped for room, keeping what it fed)."""
    off = seqs[q, K.Q_OFF]
    start = off + seqs[q, K.Q_EXT]
    end = off + min(upto, seqs[q, K.Q_EXT] + budget)
    if start >= end:
        return 0, K.DONE
    s0, e0, h0 = meta[0], meta[1], meta[2]
    stop, last = K.extend_tokens(
        states, edges, hashes, meta, trees[tid, K.ROOT], seqs[q, K.Q_LAST], pool, levels, start, end
    )
    seqs[q, K.Q_LAST] = last
    seqs[q, K.Q_EXT] = stop - off
    trees[tid, K.T_TOKENS] += stop - start
    trees[tid, K.T_STATES] += meta[0] - s0
    trees[tid, K.T_EDGES] += meta[1] - e0
    trees[tid, K.T_HASHED] += meta[2] - h0
    return stop - start, K.DONE if stop == end else K.NEED_ARENA


@njit(cache=True, nogil=True)
def mirror_pass(states, edges, hashes, meta, trees, seqs, owner, real_seqs, pool, levels, q, budget):
    """Feeds the mirror's trees, from sequence row q on, with what the real trees hold and the mirror not yet:
    for each owned row, its pooled tokens from the mirror's Q_EXT up to the real tree's. Returns (row reached,
    tokens fed, status): DONE with row = number of rows when every row has caught up, DONE with a row before
    that when the budget ran out there, NEED_ARENA at the row that needs room."""
    fed = 0
    n = owner.shape[0]
    while q < n:
        tid = owner[q]
        if tid >= 0:
            seqs[q, K.Q_OFF] = real_seqs[q, K.Q_OFF]
            upto = real_seqs[q, K.Q_EXT]
            if seqs[q, K.Q_EXT] < upto:
                if fed >= budget:
                    return q, fed, K.DONE
                done, status = feed_seq(
                    states, edges, hashes, meta, trees, seqs, pool, levels, tid, q, upto, budget - fed
                )
                fed += done
                if status != K.DONE:
                    return q, fed, status
                if seqs[q, K.Q_EXT] < upto:
                    return q, fed, K.DONE  # the budget ended inside this row
        q += 1
    return q, fed, K.DONE


def place(tree: SuffixTree, seq_id: int, tokens: np.ndarray, levels: np.ndarray | None) -> int:
    """Adds sequence `seq_id` to `tree` with its tokens in the pool but none in the automaton yet (a `feed`
    takes them in); returns its row. Tokens are validated int32 ids (`as_tokens`)."""
    f = tree.forest
    q = tree.add_seq(seq_id, max(int(tokens.shape[0]), 1))
    n = int(tokens.shape[0])
    f.make_room(q, n)
    off = int(f.seqs[q, K.Q_OFF])
    f.pool[off : off + n] = tokens
    if f.remembered:
        f.levels[off : off + n] = 0 if levels is None else levels
    f.seqs[q, K.Q_LEN] = n
    return q


def feed(tree: SuffixTree, q: int, budget: int) -> int:
    """Feeds up to `budget` of row q's pooled tokens that `tree` has not taken in yet; grows the arena when it
    must. Returns the tokens fed."""
    f = tree.forest
    done = 0
    while done < budget:
        n, status = feed_seq(
            f.states,
            f.edges,
            f.hashes,
            f.meta,
            f.trees,
            f.seqs,
            f.pool,
            f.levels,
            tree.tid,
            q,
            int(f.seqs[q, K.Q_LEN]),
            budget - done,
        )
        done += int(n)
        if status == K.DONE:
            break
        f.grow_for(tree.tid, q, budget - done)
    return done


def left_in(tree: SuffixTree, q: int) -> int:
    """Pooled tokens of row q that `tree` has not taken in."""
    seqs = tree.forest.seqs
    return int(seqs[q, K.Q_LEN] - seqs[q, K.Q_EXT])


def adopt(tree: SuffixTree, shadow: SuffixTree) -> None:
    """`tree` becomes what `shadow` holds, in place: the same tree id (requests keep pointing at it), the
    shadow's root, states, sequences and counters, a new version (requests re-match); its own states become
    garbage and the shadow's id is free again."""
    f = tree.forest
    old, new = tree.tid, shadow.tid
    f.garbage_states += int(f.trees[old, K.T_STATES])
    for q in tree._seqs.values():
        f.free_seq(q)
    f.trees[old] = f.trees[new]
    f.trees[old, K.VERSION] = f.next_version()
    tree._seqs = shadow._seqs
    shadow._seqs = {}
    del f.live_trees[new]
    f._free_trees.append(new)
    if f.observer is not None:
        f.observer.adopted(old, new, list(tree._seqs.values()))
    f.maybe_compact()


@dataclass
class _Feed:
    """A rollout whose tokens its tree has yet to take in."""

    tree: SuffixTree
    seq_id: int
    q: int
    invalidate: bool  # re-match requests on the tree when it is in (a problem's tree: longer matches)
    tag: Any = None  # the owner's name for the rollout, handed back to `on_fed`


@dataclass
class ShadowRebuild:
    """Rebuilds `tree` without the sequences in `exclude`, into a shadow tree beside it, a piece at a time.

    The shadow takes every other sequence of the tree in id order, those added while it works included; once
    it holds them all it replaces the tree (`adopt`). Sequences removed after the shadow copied them stay in
    it: the owner starts another rebuild for them (`late`)."""

    tree: SuffixTree
    exclude: set[int]
    shadow: SuffixTree | None = None
    copied: dict[int, int] = field(default_factory=dict)  # seq id -> the shadow's row
    todo: deque[int] = field(default_factory=deque)
    highest: int = -1  # the highest seq id queued so far
    current: int | None = None  # the seq id being fed

    def start(self) -> None:
        self.shadow = SuffixTree(self.tree.config, self.tree.forest)
        self._queue_new()

    def _queue_new(self) -> None:
        new = sorted(s for s in self.tree._seqs if s > self.highest)
        if new:
            self.highest = new[-1]
            self.todo.extend(new)

    def drop(self, seq_ids: set[int]) -> set[int]:
        """Leaves these sequences out if the shadow has not copied them yet; returns those it already has
        (a later rebuild must remove them)."""
        self.exclude |= seq_ids
        return {s for s in seq_ids if s in self.copied}

    def run(self, budget: int, wait: bool = False) -> tuple[int, bool]:
        """Does up to `budget` tokens of the rebuild; returns (tokens done, finished). Finished: the tree
        has been replaced. `wait`: stop where the hash table's growth is not ready (`SuffixForest.wait_for_hashes`)."""
        assert self.shadow is not None
        done = 0
        f = self.tree.forest
        while done < budget:
            if wait and f.wait_for_hashes(budget - done):
                break
            if self.current is None:
                if not self.todo:
                    self._queue_new()
                    if not self.todo:
                        adopt(self.tree, self.shadow)
                        self.shadow = None
                        return done, True
                seq_id = self.todo.popleft()
                if seq_id in self.exclude or seq_id not in self.tree._seqs:
                    continue
                src = self.tree._seqs[seq_id]
                off, n = int(f.seqs[src, K.Q_OFF]), int(f.seqs[src, K.Q_LEN])
                tokens = f.pool[off : off + n].copy()
                levels = f.levels[off : off + n].copy() if f.remembered else None
                self.copied[seq_id] = place(self.shadow, seq_id, tokens, levels)
                self.current = seq_id
            q = self.copied[self.current]
            done += feed(self.shadow, q, budget - done)
            if left_in(self.shadow, q) == 0:
                self.current = None
        return done, False

    def abandon(self) -> None:
        """Drops the shadow (its states become garbage)."""
        if self.shadow is not None:
            self.shadow.close()
            self.shadow = None


class Mirror:
    """An incremental compaction: every live tree rebuilt into fresh arrays while the trees keep changing.

    It follows the forest through the forest's `observer` hooks, which only record what happened (they run
    inside the decode step); `apply_events` replays them on the mirror before each piece. `prepare` (no hold
    needed: nothing else touches the mirror's arrays) grows the fresh arrays ahead of the next piece. When a
    pass finds every sequence caught up, `swap` installs the fresh arrays in the forest."""

    def __init__(self, forest: SuffixForest) -> None:
        """Fresh arrays with room for `HEADROOM` times what the forest's live trees hold (allocated here, which
        needs no hold on the step; the hash table's empty slots are written by `prepare`, a chunk at a time,
        and `begin` waits for them: `ready`)."""
        self.forest = forest
        used_states, used_edges, used_hash = (max(1, int(x)) for x in forest.meta[: K.JOURNAL])
        live = max(1, used_states - forest.garbage_states) / used_states  # the live share of what is used
        states = max(1024, int(HEADROOM * live * used_states))
        edges = max(1024, int(HEADROOM * live * used_edges))
        hashed = max(1024, int(HEADROOM * live * used_hash))
        self.states = resident.zeros((states, forest.states.shape[1]), np.int32)
        self.edges = resident.zeros((edges, K.EDGE_FIELDS), np.int32)
        self._empty_hashes = Filled((pow2(4 * hashed), K.HASH_FIELDS), np.int32, -1)
        self.hashes = self._empty_hashes.array
        self.meta = K.new_meta()
        self.trees = np.zeros_like(forest.trees)
        self.seqs = np.zeros_like(forest.seqs)
        self.owner = np.full(forest.seqs.shape[0], -1, np.int64)
        self.events: list[tuple[str, Any]] = []
        self.cursor = 0
        self.need: tuple[int, int] | None = None  # (tid, row) the last piece stopped at for room
        self._frontier = Frontier()

    @property
    def ready(self) -> bool:
        """Its hash table's empty slots are all written: `begin` may start it."""
        return self._empty_hashes.ready

    def begin(self) -> None:
        """Starts following the forest (hold the step off): a root per live tree, every sequence to feed."""
        f = self.forest
        self._fit_tables()
        for tid, tree in f.live_trees.items():
            self._reset(tid, list(tree._seqs.values()))
        f.observer = self

    # ---- hooks (called by the forest, inside the step): record only --------------------------------------

    def tree_reset(self, tid: int) -> None:
        self.events.append(("reset", tid))

    def tree_freed(self, tid: int) -> None:
        self.events.append(("freed", tid))

    def seq_added(self, tid: int, q: int) -> None:
        self.events.append(("seq", (tid, q)))

    def seq_freed(self, q: int) -> None:
        self.events.append(("unseq", q))

    def adopted(self, tid: int, shadow_tid: int, qs: list[int]) -> None:
        self.events.append(("adopt", (tid, shadow_tid, qs)))

    # ---- the mirror's own work ---------------------------------------------------------------------------

    def _fit_tables(self) -> None:
        f = self.forest
        if self.trees.shape[0] < f.trees.shape[0]:
            self.trees = resident.grown(self.trees, f.trees.shape[0])
        if self.seqs.shape[0] < f.seqs.shape[0]:
            self.seqs = resident.grown(self.seqs, f.seqs.shape[0])
            owner = np.full(f.seqs.shape[0], -1, np.int64)
            owner[: self.owner.shape[0]] = self.owner
            self.owner = owner

    def _root(self, tid: int) -> int:
        self._room(1, 0)
        root = int(K.new_state(self.states, self.meta, 0, -1, 0, -1))
        self.trees[tid] = 0
        self.trees[tid, K.ROOT] = root
        self.trees[tid, K.T_STATES] = 1
        return root

    def _reset(self, tid: int, qs: list[int]) -> None:
        self._fit_tables()
        root = self._root(tid)
        rows = np.asarray(qs, np.int64)
        self.owner[rows] = tid
        self.seqs[rows, K.Q_LAST] = root
        self.seqs[rows, K.Q_EXT] = 0

    def apply_events(self) -> None:
        """Replays what the forest reported since the last call (hold the step off: it reads the trees)."""
        events, self.events = self.events, []
        f = self.forest
        self._fit_tables()
        for kind, arg in events:
            if kind == "reset":
                tree = f.live_trees.get(arg)
                self._reset(arg, list(tree._seqs.values()) if tree is not None else [])
            elif kind == "seq":
                tid, q = arg
                self.owner[q] = tid
                self.seqs[q, K.Q_LAST] = self.trees[tid, K.ROOT]
                self.seqs[q, K.Q_EXT] = 0
            elif kind == "unseq":
                self.owner[arg] = -1
            elif kind == "adopt":
                tid, shadow, qs = arg
                self.trees[tid] = self.trees[shadow]
                for q in qs:
                    self.owner[q] = tid
            # "freed": the tree's sequences were freed one by one before it; nothing of it is fed again

    def _room(self, states: int, edges: int) -> None:
        n_states, n_edges, n_hash = (int(x) for x in self.meta[: K.JOURNAL])
        if n_states + states > self.states.shape[0]:
            self.states = resident.grown(self.states, max(n_states + states, 2 * self.states.shape[0]))
        if n_edges + edges > self.edges.shape[0]:
            self.edges = resident.grown(self.edges, max(n_edges + edges, 2 * self.edges.shape[0]))
        if 2 * (n_hash + edges) > self.hashes.shape[0]:
            hashes = np.full((pow2(4 * (n_hash + edges)), K.HASH_FIELDS), -1, np.int32)
            K.copy_hashes(hashes, self.hashes)
            self.hashes = hashes

    def prepare(self, tokens: int) -> None:
        """Writes the next chunk of the hash table's empty slots until it is `ready`; then grows the fresh
        arrays for what the last piece stopped at, and maps the rows the next `tokens` tokens may write
        (`resident`; needs no hold on the step)."""
        if not self.ready:
            self._empty_hashes.fill(FILL_BYTES)
            return
        self._frontier.ahead(arena_rows_ahead(self.states, self.edges, self.meta, tokens))
        if self.need is None:
            return
        tid, q = self.need
        f = self.forest
        left = int(f.seqs[q, K.Q_LEN] - self.seqs[q, K.Q_EXT])
        last, root = int(self.seqs[q, K.Q_LAST]), int(self.trees[tid, K.ROOT])
        need = int(self.states[last, K.LEN]) + 2 + int(self.states[root, K.COUNT])
        self._room(2 * left + 2, need + 3 * left)
        self.need = None

    def _pass(self, cursor: int, budget: int) -> tuple[int, int, int]:
        f = self.forest
        return mirror_pass(
            self.states,
            self.edges,
            self.hashes,
            self.meta,
            self.trees,
            self.seqs,
            self.owner,
            f.seqs,
            f.pool,
            f.levels,
            cursor,
            budget,
        )

    def run(self, budget: int) -> tuple[int, bool]:
        """A piece of at most `budget` tokens (hold the step off); returns (tokens fed, caught up). Caught up:
        a whole pass over the sequences found nothing left to feed."""
        self.apply_events()
        if self.need is not None:
            return 0, False  # out of room: `prepare` grows the arrays outside the hold (a copy of the arena)
        start = self.cursor
        q, fed, status = self._pass(self.cursor, budget)
        fed = int(fed)
        if status != K.DONE:
            self.cursor = int(q)
            self.need = (int(self.owner[q]), int(q))
            return fed, False
        if q < self.owner.shape[0]:
            self.cursor = int(q)
            return fed, False
        self.cursor = 0
        # Caught up if this pass started at row 0 and fed nothing, or a quick second look finds nothing.
        if start == 0 and fed == 0:
            return fed, True
        q, _, status = self._pass(0, 0)
        return fed, status == K.DONE and q == self.owner.shape[0]

    def swap(self) -> None:
        """Installs the fresh arrays (hold the step off): the forest's trees and sequences point into them, and
        every tree gets a new version, so requests re-match once."""
        f = self.forest
        tids = np.fromiter(f.live_trees, np.int64, len(f.live_trees))
        cols = [K.ROOT, K.T_STATES, K.T_EDGES, K.T_HASHED, K.T_TOKENS]
        if tids.size:
            f.trees[np.ix_(tids, cols)] = self.trees[np.ix_(tids, cols)]
            for tid in tids.tolist():
                f.trees[tid, K.VERSION] = f.next_version()
        owned = np.flatnonzero(self.owner >= 0)
        f.seqs[owned, K.Q_LAST] = self.seqs[owned, K.Q_LAST]
        f.seqs[owned, K.Q_EXT] = self.seqs[owned, K.Q_EXT]
        f.drop_hash_growth()  # it copies the table replaced here
        f.states, f.edges, f.hashes, f.meta = self.states, self.edges, self.hashes, self.meta
        f.garbage_states = 0
        f.replaced()


# Tokens of insertion whose arena rows `prepare` keeps mapped ahead (`resident`): 64k tokens are 4 MiB of
# states, mapped 2 MiB at a time, and about 0.2 s of the fastest ingest `das bench ingest` drives (300k tokens/s);
# `prepare` runs before every piece.
RESIDENT_TOKENS = 1 << 16
# A compaction's fresh arrays have room for this many times the live trees' states and edges (they grow in
# place past it, `resident.grown`, as the forest's own do).
HEADROOM = 1.5


# A `PoolMirror` packs the token pool, in pieces, once its garbage is this share of its live tokens (the forest
# packs it at once, inside whatever call needs room, past 1.0)...
POOL_GARBAGE = 0.5
# ... and grows it once it is this full, where growing would copy it (a pool that has no reservation left;
# a reserved one grows in place, `resident.grown`).
POOL_TIGHT = 0.7
# Copying this many pooled tokens counts as one token of tree work (a copy of 4 bytes against an insertion).
POOL_COPY_PER_TOKEN = 1024


def _pool_wanted(f: SuffixForest) -> bool:
    """Whether the token pool wants packing or, where growing it would copy it, growing (`PoolMirror`)."""
    if f.pool_garbage > POOL_GARBAGE * max(f.pool_used - f.pool_garbage, 1 << 10):
        return True
    copies = resident.capacity(f.pool) < 2 * f.pool.shape[0]
    return copies and f.pool_used > POOL_TIGHT * f.pool.shape[0]


class TreeWork:
    """The queue of tree work a `DeferredIndex` hands out, done in pieces of bounded tokens (`run`).

    Order within a piece: rollouts waiting to be inserted first (they make history fresh), then rebuilds of
    trees that lost rollouts, then compaction; when more than one kind waits, each gets its share of a piece,
    so none starves. Compaction starts when the forest asks for it (`SuffixForest.maybe_compact` with the
    forest's `defer_compaction`)."""

    def __init__(self, forest: SuffixForest) -> None:
        self.forest = forest
        forest.defer_compaction = True
        self.feeds: deque[_Feed] = deque()
        self.feed_tokens = 0  # pooled tokens the queued feeds have yet to insert (an estimate)
        self.rebuilds: dict[int, ShadowRebuild] = {}  # tree id -> its rebuild under way
        self.late: dict[int, tuple[SuffixTree, set[int]]] = {}  # removals a running rebuild had copied
        self.mirror: Mirror | None = None
        self.pool_mirror: PoolMirror | None = None  # allocated outside the hold (`prepare`)
        self.pool_installs = 0  # pools grown and packed in pieces
        self._planned: Mirror | None = None  # a compaction's arrays, allocated outside the hold (`prepare`)
        self.done_tokens = 0  # every token of work done, for reports
        self.pieces = 0
        self.on_fed: Any = None  # called with each _Feed whose rollout is in

    # ---- what the index hands over -------------------------------------------------------------------

    def insert(
        self,
        tree: SuffixTree,
        seq_id: int,
        tokens: np.ndarray,
        levels: np.ndarray | None,
        invalidate: bool,
        tag: Any = None,
    ) -> None:
        """Queues a rollout for `tree`: its tokens go into the pool now, into the automaton piece by piece;
        `on_fed` gets `tag` back when it is in."""
        q = place(tree, seq_id, tokens, levels)
        self.feeds.append(_Feed(tree, seq_id, q, invalidate, tag))
        self.feed_tokens += int(tokens.shape[0])

    def remove(self, tree: SuffixTree, seq_ids: list[int]) -> None:
        """Removes sequences from `tree`: at once when none would be left (a new root costs nothing),
        otherwise by a shadow rebuild that keeps the tree serving meanwhile."""
        ids = {int(s) for s in seq_ids}
        if not ids:
            return
        if ids >= set(tree._seqs):  # everything goes: nothing to rebuild
            self._cancel(tree)
            tree.remove_many(list(tree._seqs))
            return
        job = self.rebuilds.get(tree.tid)
        if job is not None:
            copied = job.drop(ids)
            if copied:
                pending = self.late.setdefault(tree.tid, (tree, set()))[1]
                pending |= copied
            return
        job = ShadowRebuild(tree, ids)
        job.start()
        self.rebuilds[tree.tid] = job

    def _cancel(self, tree: SuffixTree) -> None:
        job = self.rebuilds.pop(tree.tid, None)
        if job is not None:
            job.abandon()
        self.late.pop(tree.tid, None)

    def forget(self, tree: SuffixTree) -> None:
        """The tree is about to lose every sequence or close: no rebuild of it goes on."""
        self._cancel(tree)

    @property
    def pending(self) -> bool:
        return bool(
            self.feeds
            or self.rebuilds
            or self.late
            or self.mirror is not None
            or self.forest.compaction_wanted
            or self.pool_mirror is not None
            or self.forest.hash_growth_due
        )

    # ---- doing it ----------------------------------------------------------------------------------------

    def run(self, budget: int, wait: bool = True) -> int:
        """Does at most about `budget` tokens of work (hold the step off); returns the tokens done. `wait`:
        feeds and rebuilds stop short of growing the hash table before its next size is ready
        (`SuffixForest.wait_for_hashes`), which `prepare` builds; `settle`, where nobody waits, grows it."""
        self.pieces += 1
        self.forest.hash_piece()  # the hash table's growth: begun or installed, O(1) or its journal's length
        kinds = [k for k, busy in (("feed", self.feeds), ("rebuild", self.rebuilds or self.late)) if busy]
        if self.mirror is not None or self.forest.compaction_wanted:
            kinds.append("compact")
        if self.pool_mirror is not None:
            kinds.append("pool")
        if not kinds:
            return 0
        share = max(1, budget // len(kinds))
        done = 0
        for kind in kinds:
            left = budget - done if kind == kinds[-1] else share
            if kind == "feed":
                done += self._feed(left, wait)
            elif kind == "rebuild":
                done += self._rebuild(left, wait)
            elif kind == "pool":
                done += self._pool(left)
            else:
                done += self._compact(left)
        self.done_tokens += done
        return done

    def _feed(self, budget: int, wait: bool) -> int:
        done = 0
        while self.feeds and done < budget:
            if wait and self.forest.wait_for_hashes(budget - done):
                break
            item = self.feeds[0]
            q = item.tree._seqs.get(item.seq_id)
            if q is None or self.forest.live_trees.get(item.tree.tid) is not item.tree:
                self.feeds.popleft()  # removed before it was in
                continue
            item.q = q  # a rebuild of its tree may have put it in a row of its own
            n = feed(item.tree, item.q, budget - done)
            done += n
            self.feed_tokens -= n
            if left_in(item.tree, item.q) == 0:
                self.feeds.popleft()
                if item.invalidate:
                    item.tree.invalidate_matches()
                if self.on_fed is not None:
                    self.on_fed(item)
        if not self.feeds:
            self.feed_tokens = 0
        return done

    def _rebuild(self, budget: int, wait: bool) -> int:
        done = 0
        for tid in list(self.rebuilds):
            if done >= budget:
                break
            job = self.rebuilds[tid]
            n, finished = job.run(budget - done, wait)
            done += n
            if finished:
                del self.rebuilds[tid]
        for tid in list(self.late):
            if tid not in self.rebuilds:
                tree, ids = self.late.pop(tid)
                ids &= set(tree._seqs)
                self.remove(tree, list(ids))
        return done

    def _compact(self, budget: int) -> int:
        f = self.forest
        if self.mirror is None:
            if self._planned is None or not self._planned.ready:
                return 0  # its arrays are made ready outside the hold first (`prepare`)
            f.compaction_wanted = False
            self.mirror, self._planned = self._planned, None
            self.mirror.begin()
            return 0
        done, caught_up = self.mirror.run(budget)
        if caught_up:
            self.mirror.apply_events()
            done2, caught_up = self.mirror.run(1 << 30) if self.mirror.events else (0, True)
            done += done2
            if caught_up:
                self.mirror.swap()
                f.observer = None
                self.mirror = None
        return done

    def _pool(self, budget: int) -> int:
        """A piece of the pool's growth (`PoolMirror`), `budget` tokens of tree work's worth."""
        job = self.pool_mirror
        assert job is not None
        if not job.begun:
            if not job.begin():
                self.pool_mirror = None  # outgrown before it began: `prepare` plans a larger one
            return 1
        if not job.copied:
            return max(1, job.run(budget * POOL_COPY_PER_TOKEN) // POOL_COPY_PER_TOKEN)
        if job.finish():  # or outgrown meanwhile: either way a later one starts afresh
            self.pool_installs += 1
        self.pool_mirror = None
        return 1

    def prepare(self, serving: bool = True) -> None:
        """Work that needs no hold on the step: mapping the arena's next rows (`resident`), making a
        compaction's new arrays ready or growing them, and while `serving` (not `settle`, where nobody waits)
        writing the hash table's next size ahead and allocating the pool's new arrays."""
        f = self.forest
        f.populate_ahead(RESIDENT_TOKENS, spare=serving)
        if serving and self.pool_mirror is None and _pool_wanted(f):
            self.pool_mirror = PoolMirror(f)
        if self.mirror is not None:
            self.mirror.prepare(RESIDENT_TOKENS)
        elif self.forest.compaction_wanted:
            if self._planned is None:
                self._planned = Mirror(self.forest)
            self._planned.prepare(RESIDENT_TOKENS)

    def settle(self, piece: int = 1 << 16) -> int:
        """Does everything queued (a caller that wants the trees complete now: tests, a synchronous
        catch-up). Returns the tokens done."""
        total = 0
        while self.pending:
            total += self.run(piece, wait=False)
            # Nobody waits here: the pool is not copied beside itself by a pool mirror, nor the hash table's next
            # size written ahead (memory held early: at 10 M history tokens an eager start took 108 s and peaked
            # 4.9 GB with a pool mirror and a compaction beside the arena, benchmarks/history_load_grown_in_place.json).
            self.prepare(serving=False)
        return total
