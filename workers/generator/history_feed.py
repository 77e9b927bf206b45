"""How a drafting server follows its node's history replica without doing it inside the decode step.

vLLM waits for the proposer's `propose` before it schedules the next step (asynchronous scheduling is off for
`custom_class` drafters), so anything the proposer does there is the engine's time. A cluster publishes
trajectories at a rate no server controls (a GRPO step of 256 prompts x 8 samples x 2k tokens is 4 M tokens per
node), and taking them in used to happen inside the step: the change log read, every record decoded and
inserted, the global tree rebuilt past its cap, the arena compacted (issue 47, item 1: p99 31.7 ms, max 1.8 s
at 100k tokens/s). Here a thread of the server's own does it between steps:
- it opens the replica (a RocksDB secondary), or keeps trying every `retry_s` (`DAS_HISTORY_RETRY_S`) while there is none or it is
  damaged (the server drafts from its requests' own tokens and siblings meanwhile), loads it streaming, and
  catches up with the writer every `catch_up_interval_s`, right after a step returns (RocksDB's catch-up holds
  the GIL for milliseconds: then the engine's next step is furthest away);
- it decodes what changed into a queue of at most `QUEUE_TOKENS` tokens (a reader that falls behind the
  trimmed change log reloads the same way, streaming, with the trees cleared first), skipping records this
  server inserted itself (`own`);
- it applies the queue to the index (`DeferredIndex`: bookkeeping at once, tree work in pieces of at most
  `PIECE_TOKENS` tokens), holding the index only between steps: the step holds it for its whole call through
  `StepGate`, a waiting step is never overtaken, and a piece starts only when the next step is not due yet (the
  gate learns the interval between steps). A step that arrives during a piece waits for that piece alone.
Every piece of work yields the GIL when it ends (`time.sleep(0)`): a busy Python thread otherwise holds it for
`sys.getswitchinterval()` (5 ms) whenever another thread wants it, and the tree kernels release it while they
run (`nogil`).

The thread holds the index for at most a `duty` share of wall time (`DAS_HISTORY_DUTY`, 0.3): after a piece
of t seconds the next waits t * (1 / duty - 1), so ingest takes at most that share of the trees whatever the
cluster publishes; work beyond it queues, and past `DeferredIndex.max_backlog` new rollouts skip the global tree
(their problems' trees still take them). Pieces stay short because what made some long happens outside the
hold, before each piece and while idle (`DeferredIndex.prepare`): the arena's next rows are mapped ahead (a
first write to fresh memory took 30-50 ms on these VMs), the arena and the pool grow in place instead of by a
copy (`resident`: at batch 256 and 100k tokens/s one such copy held a step 1.2 s), a hash table's next size is
written ahead, and the pool is packed in pieces (`pool_mirror`). Doing at most a piece inside each step instead was measured against this by `das bench ingest` (batch 64
at 100k tokens/s: p99 37.2 ms against 1.4 ms, docs/benchmarks.md) and dropped.

What is counted: `das_proposer_history_missing` (1 while the server has no readable history), every time it
lost or never found it (`das_proposer_history_outages_total`, logged once per outage), and the tokens
waiting to enter its trees (`das_proposer_history_backlog_tokens`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from history_store.automaton.deferred_index import DeferredIndex
from history_store.durable.store import Change, HistoryReader, HistoryStore, StoredTrajectory
from history_store.errors import StoreError
from history_store.indexed_history import apply_order, load_index, records_in_apply_order
from monitoring.metrics import (
    PROPOSER_HISTORY_BACKLOG,
    PROPOSER_HISTORY_MISSING,
    PROPOSER_HISTORY_OUTAGES,
)

logger = logging.getLogger(__name__)

# Tokens of tree work in one piece: about half a millisecond of insertion on an idle core (a step that arrives
# meanwhile waits for it), a few thousand pieces a second at most.
PIECE_TOKENS = 512
# Records whose bookkeeping one piece applies before its tree work (each a few tens of microseconds).
OPS_PER_PIECE = 8
# Decoded tokens the queue holds at most: what a server holds of the cluster's output beyond its trees.
QUEUE_TOKENS = 1 << 20
# A step is due when this share of the usual interval between steps has passed since the last one ended.
_DUE_SHARE = 0.75
# Tokens of tree work between two looks at whether a step waits.
_PART_TOKENS = 128
# A piece is expected to take at most this long (one that took longer was preempted, not large).
_PIECE_MAX_S = 0.002
# With work queued, a piece runs after this long without one even when a step may come meanwhile.
_OVERDUE_S = 0.05


class StepGate:
    """The decode step's hold on the index, ahead of the history thread.

    The step enters it for its whole call (`with gate:`), other callers into the index use `hold()`; the thread
    takes it only with `try_hold` and only when `room()` says the next step is not due. The gate learns the
    interval between steps (the engine's forward pass) as an average of the last ones."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting = 0
        self.last_leave = time.perf_counter()
        self.gap = 0.0
        self.left = threading.Event()  # set when a step ends
        self.waited = 0.0  # seconds steps spent waiting for the history thread's pieces
        # The CPU seconds of the piece a step waited for (what the wait is on a machine with a core free: on a
        # loaded one the OS may also have taken the core from the thread mid-piece), summed over steps.
        self.waited_cpu = 0.0
        self.piece_cpu = 0.0  # the CPU seconds of the last piece (set before it releases the gate)
        self.waits = 0

    def __enter__(self) -> StepGate:
        self._waiting += 1
        started = time.perf_counter()
        if not self._lock.acquire(blocking=False):
            self._lock.acquire()
            self.waited += time.perf_counter() - started
            self.waited_cpu += self.piece_cpu
            self.waits += 1
        self._waiting -= 1
        gap = started - self.last_leave
        self.gap = gap if self.gap == 0.0 else 0.8 * self.gap + 0.2 * min(gap, 1.0)
        return self

    def __exit__(self, *exc: object) -> None:
        self.last_leave = time.perf_counter()
        self._lock.release()
        self.left.set()

    def hold(self) -> AbstractContextManager[Any]:
        """The index for a caller outside the step (an RPC, a test): waits for the thread's piece."""
        return self._lock

    def try_hold(self) -> bool:
        """The thread's take: never while a step waits."""
        return self._waiting == 0 and self._lock.acquire(blocking=False)

    @property
    def step_waiting(self) -> bool:
        """A step waits for the gate: a piece ends at its next boundary."""
        return self._waiting > 0

    def release(self) -> None:
        self._lock.release()

    def room(self) -> float:
        """Seconds until the next step is due (infinite when none is expected: no step yet, or the engine has
        gone quiet for three intervals); 0 when a step waits."""
        if self._waiting:
            return 0.0
        since = time.perf_counter() - self.last_leave
        if self.gap == 0.0 or since > 3 * self.gap + 0.005:
            return math.inf
        return _DUE_SHARE * self.gap - since


@dataclass(slots=True)
class _Op:
    kind: str  # "add", "evict", "remove", "reload", "relearn"
    key: tuple[str, int, int] | None = None
    record: StoredTrajectory | None = None
    tokens: int = 0
    order: list[tuple[int, tuple[str, int, int], int, int]] | None = (
        None  # a reload's records, in apply order
    )


class HistoryFeed:
    """A drafting server's view of its node's replica, kept up off the decode step (see the module)."""

    def __init__(
        self,
        path: Path,
        secondary: Path,
        index: DeferredIndex,
        learn: Callable[[str, int], None],
        forget: Callable[[str], None],
        relearn: Callable[[], None],
        catch_up_interval_s: float = 0.2,
        retry_s: float = 2.0,
        duty: float = 0.3,
        publish: bool = True,
    ) -> None:
        self.path, self.secondary, self.index = path, secondary, index
        self._learn, self._forget, self._relearn = learn, forget, relearn
        self.interval = catch_up_interval_s
        self.retry_s = retry_s  # seconds between attempts to open a replica that is missing or damaged
        self.duty = duty  # the largest share of wall time the thread holds the index (see the module)
        self.publish = publish
        self.gate = StepGate()
        self.reader: HistoryReader | None = None
        self._reader_lock = threading.Lock()  # the reader: this thread, and the step's tree builds (`fetch`)
        self._changes: deque[Change] = deque()  # caught up, not decoded yet
        self._ops: deque[_Op] = deque()
        self._op_tokens = 0
        self._own: set[tuple[str, int, int]] = set()
        self._next_catch_up = 0.0
        self._next_open = 0.0
        self._reloading: Any = None  # the records of a reload still to queue (an iterator)
        self._reload_global: dict[tuple[str, int, int], bool] = {}  # which of a reload's records go global
        # Held by the thread while it works (not while it waits), and by `drain`: one of them at a time.
        self._work_lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.available = False
        self.outages = 0  # times it found no readable replica, or lost the one it followed
        self._outage_logged = False
        self.errors = 0
        # What it did, for stats and the ingest bench.
        self.applied = 0
        self.decoded = 0
        self.skipped_own = 0
        self.reloads = 0
        self.opens = 0
        self.piece_seconds = 0.0
        self.pieces = 0

    # ---- opening ---------------------------------------------------------------------------------------

    def _reader(self) -> HistoryReader | None:
        try:
            return HistoryStore.open_secondary(self.path, self.secondary)
        except (StoreError, OSError) as exc:
            self._unavailable(str(exc))
            return None

    def open(self) -> bool:
        """Opens the replica and loads it into the index at once, streaming (the server's start: each record
        decoded once, one held at a time); False when there is none readable yet (the thread keeps trying)."""
        reader = self._reader()
        if reader is None:
            return False
        with self._reader_lock:
            self.reader = reader
        try:
            with self.gate.hold():
                self.index.clear_history()
                load_index(reader, self.index)
                self.index.settle()
                self._relearn()
        except Exception as exc:  # a damaged store: drop it and try again later
            self._lost(exc)
            return False
        self._available()
        self.opens += 1
        return True

    def _reopen(self) -> None:
        """The thread's open: the reader now, its records as a reload through the queue (the trees cleared when
        the reload's first operation applies), so no step waits for a whole load."""
        reader = self._reader()
        if reader is None:
            return
        with self._reader_lock:
            self.reader = reader
        try:
            self._reload(reader)
        except Exception as exc:
            self._lost(exc)
            return
        self._available()
        self.opens += 1

    def _reload(self, reader: HistoryReader) -> None:
        order = apply_order(reader, pause=lambda: time.sleep(0))
        self._changes.clear()
        self._ops.append(_Op("reload", order=order))
        self._reloading = iter(records_in_apply_order(reader, order))
        self.reloads += 1

    def _available(self) -> None:
        if not self.available:
            if self._outage_logged:
                logger.warning("DAS: history replica %s opened; drafting from history again", self.path)
            self.available = True
            self._outage_logged = False
            if self.publish:
                PROPOSER_HISTORY_MISSING.set(0)

    def _unavailable(self, why: str) -> None:
        self._next_open = time.monotonic() + self.retry_s
        if self.available or not self._outage_logged:
            self.available = False
            self.outages += 1
            if self.publish:
                PROPOSER_HISTORY_MISSING.set(1)
                PROPOSER_HISTORY_OUTAGES.inc()
            if not self._outage_logged:
                logger.warning(
                    "DAS: history replica %s unavailable (%s); drafting from each request's own tokens and its "
                    "siblings, retrying every %g s",
                    self.path,
                    why,
                    self.retry_s,
                )
                self._outage_logged = True

    def _lost(self, exc: BaseException) -> None:
        """The replica failed under us (damage, a swapped store): close it, keep the trees, reopen later."""
        self.errors += 1
        with self._reader_lock:
            reader, self.reader = self.reader, None
        if reader is not None:
            with suppress(Exception):  # closing a broken instance may fail too; it is gone either way
                reader.close()
        self._changes.clear()
        self._reloading = None
        self._unavailable(f"{type(exc).__name__}: {exc}")

    def start(self) -> None:
        """Starts the thread (it opens the replica itself when `open` found none)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="das-history", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self.gate.left.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._reader_lock:
            if self.reader is not None:
                self.reader.close()
                self.reader = None

    # ---- what the proposer tells it ----------------------------------------------------------------------

    def own(self, key: tuple[str, int, int]) -> None:
        """A trajectory this server inserted itself (when it finished here): its copy from the replica is
        neither decoded nor inserted again."""
        if len(self._own) < 1 << 16:
            self._own.add(key)

    def fetch(self, problem_id: str, epoch: int, sample: int) -> StoredTrajectory | None:
        """A stored record (for a problem's tree built on its first request), None without a replica."""
        with self._reader_lock:
            if self.reader is None:
                return None
            try:
                return self.reader.get(problem_id, epoch, sample)
            except StoreError:
                return None

    def drain(self) -> None:
        """Everything the writer has written, in the index now (tests, `DasProposer.catch_up`): opens a missing
        replica, catches up, decodes and applies all of it, and finishes the tree work. Call it outside the
        step; it holds the gate."""
        with self._work_lock:
            for _ in range(2):  # a reader found stale is reopened (and reloads) once
                if self.reader is None:
                    self._reopen()
                    if self.reader is None:
                        return
                try:
                    self._catch_up(force=True)
                    while self.reader is not None and self.reader.behind_writer:
                        time.sleep(0.05)  # the writer's last batch, not visible yet, or a stale reader
                        self._catch_up(force=True)
                except Exception as exc:
                    self._lost(exc)
                    continue
                break
            while True:
                self._decode(256)
                with self.gate.hold():
                    self._apply_ops(len(self._ops))
                    if not (self._changes or self._reloading is not None):
                        self.index.settle()
                        break
            self._backlog()

    # ---- the thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        piece_s = 0.0005
        last_piece = next_piece = time.perf_counter()
        prepared = False  # `index.prepare` has run since the last piece
        while not self._stop.is_set():
            self._work_lock.acquire()
            try:
                now = time.monotonic()
                if self.reader is None:
                    if now >= self._next_open and self.gate.room() > 0.0:
                        self._reopen()
                    if self.reader is None:
                        self._work_lock.release()
                        self._stop.wait(0.05)
                        self._work_lock.acquire()
                        continue
                room = self.gate.room()
                gap = self.gate.gap
                fresh_gap = room == math.inf or room >= (_DUE_SHARE - 0.3) * gap
                if now >= self._next_catch_up and fresh_gap and self._op_tokens < QUEUE_TOKENS:
                    self._catch_up()
                    time.sleep(0)
                if (self._changes or self._reloading is not None) and self._op_tokens < QUEUE_TOKENS:
                    self._decode(16)
                    time.sleep(0)
                busy = bool(self._ops) or self.index.work_pending
                if busy:
                    # A piece when the next step is not due before it ends, or, so that history never stalls
                    # behind steps that come too close together, when none has run for a while.
                    now_p = time.perf_counter()
                    if now_p < next_piece:  # the duty cycle: the index is the engine's meanwhile
                        self._work_lock.release()
                        self._stop.wait(min(next_piece - now_p, 0.02))
                        self._work_lock.acquire()
                        continue
                    if not prepared:  # outside the gate, once per piece: the arena's next rows, new arrays
                        self.index.prepare()
                        prepared = True
                    overdue = now_p - last_piece > _OVERDUE_S
                    if (self.gate.room() > 1.5 * piece_s or overdue) and self.gate.try_hold():
                        started, cpu = time.perf_counter(), time.thread_time()
                        try:
                            self._apply(PIECE_TOKENS)
                        finally:
                            self.gate.piece_cpu = time.thread_time() - cpu
                            self.gate.release()
                        last_piece = time.perf_counter()
                        took = last_piece - started
                        next_piece = last_piece + took * (1.0 / self.duty - 1.0)
                        # The usual piece: a slow one (the OS took the core away) must not shut the window.
                        piece_s = 0.9 * piece_s + 0.1 * min(took, _PIECE_MAX_S)
                        self.piece_seconds += took
                        self.pieces += 1
                        prepared = False
                        time.sleep(0)
                        continue
                    self.gate.left.clear()
                    if self.gate.room() <= 1.5 * piece_s:
                        self._work_lock.release()
                        self.gate.left.wait(0.02)
                        self._work_lock.acquire()
                    continue
                if self._changes or self._reloading is not None:
                    continue
                # Idle: what needs no hold goes on (a spare hash table's empty slots, rows mapped ahead), so
                # that a step's own growth (a lazy load's first request, committed tokens) finds them ready.
                self.index.prepare()
                self.gate.left.clear()
                self._work_lock.release()
                self._stop.wait(max(0.0005, min(0.02, self._next_catch_up - time.monotonic())))
                self._work_lock.acquire()
            except Exception as exc:  # the replica or a record failed: reopen later, never stop the thread
                logger.exception("DAS: following the history replica failed; reopening it")
                self._lost(exc)
            finally:
                self._work_lock.release()

    def _catch_up(self, force: bool = False) -> None:
        self._next_catch_up = time.monotonic() + self.interval
        with self._reader_lock:
            if self.reader is None:
                return
            caught = self.reader.catch_up(force=force)
        if caught.reset:
            # Fell behind the trimmed change log: reload, streaming, the trees cleared first.
            with self._reader_lock:
                if self.reader is not None:
                    self._reload(self.reader)
        else:
            self._changes.extend(caught.changes)

    def _decode(self, records: int) -> None:
        """Turns up to `records` caught-up changes (or records of a reload) into queued operations."""
        for _ in range(records):
            if self._op_tokens >= QUEUE_TOKENS:
                return
            if self._reloading is not None:
                with self._reader_lock:
                    record = next(self._reloading, None) if self.reader is not None else None
                if record is None:
                    self._reloading = None
                    self._ops.append(_Op("relearn"))
                    continue
                self._queue(_Op("add", record.key, record, int(record.response_ids.size)))
                continue
            if not self._changes:
                return
            change = self._changes.popleft()
            if change.op == "added":
                if change.key in self._own:
                    self._own.discard(change.key)
                    self.skipped_own += 1
                    continue
                record = self.fetch(*change.key)
                if record is not None:  # None: evicted or quarantined since
                    self.decoded += 1
                    self._queue(_Op("add", change.key, record, int(record.response_ids.size)))
            else:
                self._queue(_Op("evict" if change.op == "removed" else "remove", change.key))

    def _queue(self, op: _Op) -> None:
        self._ops.append(op)
        self._op_tokens += op.tokens

    def _apply(self, budget: int) -> None:
        """One piece (the gate held): up to OPS_PER_PIECE queued operations, then `budget` tokens of tree
        work, in parts of `_PART_TOKENS`; a step that starts waiting ends it at the next part."""
        gate = self.gate
        for _ in range(OPS_PER_PIECE):
            if not self._ops or gate.step_waiting:
                break
            self._apply_ops(1)
        done = 0
        for _ in range(2 * budget // _PART_TOKENS + 2):
            if done >= budget or gate.step_waiting or not self.index.work_pending:
                break
            done += self.index.work(min(_PART_TOKENS, budget - done))
        self._backlog()

    def _apply_ops(self, count: int) -> None:
        for _ in range(count):
            if not self._ops:
                return
            op = self._ops.popleft()
            self._op_tokens -= op.tokens
            if op.kind == "add":
                self._add(op.record, self._reload_global.get(op.key))
            elif op.kind == "evict":
                for problem_id in self.index.evict_keys([op.key]):
                    self._forget(problem_id)
            elif op.kind == "remove":
                self.index.remove_trajectory(*op.key)
            elif op.kind == "reload":
                self.index.clear_history()
                order = op.order or []
                flags = self.index.global_admission([(k[1], p, r) for _, k, p, r in order])
                self._reload_global = {k: f for (_, k, _, _), f in zip(order, flags, strict=True)}
            else:  # relearn: a reload is complete
                self._reload_global = {}
                self._relearn()
            self.applied += 1

    def _add(self, record: StoredTrajectory, to_global: bool | None) -> None:
        """Adds a record: as any arrival (None), or as one of a reload's (whether the global tree takes it)."""
        args = (*record.key, record.prompt_ids, record.response_ids, record.response_logprobs)
        new = (
            self.index.add_trajectory(*args) if to_global is None else self.index.add_loaded(*args, to_global)
        )
        if new:
            self._learn(record.problem_id, int(record.response_ids.size))

    def _backlog(self) -> None:
        if self.publish:
            PROPOSER_HISTORY_BACKLOG.set(self._op_tokens + self.index.tree_work.feed_tokens)

    def stats(self) -> dict[str, Any]:
        return {
            "available": self.available,
            "opens": self.opens,
            "reloads": self.reloads,
            "errors": self.errors,
            "records_decoded": self.decoded,
            "own_skipped": self.skipped_own,
            "queued_tokens": self._op_tokens,
            "tree_backlog_tokens": self.index.tree_work.feed_tokens,
            "global_skipped": self.index.global_skipped,
            "lazy_builds_queued": self.index.lazy_builds_queued,
            "pieces": self.pieces,
            "piece_seconds": round(self.piece_seconds, 3),
            "step_waits": self.gate.waits,
            "step_wait_seconds": round(self.gate.waited, 3),
            "step_wait_cpu_seconds": round(self.gate.waited_cpu, 3),
        }


def no_gate() -> AbstractContextManager[Any]:
    """The gate of a proposer without a replica: nothing to wait for."""
    return nullcontext()
