"""History that remembers how sure the model was: each automaton state sums the sampling probabilities of its
end positions (PSUM over PKNOWN), exactly, through insertion, clones, eviction and serialization; drafts stay
those of the counts, and the remembered mean travels beside them to the budget. Only an arena that remembers
them pays for them: without, it holds what it held before the feature."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from history_store.automaton import kernels as K
from history_store.automaton.config import DraftConfig
from history_store.automaton.problem_index import ProblemIndex
from history_store.automaton.suffix_tree import SuffixForest, SuffixTree, as_levels

REMEMBERED = DraftConfig(remembered_probs=True)


def _state_of(tree: SuffixTree, string: list[int]) -> int:
    f = tree.forest
    state = tree.root
    for tok in string:
        edge = K.find_edge(f.states, f.edges, f.hashes, state, tok)
        if edge == -1:
            return -1
        state = int(f.edges[edge, K.TO])
    return state


def _check_sums(tree: SuffixTree, seqs: dict[int, tuple[list[int], np.ndarray]], longest: int = 4) -> int:
    """Every substring (up to `longest` tokens) of the sequences: its state's PKNOWN and PSUM are the known
    levels of the positions where it ends, counted and summed. Returns the substrings checked."""
    f = tree.forest
    expected: dict[tuple[int, ...], list[int]] = {}
    for tokens, levels in seqs.values():
        for end in range(len(tokens)):
            for n in range(1, min(longest, end + 1) + 1):
                expected.setdefault(tuple(tokens[end - n + 1 : end + 1]), []).append(int(levels[end]))
    for string, ends in expected.items():
        state = _state_of(tree, list(string))
        assert state >= 0, f"{string} not in the automaton"
        known = [level for level in ends if level > 0]
        assert f.states[state, K.COUNT] == len(ends), string
        assert f.states[state, K.PKNOWN] == len(known), string
        assert f.states[state, K.PSUM] == sum(level - 1 for level in known), string
    return len(expected)


def _random_seqs(rng: np.random.Generator, n: int) -> dict[int, tuple[list[int], np.ndarray]]:
    seqs = {}
    for seq_id in range(n):
        length = int(rng.integers(1, 40))
        tokens = rng.integers(0, 4, length).tolist()  # a small vocabulary: many repeats, many clones
        levels = rng.integers(1, K.PROB_LEVELS + 2, length).astype(np.uint8)
        levels[rng.random(length) < 0.3] = 0  # some unknown, as prompt tokens are
        seqs[seq_id] = (tokens, levels)
    return seqs


@pytest.mark.parametrize("seed", range(4))
def test_sums_match_brute_force_through_growth_and_eviction(seed: int) -> None:
    rng = np.random.default_rng(seed)
    seqs = _random_seqs(rng, 12)
    tree = SuffixTree(REMEMBERED)
    for seq_id, (tokens, levels) in seqs.items():
        half = len(tokens) // 2  # appended in two pieces, as live sequences grow
        tree.extend(seq_id, tokens[:half], levels[:half])
        tree.extend(seq_id, tokens[half:], levels[half:])
    tree.forest.check_arena()
    assert _check_sums(tree, seqs) > 50
    gone = [1, 4, 7]
    tree.remove_many(gone)  # eviction: the evicted sequences' probabilities leave with their tokens
    tree.forest.check_arena()
    _check_sums(tree, {k: v for k, v in seqs.items() if k not in gone})


def test_serialization_keeps_levels_and_reads_version_1() -> None:
    rng = np.random.default_rng(7)
    seqs = _random_seqs(rng, 5)
    tree = SuffixTree(REMEMBERED)
    for seq_id, (tokens, levels) in seqs.items():
        tree.extend(seq_id, tokens, levels if seq_id % 2 else None)  # some sequences without probabilities
    loaded = SuffixTree.from_bytes(tree.to_bytes(), REMEMBERED)
    for seq_id in seqs:
        q, p = tree.seq_row(seq_id), loaded.seq_row(seq_id)
        assert np.array_equal(tree.forest.seq_levels(q), loaded.forest.seq_levels(p))
    _check_sums(loaded, {k: (t, lv if k % 2 else np.zeros(len(t), np.uint8)) for k, (t, lv) in seqs.items()})
    # A version-1 buffer (tokens only, as checkpoints before this change wrote them) still loads.
    v1 = b"DAST" + struct.pack("<HI", 1, 1) + struct.pack("<qI", 9, 3) + np.array([5, 6, 5], "<i4").tobytes()
    old = SuffixTree.from_bytes(v1)
    assert old.forest.seq_tokens(old.seq_row(9)).tolist() == [5, 6, 5]
    assert not old.forest.seq_levels(old.seq_row(9)).any()
    with pytest.raises(ValueError, match="truncated"):
        SuffixTree.from_bytes(tree.to_bytes()[:-1])


def test_either_arena_reads_the_others_serialized_trees_and_drafts_the_same() -> None:
    """A version-2 buffer with levels loads into an arena that keeps none (they are dropped), and one written
    without them loads into an arena that keeps them (all unknown); the drafts never differ."""
    rng = np.random.default_rng(11)
    seqs = _random_seqs(rng, 6)
    remembering, plain = SuffixTree(REMEMBERED), SuffixTree()
    for seq_id, (tokens, levels) in seqs.items():
        remembering.extend(seq_id, tokens, levels)
        plain.extend(seq_id, tokens, levels)  # validated, then dropped
    assert not plain.forest.seq_levels(plain.seq_row(0)).any()
    dropped = SuffixTree.from_bytes(remembering.to_bytes())
    assert dropped.to_bytes() == plain.to_bytes()
    unknown = SuffixTree.from_bytes(plain.to_bytes(), REMEMBERED)
    _check_sums(unknown, {k: (t, np.zeros(len(t), np.uint8)) for k, (t, _) in seqs.items()})
    for tokens, _ in seqs.values():
        for cut in range(len(tokens)):
            drafts = [t.speculate(tokens[:cut]) for t in (remembering, plain, dropped, unknown)]
            assert len({(d.tokens.tobytes(), d.probs.tobytes(), d.support.tobytes()) for d in drafts}) == 1


def test_memory_follows_the_feature() -> None:
    """Off (the default), an arena's state rows end before PSUM and its token pool has no levels: a stored token
    costs what the automaton without the feature costs, a bound computed from the table layouts. On, exactly 4
    bytes per probability column per state and 1 per token more."""
    rng = np.random.default_rng(3)
    base_columns = [name for name, _ in K.STATE_LAYOUT if name not in ("PSUM", "PKNOWN")]
    trees = {on: SuffixTree(DraftConfig(remembered_probs=on)) for on in (False, True)}
    for seq_id in range(8):
        tokens = rng.integers(0, 50, 500)
        levels = as_levels(np.log(rng.uniform(0.05, 1.0, 500)), 500)
        for tree in trees.values():
            tree.extend(seq_id, tokens, levels)
    plain, remembering = trees[False], trees[True]
    row = plain.forest.trees[plain.tid]
    assert (row == remembering.forest.trees[remembering.tid])[
        [K.T_STATES, K.T_EDGES, K.T_HASHED, K.T_TOKENS]
    ].all()
    n_states, n_edges, n_hashed, n_tokens = (
        int(row[c]) for c in (K.T_STATES, K.T_EDGES, K.T_HASHED, K.T_TOKENS)
    )
    automaton = 4 * (
        len(base_columns) * n_states + K.EDGE_FIELDS * n_edges + K.HASH_FIELDS * n_hashed + n_tokens
    )
    assert plain.memory_bytes / n_tokens <= automaton / n_tokens
    assert remembering.memory_bytes == automaton + 4 * 2 * n_states + n_tokens
    # The whole arena as allocated, not only the tree's share of it.
    assert plain.forest.states.shape[1] == len(base_columns) and plain.forest.levels.nbytes == 0
    assert remembering.forest.levels.shape == remembering.forest.pool.shape
    plain.forest.check_arena()
    remembering.forest.check_arena()


def test_remembered_probabilities_need_an_arena_that_keeps_them() -> None:
    with pytest.raises(ValueError, match="SuffixForest\\(remembered=True\\)"):
        SuffixTree(REMEMBERED, SuffixForest())
    shared = SuffixForest(remembered=True)  # a remembering arena serves trees that do not read them too
    SuffixTree(DraftConfig(), shared).extend(0, [1, 2, 3])
    assert ProblemIndex(config=REMEMBERED).forest.remembered
    assert not ProblemIndex().forest.remembered


def test_as_levels_quantises_and_rejects_what_is_not_a_log_probability() -> None:
    levels = as_levels([0.0, np.log(0.5), -50.0, float("nan")], 4)
    assert levels.tolist() == [K.PROB_LEVELS + 1, 1 + round(0.5 * K.PROB_LEVELS), 1, 0]
    assert not as_levels(None, 3).any()
    for bad in ([0.1, -1.0], [float("-inf"), -1.0], [-1.0]):
        with pytest.raises(ValueError):
            as_levels(bad, 2)


def test_drafts_are_the_counts_and_carry_the_remembered_mean() -> None:
    """The remembered probabilities never change a draft; the draft token's mean sampling probability after
    the matched context comes beside it, -1 where history has none."""
    base = [1, 2, 3, 4, 5, 6, 7, 8]
    plain, annotated = SuffixTree(), SuffixTree(DraftConfig(remembered_probs=True))
    for seq_id, (p3, p4) in enumerate([(0.9, 0.2), (0.5, 0.4)]):
        logprobs = np.log([1.0, 1.0, p3, p4, 1.0, 1.0, 1.0, 1.0])
        plain.extend(seq_id, base)
        annotated.extend(seq_id, base, as_levels(logprobs, len(base)))
    a, b = plain.speculate([1, 2], 4), annotated.speculate([1, 2], 4)
    assert a.tokens.tolist() == b.tokens.tolist() == [3, 4]  # a factor-1 draft from a 2-token match
    assert np.array_equal(a.probs, b.probs) and np.array_equal(a.support, b.support)
    assert plain.speculate([1, 2], 4).remembered.tolist() == [-1.0, -1.0]
    assert np.allclose(b.remembered, [0.7, 0.3], atol=1 / K.PROB_LEVELS)
    off = SuffixTree()  # the default: remembered probabilities off
    off.extend(0, base, as_levels(np.zeros(len(base)), len(base)))
    assert off.speculate([1, 2], 4).remembered.tolist() == [-1.0, -1.0]


def test_index_validates_logprobs_before_any_change() -> None:
    index = ProblemIndex(window_epochs=2)
    assert index.add_trajectory("p", 0, 0, [1, 2], [3, 4, 5], [-0.1, -0.2, -0.3])
    with pytest.raises(ValueError, match="one log probability per token"):
        index.add_trajectory("p", 2, 0, [1, 2], [3, 4, 5], [-0.1])
    with pytest.raises(ValueError, match="finite and <= 0"):
        index.add_trajectory("p", 2, 1, [1, 2], [3, 4, 5], [0.5, -0.1, -0.1])
    # Nothing changed: epoch 0 is still in the window (a newer epoch would have evicted it).
    assert index.problem_stats("p")["samples"] == 1


def test_a_replay_without_probabilities_is_todays() -> None:
    """Records without `response_logprobs` replay exactly as with the feature off (today's drafting and
    budget), and so does an annotated trace with it off; with it on, the annotated trace's drafts are the
    same tokens (the budget alone may keep fewer or more of them)."""
    from pathlib import Path

    from workers.bench import replay
    from workers.bench.cost_model import CostModel

    path = Path(__file__).resolve().parents[1] / "data" / "annotated" / "fidelity_das.jsonl.gz"
    annotated = [
        r for r in replay.load_traces(path) if r.problem_id in ("builtin-0", "builtin-1", "builtin-7")
    ]
    assert annotated and all(r.response_logprobs is not None for r in annotated)
    stripped = [r.model_copy(update={"response_logprobs": None}) for r in annotated]

    def summary(records: list, remembered: bool) -> dict:
        config = DraftConfig(remembered_probs=remembered)
        return replay.summarize(replay.simulate(records, "das", config), CostModel())

    today = summary(annotated, remembered=False)
    assert summary(stripped, remembered=True) == today
    assert summary(stripped, remembered=False) == today
    assert summary(annotated, remembered=True)["tokens"] == today["tokens"]


def test_ceiling_remembered_only_needs_an_annotated_trace() -> None:
    from pathlib import Path

    from workers.bench import replay
    from workers.bench.ceiling import remembered_only

    data = Path(__file__).resolve().parents[1] / "data"
    keep = ("builtin-0", "builtin-1", "builtin-7")
    plain = [r for r in replay.load_traces(data / "fidelity_das.jsonl.gz") if r.problem_id in keep]
    with pytest.raises(ValueError, match="annotate the trace first"):
        remembered_only(plain)
    annotated = [
        r for r in replay.load_traces(data / "annotated" / "fidelity_das.jsonl.gz") if r.problem_id in keep
    ]
    report = remembered_only(annotated)
    section = report["remembered"]
    assert section["tokens"] > 100 and 0.0 < section["share"] < 1.0
    sources = {row["source"]: row for row in section["by_source"]}
    assert sum(row["tokens"] for row in sources.values()) == section["tokens"]
    assert sources["live"]["share_remembered"] == 0.0  # in-flight tokens carry no probabilities
