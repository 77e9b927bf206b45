"""`das bench ingest`: what a node's history ingest costs the proposer's decode step (issue 47, item 1).

For each batch size and each ingest rate, on a fresh copy of one preloaded store:
- a writer process holds the store as its primary (`HistoryStore`, as the node's replica service does) and
  applies synthetic trajectories (`pipeline.synthetic`, 1k-token median responses) at a fixed rate in tokens
  per second, in a batch every 50 ms, logging when each batch became durable;
- this process runs a real `DasProposer` on the store as a drafting server does (`DAS_HISTORY_DIR`, lazy load,
  `load_model`), and steps it at the batch size with `interval_ms` between steps, as if a GPU step ran: rows
  of requests (8 per problem, as GRPO samples them) decode synthetic responses, each step committing the
  accepted prefix of the row's draft plus one token, as verification would.
The preload holds more than the global tree's token cap, and the writer's problems advance through epochs
(8 samples per problem and epoch, in problem order, as a data loader's passes), so every rate crosses the
global tree's cap and slides windows while it is measured.

Per batch and rate: step p50, p99 and max (wall clock around `DasProposer.step`), the thread's CPU time of
the same steps, how late each step started against its schedule (a thread holding the GIL delays the caller
before its step begins, which the step's own clock does not see), `max_ingest_ms_per_step` (the most time one
step spent on history ingest: the proposer's history work on the step, timed with perf_counter around just
that work), the tokens the writer applied and the proposer took in, and freshness: seconds from a
trajectory's apply in the store (its batch durable) to the end of the step after which the global tree held
it (the step that could draft from it). The machine's load average is reported beside the figures: on a
shared machine, wall times include other processes' bursts; the ingest work per step and the freshness are
the figures to read there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
RATES = (0, 20_000, 100_000, 300_000)
BATCHES = (64, 256)
SAMPLES = 8  # per problem and epoch, as a GRPO group
PROBLEMS = 256
WINDOW_EPOCHS = 3
BATCH_S = 0.05  # the writer applies a batch this often, as a replica applies a consumer poll
PRELOAD_TOKENS = 6_000_000
K = 8
# What a proposer before the history feed did for history inside the step (it followed the change log there),
# timed where it exists so that the same bench measures that version too; the feed's share of a step is the
# time the step waited at its gate.
_INGEST_ON_STEP = ("catch_up",)


def _record(index: int, problems: int, seed: int) -> Any:
    """Trajectory `index` of the writer's stream: problems in order, SAMPLES per problem and epoch, epochs
    advancing once every problem has had its samples (a data loader's pass); tokens from pipeline.synthetic."""
    from pipeline.schemas import TrajectoryRecord
    from pipeline.synthetic import SyntheticShape, synthetic_record

    base = synthetic_record(0, index, 1, SyntheticShape(problems=problems, epochs=1), seed)
    return TrajectoryRecord.model_construct(
        problem_id=f"problem-{(index // SAMPLES) % problems}",
        epoch=index // (SAMPLES * problems),
        sample=index % SAMPLES,
        prompt_ids=base.prompt_ids,
        response_ids=base.response_ids,
        finish_reason="stop",
        worker="bench-ingest",
    )


def preload(store: Path, tokens: int, problems: int, seed: int = 0) -> int:
    """Writes the stream's first records up to `tokens` response tokens; returns how many records."""
    from history_store.durable.store import HistoryStore

    count = written = 0
    with HistoryStore(store, window_epochs=WINDOW_EPOCHS) as writer:
        while written < tokens:
            batch = [_record(count + i, problems, seed) for i in range(256)]
            writer.apply(batch, {})
            written += sum(len(r.response_ids) for r in batch)
            count += len(batch)
    return count


def write(store: Path, rate: float, seconds: float, first: int, problems: int, log: Path) -> None:
    """The writer process: waits for a line on stdin, then applies the stream from record `first` at `rate`
    response tokens per second for `seconds`, a batch every BATCH_S; writes [[apply time, keys], ...]
    (time.monotonic, system-wide on Linux) to `log` and prints a line when done."""
    from history_store.durable.store import HistoryStore

    entries: list[tuple[float, list[tuple[str, int, int]], int]] = []
    with HistoryStore(store, window_epochs=WINDOW_EPOCHS) as writer:
        print("ready", flush=True)
        sys.stdin.readline()
        started = time.monotonic()
        index, written = first, 0
        tick = started
        while tick - started < seconds:
            tick += BATCH_S
            batch = []
            while rate > 0 and written < rate * (tick - started):
                record = _record(index, problems, 0)
                batch.append(record)
                written += len(record.response_ids)
                index += 1
            if batch:
                writer.apply(batch, {})
                entries.append(
                    (
                        time.monotonic(),
                        [(r.problem_id, r.epoch, r.sample) for r in batch],
                        sum(len(r.response_ids) for r in batch),
                    )
                )
            pause = tick - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        elapsed = time.monotonic() - started
    log.write_text(json.dumps({"entries": entries, "seconds": elapsed, "tokens": written}))
    print("done", flush=True)


class _Rows:
    """The engine's side: `batch` rows decoding synthetic responses, SAMPLES requests per problem of the
    first batch / SAMPLES problems; a finished request's row goes to a fresh request of the same problem."""

    def __init__(self, batch: int, max_len: int, seed: int) -> None:
        from pipeline.synthetic import SyntheticShape, synthetic_record

        self._record = lambda i: synthetic_record(1, i, 1, SyntheticShape(), seed)
        self.batch = batch
        self.problems = max(1, batch // SAMPLES)
        self.token_ids = np.zeros((batch, max_len), np.int32)
        self.num_tokens = np.zeros(batch, np.int32)
        self.rows: list[SimpleNamespace] = []
        self.requests: dict[str, Any] = {}
        self.started = 0
        self.committed = 0
        self.accepted = 0
        for i in range(batch):
            self.rows.append(SimpleNamespace())
            self._admit(i)

    def problem_ids(self) -> list[str]:
        return [f"problem-{p}" for p in range(self.problems)]

    def _admit(self, i: int) -> None:
        record = self._record(self.started)
        key = f"req-{self.started}"
        problem = f"problem-{i % self.problems}"
        self.started += 1
        prompt = np.asarray(record.prompt_ids, np.int32)
        response = np.asarray(record.response_ids, np.int32)
        response = response[: self.token_ids.shape[1] - prompt.shape[0] - K - 2]
        self.token_ids[i, : prompt.shape[0]] = prompt
        self.token_ids[i, prompt.shape[0]] = response[0]
        self.num_tokens[i] = prompt.shape[0] + 1
        self.rows[i] = SimpleNamespace(key=key, prompt_len=prompt.shape[0], response=response, pos=1)
        # No das_epoch/das_sample: the server's own finished requests do not enter its history here, so what
        # the step does for history is the replica's ingest alone.
        self.requests[key] = SimpleNamespace(
            num_prompt_tokens=prompt.shape[0],
            sampling_params=SimpleNamespace(
                extra_args={"das_problem_id": problem}, max_tokens=int(response.shape[0])
            ),
        )

    def req_ids(self) -> list[str]:
        return [row.key for row in self.rows]

    def verify(self, drafts: list[list[int]]) -> None:
        for i, draft in enumerate(drafts):
            row = self.rows[i]
            if row.pos >= row.response.shape[0]:
                del self.requests[row.key]
                self._admit(i)
                continue
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
            self.accepted += advance - 1


class _OnStep:
    """Times the proposer's history work on the step: wraps the methods in _INGEST_ON_STEP it has (wall clock
    and the thread's CPU time), and adds the time a step waited for the history thread's piece of work
    (`StepGate.waited`, and the CPU time of the pieces waited for, `waited_cpu`), where the proposer has one."""

    def __init__(self, proposer: Any) -> None:
        self.wall = 0.0
        self.cpu = 0.0
        self.proposer = proposer
        self.names = [name for name in _INGEST_ON_STEP if hasattr(proposer, name)]
        for name in self.names:
            setattr(proposer, name, self._wrap(getattr(proposer, name)))
        feed = getattr(proposer, "_feed", None)
        self.gate = getattr(feed, "gate", None)

    def totals(self) -> tuple[float, float, int]:
        """(wall, CPU) seconds of ingest on the step so far, and the steps that waited for a piece."""
        if self.gate is None:
            return self.wall, self.cpu, 0
        return self.wall + self.gate.waited, self.cpu + self.gate.waited_cpu, self.gate.waits

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - start
                self.cpu += time.thread_time() - cpu

        return timed

    def restore(self) -> None:
        for name in self.names:
            delattr(self.proposer, name)


def _drafted_keys(index: Any, seen: int) -> tuple[list[tuple[str, int, int]], int]:
    """Keys that entered the global tree since `seen` of them had (the index numbers its global rollouts in
    arrival order, `_global_next`, and keeps them oldest first in `_global_fifo`)."""
    total = index._global_next
    new = total - seen
    if new <= 0:
        return [], total
    fifo = index._global_fifo
    tail = [fifo[i][0] for i in range(max(0, len(fifo) - new), len(fifo))]
    return tail, total


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def _ms(x: float) -> float:
    return round(1000 * x, 3)


def _measure(
    template: Path, work: Path, batch: int, rate: float, seconds: float, first: int, interval_ms: float
) -> dict[str, Any]:
    store = work / "history"
    if store.exists():
        shutil.rmtree(store)
    shutil.copytree(template, store)
    log = work / "writer.json"
    writer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workers.bench.ingest",
            "--write",
            str(store),
            str(rate),
            str(seconds),
            str(first),
            str(PROBLEMS),
            str(log),
        ],
        cwd=str(REPO),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdin is not None
        if writer.stdout.readline().strip() != "ready":
            raise RuntimeError("the writer process did not start")
        result = _steps(store, work, batch, rate, seconds, interval_ms, writer)
    finally:
        if writer.poll() is None:
            writer.kill()
        writer.wait()
    written = json.loads(log.read_text())
    applied = {tuple(key): t for t, keys, _ in written["entries"] for key in keys}
    fresh = [result["drafted_at"][key] - applied[key] for key in applied if key in result["drafted_at"]]
    result.pop("drafted_at")
    result.update(
        writer_tokens=written["tokens"],
        writer_tokens_per_s=round(written["tokens"] / max(written["seconds"], 1e-9)),
        trajectories_applied=len(applied),
        trajectories_drafted=len(fresh),
        freshness_s={
            "p50": round(_percentile(fresh, 50), 3),
            "p99": round(_percentile(fresh, 99), 3),
            "max": round(max(fresh, default=0.0), 3),
        },
    )
    return result


def _steps(
    store: Path, work: Path, batch: int, rate: float, seconds: float, interval_ms: float, writer: Any
) -> dict[str, Any]:
    os.environ.update(
        DAS_HISTORY_DIR=str(store),
        DAS_SECONDARY_DIR=str(work / f"secondary-{batch}-{int(rate)}"),
        DAS_HISTORY_LOAD="lazy",
        DAS_WINDOW_EPOCHS=str(WINDOW_EPOCHS),
    )
    from workers.generator.proposer import DasProposer

    max_len = 8192 + 400
    proposer = DasProposer.standalone(K, max_len, publish=False)
    loaded = time.perf_counter()
    proposer.load_model()
    load_s = time.perf_counter() - loaded
    rows = _Rows(batch, max_len, seed=1)
    proposer.prefetch(rows.problem_ids())
    interval = interval_ms / 1000
    for _ in range(100):  # warm: every row registered, the kernels' first calls behind
        rows.verify(proposer.step(rows.req_ids(), rows.num_tokens, rows.token_ids, rows.requests))
        time.sleep(interval)
    index = proposer.index
    _, seen = _drafted_keys(index, 0)
    on_step = _OnStep(proposer)
    walls: list[float] = []
    cpus: list[float] = []
    ingest: list[float] = []
    ingest_cpu: list[float] = []
    late: list[float] = []
    drafted_at: dict[tuple[str, int, int], float] = {}
    committed0, accepted0 = rows.committed, rows.accepted
    load_before = os.getloadavg()[0]
    writer.stdin.write("go\n")
    writer.stdin.flush()
    done_at = None
    due = time.perf_counter()
    try:
        while True:
            if done_at is None and writer.poll() is not None:  # it prints "done" and exits
                done_at = time.perf_counter()
            # After the writer stops, a few more seconds let the proposer take in what is left.
            if done_at is not None and time.perf_counter() - done_at > 3.0:
                break
            started = time.perf_counter()
            late.append(max(0.0, started - due))
            cpu = time.thread_time()
            wall_before, cpu_before, _ = on_step.totals()
            drafts = proposer.step(rows.req_ids(), rows.num_tokens, rows.token_ids, rows.requests)
            ended = time.perf_counter()
            cpus.append(time.thread_time() - cpu)
            walls.append(ended - started)
            wall_after, cpu_after, _ = on_step.totals()
            ingest.append(wall_after - wall_before)
            ingest_cpu.append(cpu_after - cpu_before)
            now = time.monotonic()
            keys, seen = _drafted_keys(index, seen)
            for key in keys:
                drafted_at.setdefault(key, now)
            rows.verify(drafts)
            due = time.perf_counter() + interval
            time.sleep(interval)
    finally:
        on_step.restore()
    stats = proposer.stats()
    steps = len(walls)
    return {
        "batch": batch,
        "rate_tokens_per_s": rate,
        "steps": steps,
        "load_model_s": round(load_s, 2),
        "step_ms": {
            "p50": _ms(_percentile(walls, 50)),
            "p99": _ms(_percentile(walls, 99)),
            "max": _ms(max(walls, default=0.0)),
        },
        "step_cpu_ms": {
            "p50": _ms(_percentile(cpus, 50)),
            "p99": _ms(_percentile(cpus, 99)),
            "max": _ms(max(cpus, default=0.0)),
        },
        "start_late_ms": {
            "p50": _ms(_percentile(late, 50)),
            "p99": _ms(_percentile(late, 99)),
            "max": _ms(max(late, default=0.0)),
        },
        # Ingest on the step: the work done inside it plus the wait for a piece of the history thread's, by the
        # wall clock (on a loaded machine the OS may stop that thread mid-piece) and in CPU time (the work).
        "max_ingest_ms_per_step": _ms(max(ingest, default=0.0)),
        "ingest_ms_per_step_p99": _ms(_percentile(ingest, 99)),
        "steps_over_5ms_ingest": sum(x > 0.005 for x in ingest),
        "max_ingest_cpu_ms_per_step": _ms(max(ingest_cpu, default=0.0)),
        "ingest_cpu_ms_per_step_p99": _ms(_percentile(ingest_cpu, 99)),
        "steps_over_5ms_ingest_cpu": sum(x > 0.005 for x in ingest_cpu),
        "steps_that_waited_for_ingest": on_step.totals()[2],
        "steps_over_50ms": sum(x > 0.05 for x in walls),
        "global_tree_tokens_end": index.global_tree_tokens,
        "tokens_per_step": round((rows.committed - committed0) / max(1, steps * batch), 3),
        "accepted_per_row_step": round((rows.accepted - accepted0) / max(1, steps * batch), 3),
        "errors": stats["errors"],
        "history_feed": stats.get("history_feed"),
        "load_average_1m": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "drafted_at": drafted_at,
    }


def _child(args: list[str]) -> dict[str, Any]:
    """One (batch, rate) measurement in a fresh process (a proposer's memory and threads do not carry over)."""
    out = subprocess.run(
        [sys.executable, "-m", "workers.bench.ingest", "--measure", *args],
        cwd=str(REPO),
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"das bench ingest: a measurement failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(
    rates: tuple[int, ...] = RATES,
    batches: tuple[int, ...] = BATCHES,
    seconds: float = 30.0,
    interval_ms: float = 10.0,
    preload_tokens: int = PRELOAD_TOKENS,
    work_dir: str | Path | None = None,
) -> dict[str, Any]:
    """The JSON `das bench ingest` prints."""
    made = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="das-bench-ingest-")) if made else Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    try:
        template = work / "template"
        if template.exists():
            shutil.rmtree(template)
        started = time.perf_counter()
        first = preload(template, preload_tokens, PROBLEMS)
        preload_s = time.perf_counter() - started
        runs = []
        for batch in batches:
            for rate in rates:
                runs.append(
                    _child(
                        [
                            str(template),
                            str(work),
                            str(batch),
                            str(rate),
                            str(seconds),
                            str(first),
                            str(interval_ms),
                        ]
                    )
                )
        return {
            "seconds_per_rate": seconds,
            "interval_ms": interval_ms,
            "k": K,
            "problems": PROBLEMS,
            "samples_per_problem_epoch": SAMPLES,
            "window_epochs": WINDOW_EPOCHS,
            "preload": {"records": first, "seconds": round(preload_s, 1)},
            "cpus": os.cpu_count(),
            "runs": runs,
        }
    finally:
        if made:
            shutil.rmtree(work, ignore_errors=True)


def _main(argv: list[str]) -> None:
    if argv[0] == "--write":
        store, rate, seconds, first, problems, log = argv[1:]
        write(Path(store), float(rate), float(seconds), int(first), int(problems), Path(log))
    elif argv[0] == "--measure":
        template, work, batch, rate, seconds, first, interval_ms = argv[1:]
        result = _measure(
            Path(template),
            Path(work),
            int(batch),
            float(rate),
            float(seconds),
            int(first),
            float(interval_ms),
        )
        print(json.dumps(result))
    else:
        raise SystemExit(f"unknown mode {argv[0]!r}")


if __name__ == "__main__":
    _main(sys.argv[1:])
