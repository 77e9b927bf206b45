"""The per-problem drafting index: what DAS drafts from.

Each request drafts from up to three trees, all in one arena, and the best-scoring draft wins:
  1. its problem's history tree: that problem's rollouts of the last `window_epochs` epochs;
  2. its live tree: its own prompt and output, and those of its in-flight siblings (same problem;
     `live_scope` can widen this to every in-flight request or narrow it to the request alone);
  3. the global tree: recent responses of all problems, capped at `global_tokens` (FIFO). On real
     rollouts of a small model problems share phrasing and early epochs have thin history, so a
     per-problem-only drafter lost to one global tree; composing them keeps both strengths.
A request without a problem id drafts from its own context (and the global tree).

A lazy index (`lazy=True`) keeps every problem's bookkeeping (which rollouts its window holds, their lengths)
and the global tree exactly as an eager one, but builds a problem's history tree only once it is made resident
(`make_resident`, with the rollouts' tokens fetched from the store): a server behind problem-keyed routing then
holds the trees of the problems routed to it, not of the whole history. Resident trees are built from the same
rollouts under the same sequence ids as the eager index's (whose removals rebuild from the survivors in id
order), so they draft the same.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from history_store.automaton import kernels as K
from history_store.automaton.config import DEFAULT_WINDOW_EPOCHS, DraftConfig
from history_store.automaton.draft_threads import usable_draft_threads
from history_store.automaton.suffix_tree import SuffixForest, SuffixTree, as_levels, as_tokens
from history_store.errors import InvalidInput
from history_store.native.bundles import DraftOutputs, StepRows, draft_params
from history_store.native.dense_rows import DenseRows

# A live tree is rebuilt from its active requests once finished ones hold this many times their tokens. Each
# rebuild re-inserts the active tokens, so its cost per finished request falls as 1/DEAD_PER_LIVE; the
# finished ones mostly sit in their problem's history too, so drafts barely notice the delay (check a change
# with `das bench replay` on the traces in data/).
DEAD_PER_LIVE = 4


def eviction_bounds(keys: Iterable[tuple[str, int, int]]) -> dict[str, int]:
    """The store evicts whole epochs from the bottom of a problem's window: for evicted keys (problem, epoch,
    sample), the first epoch each problem keeps (its newest evicted epoch + 1)."""
    bounds: dict[str, int] = {}
    for problem_id, epoch, _sample in keys:
        bounds[problem_id] = max(bounds.get(problem_id, 0), epoch + 1)
    return bounds


@dataclass(frozen=True)
class BatchDrafts:
    """Drafts for a batch, row-aligned with the request keys. `probs` are path probabilities; `support` is
    the occurrence count behind each draft token (how much evidence the tree had for it), `remembered` the
    mean probability its occurrences were sampled with (-1: not known). The arrays are
    views of the index's step buffers: valid until its next draft."""

    tokens: np.ndarray  # int32 (n, K)
    lengths: np.ndarray  # int32 (n,)
    probs: np.ndarray  # float32 (n, K)
    support: np.ndarray  # int32 (n, K)
    remembered: np.ndarray  # float32 (n, K)
    match_lens: np.ndarray  # int32 (n,)
    scores: np.ndarray  # float64 (n,)
    sources: np.ndarray  # int32 (n,): a kernels.Source
    agreement: np.ndarray  # int32 (n, 2): draft tokens each other tree's likeliest path repeats

    def draft(self, row: int) -> list[int]:
        return self.tokens[row, : self.lengths[row]].tolist()


_NO_TOKENS = np.zeros(0, np.int32)


class _StepBuffers:
    """Per-batch arrays of the step kernel, allocated once for the largest batch seen and reused; the views
    of the last batch size are kept too (a view costs about as much as a small numpy operation)."""

    def __init__(self, rows: int, k: int) -> None:
        self.tokens = np.zeros((rows, k), np.int32)
        self.probs = np.zeros((rows, k), np.float32)
        self.support = np.zeros((rows, k), np.int32)
        self.remembered = np.zeros((rows, k), np.float32)
        self.info = np.zeros((rows, K.INFO_FIELDS), np.int32)
        self.scores = np.zeros(rows, np.float64)
        self._n = -1
        self._views: tuple[BatchDrafts, DraftOutputs] | None = None

    def views(self, n: int) -> tuple[BatchDrafts, DraftOutputs]:
        """The drafts of a batch of n rows, and the kernel's output arrays they view."""
        if n != self._n or self._views is None:
            out = DraftOutputs(
                tok=self.tokens[:n],
                prob=self.probs[:n],
                sup=self.support[:n],
                mem=self.remembered[:n],
                info=self.info[:n],
                score=self.scores[:n],
            )
            info = out.info
            drafts = BatchDrafts(
                tokens=out.tok,
                lengths=info[:, K.I_LEN],
                probs=out.prob,
                support=out.sup,
                remembered=out.mem,
                match_lens=info[:, K.I_MATCH],
                scores=out.score,
                sources=info[:, K.I_SOURCE],
                agreement=info[:, K.I_AGREE : K.I_AGREE + K.N_CANDIDATES - 1],
            )
            self._n, self._views = n, (drafts, out)
        return self._views


@dataclass
class _Problem:
    tree: SuffixTree
    seq_of: dict[tuple[int, int], int] = field(default_factory=dict)  # (epoch, sample) -> seq id
    lengths: dict[tuple[int, int], int] = field(default_factory=dict)  # response lengths in the window
    newest_epoch: int = -1
    next_seq: int = 0


@dataclass
class _LiveTree:
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


class ProblemIndex:
    """Per-problem history trees over a sliding window of epochs, live sibling overlays and a global tree."""

    def __init__(
        self,
        window_epochs: int = DEFAULT_WINDOW_EPOCHS,
        config: DraftConfig | None = None,
        global_tokens: int = 2_000_000,
        use_history: bool = True,
        use_global: bool = True,
        live_scope: str = "problem",
        draft_threads: int = 1,
        lazy: bool = False,
    ) -> None:
        """draft_threads: threads a step's drafting may use, as granted by `usable_draft_threads` (the drafts
        are the same on any number). lazy: build history trees only for problems made resident."""
        if window_epochs < 1:
            raise InvalidInput(f"window_epochs must be >= 1, got {window_epochs}")
        self.window_epochs = window_epochs
        self.config = config or DraftConfig()
        self._params = draft_params(self.config)  # the config is frozen: its kernel form once
        self.draft_threads = usable_draft_threads(draft_threads)
        self.global_tokens = global_tokens
        # The global tree past its cap drops its oldest rollouts down to this share of the cap.
        self.global_keep = 0.75
        if live_scope not in ("problem", "request", "all"):
            raise InvalidInput(f"live_scope must be 'problem', 'request' or 'all', got {live_scope!r}")
        self.use_history = use_history
        self.live_scope = live_scope
        self.forest = SuffixForest(remembered=self.config.remembered_probs)
        self._problems: dict[str, _Problem] = {}
        # Problems whose history tree is built; None: every problem's (an eager index).
        self._resident: set[str] | None = set() if lazy else None
        self._global = SuffixTree(self.config, self.forest) if use_global and global_tokens > 0 else None
        self._global_seq: dict[tuple[str, int, int], int] = {}  # trajectory key -> seq id
        self._global_fifo: deque[tuple[tuple[str, int, int], int]] = deque()  # (key, tokens), arrival order
        self._global_next = 0
        self._global_newest = -1
        self._live: dict[str, _LiveTree] = {}
        self._requests: dict[str, _Request] = {}
        # The one allocator of request slots: the budget policy and the step book register their per-request
        # arrays with it too (`DenseRows`), so one growth replaces every owner's at once.
        self.request_rows = DenseRows()
        self.request_rows.register(self, "slots", (K.SLOT_FIELDS,), np.int64)  # the kernels' slot table
        self._buffers = _StepBuffers(0, self.config.max_spec_tokens)

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
        response_logprobs: Sequence[float] | np.ndarray | None = None,
    ) -> bool:
        """Indexes a finished rollout, with the log probability each response token was sampled with when
        known. Returns False (and changes nothing) if it is already indexed or older than the problem's
        window. A newer epoch slides the window and evicts what falls out of it."""
        return self._add(
            problem_id, epoch, sample, prompt_ids, response_ids, response_logprobs, to_global=True
        )

    def add_trajectories(self, records: Iterable[tuple[Any, ...]]) -> int:
        """Bulk-loads rollouts (problem_id, epoch, sample, prompt_ids, response_ids[, response_logprobs]) in
        arrival order, as at start-up; returns how many were indexed. The same as adding them one by one, except that the global
        tree receives only the newest rollouts that fit its window and cap, instead of being filled, trimmed
        and rebuilt over and over."""
        records = list(records)
        to_global = self.global_admission([(r[1], len(r[3]), len(r[4])) for r in records])
        return sum(
            self._add(*record[:5], record[5] if len(record) > 5 else None, to_global=flag)
            for record, flag in zip(records, to_global, strict=True)
        )

    def add_loaded(
        self,
        problem_id: str,
        epoch: int,
        sample: int,
        prompt_ids: Sequence[int] | np.ndarray,
        response_ids: Sequence[int] | np.ndarray,
        response_logprobs: Sequence[float] | np.ndarray | None = None,
        to_global: bool = False,
    ) -> bool:
        """One rollout of a bulk load (`global_admission` said whether the global tree takes it); returns
        whether it was new."""
        return self._add(problem_id, epoch, sample, prompt_ids, response_ids, response_logprobs, to_global)

    def global_admission(self, sizes: Sequence[tuple[int, int, int]]) -> list[bool]:
        """Which of a bulk load's rollouts, given as (epoch, prompt length, response length) in arrival order,
        go into the global tree: the newest that fit its window and cap. Slides the global window to the
        newest epoch (what the adds would do first). `add_loaded` then adds each with its flag."""
        to_global = [False] * len(sizes)
        if self._global is not None and sizes:
            newest = max(self._global_newest, max(size[0] for size in sizes))
            start = max(0, newest - self.window_epochs + 1)
            self._global_newest = newest
            self._drop_global(k for k in self._global_seq if k[1] < start)
            room = self.global_tokens - self._global_size()
            for i in range(len(sizes) - 1, -1, -1):
                epoch, prompt_len, response_len = sizes[i]
                size = min(prompt_len, self.config.max_depth) + response_len
                if epoch >= start and size <= room:
                    to_global[i] = True
                    room -= size
        return to_global

    def load_stored(
        self,
        entries: Sequence[tuple[str, int, int, int, int]],
        fetch: Callable[[str, int, int], tuple[Any, ...] | None],
    ) -> int:
        """Bulk-loads stored rollouts known by (problem_id, epoch, sample, prompt length, response length), in
        arrival order, fetching the tokens (prompt, response[, response logprobs]) of each only when a tree
        takes them, one at a time: the index that results equals `add_trajectories` of the same rollouts,
        while the memory a load holds beyond the trees is the entries, not every rollout's tokens (a lazy
        index fetches the global tree's rollouts only). `fetch` returns None for a rollout the store no longer
        holds (it is skipped). Returns how many were indexed."""
        to_global = self.global_admission([(e[1], e[3], e[4]) for e in entries])
        count = 0
        for (problem_id, epoch, sample, _, response_len), flag in zip(entries, to_global, strict=True):
            if flag or self._builds(problem_id):
                tokens = fetch(problem_id, epoch, sample)
                if tokens is None:
                    continue
                prompt, response = tokens[0], tokens[1]
                logprobs = tokens[2] if len(tokens) > 2 else None
            else:  # bookkeeping only: no tree takes its tokens, only its length counts
                prompt, response, logprobs = _NO_TOKENS, np.zeros(response_len, np.int32), None
            count += self._add(problem_id, epoch, sample, prompt, response, logprobs, to_global=flag)
        return count

    def _add(
        self,
        problem_id: str,
        epoch: int,
        sample: int,
        prompt_ids: Sequence[int] | np.ndarray,
        response_ids: Sequence[int] | np.ndarray,
        response_logprobs: Sequence[float] | np.ndarray | None,
        to_global: bool,
    ) -> bool:
        if not isinstance(problem_id, str) or not problem_id:
            raise InvalidInput(f"problem_id must be a non-empty string, got {problem_id!r}")
        if epoch < 0 or sample < 0:
            raise InvalidInput(f"epoch and sample must be >= 0, got {epoch}, {sample}")
        prompt = as_tokens(prompt_ids, "prompt_ids")
        response = as_tokens(response_ids, "response_ids")
        tokens, levels = self._sequence(prompt, response, response_logprobs)  # validates before any change
        problem = self._problems.get(problem_id)
        if problem is None:
            problem = self._problems[problem_id] = _Problem(SuffixTree(self.config, self.forest))
            if self.use_history:
                for req in self._requests.values():  # live requests of a problem that had no history yet
                    if req.problem_id == problem_id:
                        self.slots[req.slot, K.R_CAND + K.candidate(K.Source.HISTORY)] = problem.tree.tid
        if (epoch, sample) in problem.seq_of or epoch < self.window_start(problem_id, problem.newest_epoch):
            return False
        if self._global is not None and epoch > self._global_newest:
            # Slide the global tree's window first: one rebuild per epoch, not one per problem.
            self._global_newest = epoch
            self._drop_global(k for k in self._global_seq if k[1] < self.window_start(problem_id, epoch))
        if epoch > problem.newest_epoch:
            problem.newest_epoch = epoch
            self.evict_epochs_before(problem_id, self.window_start(problem_id, epoch))
        seq_id = problem.next_seq
        problem.next_seq += 1
        if self._builds(problem_id):
            self._tree_extend(problem.tree, seq_id, tokens, levels, invalidate=True)
        problem.seq_of[(epoch, sample)] = seq_id
        problem.lengths[(epoch, sample)] = int(response.shape[0])
        if (
            to_global
            and self._global is not None
            and epoch >= self.window_start(problem_id, self._global_newest)
        ):
            self._add_global((problem_id, epoch, sample), tokens, levels)
        return True

    def _sequence(
        self,
        prompt: np.ndarray,
        response: np.ndarray,
        response_logprobs: Sequence[float] | np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """A rollout as its trees hold it: the prompt's tail (it lets drafting start at the first response
        token; more prompt adds nothing) and the response, with each token's sampling probability level
        (unknown for the prompt). Raises ValueError on log probabilities that do not fit the response."""
        head = prompt[-self.config.max_depth :]
        levels = np.concatenate(
            [np.zeros(head.shape[0], np.uint8), as_levels(response_logprobs, response.shape[0])]
        )
        return np.concatenate([head, response]), levels

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
            if self._builds(problem_id):
                self._tree_remove(problem.tree, seq_ids)
            # An evicted rollout must never be drafted again, from the global tree either.
            self._drop_global((problem_id, e, s) for e, s in gone)
        return gone

    def evict_keys(self, keys: Iterable[tuple[str, int, int]]) -> dict[str, int]:
        """Follows a store's evictions: drops every epoch up to the newest evicted one of each problem.
        Returns the bounds applied (see `eviction_bounds`)."""
        bounds = eviction_bounds(keys)
        for problem_id, min_epoch in bounds.items():
            self.evict_epochs_before(problem_id, min_epoch)
        return bounds

    def remove_trajectory(self, problem_id: str, epoch: int, sample: int) -> bool:
        """Drops one rollout (a store quarantined it) from its problem's tree and the global tree; the rest
        of its epoch stays. Returns False when it was not indexed."""
        problem = self._problems.get(problem_id)
        if problem is None or (epoch, sample) not in problem.seq_of:
            return False
        seq_id = problem.seq_of.pop((epoch, sample))
        del problem.lengths[(epoch, sample)]
        if self._builds(problem_id):
            self._tree_remove(problem.tree, [seq_id])
        self._drop_global([(problem_id, epoch, sample)])
        return True

    def clear_history(self) -> None:
        """Forgets every rollout (problem and global trees), keeping live requests: before reloading a store
        whose change log a reader can no longer follow."""
        for problem_id, problem in self._problems.items():
            if self._builds(problem_id):
                self._tree_remove(problem.tree, problem.tree.seq_ids)
            problem.seq_of.clear()
            problem.lengths.clear()
            problem.newest_epoch = -1
        if self._global is not None:
            self._tree_remove(self._global, self._global.seq_ids)
        self._global_seq.clear()
        self._global_fifo.clear()
        self._global_newest = -1

    def _builds(self, problem_id: str) -> bool:
        """Whether the problem's history tree holds its window (not for a lazy index's other problems)."""
        return self.use_history and (self._resident is None or problem_id in self._resident)

    def is_resident(self, problem_id: str) -> bool:
        """Whether the problem's history tree is built (always, in an eager index)."""
        return self._resident is None or problem_id in self._resident

    def make_resident(self, problem_id: str, fetch: Callable[[str, int, int], tuple[Any, ...] | None]) -> int:
        """Builds a lazy index's history tree of `problem_id` from the rollouts its window holds, whose
        (prompt, response[, response logprobs]) `fetch(problem_id, epoch, sample)` returns (None: the store no
        longer has it; the rollout then leaves the window, as when the store quarantines it). Returns the
        tokens added (0 when it was resident already or has no history)."""
        if self.is_resident(problem_id):
            return 0
        self._resident.add(problem_id)  # type: ignore[union-attr]  # is_resident is True without the set
        problem = self._problems.get(problem_id)
        if problem is None:
            return 0  # its rollouts, when they come, go into the tree as for any resident problem
        before = problem.tree.num_tokens
        for (epoch, sample), seq_id in sorted(problem.seq_of.items(), key=lambda item: item[1]):
            tokens = fetch(problem_id, epoch, sample)
            if tokens is None:
                del problem.seq_of[(epoch, sample)], problem.lengths[(epoch, sample)]
                self._drop_global([(problem_id, epoch, sample)])
                continue
            prompt, response = as_tokens(tokens[0], "prompt_ids"), as_tokens(tokens[1], "response_ids")
            if self.use_history:
                self._build(
                    problem.tree,
                    seq_id,
                    *self._sequence(prompt, response, tokens[2] if len(tokens) > 2 else None),
                )
        problem.tree.invalidate_matches()
        return problem.tree.num_tokens - before

    def release(self, problem_id: str) -> int:
        """Drops a lazy index's history tree of `problem_id` (its bookkeeping and global rollouts stay), unless a
        live request drafts from it; `make_resident` builds it again, the same. Returns the tokens dropped."""
        if self._resident is None or problem_id not in self._resident:
            return 0
        if any(req.problem_id == problem_id for req in self._requests.values()):
            return 0
        self._resident.discard(problem_id)
        problem = self._problems.get(problem_id)
        if problem is None:
            return 0
        tokens = problem.tree.num_tokens
        self._tree_remove(problem.tree, problem.tree.seq_ids)
        return tokens

    @property
    def global_tree_tokens(self) -> int:
        """Tokens the global tree holds (0 without one)."""
        return self._global.num_tokens if self._global is not None else 0

    def global_keys(self) -> list[tuple[str, int, int]]:
        """Trajectory keys in the global tree, oldest first (the order its token cap drops them in)."""
        return [key for key, _ in self._global_fifo if key in self._global_seq]

    def _add_global(self, key: tuple[str, int, int], tokens: np.ndarray, levels: np.ndarray) -> None:
        seq_id = self._global_next
        self._global_next += 1
        # No re-match for requests drafting from the global tree: every finished rollout lands here, so a
        # re-match would cost every row of the batch a full re-match whenever any request finishes, and on
        # real rollouts it found nothing the request's held match and its live tree did not (replay, same
        # figures). Additions never invalidate a held match (see advance_match); only rebuilds do.
        self._global_seq[key] = seq_id
        self._global_fifo.append((key, tokens.shape[0]))
        self._tree_extend(self._global, seq_id, tokens, levels, invalidate=False)
        if self._global_size() > self.global_tokens:
            # Drop the oldest down to `global_keep` of the cap: one rebuild pays for many insertions.
            drop = []
            kept = self._global_size()
            while self._global_fifo and kept > self.global_keep * self.global_tokens:
                old, n = self._global_fifo.popleft()
                if old in self._global_seq:
                    drop.append(old)
                    kept -= n
            self._drop_global(drop)

    def _drop_global(self, keys: Iterable[tuple[str, int, int]]) -> None:
        seq_ids = [self._global_seq.pop(k) for k in list(keys) if k in self._global_seq]
        if seq_ids and self._global is not None:
            self._tree_remove(self._global, seq_ids)
        # Rollouts arrive in epoch order, so those the window dropped sit at the FIFO's front: prune them
        # there, or a long run would keep an entry per rollout ever seen.
        while self._global_fifo and self._global_fifo[0][0] not in self._global_seq:
            self._global_fifo.popleft()

    # ---- how trees change (a `DeferredIndex` does it in pieces, between decode steps) ----------------------

    def _build(self, tree: SuffixTree, seq_id: int, tokens: np.ndarray, levels: np.ndarray) -> None:
        """A rollout of a lazy build (`make_resident`) into its problem's tree, at once."""
        tree.extend(seq_id, tokens, levels)

    def _tree_extend(
        self, tree: SuffixTree, seq_id: int, tokens: np.ndarray, levels: np.ndarray, invalidate: bool
    ) -> None:
        """Adds a rollout's tokens to a history tree (the problem's or the global one); `invalidate`: requests
        re-match on it (a problem's tree: new rollouts may offer longer matches)."""
        tree.extend(seq_id, tokens, levels)
        if invalidate:
            tree.invalidate_matches()

    def _tree_remove(self, tree: SuffixTree, seq_ids: Iterable[int]) -> None:
        """Drops rollouts from a history tree."""
        tree.remove_many(seq_ids)

    def _global_size(self) -> int:
        """Tokens of the rollouts the global tree holds, against its cap."""
        return self._global.num_tokens if self._global is not None else 0

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
        self,
        request_key: str,
        problem_id: str | None,
        prompt_ids: Sequence[int] | np.ndarray,
        expected_tokens: int | None = None,
    ) -> int:
        """Registers an in-flight request with its prompt; returns its slot (a dense id for `step`).
        `expected_tokens` (prompt and output, e.g. prompt + max_tokens) sizes its token segment once, so a
        step rarely stops to move it. Raises ValueError if the key is already live."""
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
            live = self._live[live_key] = _LiveTree(SuffixTree(self.config, self.forest))
        seq_id = live.next_seq
        live.next_seq += 1
        live.active.add(seq_id)
        # Room for what the request may commit (by default the prompt and as much output again): a request
        # that outgrows its segment is moved, and the step that finds it stops and resumes around the move.
        capacity = max(256, 2 * prompt.shape[0]) if expected_tokens is None else expected_tokens
        q = live.tree.add_seq(seq_id, max(capacity, prompt.shape[0], 16))
        live.tree.extend(seq_id, prompt)
        slot = self.request_rows.take()
        self._requests[request_key] = _Request(slot, seq_id, live_key, problem_id)
        row = self.slots[slot]
        row[:] = 0
        row[K.R_SEQ] = q
        row[K.R_LIVE] = live.tree.tid
        problem = self._problems.get(problem_id) if problem_id is not None else None
        history = problem.tree.tid if problem is not None and self.use_history else -1
        row[K.R_CAND + K.candidate(K.Source.HISTORY)] = history
        row[K.R_CAND + K.candidate(K.Source.LIVE)] = live.tree.tid
        row[K.R_CAND + K.candidate(K.Source.GLOBAL)] = self._global.tid if self._global is not None else -1
        return slot

    def slot(self, request_key: str) -> int:
        """The slot of a live request. Raises KeyError for an unknown key."""
        return self._requests[request_key].slot

    def committed(self, slots: np.ndarray) -> np.ndarray:
        """Tokens (prompt and output) each slot's request has committed so far."""
        return K.committed(self.forest.seqs, self.slots, slots)

    def request_tokens(self, request_key: str) -> np.ndarray:
        """A copy of the prompt and output a live request committed. Raises KeyError for an unknown request."""
        req = self._requests[request_key]
        return self.forest.seq_tokens(self._live[req.live_key].tree.seq_row(req.seq_id)).copy()

    def append_request(self, request_key: str, tokens: Sequence[int] | np.ndarray) -> None:
        """Adds tokens committed this step to a live request. Raises KeyError for an unknown request."""
        self.append_batch([request_key], [tokens])

    def append_batch(self, request_keys: Sequence[str], tokens: Sequence[Sequence[int]]) -> None:
        """Adds each request's tokens committed this step, for a whole decode batch in one native call.
        Raises KeyError for an unknown request and ValueError/TypeError for bad tokens (nothing appended)."""
        slots = self._slots_of(request_keys)
        if len(tokens) != slots.shape[0]:
            raise ValueError(f"{slots.shape[0]} request keys but {len(tokens)} token lists")
        lengths = np.fromiter((len(t) for t in tokens), np.int64, slots.shape[0])
        parts = [np.asarray(t) for t in tokens]
        flat = as_tokens(np.concatenate(parts) if parts else [])
        have = self.committed(slots)
        start = np.zeros(slots.shape[0], np.int64)
        np.cumsum(lengths[:-1], out=start[1:])
        # Token j of row i's request sits at flat[base + j] for the new ones: base = where they start - have.
        self._run(slots, flat, start - have, have + lengths, np.zeros_like(slots), draft=False)

    def finish_request(self, request_key: str) -> None:
        """Ends a request. Its tokens stay draftable for siblings until finished requests outweigh the live
        ones DEAD_PER_LIVE to one."""
        req = self._requests.pop(request_key, None)
        if req is None:
            return
        self.request_rows.release(req.slot)
        live = self._live[req.live_key]
        live.active.discard(req.seq_id)
        live.dead_tokens += int(self.forest.seqs[live.tree.seq_row(req.seq_id), K.Q_LEN])
        if not live.active:
            live.tree.close()
            del self._live[req.live_key]
        elif live.dead_tokens > DEAD_PER_LIVE * (live.tree.num_tokens - live.dead_tokens):
            live.tree.remove_many([s for s in live.tree.seq_ids if s not in live.active])
            live.dead_tokens = 0

    def _slots_of(self, request_keys: Sequence[str]) -> np.ndarray:
        requests = self._requests
        slots = np.fromiter((requests[key].slot for key in request_keys), np.int64, len(request_keys))
        if np.unique(slots).shape[0] != slots.shape[0]:
            raise ValueError("a request key appears twice in one batch")
        return slots

    # ---- drafting ------------------------------------------------------------------------------------

    def draft_batch(self, request_keys: Sequence[str], budgets: np.ndarray | Sequence[int]) -> BatchDrafts:
        """Drafts for every listed live request in one native call; budgets[i] caps row i's draft.
        Raises KeyError for an unknown request key."""
        slots = self._slots_of(request_keys)
        return self.step(slots, np.empty(0, np.int32), np.zeros_like(slots), self.committed(slots), budgets)

    def step(
        self,
        slots: np.ndarray,
        src: np.ndarray,
        base: np.ndarray,
        end: np.ndarray,
        budgets: np.ndarray | Sequence[int],
    ) -> BatchDrafts:
        """A decode step in one native call: commits each row's new tokens and drafts for every row.

        Row i is the request in slots[i] (distinct live slots); after this step it holds end[i] tokens, and
        its token j is src[base[i] + j] (so the new ones are src[base[i] + committed : base[i] + end[i]]);
        budgets[i] caps its draft. src is int32 token ids (vLLM's token_ids_cpu, flattened, fits as is).
        Raises ValueError for a negative token id (nothing of that row or later rows is committed).
        """
        return self._run(slots, src, base, end, budgets, draft=True)

    def _run(
        self,
        slots: np.ndarray,
        src: np.ndarray,
        base: np.ndarray,
        end: np.ndarray,
        budgets: np.ndarray | Sequence[int],
        draft: bool,
    ) -> BatchDrafts:
        drafts, out = self.step_buffers(slots.shape[0])
        rows = StepRows(slots=slots, bases=base, ends=end, budgets=np.asarray(budgets), src=src)
        params = self._params
        row = 0
        while True:
            arena = self.forest.tables()  # again after growth: growing replaces arrays
            row, status = K.step_rows(arena, self.slots, rows, row, draft, params, out, self.draft_threads)
            if status == K.DONE:
                return drafts
            self.make_room(status, slots, row, end)

    def step_buffers(self, n: int) -> tuple[BatchDrafts, DraftOutputs]:
        """The drafts of a batch of n rows and the step kernel's output arrays they view: reused buffers,
        valid until the next step."""
        buf = self._buffers
        if buf.tokens.shape[0] < n:
            buf = self._buffers = _StepBuffers(max(n, 2 * buf.tokens.shape[0]), self.config.max_spec_tokens)
        return buf.views(n)

    def make_room(self, status: int, slots: np.ndarray, row: int, end: np.ndarray) -> None:
        """Grows what the step kernel stopped for (`status` at `row`: K.NEED_POOL or K.NEED_ARENA), so that it
        can resume there. Raises ValueError when it stopped at a negative token id."""
        f = self.forest
        q = int(self.slots[slots[row], K.R_SEQ])
        if status == K.NEED_POOL:
            f.make_room(q, int(end[row]))
        elif status == K.NEED_ARENA:
            f.grow_for(int(self.slots[slots[row], K.R_LIVE]), q)
        else:
            raise ValueError(f"row {row} commits a negative token id")
