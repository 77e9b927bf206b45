"""The per-problem drafting index: what DAS drafts from.

Each request drafts from up to three trees, all in one arena, and the best-scoring draft wins:
  1. its problem's history tree: that problem's rollouts of the last `window_epochs` epochs;
  2. its live tree: its own prompt and output, and those of its in-flight siblings (same problem;
     `live_scope` can widen this to every in-flight request or narrow it to the request alone);
  3. the global tree: recent responses of all problems, capped at `global_tokens` (FIFO). On real
     rollouts of a small model problems share phrasing and early epochs have thin history, so a
     per-problem-only drafter lost to one global tree; composing them keeps both strengths.
A request without a problem id drafts from its own context (and the global tree).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from history_store import _kernels as K
from history_store.suffix_tree import DraftConfig, SuffixForest, SuffixTree, as_tokens

SOURCE_NONE, SOURCE_HISTORY, SOURCE_LIVE, SOURCE_GLOBAL = 0, 1, 2, 3
_N_CANDIDATES = 3


@dataclass(frozen=True)
class BatchDrafts:
    """Drafts for a batch, row-aligned with the request keys. `probs` are path probabilities."""

    tokens: np.ndarray  # int32 (n, K)
    lengths: np.ndarray  # int32 (n,)
    probs: np.ndarray  # float32 (n, K)
    match_lens: np.ndarray  # int32 (n,)
    scores: np.ndarray  # float64 (n,)
    sources: np.ndarray  # int8 (n,): SOURCE_*

    def draft(self, row: int) -> list[int]:
        return self.tokens[row, : self.lengths[row]].tolist()


@dataclass
class _Problem:
    tree: SuffixTree
    seq_of: dict[tuple[int, int], int] = field(default_factory=dict)  # (epoch, sample) -> seq id
    lengths: dict[tuple[int, int], int] = field(default_factory=dict)  # response lengths in the window
    newest_epoch: int = -1
    next_seq: int = 0


@dataclass
class _Live:
    """In-flight requests of one problem (or one request without a problem)."""

    tree: SuffixTree
    active: set[int] = field(default_factory=set)
    dead_tokens: int = 0
    next_seq: int = 0


@dataclass
class _Request:
    slot: int
    seq_id: int
    live_key: str
    problem_id: str | None
    buffer: np.ndarray
    length: int = 0
    pending: list[np.ndarray] = field(default_factory=list)

    def context(self, n: int) -> np.ndarray:
        return self.buffer[max(0, self.length - n) : self.length]


class ProblemIndex:
    """Per-problem history trees over a sliding window of epochs, live sibling overlays and a global tree."""

    def __init__(
        self,
        window_epochs: int = 3,
        config: DraftConfig | None = None,
        global_tokens: int = 2_000_000,
        use_history: bool = True,
        use_global: bool = True,
        live_scope: str = "problem",
    ) -> None:
        if window_epochs < 1:
            raise ValueError(f"window_epochs must be >= 1, got {window_epochs}")
        self.window_epochs = window_epochs
        self.config = config or DraftConfig()
        self.global_tokens = global_tokens
        if live_scope not in ("problem", "request", "all"):
            raise ValueError(f"live_scope must be 'problem', 'request' or 'all', got {live_scope!r}")
        self.use_history = use_history
        self.live_scope = live_scope
        self.forest = SuffixForest()
        self._problems: dict[str, _Problem] = {}
        self._global = SuffixTree(self.config, self.forest) if use_global and global_tokens > 0 else None
        self._global_seq: dict[tuple[str, int, int], int] = {}  # trajectory key -> seq id
        self._global_fifo: deque[tuple[tuple[str, int, int], int]] = deque()  # (key, tokens), arrival order
        self._global_next = 0
        self._global_newest = -1
        self._live: dict[str, _Live] = {}
        self._requests: dict[str, _Request] = {}
        self._free_slots: list[int] = []
        self._m_state = np.zeros((0, _N_CANDIDATES), np.int32)
        self._m_len = np.zeros((0, _N_CANDIDATES), np.int32)
        self._m_version = np.zeros((0, _N_CANDIDATES), np.int64)

    # ---- history -------------------------------------------------------------------------------------

    def window_start(self, problem_id: str, newest_epoch: int) -> int:
        """First epoch kept for a problem whose newest epoch is `newest_epoch`."""
        return max(0, newest_epoch - self.window_epochs + 1)

    def add_trajectory(
        self,
        problem_id: str,
        epoch: int,
        sample: int,
        prompt_ids: Sequence[int] | np.ndarray,
        response_ids: Sequence[int] | np.ndarray,
    ) -> bool:
        """Indexes a finished rollout. Returns False (and changes nothing) if it is already indexed or older
        than the problem's window. A newer epoch slides the window and evicts what falls out of it."""
        return self._add(problem_id, epoch, sample, prompt_ids, response_ids, to_global=True)

    def add_trajectories(
        self, records: Iterable[tuple[str, int, int, Sequence[int] | np.ndarray, Sequence[int] | np.ndarray]]
    ) -> int:
        """Bulk-loads rollouts (problem_id, epoch, sample, prompt_ids, response_ids) in arrival order, as at
        start-up; returns how many were indexed. The same as adding them one by one, except that the global
        tree receives only the newest rollouts that fit its window and cap, instead of being filled, trimmed
        and rebuilt over and over."""
        records = list(records)
        to_global = [False] * len(records)
        if self._global is not None and records:
            newest = max(self._global_newest, max(r[1] for r in records))
            start = max(0, newest - self.window_epochs + 1)
            self._global_newest = newest
            self._drop_global(k for k in self._global_seq if k[1] < start)
            room = self.global_tokens - self._global.num_tokens
            for i in range(len(records) - 1, -1, -1):
                _, epoch, _, prompt, response = records[i]
                size = min(len(prompt), self.config.max_depth) + len(response)
                if epoch >= start and size <= room:
                    to_global[i] = True
                    room -= size
        return sum(
            self._add(*record, to_global=flag) for record, flag in zip(records, to_global, strict=True)
        )

    def _add(
        self,
        problem_id: str,
        epoch: int,
        sample: int,
        prompt_ids: Sequence[int] | np.ndarray,
        response_ids: Sequence[int] | np.ndarray,
        to_global: bool,
    ) -> bool:
        if not isinstance(problem_id, str) or not problem_id:
            raise ValueError(f"problem_id must be a non-empty string, got {problem_id!r}")
        if epoch < 0 or sample < 0:
            raise ValueError(f"epoch and sample must be >= 0, got {epoch}, {sample}")
        prompt = as_tokens(prompt_ids, "prompt_ids")
        response = as_tokens(response_ids, "response_ids")
        problem = self._problems.get(problem_id)
        if problem is None:
            problem = self._problems[problem_id] = _Problem(SuffixTree(self.config, self.forest))
        if (epoch, sample) in problem.seq_of or epoch < self.window_start(problem_id, problem.newest_epoch):
            return False
        if self._global is not None and epoch > self._global_newest:
            # Slide the global tree's window first: one rebuild per epoch, not one per problem.
            self._global_newest = epoch
            self._drop_global(k for k in self._global_seq if k[1] < self.window_start(problem_id, epoch))
        if epoch > problem.newest_epoch:
            problem.newest_epoch = epoch
            self.evict_epochs_before(problem_id, self.window_start(problem_id, epoch))
        # The prompt's tail lets drafting start at the first response token; more prompt adds nothing.
        tokens = np.concatenate([prompt[-self.config.max_depth :], response])
        seq_id = problem.next_seq
        problem.next_seq += 1
        if self.use_history:
            problem.tree.extend(seq_id, tokens)
            problem.tree.invalidate_matches()
        problem.seq_of[(epoch, sample)] = seq_id
        problem.lengths[(epoch, sample)] = int(response.shape[0])
        if (
            to_global
            and self._global is not None
            and epoch >= self.window_start(problem_id, self._global_newest)
        ):
            self._add_global((problem_id, epoch, sample), tokens)
        return True

    def evict_epochs_before(self, problem_id: str, min_epoch: int) -> list[tuple[int, int]]:
        """Removes a problem's rollouts of epochs < min_epoch from its tree; returns their (epoch, sample)."""
        problem = self._problems.get(problem_id)
        if problem is None:
            return []
        gone = sorted(key for key in problem.seq_of if key[0] < min_epoch)
        if gone:
            seq_ids = [problem.seq_of.pop(key) for key in gone]
            for key in gone:
                del problem.lengths[key]
            if self.use_history:
                problem.tree.remove_many(seq_ids)
            # An evicted rollout must never be drafted again, from the global tree either.
            self._drop_global((problem_id, e, s) for e, s in gone)
        return gone

    def _add_global(self, key: tuple[str, int, int], tokens: np.ndarray) -> None:
        seq_id = self._global_next
        self._global_next += 1
        self._global.extend(seq_id, tokens)
        self._global.invalidate_matches()
        self._global_seq[key] = seq_id
        self._global_fifo.append((key, tokens.shape[0]))
        if self._global.num_tokens > self.global_tokens:
            # Drop the oldest down to 3/4 of the cap: one rebuild pays for many insertions.
            drop = []
            kept = self._global.num_tokens
            while self._global_fifo and kept > 0.75 * self.global_tokens:
                old, n = self._global_fifo.popleft()
                if old in self._global_seq:
                    drop.append(old)
                    kept -= n
            self._drop_global(drop)

    def _drop_global(self, keys: Iterable[tuple[str, int, int]]) -> None:
        seq_ids = [self._global_seq.pop(k) for k in list(keys) if k in self._global_seq]
        if seq_ids and self._global is not None:
            self._global.remove_many(seq_ids)
        # Rollouts arrive in epoch order, so those the window dropped sit at the FIFO's front: prune them
        # there, or a long run would keep an entry per rollout ever seen.
        while self._global_fifo and self._global_fifo[0][0] not in self._global_seq:
            self._global_fifo.popleft()

    def problem_ids(self) -> list[str]:
        return list(self._problems)

    def problem_stats(self, problem_id: str) -> dict:
        """Epochs, samples, tokens, tree bytes and response lengths of a problem's window.
        Raises KeyError for an unknown problem."""
        problem = self._problems[problem_id]
        return {
            "epochs": sorted({e for e, _ in problem.seq_of}),
            "samples": len(problem.seq_of),
            "tokens": problem.tree.num_tokens,
            "tree_bytes": problem.tree.memory_bytes,
            "response_lengths": list(problem.lengths.values()),
        }

    # ---- live requests -------------------------------------------------------------------------------

    def start_request(
        self, request_key: str, problem_id: str | None, prompt_ids: Sequence[int] | np.ndarray
    ) -> None:
        """Registers an in-flight request with its prompt. Raises ValueError if the key is already live."""
        if request_key in self._requests:
            raise ValueError(f"request {request_key!r} is already live")
        prompt = as_tokens(prompt_ids, "prompt_ids")
        # Who shares a live tree: siblings of one problem (DAS), every in-flight request (SuffixDecoding's
        # global tree of active responses), or nobody (prompt lookup).
        if self.live_scope == "all":
            live_key = "all"
        elif self.live_scope == "problem" and problem_id is not None:
            live_key = f"p:{problem_id}"
        else:
            live_key = f"r:{request_key}"
        live = self._live.get(live_key)
        if live is None:
            live = self._live[live_key] = _Live(SuffixTree(self.config, self.forest))
        seq_id = live.next_seq
        live.next_seq += 1
        live.active.add(seq_id)
        slot = self._take_slot()
        buffer = np.empty(max(256, 2 * prompt.shape[0]), np.int32)
        req = self._requests[request_key] = _Request(slot, seq_id, live_key, problem_id, buffer)
        live.tree.extend(seq_id, [])  # the sequence exists even for an empty prompt
        self._append(req, live, prompt)

    def append_request(self, request_key: str, tokens: Sequence[int] | np.ndarray) -> None:
        """Adds tokens committed this step to a live request. Raises KeyError for an unknown request."""
        req = self._requests[request_key]
        self._append(req, self._live[req.live_key], as_tokens(tokens))

    def append_batch(self, request_keys: Sequence[str], tokens: Sequence[Sequence[int]]) -> None:
        """Adds each request's tokens committed this step, for a whole decode batch in one native call.
        Raises KeyError for an unknown request and ValueError/TypeError for bad tokens (nothing appended)."""
        reqs = [self._requests[key] for key in request_keys]
        if len(set(request_keys)) != len(reqs):
            raise ValueError("a request key appears twice in one batch")
        lengths = np.fromiter((len(t) for t in tokens), np.int64, len(reqs))
        if lengths.shape[0] != len(reqs):
            raise ValueError(f"{len(reqs)} request keys but {lengths.shape[0]} token lists")
        off = np.zeros(len(reqs) + 1, np.int64)
        np.cumsum(lengths, out=off[1:])
        parts = [np.asarray(t) for t in tokens]
        flat = as_tokens(np.concatenate(parts) if parts else [])
        rows = np.nonzero(lengths)[0]
        for i in rows:
            self._buffer(reqs[i], flat[off[i] : off[i + 1]])
        self.forest.extend_rows(
            [self._live[reqs[i].live_key].tree for i in rows],
            [reqs[i].seq_id for i in rows],
            flat,
            np.concatenate([off[rows], off[rows[-1] + 1 : rows[-1] + 2]]) if rows.size else off[:1],
        )

    def _buffer(self, req: _Request, toks: np.ndarray) -> None:
        if req.length + toks.shape[0] > req.buffer.shape[0]:
            grown = np.empty(2 * (req.length + toks.shape[0]), np.int32)
            grown[: req.length] = req.buffer[: req.length]
            req.buffer = grown
        req.buffer[req.length : req.length + toks.shape[0]] = toks
        req.length += toks.shape[0]
        req.pending.append(toks)

    def _append(self, req: _Request, live: _Live, toks: np.ndarray) -> None:
        if toks.shape[0] == 0:
            return
        self._buffer(req, toks)
        live.tree.extend(req.seq_id, toks)

    def finish_request(self, request_key: str) -> None:
        """Ends a request. Its tokens stay draftable for siblings until they outweigh the live ones."""
        req = self._requests.pop(request_key, None)
        if req is None:
            return
        self._free_slots.append(req.slot)
        live = self._live[req.live_key]
        live.active.discard(req.seq_id)
        live.dead_tokens += req.length
        if not live.active:
            live.tree.close()
            del self._live[req.live_key]
        elif live.dead_tokens > live.tree.num_tokens - live.dead_tokens:
            live.tree.remove_many([s for s in live.tree.seq_ids if s not in live.active])
            live.dead_tokens = 0

    def _take_slot(self) -> int:
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = self._m_state.shape[0]
            grow = max(64, slot)
            self._m_state = np.concatenate([self._m_state, np.zeros((grow, _N_CANDIDATES), np.int32)])
            self._m_len = np.concatenate([self._m_len, np.zeros((grow, _N_CANDIDATES), np.int32)])
            self._m_version = np.concatenate([self._m_version, np.zeros((grow, _N_CANDIDATES), np.int64)])
            self._free_slots.extend(range(slot + grow - 1, slot, -1))
        self._m_version[slot] = 0
        return slot

    # ---- drafting ------------------------------------------------------------------------------------

    def draft_batch(self, request_keys: Sequence[str], budgets: np.ndarray | Sequence[int]) -> BatchDrafts:
        """Drafts for every listed live request in one native call; budgets[i] caps row i's draft.
        Raises KeyError for an unknown request key."""
        n = len(request_keys)
        k = self.config.max_spec_tokens
        budgets = np.minimum(np.asarray(budgets, np.int32), k)
        roots = np.full((n, _N_CANDIDATES), -1, np.int32)
        versions = np.zeros((n, _N_CANDIDATES), np.int64)
        slots = np.empty(n, np.int64)
        reqs = [self._requests[key] for key in request_keys]
        g = self._global
        for i, req in enumerate(reqs):
            slots[i] = req.slot
            problem = self._problems.get(req.problem_id) if req.problem_id is not None else None
            if problem is not None and self.use_history:
                roots[i, 0] = problem.tree.root
                versions[i, 0] = problem.tree.version
            live = self._live[req.live_key].tree
            roots[i, 1] = live.root
            versions[i, 1] = live.version
            if g is not None:
                roots[i, 2] = g.root
                versions[i, 2] = g.version
        new_parts = []
        new_off = np.zeros(n + 1, np.int64)
        for i, req in enumerate(reqs):
            new_parts.extend(req.pending)
            new_off[i + 1] = new_off[i] + sum(p.shape[0] for p in req.pending)
            req.pending = []
        m_state, m_len, m_version = self._m_state[slots], self._m_len[slots], self._m_version[slots]
        stale = np.nonzero((m_version != versions).any(axis=1))[0]
        ctx_off = np.zeros(n + 1, np.int64)
        ctx_parts = []
        depth = self.config.max_depth
        lengths = np.zeros(n, np.int64)
        for i in stale:
            ctx = reqs[i].context(depth)
            ctx_parts.append(ctx)
            lengths[i] = ctx.shape[0]
        ctx_off[1:] = np.cumsum(lengths)
        out = BatchDrafts(
            tokens=np.zeros((n, k), np.int32),
            lengths=np.zeros(n, np.int32),
            probs=np.zeros((n, k), np.float32),
            match_lens=np.zeros(n, np.int32),
            scores=np.zeros(n, np.float64),
            sources=np.zeros(n, np.int8),
        )
        f = self.forest
        cfg = self.config
        K.draft_batch_kernel(
            *f.arena[:9],
            roots,
            versions,
            m_state,
            m_len,
            m_version,
            np.concatenate(new_parts) if new_parts else np.empty(0, np.int32),
            new_off,
            np.concatenate(ctx_parts) if ctx_parts else np.empty(0, np.int32),
            ctx_off,
            budgets,
            depth,
            cfg.max_spec_factor,
            cfg.max_spec_offset,
            cfg.min_token_prob,
            cfg.escape,
            out.tokens,
            out.lengths,
            out.probs,
            out.match_lens,
            out.scores,
            out.sources,
        )
        self._m_state[slots], self._m_len[slots], self._m_version[slots] = m_state, m_len, m_version
        return out
