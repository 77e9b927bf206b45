"""A `ProblemIndex` whose history trees change in bounded pieces of work, between decode steps.

What a drafting server that follows its node's replica uses (`workers.generator.history_feed`). Its bookkeeping
is the `ProblemIndex`'s and changes at once (which rollouts each window holds, their lengths, the global tree's
rollouts and its cap, evictions), so the budget learns lengths as soon as a rollout arrives. The trees follow
through a `TreeWork` (`history_store.automaton.tree_work`), a piece of at most a given number of tokens at a
time (`work`): a rollout's tokens enter its trees piece by piece, a tree that loses rollouts keeps serving until
its rebuild is ready, and compaction of the arena runs the same way. `settle` does everything queued (the trees
then equal a `ProblemIndex`'s given the same rollouts, drafts included).

Differences from a `ProblemIndex` while work is queued: a rollout drafts only once (and as far as) its tokens
are in; an evicted rollout stays draftable until its tree's rebuild replaces the tree (it is still lossless:
verification decides, and the next rollout of the epoch that slid brings better history anyway); the global
tree past its cap drops to `global_keep` of it (half: a rebuild then comes every half cap of new tokens, not
every quarter); and when inserting falls behind by more than `max_backlog` tokens, new rollouts skip the
global tree (their problems' trees still take them), so the work a cluster hands a server stays bounded
whatever it publishes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np

from history_store.automaton import kernels as K
from history_store.automaton.problem_index import ProblemIndex
from history_store.automaton.suffix_tree import SuffixTree
from history_store.automaton.tree_work import TreeWork

# Rollout keys whose global insertion finished, kept for `drain_global_ready` (a report's window).
_READY_KEPT = 1 << 16


class DeferredIndex(ProblemIndex):
    """A ProblemIndex whose trees change in bounded pieces (`work`), see the module's docstring."""

    def __init__(
        self, *args: Any, global_keep: float = 0.5, max_backlog: int | None = None, **kwargs: Any
    ) -> None:
        """The arguments of ProblemIndex; `global_keep`: the share of the cap the global tree keeps when it
        passes it; `max_backlog`: tokens waiting to be inserted past which new rollouts skip the global tree
        (None: a quarter of the global tree's cap)."""
        super().__init__(*args, **kwargs)
        if not 0.0 < global_keep < 1.0:
            raise ValueError(f"global_keep must be in (0, 1), got {global_keep}")
        self.global_keep = global_keep
        self.max_backlog = self.global_tokens // 4 if max_backlog is None else max_backlog
        self.tree_work = TreeWork(self.forest)
        self.tree_work.on_fed = self._fed
        self._global_pooled = 0
        self.global_skipped = 0  # rollouts that skipped the global tree (backlog)
        self.lazy_builds_queued = 0  # rollouts of lazy builds left to the tree work (`_build`)
        self._bulk = False  # inside add_loaded
        self._ready: deque[tuple[str, int, int]] = deque(maxlen=_READY_KEPT)

    # ---- the trees' changes, handed to the tree work -------------------------------------------------------

    def _tree_extend(
        self, tree: SuffixTree, seq_id: int, tokens: np.ndarray, levels: np.ndarray, invalidate: bool
    ) -> None:
        tag = None
        if tree is self._global:
            self._global_pooled += int(tokens.shape[0])
            tag = self._global_fifo[-1][0]  # _add_global records the key before it extends
        self.tree_work.insert(tree, seq_id, tokens, levels, invalidate, tag)

    def _build(self, tree: SuffixTree, seq_id: int, tokens: np.ndarray, levels: np.ndarray) -> None:
        """At once, as a `ProblemIndex`'s, unless that would grow the hash table before its next size is
        ready (`SuffixForest.wait_for_hashes`): then the tree work feeds it, once the history thread built it."""
        if self.forest.wait_for_hashes(int(tokens.shape[0])):
            self.lazy_builds_queued += 1
            self.tree_work.insert(tree, seq_id, tokens, levels, invalidate=True)
        else:
            tree.extend(seq_id, tokens, levels)

    def _tree_remove(self, tree: SuffixTree, seq_ids: Iterable[int]) -> None:
        ids = [int(s) for s in seq_ids]
        if tree is self._global:
            seqs, rows = self.forest.seqs, tree._seqs
            self._global_pooled -= sum(int(seqs[rows[s], K.Q_LEN]) for s in ids if s in rows)
        self.tree_work.remove(tree, ids)

    def _global_size(self) -> int:
        return self._global_pooled

    def _add_global(self, key: tuple[str, int, int], tokens: np.ndarray, levels: np.ndarray) -> None:
        if not self._bulk and self.tree_work.feed_tokens > self.max_backlog:
            self.global_skipped += 1
            return
        super()._add_global(key, tokens, levels)

    def add_loaded(self, *args: Any, **kwargs: Any) -> bool:
        """ProblemIndex.add_loaded: a bulk load says itself which rollouts the global tree takes, whatever is
        queued."""
        self._bulk = True
        try:
            return super().add_loaded(*args, **kwargs)
        finally:
            self._bulk = False

    def load_stored(self, *args: Any, **kwargs: Any) -> int:
        """ProblemIndex.load_stored, a bulk load as `add_loaded`'s."""
        self._bulk = True
        try:
            return super().load_stored(*args, **kwargs)
        finally:
            self._bulk = False

    def _fed(self, item: Any) -> None:
        if item.tag is not None:
            self._ready.append(item.tag)

    # ---- doing it ------------------------------------------------------------------------------------------

    def work(self, budget: int) -> int:
        """At most about `budget` tokens of tree work (the caller holds the decode step off); returns the
        tokens done."""
        return self.tree_work.run(budget)

    def prepare(self) -> None:
        """Tree work that needs no hold on the step: mapping the arena's next rows (`resident`), writing a hash
        table's next size ahead, making a compaction's fresh arrays ready and the token pool's (`pool_mirror`).
        Call it between pieces, or a compaction or the pool's packing waits for it."""
        self.tree_work.prepare()

    @property
    def work_pending(self) -> bool:
        return self.tree_work.pending

    def settle(self) -> int:
        """Does all queued tree work; returns the tokens done."""
        return self.tree_work.settle()

    def drain_global_ready(self) -> list[tuple[str, int, int]]:
        """Keys of rollouts wholly in the global tree since the last call, in the order they got there."""
        out = list(self._ready)
        self._ready.clear()
        return out

    @property
    def global_tree_tokens(self) -> int:
        """Tokens of the rollouts the global tree holds (some perhaps still being inserted)."""
        return self._global_pooled
