"""History tree work in bounded pieces (`DeferredIndex`, `tree_work`): no piece exceeds its token budget, the
trees stay valid automata while pieces interleave with decode steps (live requests committing and drafting,
rollouts arriving, windows sliding, the global tree passing its cap, the arena compacting), and once the work
is done they draft exactly what a `ProblemIndex` given the same rollouts drafts (issue 47, item 1)."""

from __future__ import annotations

import numpy as np
import pytest
from _store_workload import Workload

from history_store.automaton import kernels as K
from history_store.automaton.config import DraftConfig
from history_store.automaton.deferred_index import DeferredIndex
from history_store.automaton.problem_index import ProblemIndex
from history_store.automaton.suffix_tree import SuffixForest, SuffixTree
from history_store.automaton.tree_work import POOL_TIGHT, TreeWork, _pool_wanted

WORKLOAD = Workload(problems=5, epochs=6, samples=3, min_len=30, max_len=160)
CONFIG = DraftConfig(max_spec_tokens=8)
WINDOW = 2


def _probes(index: ProblemIndex) -> list[list[int]]:
    """Drafts of one fresh request per (problem, newest epoch's sample, prefix): what the trees hold."""
    drafts = []
    for p in range(WORKLOAD.problems):
        for e in range(WORKLOAD.epochs - WINDOW, WORKLOAD.epochs):
            record = WORKLOAD.record(p, e, 1)
            key = f"probe-{p}-{e}"
            index.start_request(key, record.problem_id, record.prompt_ids + record.response_ids[:6])
            drafts.append(index.draft_batch([key], np.array([8])).draft(0))
            index.finish_request(key)
    return drafts


def _add(index: ProblemIndex, record) -> None:
    index.add_trajectory(
        record.problem_id, record.epoch, record.sample, record.prompt_ids, record.response_ids
    )


@pytest.mark.parametrize("piece", [7, 64, 1000])
def test_pieces_interleaved_with_steps_end_in_the_trees_a_problem_index_builds(piece: int) -> None:
    reference = ProblemIndex(window_epochs=WINDOW, config=CONFIG, global_tokens=3000)
    deferred = DeferredIndex(
        window_epochs=WINDOW, config=CONFIG, global_tokens=3000, global_keep=0.75, max_backlog=10**9
    )
    # Live requests that decode throughout: they commit tokens, draft, start and finish while work is queued,
    # so the compaction mirror has trees to follow that change under it.
    rng = np.random.default_rng(0)
    live: dict[str, list[int]] = {}
    work = compactions = 0
    for n, record in enumerate(WORKLOAD.stream()):
        _add(reference, record)
        _add(deferred, record)
        if n % 4 == 0:
            key = f"live-{n}"
            live[key] = list(record.prompt_ids)
            deferred.start_request(key, record.problem_id, live[key])
        if len(live) > 6:
            gone = next(iter(live))
            deferred.finish_request(gone)
            del live[gone]
        keys = list(live)
        for key in keys:
            live[key].extend(int(t) for t in rng.integers(0, 50, 3))
        if keys:
            slots = np.array([deferred.slot(k) for k in keys], np.int64)
            src = np.concatenate([np.asarray(live[k], np.int32) for k in keys])
            bases = np.cumsum([0] + [len(live[k]) for k in keys[:-1]]).astype(np.int64)
            ends = np.array([len(live[k]) for k in keys], np.int64)
            deferred.step(slots, src, bases, ends, np.full(len(keys), 8))
        if n % 40 == 20 and deferred.tree_work.mirror is None:
            deferred.forest.compaction_wanted = True  # the arena is too small to ask by itself: ask here
        # About 2000 tokens of work between two records, in pieces: what a server does between decode steps.
        for _ in range(max(1, 2000 // piece)):
            mirror_before = deferred.tree_work.mirror
            done = deferred.work(piece)
            deferred.prepare()  # between pieces, as the feed's thread: a compaction's arrays grow here
            assert done <= piece, f"a piece of {piece} tokens did {done}"
            work += done
            if mirror_before is not None and deferred.tree_work.mirror is None:
                compactions += 1
        deferred.forest.check_arena()
    for key in list(live):
        deferred.finish_request(key)
    deferred.settle()
    deferred.forest.check_arena()
    assert work > 0
    assert compactions >= 2, "no compaction ran in pieces: the test proves nothing of it"
    assert deferred.tree_work.pool_installs >= 2, "the token pool never grew in pieces"
    assert deferred.global_keys() == reference.global_keys()
    for p in range(WORKLOAD.problems):
        mine, theirs = deferred.problem_stats(f"problem-{p}"), reference.problem_stats(f"problem-{p}")
        assert mine["tokens"] == theirs["tokens"] and mine["epochs"] == theirs["epochs"]
    assert _probes(deferred) == _probes(reference)
    assert any(_probes(reference))


def test_a_tree_losing_rollouts_keeps_serving_until_its_rebuild_replaces_it() -> None:
    index = DeferredIndex(window_epochs=WINDOW, config=CONFIG, global_tokens=10**6)
    for record in WORKLOAD.stream()[: WORKLOAD.problems * WORKLOAD.samples * WINDOW]:
        _add(index, record)
    index.settle()
    tree = index._problems["problem-0"].tree
    tid, version, tokens = tree.tid, tree.version, tree.num_tokens
    index.evict_epochs_before("problem-0", 1)  # epoch 0 leaves the window: a rebuild is queued
    assert tree.num_tokens == tokens and tree.version == version  # still the old tree, serving
    assert index.work_pending
    while index.work_pending:
        assert index.work(16) <= 16
        index.prepare()
    assert tree.tid == tid and tree.version != version  # the same tree id, a new version: requests re-match
    assert 0 < tree.num_tokens < tokens
    assert index.problem_stats("problem-0")["epochs"] == [1]
    index.forest.check_arena()


def test_a_compaction_in_pieces_follows_requests_that_come_and_go_and_frees_the_garbage() -> None:
    index = DeferredIndex(window_epochs=WINDOW, config=CONFIG, global_tokens=2000, global_keep=0.75)
    reference = ProblemIndex(window_epochs=WINDOW, config=CONFIG, global_tokens=2000)
    for record in WORKLOAD.stream():
        _add(index, record)
        _add(reference, record)
        index.settle()
    forest = index.forest
    used = int(forest.meta[0])
    forest.compaction_wanted = True  # ask for one now
    generation = forest.generation
    pieces = 0
    prompt = list(WORKLOAD.record(1, 5, 0).prompt_ids)
    index.start_request("r0", "problem-1", prompt)
    while index.tree_work.mirror is not None or forest.compaction_wanted:
        pieces += 1
        index.work(32)
        index.prepare()
        if pieces == 3:  # a request joins, another's live tree is rebuilt from scratch, mid-compaction
            index.start_request("r1", "problem-2", prompt)
            index.finish_request("r0")
        forest.check_arena()
    assert pieces > 3 and forest.generation > generation
    assert forest.garbage_states == 0 and int(forest.meta[0]) <= used + 2 * len(prompt) + 16
    forest.check_arena()
    index.finish_request("r1")
    assert _probes(index) == _probes(reference)


def test_rollouts_skip_the_global_tree_while_inserting_lags_too_far() -> None:
    index = DeferredIndex(window_epochs=WINDOW, config=CONFIG, global_tokens=10**6, max_backlog=500)
    for record in WORKLOAD.stream()[:30]:
        _add(index, record)
    assert index.global_skipped > 0
    # The global tree took rollouts only while fewer than 500 tokens waited (its problems' trees take them all).
    assert 0 < index.global_tree_tokens <= 500 + 2 * (WORKLOAD.max_len + 12)
    index.settle()
    index.forest.check_arena()


def test_a_seq_row_that_a_feed_stops_in_resumes_where_it_stopped() -> None:
    index = DeferredIndex(window_epochs=WINDOW, config=CONFIG)
    record = WORKLOAD.record(0, 0, 0)
    _add(index, record)
    tree = index._problems["problem-0"].tree
    q = tree.seq_row(0)
    seqs = index.forest.seqs
    steps = 0
    while seqs[q, K.Q_EXT] < seqs[q, K.Q_LEN]:
        before = int(seqs[q, K.Q_EXT])
        index.work(5)
        assert int(seqs[q, K.Q_EXT]) - before <= 5
        steps += 1
    assert steps >= (len(record.response_ids) + 12) // 5
    assert tree.num_tokens == len(record.response_ids) + len(record.prompt_ids)


def test_a_reserved_pool_is_packed_for_its_garbage_not_copied_for_its_fill() -> None:
    # A pool of 1 MiB and more grows in place (`resident.grown`): a pool mirror only packs it, once garbage is
    # half its live tokens. A plain pool still gets one from POOL_TIGHT full on, as growing it would copy it.
    forest = SuffixForest(capacity_tokens=1 << 18)
    tree = SuffixTree(DraftConfig(), forest)
    rng = np.random.default_rng(0)
    for seq_id in range(150):
        tree.extend(seq_id, rng.integers(0, 50, 1500))
    assert forest.pool_used > POOL_TIGHT * forest.pool.shape[0] and not _pool_wanted(forest)
    tree.remove_many(range(60))
    assert _pool_wanted(forest)
    small = SuffixForest(capacity_tokens=1 << 10)
    SuffixTree(DraftConfig(), small).extend(0, rng.integers(0, 50, 800))
    assert _pool_wanted(small)  # 800 of 1,024 tokens, no reservation


def test_a_piece_grows_the_arena_for_what_it_inserts_not_for_the_whole_rollout() -> None:
    # A piece inserts at most its budget of a long rollout; growing for the rest of it would grow the hash table
    # early, inside the hold, before its next size is built beside the step (`hash_growth`).
    forest = SuffixForest(capacity_tokens=64)
    work = TreeWork(forest)
    tree = SuffixTree(CONFIG, forest)
    rollout = np.random.default_rng(0).integers(0, 3000, 50_000)
    work.insert(tree, 0, rollout, None, invalidate=False)
    assert work.run(512) == 512
    assert (
        forest.hashes.shape[0] <= 1 << 13 and forest.edges.shape[0] < 10_000
    )  # room for 512 tokens, not 50k
    work.settle()
    forest.check_arena()
    assert tree.num_tokens == rollout.shape[0]
