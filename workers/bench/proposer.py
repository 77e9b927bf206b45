"""`das bench proposer`: the proposer's whole decode step outside vLLM, on real trees built from a trace.

Workload: every epoch of the trace but the last goes into the history (as the replica would have it). The
last epoch's rollouts are then decoded by `DasProposer.step` exactly as vLLM's runner would call it: a token
matrix like `token_ids_cpu` (prompt, then output), request descriptions with `das_problem_id`/`das_epoch`/
`das_sample` in `extra_args`, continuous batching at a fixed batch size (a finished request's row goes to the
next one, cycling through the epoch's rollouts as new samples of the same epoch). Each step a row commits the
longest prefix of its draft that equals the recorded continuation, plus one token, as verification would, and
the proposer sees a finished request's last tokens before the request leaves, as in vLLM. So every step
registers and finishes requests, commits tokens, asks the budget, drafts, learns acceptance, counts metrics
and adds finished rollouts to the history: the proposer's real work, minus the engine. One distortion: from
the second lap on, the history holds earlier copies of the very rollouts being decoded, so drafts are
accepted more often than on fresh rollouts (`tokens_per_step` shows it) and each step commits more tokens.

Reported per request per step: the whole step, its native calls (`step_kernels.decode_step`, and
`draft_step` when the index grew mid-step; timed by wrapping them for the run: the policy's kernels, the
bookkeeping and the index's commit and draft, plus numba's unboxing of their arguments), and the Python around
them (registering and finishing requests, history adds, packing the step's tables again after those, building
the drafts' lists).
Times are the thread's CPU time (`time.thread_time`), which other processes on a loaded machine inflate far
less than wall time (they still share caches); the whole step's wall time is reported beside it, and the
native / Python split is of the wall time (the native calls are timed by the wall clock, whose reads cost
60 ns against the CPU clock's 0.7 us). With more
than one drafting thread (`DAS_DRAFT_THREADS`, reported as `draft_threads`) the calling thread's CPU time
leaves out the helpers' work: then the wall-time figures are the ones to read.
Bytes allocated per step come from a separate tracemalloc pass (tracing slows the step).
"""

from __future__ import annotations

import os
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from history_store.automaton.config import DEFAULT_ENGINE_K
from workers.bench.replay import CostModel, load_traces, trace_max_tokens
from workers.generator import proposer as proposer_module
from workers.generator.proposer import DasProposer

BATCHES = (1, 64, 256)
TARGET_US_PER_REQUEST = {1: 15.0, 64: 4.0, 256: 2.5}  # batch 1: the whole step, not per request


class _Timed:
    """Wraps `owner.name` so every call's time adds up in `seconds` (undone by `restore`). The owner may be a
    module (its functions) or an instance (its methods, shadowed by instance attributes meanwhile).

    It reads `perf_counter` (60 ns a read here), not `thread_time` like the whole step: the thread's CPU
    clock is a system call on these machines (0.7 us a read), and four reads inside each step made a batch-1
    step look 2-3 us slower than it is."""

    def __init__(self, owner: Any, names: tuple[str, ...]) -> None:
        self.owner = owner
        self.saved = {name: vars(owner).get(name) for name in names}  # None: a method of the instance's class
        self.seconds = 0.0
        for name in names:
            setattr(owner, name, self._wrap(getattr(owner, name)))

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def restore(self) -> None:
        for name, fn in self.saved.items():
            if fn is None:
                delattr(self.owner, name)
            else:
                setattr(self.owner, name, fn)


@dataclass
class _Row:
    key: str
    prompt_len: int
    response: np.ndarray
    pos: int = 0  # response tokens committed


class _Batch:
    """The engine's side of the step: rows, the token matrix, request descriptions, verification."""

    def __init__(
        self,
        records: list[Any],
        batch: int,
        max_len: int,
        first_epoch: int,
        history: list[Any],
        add_history: Callable[[list[Any]], Any],
    ) -> None:
        self.records = records
        self.batch = batch
        self.epoch = first_epoch
        self.token_ids = np.zeros((batch, max_len), np.int32)
        self.num_tokens = np.zeros(batch, np.int32)
        self.rows: list[_Row | None] = [None] * batch
        self.requests: dict[str, Any] = {}
        self.next_record = 0
        # The engine's clock: each verification advances it by the replay's default cost model, so the
        # budget learns the same step costs on every run (timing the bench's own Python made the workload
        # itself vary from run to run).
        self.cost = CostModel()
        self.now = 0.0
        # Each lap through the epoch's rollouts decodes them as new problems in their own token alphabet (ids
        # shifted by `alphabet` per lap), whose history (the earlier epochs, shifted alike) arrives when the
        # lap starts. A lap drafts from its own problems' history and siblings, as lap 0 does, never from
        # copies of the very rollouts it decodes, which earlier laps put in the history.
        self.history = history
        self.add_history = add_history
        self.alphabet = 1 + max(max(r.prompt_ids + r.response_ids) for r in (*records, *history))
        # What the engine knows of every request as it starts, and no more: the trace's response cap and its
        # stop tokens (those that ended its "stop" responses). A trace without finish reasons gives each
        # request its own length as its cap, so that it still ends by itself and enters the history.
        everything = (*records, *history)
        self.cap = trace_max_tokens(everything)
        self.stop_ids = {
            r.response_ids[-1] for r in everything if r.finish_reason == "stop" and r.response_ids
        }
        self.laps_seeded = 0
        self.served = 0
        self.committed = 0
        for i in range(batch):
            self._admit(i)

    def _in_lap(self, record: Any, lap: int) -> Any:
        if lap == 0:
            return record
        shift = lap * self.alphabet
        return record.model_copy(
            update={
                "problem_id": f"{record.problem_id}@lap{lap}",
                "prompt_ids": [t + shift for t in record.prompt_ids],
                "response_ids": [t + shift for t in record.response_ids],
            }
        )

    def _admit(self, i: int) -> None:
        lap = self.next_record // len(self.records)
        if lap > self.laps_seeded:
            self.add_history([self._in_lap(r, lap) for r in self.history])
            self.laps_seeded = lap
        record = self._in_lap(self.records[self.next_record % len(self.records)], lap)
        self.next_record += 1
        key = f"req-{self.next_record}"
        prompt = np.asarray(record.prompt_ids, np.int32)
        response = np.asarray(record.response_ids, np.int32)
        self.token_ids[i, : prompt.shape[0]] = prompt
        # The prompt's prefill samples the first response token before the first draft, as in vLLM.
        self.token_ids[i, prompt.shape[0]] = response[0]
        self.num_tokens[i] = prompt.shape[0] + 1
        self.rows[i] = _Row(key, prompt.shape[0], response, pos=1)
        extra = {"das_problem_id": record.problem_id, "das_epoch": self.epoch, "das_sample": record.sample}
        known = self.cap is not None and record.finish_reason in ("stop", "length")
        self.requests[key] = SimpleNamespace(
            num_prompt_tokens=prompt.shape[0],
            sampling_params=SimpleNamespace(
                extra_args=extra,
                max_tokens=self.cap if known else response.shape[0],
                all_stop_token_ids={t + lap * self.alphabet for t in self.stop_ids},
            ),
        )

    def clock(self) -> float:
        return self.now

    def req_ids(self) -> list[str]:
        return [row.key for row in self.rows]  # type: ignore[union-attr]

    def verify(self, drafts: list[list[int]]) -> None:
        """Commits each row's accepted draft prefix plus one token. A row whose request finished stays one
        more step, as in vLLM: the runner asks for drafts right after it writes a step's sampled tokens, and
        removes finished requests only when it next schedules, so the proposer sees every request's last
        tokens (and adds the finished rollout to its history when the request is gone). Its draft is ignored
        and the next request takes its row."""
        active = verified = 0
        for i, draft in enumerate(drafts):
            row = self.rows[i]
            if row.pos >= row.response.shape[0]:
                del self.requests[row.key]
                self.served += 1
                self._admit(i)
                continue
            active += 1
            verified += 1 + len(draft)
            target = row.response[row.pos : row.pos + len(draft)]
            n = min(len(draft), target.shape[0])
            mismatch = np.flatnonzero(np.asarray(draft[:n], np.int32) != target[:n])
            accepted = int(mismatch[0]) if mismatch.size else n
            advance = min(accepted + 1, row.response.shape[0] - row.pos)
            start = row.prompt_len + row.pos
            self.token_ids[i, start : start + advance] = row.response[row.pos : row.pos + advance]
            row.pos += advance
            self.num_tokens[i] = row.prompt_len + row.pos
            self.committed += advance
        self.now += self.cost.step(active, verified)


def _build(records: list[Any], k: int, max_len: int) -> tuple[DasProposer, list[Any], list[Any], int]:
    """A proposer holding every epoch of the trace but the last as history; returns it, the last epoch's
    rollouts, the history and the last epoch's number."""
    last = max(r.epoch for r in records)
    proposer = DasProposer.standalone(k, max_len)
    history = [r for r in records if r.epoch < last]
    proposer.add_trajectories(history)
    live = [r for r in records if r.epoch == last and len(r.response_ids) > 0]
    return proposer, live, history, last


def _engine_for(
    proposer: DasProposer, live: list[Any], history: list[Any], last: int, batch: int, max_len: int
) -> _Batch:
    """The bench's engine at `batch` rows, decoding `live` with `proposer`, whose clock it sets."""
    engine = _Batch(live, batch, max_len, last, history, proposer.add_trajectories)
    proposer.clock = engine.clock
    return engine


def decoding(records: list[Any], k: int, batch: int) -> tuple[DasProposer, _Batch]:
    """A proposer holding every epoch of the trace but the last, and the bench's engine decoding the last
    epoch with it at `batch` rows (room for every record's tokens and a full draft)."""
    max_len = max(len(r.prompt_ids) + len(r.response_ids) for r in records) + k + 2
    proposer, live, history, last = _build(records, k, max_len)
    return proposer, _engine_for(proposer, live, history, last, batch, max_len)


def _run_batch(records: list[Any], batch: int, k: int, steps: int, warmup: int) -> dict:
    proposer, engine = decoding(records, k, batch)
    for _ in range(warmup):
        engine.verify(proposer.step(engine.req_ids(), engine.num_tokens, engine.token_ids, engine.requests))
    proposer.reset_stats()
    kernel = _Timed(proposer_module, ("decode_step", "draft_step"))
    # Requests starting and finishing (a finished rollout's history adds included): per request, not per step.
    lifecycle = _Timed(proposer, ("_reap", "_start"))
    committed0 = engine.committed
    per_step, steady, per_wall, steady_wall = [], [], [], []
    try:
        for _ in range(steps):
            req_ids = engine.req_ids()
            before = lifecycle.seconds
            start, wall = time.thread_time(), time.perf_counter()
            drafts = proposer.step(req_ids, engine.num_tokens, engine.token_ids, engine.requests)
            per_wall.append(time.perf_counter() - wall)
            per_step.append(time.thread_time() - start)
            steady.append(per_step[-1] - (lifecycle.seconds - before))
            steady_wall.append(per_wall[-1] - (lifecycle.seconds - before))
            engine.verify(drafts)
        step_s, wall_s = sum(per_step), sum(per_wall)
    finally:
        kernel.restore()
        lifecycle.restore()
    stats = proposer.stats()
    if stats["errors"]:
        raise RuntimeError(f"the proposer reported {stats['errors']} errors; see the log")
    per = 1e6 / (steps * batch)
    rows = steps * batch
    result = {
        "batch": batch,
        "steps": steps,
        "draft_threads": proposer.index.draft_threads,
        "step_us_per_request": round(step_s * per, 3),
        # The native calls are timed by the wall clock (`_Timed`): split the step's wall time, not its CPU time,
        # or a loaded machine (wall above CPU) puts more than the whole step in the native calls.
        "native_us_per_request": round(kernel.seconds * per, 3),
        "python_us_per_request": round((wall_s - kernel.seconds) * per, 3),
        "native_share": round(kernel.seconds / wall_s, 3),
        "step_us": round(1e6 * step_s / steps, 2),
        # The median and 10th-percentile steps resist other processes' bursts on a shared machine better than
        # the mean (the 10th percentile also skips the steps where requests finish: it flatters).
        "step_median_us_per_request": round(1e6 * float(np.median(per_step)) / batch, 3),
        "step_p10_us_per_request": round(1e6 * float(np.percentile(per_step, 10)) / batch, 3),
        "step_wall_us_per_request": round(wall_s * per, 3),
        "step_wall_median_us_per_request": round(1e6 * float(np.median(per_wall)) / batch, 3),
        "lifecycle_us_per_request": round(lifecycle.seconds * per, 3),
        # The step without requests starting and finishing: budgets, commit, drafts, truncation, learning
        # and counting, the scope of the step targets.
        "steady_step_us_per_request": round(sum(steady) * per, 3),
        "steady_step_median_us_per_request": round(1e6 * float(np.median(steady)) / batch, 3),
        # Wall time less the (single-threaded) starts and finishes: what vLLM waits for, drafting threads included.
        "steady_step_wall_median_us_per_request": round(1e6 * float(np.median(steady_wall)) / batch, 3),
        "tokens_per_step": round((engine.committed - committed0) / rows, 3),
        "accepted_tokens_per_draft": round(stats["accepted_tokens"] / max(stats["verified_drafts"], 1), 3),
        "draft_tokens_per_row": round(stats["draft_tokens"] / rows, 3),
        "requests_finished": engine.served,
    }
    result.update(_kernel_split(proposer, engine))
    result.update(_allocations(proposer, engine, min(steps, 50)))
    return result


def _kernel_split(proposer: DasProposer, engine: _Batch, calls: int = 200, repeats: int = 7) -> dict:
    """The batch's `ProblemIndex.step` with nothing new to commit, timed best-of-`repeats` (the least
    disturbed run), once with every budget at 0 (matching only) and once with budget K (matching and
    drafting): what drafting costs, apart from the rest of the step. Repeating is exact: with no new tokens
    the matches stay where they are."""
    index = proposer.index
    # A step registers the rows that joined after the last verification (nothing is verified after it).
    proposer.step(engine.req_ids(), engine.num_tokens, engine.token_ids, engine.requests)
    slots = np.array([index.slot(key) for key in engine.req_ids()], np.int64)
    end = index.committed(slots)
    src, base = np.empty(0, np.int32), np.zeros_like(slots)
    out = {}
    for name, budget in (("match_only", 0), ("match_and_draft", proposer.k)):
        budgets = np.full(slots.shape[0], budget, np.int64)
        index.step(slots, src, base, end, budgets)
        best = float("inf")
        for _ in range(repeats):
            start = time.thread_time()
            for _ in range(calls):
                index.step(slots, src, base, end, budgets)
            best = min(best, time.thread_time() - start)
        out[f"index_step_{name}_best_us_per_request"] = round(1e6 * best / (calls * slots.shape[0]), 3)
    return out


def _allocations(proposer: DasProposer, engine: _Batch, steps: int) -> dict:
    """Python-heap bytes a step holds at its peak and still holds when it returns (its drafts included),
    traced by tracemalloc; numba's allocations inside kernels are not traced."""
    peaks, kept = [], []
    tracemalloc.start()
    try:
        for _ in range(steps):
            req_ids = engine.req_ids()
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            drafts = proposer.step(req_ids, engine.num_tokens, engine.token_ids, engine.requests)
            current, peak = tracemalloc.get_traced_memory()
            peaks.append(peak - before)
            kept.append(current - before)  # the returned drafts included
            engine.verify(drafts)
    finally:
        tracemalloc.stop()
    return {
        "allocated_bytes_per_step_peak": int(np.median(peaks)),
        "allocated_bytes_per_step_kept": int(np.median(kept)),
    }


def _best_of(records: list[Any], batch: int, k: int, steps: int, warmup: int, repeats: int) -> dict:
    """The least disturbed of `repeats` runs (lowest median step): on a shared machine other processes only
    ever add time. The other runs' medians are kept beside it, so the spread is visible."""
    runs = [_run_batch(records, batch, k, steps, warmup) for _ in range(repeats)]
    best = min(runs, key=lambda r: r["step_median_us_per_request"])
    best["repeats"] = repeats
    best["step_median_us_per_request_all_runs"] = [r["step_median_us_per_request"] for r in runs]
    return best


def run(
    trace: str | Path,
    k: int = DEFAULT_ENGINE_K,
    steps: int = 400,
    warmup: int = 50,
    batches=BATCHES,
    repeats: int = 3,
) -> dict:
    """The JSON `das bench proposer` prints."""
    records = load_traces(trace)
    load_before = os.getloadavg()
    results = [_best_of(records, b, k, steps, warmup, repeats) for b in batches]
    return {
        "trace": str(trace),
        "k": k,
        "budget": os.environ.get("DAS_BUDGET", "on"),
        "load_average_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
        "batches": results,
        "targets_us_per_request": {str(b): t for b, t in TARGET_US_PER_REQUEST.items()},
    }
