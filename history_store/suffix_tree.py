"""Suffix trees for drafting: many trees in one native arena, so one call drafts for a whole decode batch.

A `SuffixTree` indexes a set of token sequences (a problem's recent rollouts, a request's own context, ...)
and drafts the likeliest continuation of a context. Sequences grow incrementally (`extend`) and leave whole
(`remove`, for epoch eviction). The native structure is a generalized suffix automaton (see `_kernels`),
which has the occurrence counts of a depth-bounded suffix tree with amortized O(1) insertion.

Inputs are validated here, once, at the boundary: token ids are integers in [0, 2**31 - 1].
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from history_store import _kernels as K

MAX_TOKEN_ID = 2**31 - 1
_SERIAL_MAGIC = b"DAST"
_SERIAL_VERSION = 1


@dataclass(frozen=True)
class DraftConfig:
    """Drafting parameters (SuffixDecoding's, with its defaults where they fit RL rollouts).

    max_depth: longest context suffix matched; 64 covers repeated reasoning phrases without tying drafts to
        whole paragraphs (SuffixDecoding uses 24-64).
    max_spec_tokens: hard cap on draft length per step (the engine's K).
    max_spec_factor, max_spec_offset: draft at most factor * match_len + offset tokens, so short, weak
        matches draft little (SuffixDecoding's rule; 1.0 and 0 are its defaults).
    min_token_prob: stop when the path probability of the next draft token falls below this (0.1 as in
        SuffixDecoding).
    escape: pseudo-count of "a continuation not seen yet" in each probability, count / (total + escape).
        Raw count ratios are overconfident on thin history (one sighting reads as certainty); 1.0 is PPM's
        method-A escape estimate. 0.0 gives SuffixDecoding's raw ratios.
    """

    max_depth: int = 64
    max_spec_tokens: int = 16
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    escape: float = 1.0

    def __post_init__(self) -> None:
        if self.max_depth < 1 or self.max_spec_tokens < 0:
            raise ValueError(f"max_depth must be >= 1 and max_spec_tokens >= 0, got {self}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.escape < 0.0:
            raise ValueError(f"escape must be >= 0, got {self.escape}")


@dataclass(frozen=True)
class Draft:
    """Draft tokens, the path probability of each, the matched context length and the score (sum of probs)."""

    tokens: np.ndarray
    probs: np.ndarray
    match_len: int
    score: float


def as_tokens(tokens: Sequence[int] | np.ndarray, what: str = "tokens") -> np.ndarray:
    """Validates token ids and returns them as a contiguous 1-D int32 array.

    Raises TypeError for non-integer input and ValueError for other shapes or ids outside [0, 2**31 - 1].
    """
    arr = np.asarray(tokens)
    if arr.size == 0:
        return np.empty(0, np.int32)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{what} must be integer token ids, got dtype {arr.dtype}")
    if arr.dtype != np.int32:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            raise ValueError(f"{what} must be in [0, {MAX_TOKEN_ID}], got values in [{lo}, {hi}]")
        arr = arr.astype(np.int32)
    elif arr.min() < 0:
        raise ValueError(f"{what} must be non-negative token ids, got {int(arr.min())}")
    return np.ascontiguousarray(arr)


class SuffixForest:
    """The arena: growable numpy arrays holding the automata of many trees.

    Trees never free states one by one; a tree that drops sequences is rebuilt into fresh states and its old
    states become garbage, which `compact()` reclaims once it outweighs the live part.
    """

    def __init__(self, capacity_tokens: int = 4096) -> None:
        self._allocate(capacity_tokens)
        self.trees: list[SuffixTree] = []
        self._version = 0

    def _allocate(self, capacity_tokens: int) -> None:
        n = max(64, int(capacity_tokens))
        self.s_len = np.zeros(2 * n, np.int32)
        self.s_link = np.zeros(2 * n, np.int32)
        self.s_count = np.zeros(2 * n, np.int32)
        self.s_edge = np.zeros(2 * n, np.int32)
        self.e_tok = np.zeros(3 * n, np.int32)
        self.e_to = np.zeros(3 * n, np.int32)
        self.e_next = np.zeros(3 * n, np.int32)
        self.h_key = np.full(_pow2(2 * n), -1, np.int64)  # only high-degree states' edges are hashed
        self.h_val = np.zeros(self.h_key.shape[0], np.int32)
        self.meta = np.zeros(3, np.int64)
        self.garbage_states = 0

    @property
    def arena(self) -> tuple[np.ndarray, ...]:
        """The arrays in the order every kernel takes them (see `_kernels`)."""
        return (
            self.s_len,
            self.s_link,
            self.s_count,
            self.s_edge,
            self.e_tok,
            self.e_to,
            self.e_next,
            self.h_key,
            self.h_val,
            self.meta,
        )

    def next_version(self) -> int:
        self._version += 1
        return self._version

    @property
    def memory_bytes(self) -> int:
        """Bytes the arena has allocated."""
        return sum(a.nbytes for a in self.arena)

    def new_root(self) -> int:
        self._grow(states=1, edges=0)
        s_len, s_link, s_count, s_edge, *_, meta = self.arena
        return int(K.new_state(s_len, s_link, s_count, s_edge, meta, 0, -1, 0))

    def extend(self, root: int, last: int, tokens: np.ndarray) -> int:
        """Appends tokens to the sequence ending at state `last` of the tree at `root`; returns the new end."""
        i = 0
        while i < tokens.shape[0]:
            i, last = K.extend_tokens(
                *self.arena,
                root,
                last,
                tokens,
                i,
            )
            if i < tokens.shape[0]:
                need = int(self.s_len[last]) + 2 + int(self.s_count[root])
                self._grow(states=2 * (tokens.shape[0] - i) + 2, edges=need + 3 * (tokens.shape[0] - i))
        return last

    def extend_rows(
        self, trees: Sequence[SuffixTree], seq_ids: Sequence[int], tokens: np.ndarray, off: np.ndarray
    ) -> None:
        """Appends tokens[off[i]:off[i+1]] to sequence seq_ids[i] of trees[i] (which must exist), for all
        rows in one native call. Tokens must already be validated (`as_tokens`)."""
        n = len(trees)
        seqs = [t._seqs[s] for t, s in zip(trees, seq_ids, strict=True)]
        roots = np.fromiter((t.root for t in trees), np.int32, n)
        lasts = np.fromiter((q.last for q in seqs), np.int32, n)
        d_states = np.zeros(n, np.int64)
        d_edges = np.zeros(n, np.int64)
        d_hash = np.zeros(n, np.int64)
        row, pos = 0, int(off[0]) if n else 0
        while row < n:
            row, pos = K.extend_rows(
                *self.arena,
                roots,
                lasts,
                tokens,
                off,
                row,
                pos,
                d_states,
                d_edges,
                d_hash,
            )
            if row < n:
                left = int(off[row + 1]) - pos
                need = int(self.s_len[lasts[row]]) + 2 + int(self.s_count[roots[row]])
                self._grow(states=2 * left + 2, edges=need + 3 * left)
        for i, (tree, seq) in enumerate(zip(trees, seqs, strict=True)):
            chunk = tokens[off[i] : off[i + 1]]
            if chunk.shape[0]:
                seq.last = int(lasts[i])
                seq.tokens.append(chunk)
                seq.length += chunk.shape[0]
                tree.num_tokens += chunk.shape[0]
                tree._n_states += int(d_states[i])
                tree._n_edges += int(d_edges[i])
                tree._n_hash += int(d_hash[i])

    def _grow(self, states: int, edges: int) -> None:
        n_states, n_edges, n_hash = (int(x) for x in self.meta)
        if n_states + states > self.s_len.shape[0]:
            size = _grown(self.s_len.shape[0], n_states + states)
            for name in ("s_len", "s_link", "s_count", "s_edge"):
                setattr(self, name, _resized(getattr(self, name), size))
        if n_edges + edges > self.e_tok.shape[0]:
            size = _grown(self.e_tok.shape[0], n_edges + edges)
            for name in ("e_tok", "e_to", "e_next"):
                setattr(self, name, _resized(getattr(self, name), size))
        if 2 * (n_hash + edges) > self.h_key.shape[0]:
            size = _pow2(4 * (n_hash + edges))
            h_key = np.empty(size, np.int64)
            h_val = np.empty(size, np.int32)
            K.rehash(h_key, h_val, self.e_tok, self.e_next, self.s_edge, n_states)
            self.h_key, self.h_val = h_key, h_val

    def register(self, tree: SuffixTree) -> None:
        self.trees.append(tree)

    def unregister(self, tree: SuffixTree) -> None:
        self.trees.remove(tree)
        self.garbage_states += tree.num_states

    def maybe_compact(self) -> None:
        """Rebuilds every live tree into fresh arrays when garbage outweighs live states."""
        live = int(self.meta[0]) - self.garbage_states
        if self.garbage_states > max(live, 1 << 16):
            self.compact()

    def compact(self) -> None:
        """Rebuilds every live tree into freshly allocated arrays, dropping all garbage."""
        self._allocate(sum(t.num_tokens for t in self.trees))
        for tree in self.trees:
            tree._rebuild(count_garbage=False)


def _pow2(n: int) -> int:
    return 1 << max(6, (int(n) - 1).bit_length())


def _grown(current: int, needed: int) -> int:
    return max(needed, 2 * current)


def _resized(arr: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, arr.dtype)
    out[: arr.shape[0]] = arr
    return out


@dataclass
class _Sequence:
    last: int
    tokens: list[np.ndarray] = field(default_factory=list)
    length: int = 0

    def all_tokens(self) -> np.ndarray:
        if len(self.tokens) > 1:
            self.tokens = [np.concatenate(self.tokens)]
        return self.tokens[0] if self.tokens else np.empty(0, np.int32)


class SuffixTree:
    """A set of token sequences indexed for drafting.

    extend(seq_id, tokens) appends to a sequence (created on first use); remove(seq_id) drops it whole;
    speculate(context) drafts the likeliest continuation of the context's longest matching suffix.
    Trees built on the same `SuffixForest` can be drafted from in one batched native call.
    """

    def __init__(self, config: DraftConfig | None = None, forest: SuffixForest | None = None) -> None:
        self.config = config or DraftConfig()
        self.forest = forest if forest is not None else SuffixForest()
        self._seqs: dict[int, _Sequence] = {}
        self.num_tokens = 0
        self._n_states = 1
        self._n_edges = 0
        self._n_hash = 0
        self.root = self.forest.new_root()
        self.version = self.forest.next_version()
        self.forest.register(self)

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    @property
    def num_states(self) -> int:
        return self._n_states

    @property
    def memory_bytes(self) -> int:
        """Arena bytes this tree uses (16 per state, 12 per edge, 12 per hashed edge) plus its stored tokens."""
        return 16 * self._n_states + 12 * self._n_edges + 12 * self._n_hash + 4 * self.num_tokens

    def _extend_seq(self, last: int, toks: np.ndarray) -> int:
        states, edges, hashed = (int(x) for x in self.forest.meta)
        last = self.forest.extend(self.root, last, toks)
        self._n_states += int(self.forest.meta[0]) - states
        self._n_edges += int(self.forest.meta[1]) - edges
        self._n_hash += int(self.forest.meta[2]) - hashed
        return last

    def extend(self, seq_id: int, tokens: Sequence[int] | np.ndarray) -> None:
        """Appends tokens to sequence `seq_id` (creating it). Raises ValueError/TypeError on bad tokens."""
        toks = as_tokens(tokens)
        seq = self._seqs.get(seq_id)
        if seq is None:
            if not isinstance(seq_id, int | np.integer):
                raise TypeError(f"seq_id must be an int, got {type(seq_id).__name__}")
            seq = self._seqs[seq_id] = _Sequence(last=self.root)
        if toks.shape[0] == 0:
            return
        seq.last = self._extend_seq(seq.last, toks)
        seq.tokens.append(toks)
        seq.length += toks.shape[0]
        self.num_tokens += toks.shape[0]

    def invalidate_matches(self) -> None:
        """Makes requests re-match against this tree (new sequences may offer longer matches)."""
        self.version = self.forest.next_version()

    def remove(self, seq_id: int) -> None:
        """Drops a whole sequence. Raises KeyError for an unknown seq_id."""
        self.remove_many([seq_id])

    def remove_many(self, seq_ids: Iterable[int]) -> None:
        """Drops several sequences with one rebuild. Raises KeyError (and removes nothing) on an unknown id."""
        ids = list(seq_ids)
        missing = [s for s in ids if s not in self._seqs]
        if missing:
            raise KeyError(f"unknown seq_id(s) {missing[:5]}")
        if not ids:
            return
        for s in ids:
            self.num_tokens -= self._seqs.pop(s).length
        self._rebuild(count_garbage=True)

    def _rebuild(self, count_garbage: bool) -> None:
        if count_garbage:
            self.forest.garbage_states += self._n_states
        self._n_states, self._n_edges, self._n_hash = 1, 0, 0
        self.root = self.forest.new_root()
        self.version = self.forest.next_version()
        for seq in self._seqs.values():
            seq.last = self._extend_seq(self.root, seq.all_tokens())
        if count_garbage:
            self.forest.maybe_compact()

    def speculate(self, context: Sequence[int] | np.ndarray, max_tokens: int | None = None) -> Draft:
        """Drafts a continuation of `context` (its last max_depth tokens are matched).

        Returns a Draft; an empty one when no suffix of the context has a continuation in the tree.
        """
        cfg = self.config
        budget = cfg.max_spec_tokens if max_tokens is None else int(max_tokens)
        ctx = as_tokens(context, "context")[-cfg.max_depth :]
        f = self.forest
        state, length = K.advance_match(
            *f.arena[:9], self.root, self.root, 0, ctx, 0, ctx.shape[0], cfg.max_depth
        )
        out_tok = np.empty(max(budget, 0), np.int32)
        out_prob = np.empty(max(budget, 0), np.float32)
        n, match_len, score = K.draft_from(
            *f.arena[:7],
            self.root,
            state,
            length,
            budget,
            cfg.max_spec_factor,
            cfg.max_spec_offset,
            cfg.min_token_prob,
            cfg.escape,
            out_tok,
            out_prob,
        )
        return Draft(out_tok[:n].copy(), out_prob[:n].copy(), int(match_len), float(score))

    def to_bytes(self) -> bytes:
        """Compact serialized form: the sequences (the automaton is rebuilt on load)."""
        parts = [_SERIAL_MAGIC, struct.pack("<HI", _SERIAL_VERSION, len(self._seqs))]
        for seq_id, seq in self._seqs.items():
            toks = seq.all_tokens()
            parts.append(struct.pack("<qI", seq_id, toks.shape[0]))
            parts.append(toks.astype("<i4", copy=False).tobytes())
        return b"".join(parts)

    @classmethod
    def from_bytes(
        cls, data: bytes, config: DraftConfig | None = None, forest: SuffixForest | None = None
    ) -> SuffixTree:
        """Rebuilds a tree from `to_bytes()` output. Raises ValueError on a malformed or truncated buffer."""
        view = memoryview(data)
        if len(view) < 10 or bytes(view[:4]) != _SERIAL_MAGIC:
            raise ValueError("not a serialized suffix tree (bad magic)")
        version, n_seqs = struct.unpack_from("<HI", view, 4)
        if version != _SERIAL_VERSION:
            raise ValueError(f"unsupported suffix tree serialization version {version}")
        tree = cls(config, forest)
        pos = 10
        for _ in range(n_seqs):
            if pos + 12 > len(view):
                raise ValueError("truncated suffix tree buffer")
            seq_id, n = struct.unpack_from("<qI", view, pos)
            pos += 12
            if pos + 4 * n > len(view):
                raise ValueError("truncated suffix tree buffer")
            tree.extend(seq_id, np.frombuffer(view[pos : pos + 4 * n], "<i4").astype(np.int32))
            pos += 4 * n
        if pos != len(view):
            raise ValueError("trailing bytes after serialized suffix tree")
        return tree

    def close(self) -> None:
        """Releases the tree's place in the arena (its states become garbage)."""
        self.forest.unregister(self)
        self._seqs.clear()
        self.num_tokens = 0
        self.forest.maybe_compact()
