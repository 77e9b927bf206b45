"""The proposer's per-step bookkeeping, two kernels over a table indexed by the index's request slots (the
proposer's step calls them from `workers.generator.step`).

`prepare` works out each row's committed tokens, draft headroom and output length, and finds the rows whose
previous-step draft was just verified and how many of its tokens were accepted (a row commits accepted + 1
tokens); `record` remembers this step's drafts for the next step. Both
add to running totals (drafts, tokens, per position, per source, per budget-histogram bucket and length
class) that `stats` reads and `MetricsFlush` hands to Prometheus once a second and when the process exits.
Nothing is counted per request, or even per step, in Python.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit

from history_store.automaton.kernels import Source
from history_store.native.bundles import gather
from history_store.native.dense_rows import DenseRows
from monitoring.metrics import (
    ACCEPTED_TOKENS,
    ACCEPTED_TOKENS_BY_POSITION,
    DRAFT_LATENCY,
    DRAFT_TOKENS,
    DRAFT_TOKENS_BY_POSITION,
    DRAFTS,
    LENGTH_CLASSES,
    SPEC_BUDGET,
    STEP_DURATION,
    VERIFIED_DRAFT_TOKENS,
    position_label,
)
from workers.generator.step_tables import BookState

# Running totals, one slot each in `StepBook.totals`.
STEPS, ROWS, DRAFTED, DRAFT_TOKEN_TOTAL, ACCEPTED, VERIFIED, BUDGET_TOKENS, VERIFIED_TOKENS = range(8)
TOTAL_NAMES = (
    "steps",
    "rows",
    "drafts",
    "draft_tokens",
    "accepted_tokens",
    "verified_drafts",
    "budget_tokens",
    "verified_draft_tokens",
)
logger = logging.getLogger(__name__)
# Rows of `StepBook.prepare`'s output.
END, NEW, HEADROOM, OUTPUT = range(4)
# Prometheus scrapes every 15 s by default: handing it the totals once a second is fresh enough. A flush costs
# about 80 us (some twenty locked increments): at 0.25 s it was 2.6 us of every step at batch 1.
FLUSH_INTERVAL_S = 1.0


@njit(cache=True, inline="always")
def prepare(slots, num_tokens, scheduled, have, step_no, k, max_model_len, book):
    """Per row: tokens after this step (END), committed now (NEW), draft headroom (HEADROOM: none for a row
    that committed nothing, a partial prefill), output length (OUTPUT) into book.per_row; and the verified
    previous drafts into book.rows and book.accepted.

    `scheduled[i]`: how many of row i's last draft tokens vLLM's scheduler sent to the verifier (it cuts
    drafts to fit its token budget, and a request it did not schedule keeps its draft for a later step), or -1
    when unknown: then all of them, if the row ran in the previous step (a row back from a preemption had its
    draft dropped). Only those were verified: book.length keeps that many, and a row accepted at most that
    many. Returns (verified rows, whether every row committed something)."""
    drafted_at, length, prompt_len, rows = book.drafted_at, book.length, book.prompt_len, book.rows
    accepted = book.accepted
    accepted_by_position, totals, out = book.accepted_by_position, book.totals, book.per_row
    m = 0
    every_row_new = True
    for i in range(slots.shape[0]):
        s = slots[i]
        end = max(np.int64(num_tokens[i]), have[i])
        new = end - have[i]
        out[END, i] = end
        out[NEW, i] = new
        out[HEADROOM, i] = min(k, max_model_len - end - 1) if new > 0 else 0
        out[OUTPUT, i] = end - prompt_len[s]
        if new == 0:
            every_row_new = False
        elif length[s] > 0 and (scheduled[i] >= 0 or drafted_at[s] == step_no - 1):
            if 0 <= scheduled[i] < length[s]:
                length[s] = scheduled[i]  # the tokens cut before verification were never tried
            if length[s] == 0:
                continue
            a = min(new - 1, length[s])
            rows[m] = s
            accepted[m] = a
            m += 1
            totals[ACCEPTED] += a
            totals[VERIFIED_TOKENS] += length[s]
            for j in range(a):
                accepted_by_position[j] += 1
    totals[VERIFIED] += m
    return m, every_row_new


@njit(cache=True, inline="always")
def record(slots, lengths, classes, sources, budgets, step_no, book):
    """Remembers each row's draft (lengths[i] tokens from source sources[i]) for the next step's `prepare`
    and adds it to the book's running totals. Returns the step's draft tokens."""
    bounds, drafted_at, length = book.bounds, book.drafted_at, book.length
    drafted_by_position = book.drafted_by_position
    by_source, by_bucket, sum_by_class = book.by_source, book.by_bucket, book.sum_by_class
    totals = book.totals
    step_tokens = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        n = lengths[i]
        c = classes[i]
        drafted_at[s] = step_no
        length[s] = n
        for j in range(n):
            drafted_by_position[j] += 1
        if n > 0:
            by_source[sources[i]] += 1
            totals[DRAFTED] += 1
        b = 0
        while n > bounds[b]:  # the histogram's bucket: the first upper bound >= n (the last one is +Inf)
            b += 1
        by_bucket[c, b] += 1
        sum_by_class[c] += n
        step_tokens += n
        totals[BUDGET_TOKENS] += budgets[i]
    totals[STEPS] += 1
    totals[ROWS] += slots.shape[0]
    totals[DRAFT_TOKEN_TOTAL] += step_tokens
    return step_tokens


class StepBook:
    """Per-slot state of the previous step's drafts, and running totals of everything drafted."""

    def __init__(self, k: int, request_rows: DenseRows | None = None) -> None:
        """`request_rows`: the allocator of the slots requests are named by (the index's); one of its own by
        default."""
        self.k = k
        # The budget histogram's upper bounds, +Inf last (every child of a histogram has the same).
        self.bounds = np.asarray(SPEC_BUDGET.labels(length_class=LENGTH_CLASSES[0])._upper_bounds, np.float64)
        self.request_rows = request_rows if request_rows is not None else DenseRows()
        self.request_rows.register(self, "prompt_len", dtype=np.int64)
        self.request_rows.register(self, "drafted_at", dtype=np.int64, fill=-2)  # the step that last drafted
        self.request_rows.register(self, "length", dtype=np.int64)
        self.request_rows.register(self, "rows", dtype=np.int64)
        self.request_rows.register(self, "accepted", dtype=np.int64)
        self._per_row = np.zeros((4, 64), np.int64)
        self._per_row_view = self._per_row[:, :0]
        self.totals = np.zeros(len(TOTAL_NAMES), np.int64)
        self.accepted_by_position = np.zeros(k, np.int64)
        self.drafted_by_position = np.zeros(k, np.int64)
        self.by_source = np.zeros(len(Source), np.int64)
        self.by_bucket = np.zeros((len(LENGTH_CLASSES), self.bounds.shape[0]), np.int64)
        self.sum_by_class = np.zeros(len(LENGTH_CLASSES), np.int64)

    def start(self, slot: int, prompt_len: int) -> None:
        """A new request in `slot` (given by `request_rows`, or any dense id: the tables grow to hold it)."""
        self.request_rows.reserve(slot + 1)
        self.prompt_len[slot] = prompt_len
        self.drafted_at[slot] = -2

    def kernel_state(self, n: int) -> BookState:
        """The book's arrays as the step kernels take them, for a batch of n rows (shared, not copied)."""
        self.per_row(n)  # grows the per-row table to n rows
        return gather(BookState, self, per_row=self._per_row)

    def per_row(self, n: int) -> np.ndarray:
        """The reused int64 [4, n] table `prepare` fills (END, NEW, HEADROOM, OUTPUT per row)."""
        if self._per_row.shape[1] < n:
            self._per_row = np.zeros((4, 2 * n), np.int64)
        if self._per_row_view.shape[1] != n:
            self._per_row_view = self._per_row[:, :n]
        return self._per_row_view

    def snapshot(self) -> dict[str, np.ndarray]:
        """Copies of the running totals (for `since` and for flushing)."""
        return {
            "totals": self.totals.copy(),
            "accepted_by_position": self.accepted_by_position.copy(),
            "drafted_by_position": self.drafted_by_position.copy(),
            "by_source": self.by_source.copy(),
            "by_bucket": self.by_bucket.copy(),
            "sum_by_class": self.sum_by_class.copy(),
        }

    def since(self, base: dict[str, np.ndarray]) -> dict[str, Any]:
        """Totals accumulated since `base` (a `snapshot`), as the proposer's statistics name them."""
        out: dict[str, Any] = dict(zip(TOTAL_NAMES, (self.totals - base["totals"]).tolist(), strict=True))
        out["accepted_by_position"] = (self.accepted_by_position - base["accepted_by_position"]).tolist()
        out["drafted_by_position"] = (self.drafted_by_position - base["drafted_by_position"]).tolist()
        drafts = (self.by_source - base["by_source"]).tolist()
        out["sources"] = {source.label: drafts[source] for source in Source}
        return out


class MetricsFlush:
    """Hands the growth of a StepBook's totals, and the step and draft durations seen, to Prometheus."""

    def __init__(
        self, book: StepBook, publish: bool = True, also_publish: Callable[[], None] | None = None
    ) -> None:
        self.book = book
        self._publish = publish  # False: keep the totals to itself (the proposer's warm-up steps)
        self._also_publish = also_publish  # more gauges handed over with each flush (the cost model's)
        self._flushed = book.snapshot()
        self._draft_seconds: list[float] = []
        self._step_seconds: list[float] = []
        self._next = 0.0
        # Label children resolved once: `labels()` costs a dict lookup and a lock per call.
        self._drafted_at = [
            DRAFT_TOKENS_BY_POSITION.labels(position=position_label(j)) for j in range(book.k)
        ]
        self.accepted_at = [
            ACCEPTED_TOKENS_BY_POSITION.labels(position=position_label(j)) for j in range(book.k)
        ]
        self._budget = [SPEC_BUDGET.labels(length_class=c) for c in LENGTH_CLASSES]
        # The last second's counts too: an engine's run often ends within a second of its last step.
        if publish:
            atexit.register(_flush_at_exit, weakref.ref(self))

    def step_done(self, draft_seconds: float, step_seconds: float | None, now: float) -> None:
        """Notes one step's durations; flushes when FLUSH_INTERVAL_S has passed since the last flush."""
        self._draft_seconds.append(draft_seconds)
        if step_seconds is not None:
            self._step_seconds.append(step_seconds)
        if self._publish and now >= self._next:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Adds what the totals gained since the last flush to the metrics."""
        book, old = self.book, self._flushed
        self._next = (time.perf_counter() if now is None else now) + FLUSH_INTERVAL_S
        totals = (book.totals - old["totals"]).tolist()
        if totals[DRAFTED]:
            DRAFTS.inc(totals[DRAFTED])
            DRAFT_TOKENS.inc(totals[DRAFT_TOKEN_TOTAL])
        if totals[ACCEPTED]:
            ACCEPTED_TOKENS.inc(totals[ACCEPTED])
        if totals[VERIFIED_TOKENS]:
            VERIFIED_DRAFT_TOKENS.inc(totals[VERIFIED_TOKENS])
        for children, counts in (
            (self._drafted_at, book.drafted_by_position - old["drafted_by_position"]),
            (self.accepted_at, book.accepted_by_position - old["accepted_by_position"]),
        ):
            for child, count in zip(children, counts.tolist(), strict=True):
                if count:
                    child.inc(count)
        grown = (book.by_bucket - old["by_bucket"]).tolist()
        sums = (book.sum_by_class - old["sum_by_class"]).tolist()
        for child, buckets, total in zip(self._budget, grown, sums, strict=True):
            _add_observations(child, buckets, total)
        for histogram, seconds in ((DRAFT_LATENCY, self._draft_seconds), (STEP_DURATION, self._step_seconds)):
            if seconds:
                bounds = histogram._upper_bounds
                buckets = np.bincount(np.searchsorted(bounds, seconds, side="left"), minlength=len(bounds))
                _add_observations(histogram, buckets.tolist(), float(np.sum(seconds)))
        self._draft_seconds.clear()
        self._step_seconds.clear()
        self._flushed = book.snapshot()
        if self._also_publish is not None:
            self._also_publish()


def _flush_at_exit(ref: weakref.ref[MetricsFlush]) -> None:
    metrics = ref()
    if metrics is None:
        return
    try:
        metrics.flush()
    except Exception:  # an exit must not fail on metrics; say what was lost
        logger.warning("DAS metrics: the last counts could not be flushed at exit", exc_info=True)


def _add_observations(histogram: Any, buckets: list[int], total: float) -> None:
    """What observe() would have done for many values at once: prometheus_client has no bulk observe, so the
    counts go straight into the buckets it keeps (`_buckets[i]` counts values <= `_upper_bounds[i]`) and the
    sum. Checked against the drafted tokens by the proposer tests."""
    for b, count in enumerate(buckets):
        if count:
            histogram._buckets[b].inc(count)
    if any(buckets):
        histogram._sum.inc(total)
