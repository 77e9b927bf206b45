"""The history store and the per-problem drafting index kept in step: what the history replica runs.

`IndexedHistory.open` brings the trees back at start by rebuilding them from the stored trajectories.
Loading serialized trees was measured against it (`das bench store`, "tree_load"): the suffix tree's
serialized form is its token sequences and `from_bytes` re-extends them, so loading costs the same tree
work plus keeping a second copy of every token consistent with the store; rebuilding reads the tokens once.

A drafting server keeps its index in step with the writer from the store's sequence log on a thread of its
own (`workers.generator.history_feed`), reading records in apply order as the load here does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from history_store.automaton.config import DraftConfig
from history_store.automaton.problem_index import ProblemIndex
from history_store.durable.checkpoints import Checkpointer
from history_store.durable.store import (
    ApplyResult,
    HistoryStore,
    StoredTrajectory,
    TrajectoryKey,
    TrajectoryLike,
    _StoreReader,
)
from monitoring.metrics import RESTORE_DURATION, STORE_TOKENS

log = logging.getLogger(__name__)

# Prometheus scrapes every 15 s by default; refreshing the tree-size gauge more often than that is wasted work.
_GAUGE_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What a start-up load brought back and how long it took."""

    trajectories: int
    tokens: int
    seconds: float


def apply_order(
    store: _StoreReader, pause: Callable[[], None] | None = None
) -> list[tuple[int, TrajectoryKey, int, int]]:
    """(sequence, key, prompt length, response length) of every readable stored trajectory, in apply order.
    The global tree keeps the most recent responses (FIFO): rebuilding in apply order (sequence numbers) rather
    than key order gives the same tree as the live process had. One record's tokens are held at a time (each is
    checked, as `get` checks it, so a corrupt one is left out here already). `pause` is called every 256
    records (a background reader yields the GIL there)."""
    order = []
    for n, t in enumerate(store.iter_trajectories()):
        order.append((t.sequence, t.key, int(t.prompt_ids.size), int(t.response_ids.size)))
        if pause is not None and n % 256 == 255:
            pause()
    order.sort()
    return order


def records_in_apply_order(
    store: _StoreReader, order: list[tuple[int, TrajectoryKey, int, int]] | None = None
) -> Iterator[StoredTrajectory]:
    """Every stored trajectory, decoded once each, in apply order, one at a time: what a load holds at any
    moment is one record besides the headers' order (`apply_order`)."""
    for _, key, _, _ in apply_order(store) if order is None else order:
        record = store.get(*key)
        if record is not None:  # evicted or quarantined since the headers were read
            yield record


def load_index(store: _StoreReader, index: ProblemIndex) -> LoadReport:
    """Adds every stored trajectory to `index`, in apply order. Records already indexed are skipped.

    Streamed: it learns the order and the lengths from the records' headers first (no token decoded), then
    reads only the records a tree takes (`ProblemIndex.load_stored`: all of them for an eager index; for a lazy
    one only the global tree's), one at a time. The index equals `index.add_trajectories` of every record in
    apply order."""
    started = time.perf_counter()

    def fetch(problem_id: str, epoch: int, sample: int) -> tuple[object, ...] | None:
        record = store.get(problem_id, epoch, sample)
        if record is None:
            return None
        return record.prompt_ids, record.response_ids, record.response_logprobs

    entries = [(*key, prompt_len, response_len) for _, key, prompt_len, response_len in apply_order(store)]
    count = index.load_stored(entries, fetch)
    tokens = sum(entry[4] for entry in entries)
    seconds = time.perf_counter() - started
    RESTORE_DURATION.set(seconds)
    return LoadReport(count, tokens, seconds)


def _index_tokens(index: ProblemIndex) -> int:
    return sum(index.problem_stats(p)["tokens"] for p in index.problem_ids())


class IndexedHistory:
    """A HistoryStore (durable) and a ProblemIndex (the trees) changed together, store first.

    Records enter the trees only after their batch is durable, and leave the trees when the store evicts
    them, so the trees always equal a rebuild from the store. With a `checkpointer`, every apply ends with
    `maybe_checkpoint` (timer or epoch boundary); a failed checkpoint is logged and ingest goes on (the
    last-checkpoint age metric and its alert report it).
    """

    def __init__(
        self,
        store: HistoryStore,
        index: ProblemIndex,
        load: LoadReport,
        checkpointer: Checkpointer | None = None,
    ) -> None:
        self.store = store
        self.index = index
        self.load = load
        self.checkpointer = checkpointer
        self._next_gauge_update = 0.0

    @classmethod
    def open(
        cls,
        path: str | Path,
        window_epochs: int | None = None,
        config: DraftConfig | None = None,
        global_tokens: int = 2_000_000,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every_s: float = 600.0,
        checkpoint_keep: int = 3,
        **store_options: object,
    ) -> IndexedHistory:
        """Opens (or creates) the store and rebuilds the trees from it; `load` says how long that took.
        `window_epochs` None keeps the stored window. With `checkpoint_dir`, checkpoints are written there
        automatically every `checkpoint_every_s` seconds and when a new epoch starts, keeping the last
        `checkpoint_keep`.

        Raises what HistoryStore raises (StoreLockedError, StoreOpenError).
        """
        store = HistoryStore(path, window_epochs, **store_options)  # type: ignore[arg-type]
        try:
            index = ProblemIndex(
                window_epochs=store.window_epochs, config=config, global_tokens=global_tokens
            )
            report = load_index(store, index)
            checkpointer = (
                Checkpointer(store, checkpoint_dir, checkpoint_every_s, checkpoint_keep)
                if checkpoint_dir is not None
                else None
            )
        except BaseException:
            store.close()
            raise
        log.info(
            "history store %s: %d trajectories (%d response tokens) back in the trees in %.2f s",
            store.path,
            report.trajectories,
            report.tokens,
            report.seconds,
        )
        return cls(store, index, report, checkpointer)

    def apply(
        self, records: Sequence[TrajectoryLike], offsets: Mapping[tuple[str, int], int] | None = None
    ) -> ApplyResult:
        """HistoryStore.apply, then the same records into the trees. Raises what HistoryStore.apply raises;
        on error the trees are unchanged."""
        result = self.store.apply(records, offsets)
        applied = set(result.applied)
        for record in records:
            key = (record.problem_id, record.epoch, record.sample)
            if key in applied:
                applied.discard(key)  # a key repeated in the batch was applied once
                self.index.add_trajectory(
                    *key, record.prompt_ids, record.response_ids, record.response_logprobs
                )
        self.index.evict_keys(result.evicted)
        now = time.monotonic()
        if now >= self._next_gauge_update:
            # Summing over every problem costs O(problems): refresh the gauge on a timer, not per batch.
            self._next_gauge_update = now + _GAUGE_INTERVAL_S
            STORE_TOKENS.set(_index_tokens(self.index))
        if self.checkpointer is not None:
            self.checkpointer.after_apply(result.applied)
        return result

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> IndexedHistory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
