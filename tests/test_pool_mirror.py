"""The token pool grown and packed in pieces (`PoolMirror`): sequences that grow, move, come and go between the
pieces keep their tokens, garbage is dropped, and the trees draft as before (issue 47, item 1: a pool copied
whole inside one piece held a decode step for 258 ms)."""

from __future__ import annotations

import numpy as np

from history_store.automaton import kernels as K
from history_store.automaton.config import DraftConfig
from history_store.automaton.pool_mirror import PoolMirror
from history_store.automaton.suffix_tree import SuffixForest, SuffixTree


def _tokens(forest: SuffixForest, tree: SuffixTree) -> dict[int, list[int]]:
    return {s: forest.seq_tokens(q).tolist() for s, q in tree._seqs.items()}


def test_sequences_changed_between_the_pieces_keep_their_tokens_and_garbage_is_dropped() -> None:
    rng = np.random.default_rng(0)
    forest = SuffixForest(256)
    tree = SuffixTree(DraftConfig(), forest)
    for s in range(40):
        tree.extend(s, rng.integers(0, 30, int(rng.integers(5, 60))))
    for s in range(0, 40, 4):
        tree.remove(s)  # garbage the pool still holds
    garbage = forest.pool_garbage
    assert garbage > 0
    job = PoolMirror(forest)
    assert job.begin()
    pieces = 0
    while not job.copied:
        job.run(50)  # a few segments per piece; between pieces the "step" changes sequences
        pieces += 1
        if pieces == 1:
            tree.extend(1, rng.integers(0, 30, 3))  # grows in place (within its capacity, or moved)
            tree.extend(41, rng.integers(0, 30, 20))  # a new sequence, in space given out after `begin`
        if pieces == 2:
            tree.extend(2, rng.integers(0, 30, 500))  # outgrows its segment: moved
            tree.remove(5)  # freed after it was copied
            tree.extend(42, rng.integers(0, 30, 7))  # may reuse its row
    assert pieces >= 3, "the copy must span pieces for the test to mean anything"
    expected = _tokens(forest, tree)
    probe = forest.seq_tokens(tree._seqs[2])[:20].copy()
    before = tree.speculate(probe, 8).tokens.tolist()
    used = forest.pool_used
    assert job.finish()
    assert _tokens(forest, tree) == expected
    assert forest.pool_garbage == 0 and forest.pool_used < used
    assert tree.speculate(probe, 8).tokens.tolist() == before
    forest.check_arena()
    # The pool keeps working afterwards: appends, new sequences.
    tree.extend(1, [1, 2, 3])
    assert forest.seq_tokens(tree._seqs[1]).tolist()[-3:] == [1, 2, 3]


def test_a_pool_the_forest_grew_itself_meanwhile_is_still_copied_right() -> None:
    rng = np.random.default_rng(1)
    forest = SuffixForest(64)
    tree = SuffixTree(DraftConfig(), forest)
    for s in range(10):
        tree.extend(s, rng.integers(0, 20, 30))
    job = PoolMirror(forest)
    assert job.begin()
    job.run(40)
    old = forest.pool
    tree.extend(99, rng.integers(0, 20, 4 * old.shape[0]))  # the forest grows its pool at once
    assert forest.pool is not old
    while not job.copied:
        job.run(40)
    expected = _tokens(forest, tree)
    if job.finish():
        assert _tokens(forest, tree) == expected
    else:  # the growth outran the mirror's room: nothing installed, nothing lost
        assert forest.pool is not job.pool and _tokens(forest, tree) == expected
    assert int(forest.seqs[tree._seqs[99], K.Q_LEN]) == 4 * old.shape[0]
