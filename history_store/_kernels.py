"""Native kernels of the drafter: a generalized suffix automaton over an arena shared by many trees.

Why an automaton: it indexes every substring of every stored sequence with at most two states per token,
insertion is amortized O(1) per token (no O(depth) walk as in a depth-bounded suffix trie), and its suffix
links let a request keep its match state across decode steps (Aho-Corasick style), so a step costs
O(new tokens + draft length). Occurrence counts equal those of a depth-bounded suffix tree for every string
of length <= depth, so drafting semantics are the suffix tree's.

Layout (all int32 unless noted; one arena holds every tree so one call drafts for a whole batch):
  states: s_len (longest string length), s_link (suffix link; -1 marks a root), s_count (occurrences =
          |endpos|; a root's count is never read, so it holds the root's out-degree, which bounds every
          degree in its tree), s_edge (head of the state's outgoing-edge list)
  edges:  e_tok, e_to, e_next (singly linked per state, for enumerating continuations)
  hash:   h_key (int64: state << 32 | token, -1 empty), h_val (edge id). Only states with more than
          HASHED_DEGREE edges are hashed: most states have one or two continuations, and scanning a short
          list is as fast as a probe, while hashing every edge would cost a third of the memory.
  meta:   int64 [n_states, n_edges, n_hash_used]
Every kernel takes the arena arrays first, in the order above (s_len ... h_val, meta), or a prefix of them,
so the facade passes `*forest.arena` (or a prefix) rather than naming each array.
"""

from __future__ import annotations

import numpy as np
from numba import njit

EMPTY = np.int64(-1)
HASHED_DEGREE = 4
_MUL = np.uint64(0x9E3779B97F4A7C15)


@njit(cache=True)
def _slot(key, mask):
    x = np.uint64(key) * _MUL
    x ^= x >> np.uint64(29)
    return np.int64(x & np.uint64(mask))


@njit(cache=True)
def find_edge(s_edge, e_tok, e_next, h_key, h_val, state, tok):
    """Edge id of the transition (state, tok), or -1."""
    e = s_edge[state]
    for _ in range(HASHED_DEGREE):
        if e == -1:
            return -1
        if e_tok[e] == tok:
            return e
        e = e_next[e]
    if e == -1:
        return -1
    key = (np.int64(state) << 32) | np.int64(tok)
    mask = h_key.shape[0] - 1
    i = _slot(key, mask)
    while True:
        k = h_key[i]
        if k == key:
            return h_val[i]
        if k == EMPTY:
            return -1
        i = (i + 1) & mask


@njit(cache=True)
def _hash_put(h_key, h_val, key, edge):
    mask = h_key.shape[0] - 1
    i = _slot(key, mask)
    while h_key[i] != EMPTY:
        i = (i + 1) & mask
    h_key[i] = key
    h_val[i] = edge


@njit(cache=True)
def new_state(s_len, s_link, s_count, s_edge, meta, length, link, count):
    s = meta[0]
    meta[0] += 1
    s_len[s] = length
    s_link[s] = link
    s_count[s] = count
    s_edge[s] = -1
    return np.int32(s)


@njit(cache=True)
def _add_edge(s_link, s_count, s_edge, e_tok, e_to, e_next, h_key, h_val, meta, state, tok, to):
    e = meta[1]
    meta[1] += 1
    e_tok[e] = tok
    e_to[e] = to
    e_next[e] = s_edge[state]
    s_edge[state] = e
    if s_link[state] == -1:
        s_count[state] += 1  # a root's degree
    degree = 0
    x = e
    while x != -1 and degree <= HASHED_DEGREE + 1:
        degree += 1
        x = e_next[x]
    if degree == HASHED_DEGREE + 1:  # just crossed the threshold: hash every edge of the state
        x = e
        while x != -1:
            _hash_put(h_key, h_val, (np.int64(state) << 32) | np.int64(e_tok[x]), x)
            meta[2] += 1
            x = e_next[x]
    elif degree > HASHED_DEGREE + 1:
        _hash_put(h_key, h_val, (np.int64(state) << 32) | np.int64(tok), e)
        meta[2] += 1


@njit(cache=True)
def _clone(s_len, s_link, s_count, s_edge, e_tok, e_to, e_next, h_key, h_val, meta, q, length):
    c = new_state(s_len, s_link, s_count, s_edge, meta, length, s_link[q], s_count[q])
    e = s_edge[q]
    while e != -1:
        _add_edge(s_link, s_count, s_edge, e_tok, e_to, e_next, h_key, h_val, meta, c, e_tok[e], e_to[e])
        e = e_next[e]
    return c


@njit(cache=True)
def _redirect(s_link, s_edge, e_tok, e_to, e_next, h_key, h_val, p, tok, old, new):
    """Points (p, tok) and the same transition of p's suffix ancestors from `old` to `new`."""
    while p != -1:
        e = find_edge(s_edge, e_tok, e_next, h_key, h_val, p, tok)
        if e == -1 or e_to[e] != old:
            break
        e_to[e] = new
        p = s_link[p]


@njit(cache=True)
def extend_tokens(
    s_len, s_link, s_count, s_edge, e_tok, e_to, e_next, h_key, h_val, meta, root, last, tokens, start
):
    """Appends tokens[start:] to the sequence whose current end state is `last`.

    Stops early (returning how far it got) when the arena might run out of room for the next token; the
    caller grows the arrays and calls again. Returns (next index into tokens, new end state).
    """
    n_tokens = tokens.shape[0]
    i = start
    while i < n_tokens:
        # Room for the worst case of one token: two new states, an edge for each state on the suffix path
        # (at most len(last) + 1), a clone's copied edges (at most root's degree), with the hash half empty.
        # Every state's degree is at most its root's (each token that follows anything also follows root).
        new_edges = s_len[last] + 2 + s_count[root]
        if (
            meta[0] + 2 > s_len.shape[0]
            or meta[1] + new_edges > e_tok.shape[0]
            or 2 * (meta[2] + new_edges) > h_key.shape[0]
        ):
            return i, last
        c = tokens[i]
        e = find_edge(s_edge, e_tok, e_next, h_key, h_val, last, c)
        if e != -1:
            q = e_to[e]
            if s_len[last] + 1 == s_len[q]:
                r = q
            else:
                r = _clone(
                    s_len,
                    s_link,
                    s_count,
                    s_edge,
                    e_tok,
                    e_to,
                    e_next,
                    h_key,
                    h_val,
                    meta,
                    q,
                    s_len[last] + 1,
                )
                _redirect(s_link, s_edge, e_tok, e_to, e_next, h_key, h_val, last, c, q, r)
                s_link[q] = r
        else:
            cur = new_state(s_len, s_link, s_count, s_edge, meta, s_len[last] + 1, root, 0)
            p = last
            while p != -1 and find_edge(s_edge, e_tok, e_next, h_key, h_val, p, c) == -1:
                _add_edge(s_link, s_count, s_edge, e_tok, e_to, e_next, h_key, h_val, meta, p, c, cur)
                p = s_link[p]
            if p == -1:
                s_link[cur] = root
            else:
                q = e_to[find_edge(s_edge, e_tok, e_next, h_key, h_val, p, c)]
                if s_len[p] + 1 == s_len[q]:
                    s_link[cur] = q
                else:
                    cl = _clone(
                        s_len,
                        s_link,
                        s_count,
                        s_edge,
                        e_tok,
                        e_to,
                        e_next,
                        h_key,
                        h_val,
                        meta,
                        q,
                        s_len[p] + 1,
                    )
                    _redirect(s_link, s_edge, e_tok, e_to, e_next, h_key, h_val, p, c, q, cl)
                    s_link[q] = cl
                    s_link[cur] = cl
            r = cur
        # The new end position belongs to every state on r's suffix path.
        s = r
        while s != root:
            s_count[s] += 1
            s = s_link[s]
        last = r
        i += 1
    return i, last


@njit(cache=True)
def rehash(h_key_new, h_val_new, e_tok, e_next, s_edge, n_states):
    """Re-inserts the edges of every hashed state (degree > HASHED_DEGREE) into a fresh, larger table."""
    h_key_new[:] = EMPTY
    for s in range(n_states):
        degree = 0
        e = s_edge[s]
        while e != -1 and degree <= HASHED_DEGREE:
            degree += 1
            e = e_next[e]
        if degree <= HASHED_DEGREE:  # the same rule as _add_edge: hashed once it has HASHED_DEGREE + 1 edges
            continue
        e = s_edge[s]
        while e != -1:
            _hash_put(h_key_new, h_val_new, (np.int64(s) << 32) | np.int64(e_tok[e]), e)
            e = e_next[e]


@njit(cache=True)
def advance_match(
    s_len,
    s_link,
    s_count,
    s_edge,
    e_tok,
    e_to,
    e_next,
    h_key,
    h_val,
    root,
    state,
    length,
    tokens,
    lo,
    hi,
    max_depth,
):
    """Feeds tokens[lo:hi] to a match state; returns the state and length of the longest suffix (<= depth)."""
    # A clone made since the last call may now hold the matched string: move to the state that does.
    while state != root and length <= s_len[s_link[state]]:
        state = s_link[state]
    for i in range(lo, hi):
        t = tokens[i]
        e = find_edge(s_edge, e_tok, e_next, h_key, h_val, state, t)
        while e == -1 and state != root:
            state = s_link[state]
            length = s_len[state]
            e = find_edge(s_edge, e_tok, e_next, h_key, h_val, state, t)
        if e != -1:
            state = e_to[e]
            length += 1
            if length > max_depth:
                while s_len[s_link[state]] >= max_depth:
                    state = s_link[state]
                length = max_depth
    return state, length


@njit(cache=True)
def draft_from(
    s_len,
    s_link,
    s_count,
    s_edge,
    e_tok,
    e_to,
    e_next,
    root,
    state,
    length,
    budget,
    spec_factor,
    spec_offset,
    min_prob,
    escape,
    out_tok,
    out_prob,
):
    """Drafts from a match state: the most frequent continuation while its path probability >= min_prob.

    The match falls back to the longest suffix that has a continuation (a string seen only at the end of a
    sequence, e.g. the request's own tail, predicts nothing). Probabilities are count(x+t) / (sum over
    continuations + escape), multiplied along the path. Ties go to the smaller token id.
    Returns (number of draft tokens, match length used, score = sum of path probabilities).
    """
    while state != root and s_edge[state] == -1:
        state = s_link[state]
        length = s_len[state]
    if state == root or length == 0:
        return 0, 0, 0.0
    cap = min(budget, np.int64(spec_factor * length + spec_offset), out_tok.shape[0])
    prob = 1.0
    score = 0.0
    n = 0
    while n < cap:
        e = s_edge[state]
        if e == -1:
            break
        best_e = -1
        best_c = -1
        total = 0
        while e != -1:
            c = s_count[e_to[e]]
            total += c
            if c > best_c or (c == best_c and e_tok[e] < e_tok[best_e]):
                best_c = c
                best_e = e
            e = e_next[e]
        p = prob * best_c / (total + escape)
        if p < min_prob:
            break
        prob = p
        out_tok[n] = e_tok[best_e]
        out_prob[n] = p
        score += p
        n += 1
        state = e_to[best_e]
    return n, length, score


@njit(cache=True)
def draft_batch_kernel(
    s_len,
    s_link,
    s_count,
    s_edge,
    e_tok,
    e_to,
    e_next,
    h_key,
    h_val,
    roots,
    versions,
    m_state,
    m_len,
    m_version,
    new_tok,
    new_off,
    ctx_tok,
    ctx_off,
    budgets,
    max_depth,
    spec_factor,
    spec_offset,
    min_prob,
    escape,
    out_tok,
    out_len,
    out_prob,
    out_match,
    out_score,
    out_src,
):
    """Drafts for a whole decode batch in one call.

    Row i has up to C candidate trees (roots[i, c], -1 for none). Its persisted match state per candidate
    (m_state, m_len, m_version) advances over the tokens committed since the last call (new_tok[new_off[i]:
    new_off[i+1]]); a candidate whose tree was rebuilt (version changed) re-matches from the last `max_depth`
    context tokens (ctx_tok[ctx_off[i]:ctx_off[i+1]]). The candidate with the highest score wins; out_src
    holds its index + 1 (0: no draft).
    """
    n_rows, n_cand = roots.shape
    k = out_tok.shape[1]
    tmp_tok = np.empty(k, np.int32)
    tmp_prob = np.empty(k, np.float32)
    for i in range(n_rows):
        out_len[i] = 0
        out_match[i] = 0
        out_score[i] = 0.0
        out_src[i] = 0
        for c in range(n_cand):
            root = roots[i, c]
            if root < 0:
                continue
            if m_version[i, c] != versions[i, c]:
                st, ln = advance_match(
                    s_len,
                    s_link,
                    s_count,
                    s_edge,
                    e_tok,
                    e_to,
                    e_next,
                    h_key,
                    h_val,
                    root,
                    root,
                    0,
                    ctx_tok,
                    ctx_off[i],
                    ctx_off[i + 1],
                    max_depth,
                )
                m_version[i, c] = versions[i, c]
            else:
                st, ln = advance_match(
                    s_len,
                    s_link,
                    s_count,
                    s_edge,
                    e_tok,
                    e_to,
                    e_next,
                    h_key,
                    h_val,
                    root,
                    m_state[i, c],
                    m_len[i, c],
                    new_tok,
                    new_off[i],
                    new_off[i + 1],
                    max_depth,
                )
            m_state[i, c] = st
            m_len[i, c] = ln
            if budgets[i] <= 0:
                continue
            n, used, score = draft_from(
                s_len,
                s_link,
                s_count,
                s_edge,
                e_tok,
                e_to,
                e_next,
                root,
                st,
                ln,
                budgets[i],
                spec_factor,
                spec_offset,
                min_prob,
                escape,
                tmp_tok,
                tmp_prob,
            )
            if n > 0 and score > out_score[i]:
                out_tok[i, :n] = tmp_tok[:n]
                out_prob[i, :n] = tmp_prob[:n]
                out_len[i] = n
                out_match[i] = used
                out_score[i] = score
                out_src[i] = c + 1


@njit(cache=True)
def extend_rows(
    s_len,
    s_link,
    s_count,
    s_edge,
    e_tok,
    e_to,
    e_next,
    h_key,
    h_val,
    meta,
    roots,
    lasts,
    tok,
    off,
    row,
    pos,
    d_states,
    d_edges,
    d_hash,
):
    """Appends tok[off[r]:off[r+1]] to the sequence ending at lasts[r] of tree roots[r], for rows r >= row,
    starting at token `pos`. Updates lasts in place and adds each row's new states, edges and hash entries
    to d_states / d_edges / d_hash. Stops early when the arena needs room; returns where it stopped as (row, pos), and
    (len(roots), 0) when done."""
    n_rows = roots.shape[0]
    while row < n_rows:
        end = off[row + 1]
        if pos < end:
            states0, edges0, hash0 = meta[0], meta[1], meta[2]
            nxt, last = extend_tokens(
                s_len,
                s_link,
                s_count,
                s_edge,
                e_tok,
                e_to,
                e_next,
                h_key,
                h_val,
                meta,
                roots[row],
                lasts[row],
                tok[:end],
                pos,
            )
            lasts[row] = last
            d_states[row] += meta[0] - states0
            d_edges[row] += meta[1] - edges0
            d_hash[row] += meta[2] - hash0
            if nxt < end:
                return row, nxt
        row += 1
        if row < n_rows:
            pos = off[row]
    return n_rows, 0
