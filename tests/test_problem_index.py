"""The per-problem index: batched drafts equal the best single-tree draft, with the other trees' agreement on it,
whether the arena remembers sampling probabilities or not; windows evict for good."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from history_store.automaton.config import DraftConfig
from history_store.automaton.kernels import Source
from history_store.automaton.problem_index import ProblemIndex
from history_store.automaton.suffix_tree import SuffixTree

CFG = DraftConfig(max_depth=6, max_spec_tokens=5, min_token_prob=0.0)
tokens = st.lists(st.integers(0, 4), min_size=1, max_size=15)
trajectory = st.tuples(st.sampled_from(["p", "q"]), st.integers(0, 4), st.integers(0, 2), tokens, tokens)


def with_logprobs(record: tuple, remembered: bool) -> tuple:
    """The record with a log probability per response token when the index remembers them (so the arena's
    probability columns fill), as it is otherwise: the drafts must not tell the two apart."""
    if not remembered:
        return record
    response = record[4]
    return (*record, [-0.05 * (t + 1) * (i % 3) for i, t in enumerate(response)])


def best_single_tree_draft(candidates: list[tuple[int, list[list[int]]]], context: list[int], budget: int):
    best = (0.0, [], 0)
    for source, seqs in candidates:
        tree = SuffixTree(CFG)
        for i, seq in enumerate(seqs):
            tree.extend(i, seq)
        draft = tree.speculate(context, budget)
        if draft.tokens.size and draft.score > best[0]:
            best = (draft.score, draft.tokens.tolist(), source)
    return best[1], best[2]


def agreement(seqs: list[list[int]], context: list[int], draft: list[int]) -> int:
    """How many of the draft's tokens one tree's likeliest path repeats, by brute force: the path starts at
    the longest context suffix (at most max_depth tokens) that some sequence continues, and takes the most
    frequent next token each time (ties: the smaller)."""

    def next_counts(y: list[int]) -> dict[int, int]:
        counts: dict[int, int] = {}
        for seq in seqs:
            for i in range(len(seq) - len(y)):
                if seq[i : i + len(y)] == y:
                    counts[seq[i + len(y)]] = counts.get(seq[i + len(y)], 0) + 1
        return counts

    for length in range(min(len(context), CFG.max_depth), 0, -1):
        path = context[-length:]
        if next_counts(path):
            break
    else:
        return 0
    agreed = 0
    for token in draft:
        counts = next_counts(path)
        if not counts or min(counts, key=lambda t: (-counts[t], t)) != token:
            break
        path = path + [token]
        agreed += 1
    return agreed


@pytest.mark.parametrize("remembered", [False, True])
@settings(max_examples=150, deadline=None)
@given(
    history=st.lists(trajectory, max_size=10),
    requests=st.lists(st.tuples(st.sampled_from(["p", "q", None]), tokens), min_size=1, max_size=4),
    steps=st.lists(st.lists(st.integers(0, 4), max_size=3), max_size=5),
    budget=st.integers(0, 5),
)
def test_batched_drafts_equal_the_best_single_tree_draft(remembered, history, requests, steps, budget):
    # The reference trees never remember probabilities: an index that does drafts the same.
    index = ProblemIndex(window_epochs=2, config=dataclasses.replace(CFG, remembered_probs=remembered))
    kept: dict[tuple[str, int, int], list[int]] = {}
    newest: dict[str, int] = {}
    for record in history:
        pid, epoch, sample, prompt, response = record
        if index.add_trajectory(*with_logprobs(record, remembered)):
            kept[(pid, epoch, sample)] = prompt[-CFG.max_depth :] + response
            newest[pid] = max(newest.get(pid, -1), epoch)
    kept = {k: v for k, v in kept.items() if k[1] >= newest[k[0]] - 1}
    global_seen, global_kept = -1, {}
    for pid, epoch, sample, _, _ in history:
        global_seen = max(global_seen, epoch)
        if (pid, epoch, sample) in kept and epoch >= global_seen - 1:
            global_kept[(pid, epoch, sample)] = kept[(pid, epoch, sample)]
    global_kept = {k: v for k, v in global_kept.items() if k[1] >= global_seen - 1}
    index.forest.check_arena()
    contexts = {}
    for i, (pid, prompt) in enumerate(requests):
        index.start_request(f"r{i}", pid, prompt)
        contexts[f"r{i}"] = (pid, list(prompt))
    keys = list(contexts)
    for n, step in enumerate([[]] + steps):
        if n % 2:  # both ways of committing a step's tokens: one request at a time, or the whole batch
            for key in keys:
                index.append_request(key, step)
        else:
            index.append_batch(keys, [step] * len(keys))
        for key in keys:
            contexts[key][1].extend(step)
        index.forest.check_arena()
        drafts = index.draft_batch(keys, [budget] * len(keys))
        for row, key in enumerate(keys):
            pid, ctx = contexts[key]
            history_seqs = [v for k, v in kept.items() if k[0] == pid] if pid else []
            live = [c for k2, (p2, c) in contexts.items() if (pid is not None and p2 == pid) or k2 == key]
            candidates = [
                (Source.HISTORY, history_seqs),
                (Source.LIVE, live),
                (Source.GLOBAL, list(global_kept.values())),
            ]
            expected, source = best_single_tree_draft(candidates, ctx, budget)
            assert drafts.draft(row) == expected
            if expected:
                assert drafts.sources[row] == source
                others = [agreement(seqs, ctx, expected) for src, seqs in candidates if src != source]
                assert drafts.agreement[row].tolist() == others


def test_adding_a_trajectory_twice_changes_nothing():
    index = ProblemIndex()
    assert index.add_trajectory("p", 0, 0, [1, 2], [3, 4, 5])
    assert not index.add_trajectory("p", 0, 0, [1, 2], [3, 4, 5])
    assert index.problem_stats("p")["samples"] == 1


def test_evicted_epochs_are_never_drafted_again():
    index = ProblemIndex(window_epochs=2, config=DraftConfig(min_token_prob=0.0))
    rng = np.random.default_rng(1)
    old = rng.integers(100, 200, 300)
    index.add_trajectory("p", 0, 0, [1, 2, 3], old)
    index.start_request("r", "q", old[:20])
    assert index.draft_batch(["r"], [8]).draft(0) == old[20:28].tolist()
    for epoch in range(1, 4):  # the window slides past epoch 0
        index.add_trajectory("p", epoch, 0, [1, 2, 3], rng.integers(300, 400, 300))
        index.forest.check_arena()
    drafted = index.draft_batch(["r"], [8]).draft(0)
    assert not set(drafted) & set(old[20:].tolist())
    assert index.problem_stats("p")["epochs"] == [2, 3]
    assert not index.add_trajectory("p", 0, 1, [1], [2]), "a late rollout older than the window is refused"


def test_requests_without_a_problem_draft_from_their_own_context():
    index = ProblemIndex(config=DraftConfig(min_token_prob=0.0))
    index.start_request("r", None, [5, 6, 7, 8, 9, 5, 6])
    assert index.draft_batch(["r"], [3]).draft(0) == [7, 8]  # capped at match length 2
    index.finish_request("r")
    with pytest.raises(KeyError):
        index.draft_batch(["r"], [3])


@pytest.mark.parametrize("remembered", [False, True])
@settings(max_examples=60, deadline=None)
@given(history=st.lists(trajectory, max_size=12), context=tokens)
def test_bulk_loading_drafts_like_adding_one_by_one(remembered, history, context):
    # a store replays in apply order: epochs ascend
    ordered = [with_logprobs(r, remembered) for r in sorted(history, key=lambda r: r[1])]
    config = dataclasses.replace(CFG, remembered_probs=remembered)
    one_by_one, bulk = (
        ProblemIndex(window_epochs=2, config=config),
        ProblemIndex(window_epochs=2, config=config),
    )
    added = sum(one_by_one.add_trajectory(*r) for r in ordered)
    assert bulk.add_trajectories(ordered) == added
    one_by_one.forest.check_arena()
    bulk.forest.check_arena()
    for pid in ("p", "q", None):
        one_by_one.start_request("r", pid, context)
        bulk.start_request("r", pid, context)
        a, b = one_by_one.draft_batch(["r"], [5]), bulk.draft_batch(["r"], [5])
        assert (a.draft(0), a.sources.tolist()) == (b.draft(0), b.sources.tolist())
        one_by_one.finish_request("r")
        bulk.finish_request("r")
        bulk.forest.check_arena()


def test_bulk_loading_past_the_global_cap_keeps_the_newest_rollouts():
    index = ProblemIndex(window_epochs=3, config=CFG, global_tokens=100)
    records = [("p", 0, s, [1], list(range(100 * s, 100 * s + 30))) for s in range(10)]
    assert index.add_trajectories(records) == 10
    index.start_request("r", "other", [900, 901])  # only the global tree can know problem p
    assert index.draft_batch(["r"], [5]).draft(0) == [902, 903]
    index.start_request("s", "other", [10, 11])  # an old rollout that did not fit the cap
    assert index.draft_batch(["s"], [5]).draft(0) == []


def test_the_global_tree_forgets_rollouts_that_left_the_window():
    index = ProblemIndex(window_epochs=2, config=CFG)
    for epoch in range(50):
        for sample in range(4):
            index.add_trajectory(f"p{sample}", epoch, 0, [1], [epoch, sample, 7])
        index.forest.check_arena()
    assert len(index._global_fifo) <= 2 * 4, "bookkeeping stays bounded by the window, not the run"
