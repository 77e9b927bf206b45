"""The suffix tree drafts exactly what a brute-force scan of its sequences says, through extend and remove, whether
its arena remembers sampling probabilities or not."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from history_store.automaton import kernels as K
from history_store.automaton.config import DraftConfig
from history_store.automaton.suffix_tree import SuffixForest, SuffixTree


def reference_speculate(seqs: dict[int, list[int]], context: list[int], cfg: DraftConfig, budget: int):
    """Brute force: for every context suffix (<= max_depth) seen with a continuation, longest first, the most
    frequent continuation (ties: smaller token) while the path probability stays >= min_token_prob, at most
    factor * match length + offset tokens; the draft with the highest sum of probabilities over its first
    match-length tokens wins, the longer match on ties (SuffixDecoding's rule, scored so that drafting past
    the match length only extends the chosen draft). Without `all_matches`, only the longest such suffix
    drafts."""

    def continuations(pattern: list[int]) -> dict[int, int]:
        counts: dict[int, int] = {}
        n = len(pattern)
        for seq in seqs.values():
            for end in range(n, len(seq)):
                if seq[end - n : end] == pattern:
                    counts[seq[end]] = counts.get(seq[end], 0) + 1
        return counts

    def draft(path: list[int], cap: int, scored: int) -> tuple[list[int], list, list[int], float]:
        tokens, probs, support, prob, score = [], [], [], 1.0, 0.0
        while len(tokens) < cap:
            counts = continuations(path)
            if not counts:
                break
            best = min(counts, key=lambda t: (-counts[t], t))
            p = prob * counts[best] / (sum(counts.values()) + cfg.escape)
            if p < cfg.min_token_prob:
                break
            prob = p
            tokens.append(best)
            probs.append(np.float32(p))
            support.append(counts[best])
            score += p if len(tokens) <= scored else 0.0
            path = path + [best]
        return tokens, probs, support, score

    ctx = context[-cfg.max_depth :]
    best = ([], [], [], 0.0, 0)
    for match_len in range(len(ctx), 0, -1):
        path = ctx[len(ctx) - match_len :]
        if not continuations(path):
            continue
        cap = min(budget, int(cfg.max_spec_factor * match_len + cfg.max_spec_offset))
        tokens, probs, support, score = draft(path, cap, min(cap, match_len))
        if tokens and score > best[3]:
            best = (tokens, probs, support, score, match_len)
        if not cfg.all_matches:
            break
    return best


def assert_same_as_reference(tree: SuffixTree, seqs: dict[int, list[int]], context: list[int], budget: int):
    draft = tree.speculate(context, budget)
    tokens, probs, support, score, match_len = reference_speculate(seqs, context, tree.config, budget)
    assert draft.tokens.tolist() == tokens
    assert draft.probs.tolist() == [float(p) for p in probs]
    assert draft.support.tolist() == support
    if tokens:
        assert draft.match_len == match_len
        assert draft.score == pytest.approx(score, rel=1e-9)


def some_levels(tokens: list[int], remembered: bool) -> np.ndarray | None:
    """Probability levels for a remembering tree (all kinds, unknown included), so that its probability columns
    fill; None for the other: drafts must be the same either way."""
    if not remembered:
        return None
    n = len(tokens)
    return ((np.arange(n) * 7 + np.asarray(tokens, np.int64) * 13) % (K.PROB_LEVELS + 2)).astype(np.uint8)


def remembering(cfg: DraftConfig, remembered: bool) -> SuffixTree:
    """A tree on a minimal arena (it grows and rehashes all the time) that remembers probabilities or not."""
    cfg = dataclasses.replace(cfg, remembered_probs=remembered)
    return SuffixTree(cfg, SuffixForest(capacity_tokens=1, remembered=remembered))


SMALL_VOCAB = st.integers(min_value=0, max_value=5)
operation = st.one_of(
    st.tuples(st.just("extend"), st.integers(0, 4), st.lists(SMALL_VOCAB, min_size=1, max_size=12)),
    st.tuples(st.just("remove"), st.integers(0, 4), st.just([])),
)
config = st.builds(
    DraftConfig,
    max_depth=st.integers(1, 8),
    max_spec_tokens=st.integers(1, 8),
    max_spec_factor=st.sampled_from([0.5, 1.0, 4.0]),
    max_spec_offset=st.sampled_from([0.0, 1.0]),
    min_token_prob=st.sampled_from([0.0, 0.1, 0.3]),
    escape=st.sampled_from([0.0, 1.0]),
    all_matches=st.booleans(),
)


@pytest.mark.parametrize("remembered", [False, True])
@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(operation, max_size=25),
    contexts=st.lists(st.lists(SMALL_VOCAB, max_size=10), min_size=1, max_size=6),
    cfg=config,
)
def test_speculate_equals_brute_force_after_random_extends_and_removes(remembered, ops, contexts, cfg):
    # A minimal arena grows and rehashes all the time, so growth and rehashing are checked here too.
    tree = remembering(cfg, remembered)
    seqs: dict[int, list[int]] = {}
    for op, seq_id, tokens in ops:
        if op == "extend":
            tree.extend(seq_id, tokens, some_levels(tokens, remembered))
            seqs.setdefault(seq_id, []).extend(tokens)
        elif seq_id in seqs:
            tree.remove(seq_id)
            del seqs[seq_id]
        tree.forest.check_arena()
        for context in contexts:
            assert_same_as_reference(tree, seqs, context, cfg.max_spec_tokens)
    assert tree.num_tokens == sum(len(s) for s in seqs.values())


# Tokens equal modulo 31 share a bit of a state's continuation mask: a set bit only says "maybe", so a lookup
# of an absent token that shares it must still miss. Six tokens also make hashed states (degree > 4).
ALIASED_VOCAB = st.sampled_from([1, 32, 63, 94, 2, 33])


@pytest.mark.parametrize("remembered", [False, True])
@settings(max_examples=200, deadline=None)
@given(
    seqs=st.dictionaries(st.integers(0, 4), st.lists(ALIASED_VOCAB, min_size=1, max_size=20), max_size=4),
    contexts=st.lists(st.lists(ALIASED_VOCAB, max_size=8), min_size=1, max_size=6),
    cfg=config,
)
def test_tokens_sharing_a_mask_bit_draft_as_the_brute_force_says(remembered, seqs, contexts, cfg):
    tree = remembering(cfg, remembered)
    for seq_id, tokens in seqs.items():
        tree.extend(seq_id, tokens, some_levels(tokens, remembered))
        tree.forest.check_arena()
    for context in contexts:
        assert_same_as_reference(tree, seqs, context, cfg.max_spec_tokens)


@pytest.mark.parametrize("remembered", [False, True])
@settings(max_examples=100, deadline=None)
@given(seqs=st.dictionaries(st.integers(0, 10), st.lists(SMALL_VOCAB, max_size=30), max_size=5))
def test_serialization_round_trips_exactly(remembered, seqs):
    config = DraftConfig(min_token_prob=0.0, remembered_probs=remembered)
    tree = SuffixTree(config)
    for seq_id, tokens in seqs.items():
        tree.extend(seq_id, tokens, some_levels(tokens, remembered))
    copy = SuffixTree.from_bytes(tree.to_bytes(), config)
    assert copy.to_bytes() == tree.to_bytes()
    for tokens in seqs.values():
        for cut in range(0, len(tokens), 3):
            a, b = tree.speculate(tokens[:cut]), copy.speculate(tokens[:cut])
            assert (a.tokens.tolist(), a.probs.tolist(), a.match_len) == (
                b.tokens.tolist(),
                b.probs.tolist(),
                b.match_len,
            )


@pytest.mark.parametrize("degree", range(1, 9))
def test_growing_the_arena_keeps_every_transition(degree):
    # Small states are scanned, large ones hashed; a rehash must keep exactly the hashed ones findable.
    forest = SuffixForest(capacity_tokens=1)
    tree = SuffixTree(DraftConfig(min_token_prob=0.0), forest)
    tree.extend(0, list(range(1, degree + 2)))  # the root gets degree + 1 continuations
    before = [tree.speculate([t]).tokens.tolist() for t in range(1, degree + 1)]
    forest.grow(states=0, edges=10_000)  # forces a rehash into a larger table
    forest.check_arena()
    assert [tree.speculate([t]).tokens.tolist() for t in range(1, degree + 1)] == before
    assert all(before)


def test_removing_every_sequence_returns_to_an_empty_tree():
    tree = SuffixTree()
    rng = np.random.default_rng(0)
    for seq_id in range(5):
        tree.extend(seq_id, rng.integers(0, 50, 200))
    tree.forest.check_arena()
    tree.remove_many(range(5))
    tree.forest.check_arena()
    assert tree.num_tokens == 0 and len(tree) == 0 and tree.num_states == 1
    assert tree.speculate(rng.integers(0, 50, 20)).tokens.size == 0


def test_trees_sharing_a_forest_stay_independent_through_growth_and_compaction():
    forest = SuffixForest(capacity_tokens=64)
    a, b = SuffixTree(forest=forest), SuffixTree(forest=forest)
    a.extend(0, [1, 2, 3, 4])
    b.extend(0, [1, 2, 9, 9])
    for i in range(200):  # forces growth, rebuilds and garbage
        b.extend(i + 1, list(range(100, 140)))
        b.remove(i + 1)
        forest.check_arena()
    forest.compact()
    forest.check_arena()
    assert a.speculate([1, 2]).tokens.tolist() == [3, 4]
    assert b.speculate([1, 2]).tokens.tolist() == [9, 9]


@pytest.mark.parametrize(
    ("field", "broken"),
    [
        (K.TOTAL, "TOTAL"),
        (K.BEST, "BEST"),
        (K.LINK, "suffix link"),
        (K.MASK, "not found"),
        (K.COUNT, "COUNT"),
    ],
)
def test_the_arena_check_names_a_broken_invariant(field, broken):
    # check_arena is what the property tests lean on after every mutation: it must catch what it claims to.
    tree = SuffixTree()
    tree.extend(0, [1, 2, 1, 3, 1, 2])
    tree.forest.check_arena()
    state = tree.root if field == K.COUNT else int(tree.forest.states[tree.root, K.BEST])
    tree.forest.states[state, field] = {K.LINK: tree.root + 1, K.MASK: 0}.get(field, 99)
    with pytest.raises(AssertionError, match=broken):
        tree.forest.check_arena()


@pytest.mark.parametrize(
    ("tokens", "error"),
    [([-1, 2], ValueError), ([2**31], ValueError), ([1.5, 2.0], TypeError), ([[1, 2]], ValueError)],
)
def test_bad_tokens_raise_a_clear_error_at_the_boundary(tokens, error):
    tree = SuffixTree()
    with pytest.raises(error):
        tree.extend(0, tokens)
    with pytest.raises(error):
        tree.speculate(tokens)


def test_unknown_sequence_and_bad_buffers_raise():
    tree = SuffixTree()
    tree.extend(1, [1, 2, 3])
    with pytest.raises(KeyError):
        tree.remove(7)
    data = tree.to_bytes()
    for broken in (b"nope", data[:-2], data + b"\0"):
        with pytest.raises(ValueError):
            SuffixTree.from_bytes(broken)
