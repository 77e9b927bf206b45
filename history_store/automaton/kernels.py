"""Native kernels of the drafter: a generalized suffix automaton over an arena shared by many trees.

Why an automaton: it indexes every substring of every stored sequence with at most two states per token,
insertion is amortized O(1) per token (no O(depth) walk as in a depth-bounded suffix trie), and its suffix
links let a request keep its match state across decode steps (Aho-Corasick style), so a step costs
O(new tokens + draft length). Occurrence counts equal those of a depth-bounded suffix tree for every string
of length <= depth, so drafting semantics are the suffix tree's.

The arena is four arrays (`Arena` in `suffix_tree`), passed to every kernel first, in this order:
  states  int32 [n, 8 or 10]: LEN (longest string length), LINK (suffix link; -1 marks a root), COUNT
          (occurrences = |endpos|; a root's count is never read, so it holds the root's out-degree, which
          bounds every degree in its tree), EDGE (head of the state's outgoing-edge list), BEST (the state
          its most frequent continuation leads to, ties to the smaller token; -1: none), TOTAL (its
          continuations' counts summed), TOKEN (the token on every transition into it: all strings of a
          state end alike; -1 for a root), MASK (bit t % 31 set for each continuation token t; the sign bit
          marks a hashed state), and only in a forest that remembers sampling probabilities (`remembers`),
          PSUM and PKNOWN (over the state's end positions whose sampling probability is known: how many,
          PKNOWN, and their probabilities summed in 1/PROB_LEVELS units, PSUM; the mean is how sure the model
          was when it sampled the state's last token after its strings). Insertion keeps BEST and TOTAL up to
          date, so drafting reads a state's best continuation and its probability in O(1), and each drafted
          token is one row of `states` (the next state, its count and its token) rather than an edge row and
          then a state row. MASK settles most
          failed lookups from the state's own row (matching falls back along suffix links through a miss at
          each level) and sends a hashed state's lookup straight to the hash
  edges   int32 [n, 3]: TOK, TO, NEXT (singly linked per state, for enumerating continuations)
  hashes  int32 [n, 3]: H_STATE (-1: empty), H_TOKEN, H_EDGE, open addressing. Only states with more than
          HASHED_DEGREE edges are hashed: most states have one or two continuations, and scanning a short
          list is as fast as a probe, while hashing every edge would cost a third of the memory.
  meta    int64 [4 + J]: states, edges and hash entries in use (N_STATES, N_EDGES, N_HASHED), then JOURNAL: -1, or
          while the hash table's next size is built beside the step (`hash_growth`) the length of the journal
          of hash entries added since, which its J rows after META_FIELDS hold (-2: it overflowed).
Bookkeeping tables beside it (int64, one row each):
  trees   [T, 6]: ROOT, VERSION (changes when the tree is rebuilt or gains sequences, so matches restart),
          the tree's T_STATES, T_EDGES, T_HASHED, T_TOKENS.
  seqs    [Q, 5]: where a sequence's tokens live in the token pool (Q_OFF, Q_LEN, Q_CAP), its end state
          (Q_LAST) and how many of its tokens the automaton has taken in (Q_EXT).
  slots   [S, 15]: a live request's sequence (R_SEQ) and live tree (R_LIVE), its candidate trees (R_CAND..,
          -1 for none), how far its match states have read its sequence (R_MATCHED), and per candidate the
          match state, length and the tree version it was matched against.
Packing fields into 2-D tables keeps a kernel call to a few arguments: numba unboxes every array argument
on every call (a tuple's members cost more than plain arguments), and at batch 1 that is most of a call.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from history_store.automaton.draft_threads import start_threading_layer

# Before any kernel compiles or loads (see draft_threads): GNU OpenMP would abort vLLM's forked workers, and a
# layer not yet started leaves a cached kernel that calls the threaded pass unlinkable.
start_threading_layer()

HASHED_DEGREE = 4
_HASHED = np.int32(-(2**31))  # MASK's sign bit: the state's edges are in the hash
_MUL = np.uint64(0x9E3779B97F4A7C15)


class Source(IntEnum):
    """Where a draft came from: the candidate tree that drafted it (candidate index + 1), in the order a
    request's slot lists its candidates (`ProblemIndex`); NONE: no draft."""

    NONE = 0
    HISTORY = 1  # the problem's history tree
    LIVE = 2  # the request's live tree (its own context and its in-flight siblings')
    GLOBAL = 3  # the global tree

    @property
    def label(self) -> str:
        """The source's name in reports and statistics."""
        return self.name.lower()


N_CANDIDATES = len(Source) - 1


def candidate(source: Source) -> int:
    """The candidate index of a draft source (its column offset in the slot table's candidate fields)."""
    return int(source) - 1


def columns(layout: Sequence[tuple[str, int]]) -> tuple[int, ...]:
    """The first column of each (name, width) field of a table's row, then the row's width."""
    starts = [0]
    for _name, width in layout:
        assert width >= 1, f"field {_name} has width {width}"
        starts.append(starts[-1] + width)
    return tuple(starts)


# Each table's row layout: one list of (name, width) per table, whose first columns the kernels index by
# name. Unpacked here so that numba sees plain integer constants.
# The remembered-probability columns come last: a forest that does not remember probabilities (the default,
# `DraftConfig.remembered_probs`) keeps rows of the BASE_STATE_FIELDS columns before them, 8 bytes per state
# less, and no level per pooled token. The width is the array's, not its type, so one compiled kernel serves
# both; `remembers` tells them apart.
STATE_LAYOUT = (
    ("LEN", 1),
    ("LINK", 1),
    ("COUNT", 1),
    ("EDGE", 1),
    ("BEST", 1),
    ("TOTAL", 1),
    ("TOKEN", 1),
    ("MASK", 1),
    ("PSUM", 1),
    ("PKNOWN", 1),
)
LEN, LINK, COUNT, EDGE, BEST, TOTAL, TOKEN, MASK, PSUM, PKNOWN, STATE_FIELDS = columns(STATE_LAYOUT)
BASE_STATE_FIELDS = PSUM
EDGE_LAYOUT = (("TOK", 1), ("TO", 1), ("NEXT", 1))
TOK, TO, NEXT, EDGE_FIELDS = columns(EDGE_LAYOUT)
HASH_LAYOUT = (("H_STATE", 1), ("H_TOKEN", 1), ("H_EDGE", 1))
H_STATE, H_TOKEN, H_EDGE, HASH_FIELDS = columns(HASH_LAYOUT)
META_LAYOUT = (("N_STATES", 1), ("N_EDGES", 1), ("N_HASHED", 1), ("JOURNAL", 1))
N_STATES, N_EDGES, N_HASHED, JOURNAL, META_FIELDS = columns(META_LAYOUT)
TREE_LAYOUT = (("ROOT", 1), ("VERSION", 1), ("T_STATES", 1), ("T_EDGES", 1), ("T_HASHED", 1), ("T_TOKENS", 1))
ROOT, VERSION, T_STATES, T_EDGES, T_HASHED, T_TOKENS, TREE_FIELDS = columns(TREE_LAYOUT)
SEQ_LAYOUT = (("Q_OFF", 1), ("Q_LEN", 1), ("Q_CAP", 1), ("Q_LAST", 1), ("Q_EXT", 1))
Q_OFF, Q_LEN, Q_CAP, Q_LAST, Q_EXT, SEQ_FIELDS = columns(SEQ_LAYOUT)
# A request's slot: its sequence, live tree, candidate trees (-1: none), how far its match states have read
# its sequence, and per candidate the match state, its length and the tree version it was matched against.
SLOT_LAYOUT = (
    ("R_SEQ", 1),
    ("R_LIVE", 1),
    ("R_CAND", N_CANDIDATES),
    ("R_MATCHED", 1),
    ("R_STATE", N_CANDIDATES),
    ("R_MLEN", N_CANDIDATES),
    ("R_MVER", N_CANDIDATES),
)
R_SEQ, R_LIVE, R_CAND, R_MATCHED, R_STATE, R_MLEN, R_MVER, SLOT_FIELDS = columns(SLOT_LAYOUT)
# Per drafted row: draft length, match length used, source (a Source), and how many of its tokens each other
# candidate repeats (`_agreement`, in candidate order).
INFO_LAYOUT = (("I_LEN", 1), ("I_MATCH", 1), ("I_SOURCE", 1), ("I_AGREE", N_CANDIDATES - 1))
I_LEN, I_MATCH, I_SOURCE, I_AGREE, INFO_FIELDS = columns(INFO_LAYOUT)
# The layouts the arena's serialized and packed forms assume: fail at import, not later.
assert (BASE_STATE_FIELDS, STATE_FIELDS) == (8, 10)
assert (EDGE_FIELDS, HASH_FIELDS, TREE_FIELDS, SEQ_FIELDS) == (3, 3, 6, 5)
assert (R_MATCHED, SLOT_FIELDS, INFO_FIELDS) == (
    R_CAND + N_CANDIDATES,
    3 + 4 * N_CANDIDATES,
    2 + N_CANDIDATES,
)
# What a kernel that may run out of room returns with the row it stopped at; the caller grows and resumes.
DONE, NEED_ARENA, NEED_POOL, BAD_TOKEN = 0, 1, 2, 3
# A token's sampling probability p as the probability pool holds it (uint8): 1 + round(p * PROB_LEVELS), and 0
# for unknown (prompt tokens, records without `response_logprobs`). A state stops summing after PKNOWN_MAX
# occurrences, so PSUM never overflows int32 (its mean is then that of the first PKNOWN_MAX).
PROB_LEVELS = 254
PKNOWN_MAX = (2**31 - 1) // PROB_LEVELS
# Below this many rows a step drafts on one thread: waking a second costs about what it saves.
PARALLEL_MIN_ROWS = 64


@intrinsic
def prefetch_row(typingctx, table, row):
    """Asks the CPU to start loading row `row` of a 2-D table into its caches, and returns at once:
    LLVM's prefetch, a hint with no effect on any value. Drafting a batch is a chain of dependent loads per row
    over an arena far larger than the caches; touching the next rows' first cache lines ahead of time lets
    their misses overlap the current row's work."""
    if not (isinstance(table, types.Array) and table.ndim == 2 and isinstance(row, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        table_type, row_type = signature.args
        array = context.make_array(table_type)(context, builder, args[0])
        index = context.cast(builder, args[1], row_type, types.intp)
        pointer = cgutils.get_item_pointer2(
            context,
            builder,
            data=array.data,
            shape=cgutils.unpack_tuple(builder, array.shape),
            strides=cgutils.unpack_tuple(builder, array.strides),
            layout=table_type.layout,
            inds=[index, context.get_constant(types.intp, 0)],
            wraparound=False,
        )
        byte_pointer = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        # The intrinsic's name carries its pointer type: p0 for LLVM's opaque pointers, p0i8 for typed ones.
        name = "llvm.prefetch.p0" if getattr(byte_pointer, "is_opaque", False) else "llvm.prefetch.p0i8"
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]), name
        )
        # Read (0), keep in all cache levels (3), data cache (1).
        builder.call(prefetch, [builder.bitcast(pointer, byte_pointer), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(table, row), codegen


@njit(cache=True, inline="always")
def remembers(states):
    """Whether a forest keeps remembered sampling probabilities: then its states' rows hold PSUM and PKNOWN and
    its token pool a level per token; otherwise the rows end before PSUM and the levels are empty."""
    return states.shape[1] > PSUM


@njit(cache=True)
def hash_bucket(key, mask):
    """A key's bucket in a table of mask + 1 buckets (a power of two): a multiplicative hash, which the arena's
    edge table and the budget's token outcomes use."""
    x = np.uint64(key) * _MUL
    x ^= x >> np.uint64(29)
    return np.int64(x & np.uint64(mask))


@njit(cache=True)
def _token_bit(tok):
    """The bit of MASK that stands for tok (bits 0-30; bit 31, the sign, marks a hashed state)."""
    return np.int32(1) << np.int32(np.int64(tok) % 31)


@njit(cache=True)
def find_edge(states, edges, hashes, state, tok):
    """Edge id of the transition (state, tok), or -1. The state's row settles most misses (its token's bit is
    clear in MASK: matching falls back along suffix links through a miss at each level) and says whether to
    scan the short edge list or probe the hash."""
    bits = states[state, MASK]
    if bits & _token_bit(tok) == 0:
        return np.int64(-1)
    if bits >= 0:
        e = np.int64(states[state, EDGE])
        while e != -1:
            if edges[e, TOK] == tok:
                return e
            e = np.int64(edges[e, NEXT])
        return e
    mask = hashes.shape[0] - 1
    i = hash_bucket((np.int64(state) << 32) | np.int64(tok), mask)
    while True:
        k = hashes[i, H_STATE]
        if k == state and hashes[i, H_TOKEN] == tok:
            return np.int64(hashes[i, H_EDGE])
        if k == -1:
            return np.int64(-1)
        i = (i + 1) & mask


@njit(cache=True)
def _hash_put(hashes, meta, state, tok, edge):
    """Adds an entry the table lacks, counted in meta (and journaled, `_journal`)."""
    mask = hashes.shape[0] - 1
    i = hash_bucket((np.int64(state) << 32) | np.int64(tok), mask)
    while hashes[i, H_STATE] != -1:
        i = (i + 1) & mask
    hashes[i, H_STATE] = state
    hashes[i, H_TOKEN] = tok
    hashes[i, H_EDGE] = edge
    meta[N_HASHED] += 1
    _journal(meta, state, edge)


@njit(cache=True, inline="always")
def _journal(meta, state, edge):
    """Records an entry added while the table's next size is built beside the step (`hash_growth`): JOURNAL is
    -1 when no journal is kept, and -2 once one overflowed (its builder then copies the whole table again)."""
    n = meta[JOURNAL]
    if n >= 0:
        if META_FIELDS + n < meta.shape[0]:
            meta[META_FIELDS + n] = (np.int64(state) << 32) | np.int64(edge)
            meta[JOURNAL] = n + 1
        else:
            meta[JOURNAL] = -2


@njit(cache=True)
def _hash_put_absent(hashes, state, tok, edge):
    """Adds an entry unless the table holds its key already (a table being built: `copy_hashes`)."""
    mask = hashes.shape[0] - 1
    i = hash_bucket((np.int64(state) << 32) | np.int64(tok), mask)
    while True:
        k = hashes[i, H_STATE]
        if k == -1:
            hashes[i, H_STATE] = state
            hashes[i, H_TOKEN] = tok
            hashes[i, H_EDGE] = edge
            return
        if k == state and hashes[i, H_TOKEN] == tok:
            return
        i = (i + 1) & mask


def new_meta() -> np.ndarray:
    """An arena's meta: nothing in use, no journal."""
    meta = np.zeros(META_FIELDS, np.int64)
    meta[JOURNAL] = -1
    return meta


@njit(cache=True)
def new_state(states, meta, length, link, count, token):
    s = meta[0]
    meta[0] += 1
    states[s, LEN] = length
    states[s, LINK] = link
    states[s, COUNT] = count
    states[s, EDGE] = -1
    states[s, BEST] = -1
    states[s, TOTAL] = 0
    states[s, TOKEN] = token
    states[s, MASK] = 0
    if remembers(states):
        states[s, PSUM] = 0
        states[s, PKNOWN] = 0
    return np.int64(s)


@njit(cache=True)
def _add_edge(states, edges, hashes, meta, state, tok, to):
    e = meta[1]
    meta[1] += 1
    edges[e, TOK] = tok
    edges[e, TO] = to
    edges[e, NEXT] = states[state, EDGE]
    states[state, EDGE] = e
    states[state, MASK] |= _token_bit(tok)
    if states[state, LINK] == -1:
        states[state, COUNT] += 1  # a root's degree
    if states[state, MASK] < 0:  # hashed already: hash the new edge too
        _hash_put(hashes, meta, state, tok, e)
        return
    degree = 0  # at most HASHED_DEGREE + 1: an unhashed state had at most HASHED_DEGREE edges
    x = np.int64(e)
    while x != -1:
        degree += 1
        x = np.int64(edges[x, NEXT])
    if degree > HASHED_DEGREE:  # just crossed the threshold: hash every edge of the state
        states[state, MASK] |= _HASHED
        x = np.int64(e)
        while x != -1:
            _hash_put(hashes, meta, state, edges[x, TOK], x)
            x = np.int64(edges[x, NEXT])


@njit(cache=True)
def _clone(states, edges, hashes, meta, q, length):
    c = new_state(states, meta, length, states[q, LINK], states[q, COUNT], states[q, TOKEN])
    # The same continuations to the same states, so the same counts and the same best.
    states[c, TOTAL] = states[q, TOTAL]
    states[c, BEST] = states[q, BEST]
    if remembers(states):
        states[c, PSUM] = states[q, PSUM]  # the same end positions so far, as for COUNT
        states[c, PKNOWN] = states[q, PKNOWN]
    e = np.int64(states[q, EDGE])
    while e != -1:
        _add_edge(states, edges, hashes, meta, c, edges[e, TOK], edges[e, TO])
        e = np.int64(edges[e, NEXT])
    return c


@njit(cache=True)
def _redirect(states, edges, hashes, p, tok, old, new):
    """Points (p, tok) and the same transition of p's suffix ancestors from `old` to `new` (a clone of `old`
    with its count, so a best continuation that led to `old` now leads to `new`)."""
    while p != -1:
        e = find_edge(states, edges, hashes, p, tok)
        if e == -1 or edges[e, TO] != old:
            break
        edges[e, TO] = new
        if states[p, BEST] == old:
            states[p, BEST] = new
        p = np.int64(states[p, LINK])


@njit(cache=True, inline="always")
def _occurs(states, s, level):
    """One more end position of state s, whose token was sampled at probability level `level` (0: unknown, and
    always in a forest that does not remember probabilities)."""
    states[s, COUNT] += 1
    if level > 0 and states[s, PKNOWN] < PKNOWN_MAX:
        states[s, PSUM] += level - 1
        states[s, PKNOWN] += 1


@njit(cache=True)
def extend_tokens(states, edges, hashes, meta, root, last, tokens, levels, start, end):
    """Appends tokens[start:end] to the sequence whose current end state is `last`; levels[start:end] are their
    sampling probabilities (PROB_LEVELS units, 0: unknown), read only where the forest `remembers` them.

    Stops early (returning how far it got) when the arena might run out of room for the next token; the
    caller grows the arrays and calls again. Returns (next index into tokens, new end state).
    """
    i = start
    last = np.int64(last)
    remembered = remembers(states)
    while i < end:
        # Room for the worst case of one token: two new states, an edge for each state on the suffix path
        # (at most len(last) + 1), a clone's copied edges (at most root's degree), with the hash half empty.
        # Every state's degree is at most its root's (each token that follows anything also follows root).
        new_edges = states[last, LEN] + 2 + states[root, COUNT]
        if (
            meta[0] + 2 > states.shape[0]
            or meta[1] + new_edges > edges.shape[0]
            or 2 * (meta[2] + new_edges) > hashes.shape[0]
        ):
            return i, last
        c = tokens[i]
        e = find_edge(states, edges, hashes, last, c)
        if e != -1:
            q = np.int64(edges[e, TO])
            if states[last, LEN] + 1 == states[q, LEN]:
                r = q
            else:
                r = _clone(states, edges, hashes, meta, q, states[last, LEN] + 1)
                _redirect(states, edges, hashes, last, c, q, r)
                states[q, LINK] = r
        else:
            cur = new_state(states, meta, states[last, LEN] + 1, root, 0, c)
            p = last
            while p != -1 and find_edge(states, edges, hashes, p, c) == -1:
                _add_edge(states, edges, hashes, meta, p, c, cur)
                p = np.int64(states[p, LINK])
            if p == -1:
                states[cur, LINK] = root
            else:
                q = np.int64(edges[find_edge(states, edges, hashes, p, c), TO])
                if states[p, LEN] + 1 == states[q, LEN]:
                    states[cur, LINK] = q
                else:
                    cl = _clone(states, edges, hashes, meta, q, states[p, LEN] + 1)
                    _redirect(states, edges, hashes, p, c, q, cl)
                    states[q, LINK] = cl
                    states[cur, LINK] = cl
            r = cur
        # The new end position belongs to every state on r's suffix path. Those are exactly the targets of
        # token c from the states on last's suffix path (each old suffix x, now followed by c), a run of
        # sources per target: walking both paths together counts each target once and grows each source's
        # total and, when the grown child now leads, its best continuation (counts only grow between
        # rebuilds, so the leader is the old one or the child that just grew). The target of p holds
        # longest(p) + c, so it is the state of r's path whose lengths span LEN(p) + 1: found by following
        # r's links, without looking up p's edge.
        p = last
        s = r
        level = levels[i] if remembered else 0
        _occurs(states, s, level)
        while p != -1:
            need = states[p, LEN] + 1
            if states[states[s, LINK], LEN] >= need:
                while states[states[s, LINK], LEN] >= need:
                    s = np.int64(states[s, LINK])
                _occurs(states, s, level)
            states[p, TOTAL] += 1
            b = states[p, BEST]
            if b == -1:
                states[p, BEST] = s
            elif b != s:
                n_s, n_b = states[s, COUNT], states[b, COUNT]
                if n_s > n_b or (n_s == n_b and c < states[b, TOKEN]):
                    states[p, BEST] = s
            p = np.int64(states[p, LINK])
        last = r
        i += 1
    return i, last


@njit(cache=True)
def _extend_seq(states, edges, hashes, meta, trees, seqs, pool, levels, tid, q):
    """Feeds sequence q's pooled tokens not yet in tree `tid` into it; keeps the tree's counters. Returns
    DONE, or NEED_ARENA when it stopped for room (what it added so far is kept)."""
    off = seqs[q, Q_OFF]
    start = off + seqs[q, Q_EXT]
    end = off + seqs[q, Q_LEN]
    if start >= end:
        return DONE
    s0, e0, h0 = meta[0], meta[1], meta[2]
    stop, last = extend_tokens(
        states, edges, hashes, meta, trees[tid, ROOT], seqs[q, Q_LAST], pool, levels, start, end
    )
    seqs[q, Q_LAST] = last
    seqs[q, Q_EXT] = stop - off
    trees[tid, T_TOKENS] += stop - start
    trees[tid, T_STATES] += meta[0] - s0
    trees[tid, T_EDGES] += meta[1] - e0
    trees[tid, T_HASHED] += meta[2] - h0
    return DONE if stop == end else NEED_ARENA


@njit(cache=True)
def extend_seqs(states, edges, hashes, meta, trees, seqs, pool, levels, tid, qs, i):
    """Feeds the pooled tokens of sequences qs[i:] into tree `tid`. Returns (index reached, status)."""
    while i < qs.shape[0]:
        status = _extend_seq(states, edges, hashes, meta, trees, seqs, pool, levels, tid, qs[i])
        if status != DONE:
            return i, status
        i += 1
    return i, DONE


@njit(cache=True, nogil=True)
def copy_hashes(dst, src):
    """Puts every complete entry of table src that dst lacks into dst, a larger table (its empty slots -1).
    src may be written meanwhile (`hash_growth` copies it beside the step): entries are only ever added, each
    field once from -1, so a field read >= 0 is final; a slot read half-written is skipped (its writer
    journaled it). Releases the GIL: 0.9 M entries from a 2 M-row table into an 8 M-row one took 15-45 ms."""
    for i in range(src.shape[0]):
        s = src[i, H_STATE]
        t = src[i, H_TOKEN]
        e = src[i, H_EDGE]
        if s >= 0 and t >= 0 and e >= 0:
            _hash_put_absent(dst, s, t, e)


@njit(cache=True)
def replay_journal(dst, edges, meta):
    """Puts the entries meta's journal recorded into dst where it lacks them."""
    for i in range(meta[JOURNAL]):
        x = meta[META_FIELDS + i]
        e = x & np.int64(0xFFFFFFFF)
        _hash_put_absent(dst, x >> np.int64(32), edges[e, TOK], e)


@njit(cache=True)
def advance_match(states, edges, hashes, root, state, length, tokens, lo, hi, max_depth):
    """Feeds tokens[lo:hi] to a match state; returns the state and length of the longest suffix (<= depth)."""
    state = np.int64(state)
    length = np.int64(length)
    # A clone made since the last call may now hold the matched string: move to the state that does.
    while state != root and length <= states[states[state, LINK], LEN]:
        state = np.int64(states[state, LINK])
    for i in range(lo, hi):
        t = tokens[i]
        e = find_edge(states, edges, hashes, state, t)
        while e == -1 and state != root:
            state = np.int64(states[state, LINK])
            length = np.int64(states[state, LEN])
            e = find_edge(states, edges, hashes, state, t)
        if e != -1:
            state = np.int64(edges[e, TO])
            length += 1
            if length > max_depth:
                while states[states[state, LINK], LEN] >= max_depth:
                    state = np.int64(states[state, LINK])
                length = np.int64(max_depth)
    return state, length


@njit(cache=True)
def _best_child(states, state):
    """(state, count) of a state's most frequent continuation (ties: the smaller token) and the total count of
    its continuations; state -1 when it has none. O(1): insertion keeps BEST and TOTAL."""
    best = np.int64(states[state, BEST])
    if best == -1:
        return best, 0, 0
    return best, states[best, COUNT], states[state, TOTAL]


@njit(cache=True)
def _draft_path(states, state, cap, scored, params, floor, out_tok, out_prob, out_sup):
    """The most frequent continuation from `state` into out_tok, out_prob, out_sup (arrays: a
    bundle argument costs a reference count per member per call) while its path probability >=
    params.min_prob, up to cap tokens.
    Probabilities are count(x+t) / (sum over continuations + escape), multiplied along the path; ties go to
    the smaller token id. out_sup gets each token's count (its support). The score is the sum of the first
    `scored` tokens' probabilities. Returns (tokens, score), or (0, 0.0) as soon as the score cannot beat
    `floor` (path probabilities never grow, so at most p per scored token left)."""
    escape, min_prob = params.escape, params.min_prob
    prob = 1.0
    score = 0.0
    n = 0
    while n < cap:
        best, best_c, total = _best_child(states, state)
        if best == -1:
            break
        p = prob * best_c / (total + escape)
        if p < min_prob:
            break
        if score + p * max(scored - n, 0) <= floor:
            return 0, 0.0
        prob = p
        out_tok[n] = states[best, TOKEN]
        out_prob[n] = p
        out_sup[n] = best_c
        if n < scored:
            score += p
        n += 1
        state = best
    return n, score


@njit(cache=True)
def draft_best(
    states, match, budget, params, floor, out_tok, out_prob, out_sup, r, tmp_tok, tmp_prob, tmp_sup
):
    """Drafts from a match state and, with `params.all_matches`, from every shorter match along its suffix links
    (SuffixDecoding scores every match length and keeps the best draft). Each match of length m drafts at
    most min(budget, spec_factor * m + spec_offset) tokens. A draft replaces what out_* hold only when its
    score beats `floor`, and earlier (longer) matches win ties. The score is the sum of path probabilities of
    the draft's first m tokens (at most as long as its match): tokens past that only extend the chosen
    draft, so a larger spec_factor never trades a long match's draft for a short match's longer, shakier one
    (the budget then decides how much of the extension is worth verifying).
    `match` is (the tree's root, the match state, its length). The kept draft goes to row r of out_* (a
    DraftOutputs' arrays; tmp_* hold a candidate's draft), indexed rather than through a row view: a view
    costs two atomic reference counts, and three candidates per row made them about 8% of a batch-256 step.
    Arrays, not bundles, because this runs per candidate of every row: each array member of a bundle
    argument costs a reference count on entry and another on exit (bundled, drafting measured twice as slow
    per row at batch 256).
    Returns (tokens, match length, score, the state it was drafted from) of the kept draft, (0, 0, floor, -1)
    when none beat the floor.
    """
    best_n = 0
    best_len = 0
    best = floor
    best_state = np.int64(-1)
    root, state, length = match
    k = out_tok.shape[1]
    while state != root:
        if states[state, EDGE] != -1:
            cap = min(budget, np.int64(params.spec_factor * length + params.spec_offset), k)
            scored = min(cap, length)
            if scored <= best:  # a score never exceeds its scored length, and shorter matches score fewer
                break
            n, score = _draft_path(states, state, cap, scored, params, best, tmp_tok, tmp_prob, tmp_sup)
            if n > 0 and score > best:
                for j in range(n):
                    out_tok[r, j] = tmp_tok[j]
                    out_prob[r, j] = tmp_prob[j]
                    out_sup[r, j] = tmp_sup[j]
                best_n, best_len, best, best_state = n, length, score, state
            if not params.all_matches:
                break
        state = np.int64(states[state, LINK])
        length = np.int64(states[state, LEN])
    return best_n, best_len, best, best_state


@njit(cache=True)
def remembered_path(states, state, n, remembered, out_mem, r):
    """Into out_mem[r, :n]: how sure the model was when it sampled each token of the n-token draft drafted from
    `state` (its BEST path), after that context: the mean probability over the occurrences that carry one, -1
    where none do, `remembered` is off or the forest does not remember them. Under rejection sampling a draft
    token is accepted with the target's probability of it, which no count shows; the budget may weigh it
    (`workers.budget.acceptance`). It does not steer the draft: from a short match it is the model's
    confidence in other contexts, and as the path's probability it chose worse drafts (docs/benchmarks.md,
    "Remembered probabilities"). Run once for the kept draft, not per candidate."""
    if not (remembered and remembers(states)):
        for j in range(n):
            out_mem[r, j] = -1.0
        return
    for j in range(n):
        state = np.int64(states[state, BEST])
        known = states[state, PKNOWN]
        out_mem[r, j] = states[state, PSUM] / (known * PROB_LEVELS) if known > 0 else -1.0


@njit(cache=True)
def committed(seqs, slots, req_slots):
    """Tokens each request (slots req_slots) has committed: one gather through two tables, cheaper native than
    as two numpy fancy-indexing steps."""
    out = np.empty(req_slots.shape[0], np.int64)
    for i in range(req_slots.shape[0]):
        out[i] = seqs[slots[req_slots[i], R_SEQ], Q_LEN]
    return out


@njit(cache=True, inline="always")
def _commit_rows(arena, slots, rows, row):
    """Copies each row's new tokens (src[base + have : base + end]) into its pooled sequence and feeds them
    to its live tree. Returns (row reached, status)."""
    states, edges, hashes, meta, trees = arena.states, arena.edges, arena.hashes, arena.meta, arena.trees
    seqs, pool, levels = arena.seqs, arena.pool, arena.levels
    req_slots, bases, ends, src = rows.slots, rows.bases, rows.ends, rows.src
    n_rows = req_slots.shape[0]
    remembered = remembers(states)
    while row < n_rows:
        s = req_slots[row]
        q = slots[s, R_SEQ]
        have = seqs[q, Q_LEN]
        end = ends[row]
        if end > have:
            if end > seqs[q, Q_CAP]:
                return row, NEED_POOL
            base = bases[row]
            off = seqs[q, Q_OFF]
            for j in range(have, end):
                t = src[base + j]
                if t < 0:
                    return row, BAD_TOKEN
                pool[off + j] = t
                if remembered:
                    levels[off + j] = 0  # a live token's sampling probability is not known here
            seqs[q, Q_LEN] = end
        status = _extend_seq(states, edges, hashes, meta, trees, seqs, pool, levels, slots[s, R_LIVE], q)
        if status != DONE:
            return row, status
        row += 1
    return row, DONE


@njit(cache=True)
def _prefetch_ahead(states, edges, slots, req_slots, r, n_rows):
    """Prefetches in two stages, so that each load has about a row's work to arrive in: the match states of
    row r + 2's candidates, and the best continuation's state and the first edge of row r + 1's, whose
    states the previous row prefetched (a prefetch never faults; the one real load here is bounds-checked).
    Drafts are unchanged: only when the loads start differs. The live candidate's state is the last step's
    (it drafts from the end of its own sequence, still in cache from the commit); leaving it out measured
    the same."""
    if r + 2 < n_rows:
        s = req_slots[r + 2]
        for c in range(N_CANDIDATES):
            if slots[s, R_CAND + c] >= 0:
                prefetch_row(states, slots[s, R_STATE + c])
    if r + 1 < n_rows:
        s = req_slots[r + 1]
        for c in range(N_CANDIDATES):
            if slots[s, R_CAND + c] >= 0:
                state = slots[s, R_STATE + c]
                if state >= states.shape[0]:
                    continue  # a match state from before the arena was rebuilt: re-matched when drafted
                best = states[state, BEST]
                if best != -1:
                    prefetch_row(states, best)
                head = states[state, EDGE]
                if head != -1:
                    prefetch_row(edges, head)


@njit(cache=True)
def _agreement(states, trees, slots, s, c, drafted, r, n):
    """How many of the draft's first n tokens (drafted[r]) slot s's candidate tree c (0 when it has none)
    repeats on its own likeliest path from its longest matched suffix with a continuation. A draft token that
    other trees would also draft is accepted far more often than its probability in any one tree says
    (dev_rollouts, ad hoc, first tokens at a conditional ratio of 0.4-0.8: 0.24 -> 0.33 -> 0.45 accepted with
    0, 1, 2 agreeing), so the budget takes it as evidence (`workers.budget.acceptance._features_of`). One `states` row per
    agreeing token, on states the match just visited (and `_prefetch_ahead` fetched)."""
    tid = slots[s, R_CAND + c]
    if tid < 0:
        return 0
    root = trees[tid, ROOT]
    st = np.int64(slots[s, R_STATE + c])
    while st != root and states[st, BEST] == -1:
        st = np.int64(states[st, LINK])
    j = 0
    while st != root and j < n:
        st = np.int64(states[st, BEST])
        if st == -1 or states[st, TOKEN] != drafted[r, j]:
            break
        j += 1
    return j


@njit(cache=True)
def _draft_range(arena, slots, rows, lo, hi, params, out):
    """Advances the matches of rows lo..hi-1 and keeps each row's best draft. Reads the arena and writes only
    the rows' own slots and outputs, so disjoint ranges may run on different threads."""
    states, edges, hashes, trees, seqs = arena.states, arena.edges, arena.hashes, arena.trees, arena.seqs
    pool = arena.pool
    req_slots, budgets, info, scores = rows.slots, rows.budgets, out.info, out.score
    max_depth = params.max_depth
    out_tok, out_prob, out_sup = out.tok, out.prob, out.sup
    k = out_tok.shape[1]
    tmp_tok, tmp_prob, tmp_sup = np.empty(k, np.int32), np.empty(k, np.float32), np.empty(k, np.int32)
    for r in range(lo, hi):
        _prefetch_ahead(states, edges, slots, req_slots, r, hi)
        s = req_slots[r]
        budget = budgets[r]
        q = slots[s, R_SEQ]
        off = seqs[q, Q_OFF]
        end = off + seqs[q, Q_LEN]
        for f in range(INFO_FIELDS):
            info[r, f] = 0
        scores[r] = 0.0
        drafted_from = np.int64(-1)  # the state the kept draft was drafted from
        for c in range(N_CANDIDATES):
            tid = slots[s, R_CAND + c]
            if tid < 0:
                continue
            root = trees[tid, ROOT]
            if tid == slots[s, R_LIVE] and seqs[q, Q_EXT] == seqs[q, Q_LEN]:
                # The request's own tokens are a sequence of its live tree, all of them inserted: the longest
                # suffix that occurs there is the whole context (capped at max_depth), whose state insertion
                # just left in Q_LAST. No token-by-token matching needed.
                st = np.int64(seqs[q, Q_LAST])
                ln = np.int64(states[st, LEN])
                if ln > max_depth:
                    while states[states[st, LINK], LEN] >= max_depth:
                        st = np.int64(states[st, LINK])
                    ln = np.int64(max_depth)
                slots[s, R_MVER + c] = trees[tid, VERSION]
            elif slots[s, R_MVER + c] != trees[tid, VERSION]:
                # The tree was rebuilt or gained sequences: re-match from the request's last tokens.
                st, ln = advance_match(
                    states, edges, hashes, root, root, 0, pool, max(off, end - max_depth), end, max_depth
                )
                slots[s, R_MVER + c] = trees[tid, VERSION]
            else:
                st, ln = advance_match(
                    states,
                    edges,
                    hashes,
                    root,
                    slots[s, R_STATE + c],
                    slots[s, R_MLEN + c],
                    pool,
                    off + slots[s, R_MATCHED],
                    end,
                    max_depth,
                )
            slots[s, R_STATE + c] = st
            slots[s, R_MLEN + c] = ln
            if budget <= 0:
                continue
            n, used, score, origin = draft_best(
                states,
                (root, st, ln),
                budget,
                params,
                scores[r],
                out_tok,
                out_prob,
                out_sup,
                r,
                tmp_tok,
                tmp_prob,
                tmp_sup,
            )
            if n > 0:
                info[r, I_LEN] = n
                info[r, I_MATCH] = used
                info[r, I_SOURCE] = c + 1
                scores[r] = score
                drafted_from = origin
        n = info[r, I_LEN]
        if n > 0:  # the kept draft's remembered probabilities, and the other candidates' agreement
            remembered_path(states, drafted_from, n, params.remembered, out.mem, r)
            chosen = info[r, I_SOURCE] - 1
            for j in range(
                N_CANDIDATES - 1
            ):  # the j-th other candidate, found without a branch per candidate (measured slower)
                c = j + 1 if j >= chosen else j
                info[r, I_AGREE + j] = _agreement(states, trees, slots, s, c, out_tok, r, n)
        slots[s, R_MATCHED] = end - off


@njit(cache=True, parallel=True)
def _draft_blocks(arena, slots, rows, params, out, blocks):
    """`_draft_range` over `blocks` contiguous blocks of rows, one per thread."""
    n_rows = rows.slots.shape[0]
    for b in prange(blocks):
        _draft_range(arena, slots, rows, b * n_rows // blocks, (b + 1) * n_rows // blocks, params, out)


@njit(cache=True, inline="always")
def step_rows(arena, slots, rows, row, draft, params, out, threads):
    """A decode step for a whole batch in one call: commits every row's new tokens (resuming at `row`), then,
    with `draft`, advances every row's match in each candidate tree and keeps its best-scoring draft.

    `arena` is a Forest, `slots` the index's slot table, `rows` a StepRows, `params` a DraftParams and `out`
    the DraftOutputs. Row r's request is slot rows.slots[r]; after the step it holds rows.ends[r] tokens,
    token j of it being rows.src[rows.bases[r] + j], and rows.budgets[r] caps its draft. Its candidate c's
    match state persists in the slot table and advances over the tokens committed since the last draft; a
    candidate whose tree version changed re-matches from the last `max_depth` tokens. The best draft over all
    candidates and match lengths wins (earlier candidates and longer matches win ties); out.info[r] holds its
    length, match length and source (candidate + 1; 0: none), out.sup the count behind each draft token and
    out.mem its remembered sampling probability (-1: unknown).
    Drafting a batch of at least PARALLEL_MIN_ROWS rows uses `threads` threads (the drafts are the same);
    committing always runs on one, since rows of a problem share its live tree and all trees share the arena.
    Returns (row reached, status): anything but DONE means the caller must grow and call again.
    """
    row, status = _commit_rows(arena, slots, rows, row)
    if status != DONE or not draft:
        return row, status
    # Threads only where a batch pays for waking them; a single thread never runs parallel work, so TBB's
    # workers never start.
    if threads > 1 and rows.slots.shape[0] >= PARALLEL_MIN_ROWS:
        _draft_blocks(arena, slots, rows, params, out, threads)
    else:
        _draft_range(arena, slots, rows, 0, rows.slots.shape[0], params, out)
    return row, DONE
