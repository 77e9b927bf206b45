"""The edge hash table's next size, built beside the decode step (`hash_growth`, issue 47 item 1): re-inserting
0.9 M entries inside a piece of history work held a decode step for 75-130 ms. The copy now runs outside the
hold while writers go on adding entries, a journal catches what they add, and the table a piece installs holds
exactly what the table in use does (`check_arena` counts every entry and finds every hashed edge)."""

from __future__ import annotations

import threading

import numpy as np

from history_store.automaton import kernels as K
from history_store.automaton import suffix_tree
from history_store.automaton.config import DraftConfig
from history_store.automaton.deferred_index import DeferredIndex
from history_store.automaton.hash_growth import BEGIN_AT, HashGrowth
from history_store.automaton.suffix_tree import SuffixForest, SuffixTree
from history_store.automaton.tree_work import TreeWork

CONFIG = DraftConfig(min_token_prob=0.0)
VOCAB = 3000  # wide: the root and its near descendants have many continuations, so their edges are hashed


def _rollouts(seed: int, n: int, length: int = 300) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, length) for _ in range(n)]


def _near_growth(capacity: int = 1 << 12) -> tuple[SuffixForest, SuffixTree, list[np.ndarray]]:
    """A forest whose hash table is past `BEGIN_AT` of the way to growing, and what it was fed."""
    forest = SuffixForest(capacity_tokens=capacity)
    tree = SuffixTree(CONFIG, forest)
    fed: list[np.ndarray] = []
    for seq in _rollouts(0, 100_000):
        tree.extend(len(fed), seq)
        fed.append(seq)
        if 2 * int(forest.meta[K.N_HASHED]) > BEGIN_AT * forest.hashes.shape[0] and len(fed) > 8:
            return forest, tree, fed
    raise AssertionError("the table never got near its growth")


def _ahead_until(forest: SuffixForest, done) -> None:  # noqa: ANN001
    for _ in range(10_000):  # what the history thread does between pieces and while idle
        if done():
            return
        forest.populate_ahead(1 << 10)
    raise AssertionError("the growth never got there")


def _ready_to_begin(forest: SuffixForest) -> HashGrowth:
    """The forest's growth, taken outside the hold as far as it goes before a piece begins it."""
    _ahead_until(forest, lambda: forest.hash_growth is not None and forest.hash_growth.journaled is not None)
    growth = forest.hash_growth
    assert growth is not None and growth.next.ready and forest.hash_growth_due
    return growth


def _drafts_match_a_fresh_forest(tree: SuffixTree, fed: list[np.ndarray]) -> None:
    fresh = SuffixTree(CONFIG)
    for i, seq in enumerate(fed):
        fresh.extend(i, seq)
    contexts = [seq[k : k + 4] for seq in fed[:: max(1, len(fed) // 30)] for k in (0, 100, 250)]
    for context in contexts:
        assert tree.speculate(context).tokens.tolist() == fresh.speculate(context).tokens.tolist()


def test_the_next_table_is_copied_beside_writers_and_installed_in_a_piece() -> None:
    forest, tree, fed = _near_growth()
    work = TreeWork(forest)
    table = forest.hashes
    growth = _ready_to_begin(forest)
    assert work.pending  # a piece is wanted: to begin
    work.run(1 << 10)
    assert forest.meta is growth.journaled and forest.meta[K.JOURNAL] == 0 and not work.pending
    more = _rollouts(1, 3)
    for seq in more:  # the step adds entries between begin and the copy: journaled
        tree.extend(len(fed), seq)
        fed.append(seq)
    journaled = int(forest.meta[K.JOURNAL])
    assert journaled > 0
    _ahead_until(forest, lambda: growth.copied)
    assert forest.hashes is table  # copied outside the hold, not installed yet
    for seq in _rollouts(2, 3):  # and after the copy, before the piece that installs it
        tree.extend(len(fed), seq)
        fed.append(seq)
    assert int(forest.meta[K.JOURNAL]) > journaled and work.pending
    work.run(1 << 10)
    assert forest.hashes is growth.next.array and forest.hashes.shape[0] == 4 * table.shape[0]
    assert forest.meta.shape == (K.META_FIELDS,) and forest.meta[K.JOURNAL] == -1
    assert forest.hash_growth is None and not work.pending
    forest.check_arena()
    _drafts_match_a_fresh_forest(tree, fed)


def test_a_copy_racing_a_writer_misses_nothing() -> None:
    forest, tree, fed = _near_growth(capacity=1 << 18)  # a table of 2^19 rows: its copy takes milliseconds
    growth = _ready_to_begin(forest)
    forest.hash_piece()  # begin
    started = threading.Event()

    def copy() -> None:
        started.set()
        growth.ahead(forest)  # releases the GIL: the writer below runs on the other core meanwhile

    copier = threading.Thread(target=copy)
    copier.start()
    started.wait()
    extra = _rollouts(3, 40, length=100)
    for seq in extra:
        tree.extend(len(fed), seq)
        fed.append(seq)
    copier.join()
    assert growth.copied and forest.meta[K.JOURNAL] > 0
    forest.hash_piece()  # install
    assert forest.hashes is growth.next.array
    forest.check_arena()
    _drafts_match_a_fresh_forest(tree, fed)


def test_a_journal_that_overflows_means_a_whole_copy_in_the_hold() -> None:
    forest, tree, fed = _near_growth()
    growth = _ready_to_begin(forest)
    growth.journaled = np.zeros(K.META_FIELDS + 2, np.int64)  # room for two entries
    forest.hash_piece()
    forest.populate_ahead(1 << 10)  # the copy
    for seq in _rollouts(4, 3):
        tree.extend(len(fed), seq)
        fed.append(seq)
    assert forest.meta[K.JOURNAL] == -2  # overflowed: replaying two entries would lose the rest
    forest.hash_piece()
    assert forest.hashes is growth.next.array and forest.meta[K.JOURNAL] == -1
    forest.check_arena()
    _drafts_match_a_fresh_forest(tree, fed)


def test_a_growth_that_cannot_wait_finishes_in_the_hold() -> None:
    forest, tree, fed = _near_growth()
    growth = _ready_to_begin(forest)
    forest.hash_piece()  # begun, not copied: a step's own burst needs the room first
    tree.extend(len(fed), fed[0][::-1].copy())
    fed.append(fed[0][::-1].copy())
    forest.grow(states=0, edges=forest.hashes.shape[0] // 4)
    assert forest.hashes is growth.next.array and forest.hash_growth is None
    assert forest.meta.shape == (K.META_FIELDS,) and forest.meta[K.JOURNAL] == -1
    forest.check_arena()
    _drafts_match_a_fresh_forest(tree, fed)


def test_a_compaction_gives_up_the_growth_of_the_table_it_replaces() -> None:
    forest, tree, fed = _near_growth()
    _ready_to_begin(forest)
    forest.hash_piece()
    assert forest.meta[K.JOURNAL] == 0
    forest.compact()
    assert (
        forest.hash_growth is None and forest.meta.shape == (K.META_FIELDS,) and forest.meta[K.JOURNAL] == -1
    )
    forest.check_arena()
    _drafts_match_a_fresh_forest(tree, fed)


def test_a_lazy_build_that_would_grow_the_table_inside_the_step_is_left_to_pieces(monkeypatch) -> None:
    # Every next table counts as too large to write inside a caller (at scale: more than one 8 MiB chunk).
    monkeypatch.setattr(suffix_tree, "FILL_BYTES", 0)
    prompt = np.arange(1, 9)
    rollouts = {f"p{i}": _rollouts(10 + i, 4) for i in range(60)}

    def fetch(problem_id: str, epoch: int, sample: int) -> tuple[np.ndarray, np.ndarray]:
        return prompt, rollouts[problem_id][sample]

    lazy, eager = (DeferredIndex(window_epochs=2, lazy=True, config=CONFIG) for _ in range(2))
    for index in (lazy, eager):
        for problem_id, seqs in rollouts.items():
            for sample, seq in enumerate(seqs):
                index.add_trajectory(problem_id, 0, sample, prompt, seq)
    forest = lazy.forest
    tables = []
    for problem_id in rollouts:  # first requests, one after another, inside steps
        lazy.make_resident(problem_id, fetch)
        tables.append(forest.hashes.shape[0])
    assert lazy.lazy_builds_queued > 0  # some were left to the tree work
    assert len(set(tables)) == 1  # and no build grew the table in the caller
    assert lazy.work_pending and forest.hashes_wanted
    assert lazy.work(1 << 12) == 0  # a piece feeds nothing until the next table is copied beside the step
    for _ in range(1000):  # the history thread: `prepare` between pieces
        if not lazy.work_pending:
            break
        lazy.prepare()
        lazy.work(1 << 12)
    assert not lazy.work_pending and forest.hashes.shape[0] > tables[0] and not forest.hashes_wanted
    forest.check_arena()
    with monkeypatch.context() as m:
        m.setattr(suffix_tree, "FILL_BYTES", 1 << 40)  # the same builds, each at once
        for problem_id in rollouts:
            eager.make_resident(problem_id, fetch)
    assert eager.lazy_builds_queued == 0
    for problem_id, seqs in rollouts.items():  # the same trees, so the same drafts
        mine, theirs = lazy._problems[problem_id].tree, eager._problems[problem_id].tree
        assert mine.num_tokens == theirs.num_tokens
        for seq in seqs[:2]:
            for k in (0, 150):
                context = seq[k : k + 5]
                assert mine.speculate(context).tokens.tolist() == theirs.speculate(context).tokens.tolist()
