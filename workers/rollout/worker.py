"""The rollout worker: epochs of a problem set through vLLM, each finished trajectory handed on as it finishes.

RL rollouts sample every problem n times per epoch (temperature 1.0) and train on the results; the next epoch
samples the same problems again, which is what DAS drafts from. The worker drives `LLMEngine.step()` itself
rather than `LLM.generate`, so each trajectory is published the moment it finishes, request latencies are
measured, and the driver can act between steps (push history, evict).

Strategies: `none` (plain decoding), `ngram` (vLLM's prompt lookup), `das` (`workers.proposer.DasProposer`).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from history_store.automaton.config import DEFAULT_ENGINE_K
from monitoring.metrics import EPOCH, EPOCH_MAKESPAN, REQUEST_DURATION, REQUEST_DURATION_MAX
from pipeline.schemas import TrajectoryRecord
from pipeline.trace_files import numbered_lines
from workers.errors import InvalidInput
from workers.generator.model import require_model
from workers.rollout.priority import LengthPredictor

STRATEGIES = ("none", "ngram", "das")
# vLLM's scheduling policies: admission in arrival order, or by each request's priority (lower first).
SCHEDULING_POLICIES = ("fcfs", "priority")
# The names users put in their engine arguments (`workers.proposer` re-exports them).
PROPOSER_CLASS = "workers.proposer.DasProposer"
WORKER_EXTENSION = "workers.proposer.DasWorkerExtension"
_SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class EngineOptions:
    """How to build the engine. None means the platform's default (`engine_kwargs`): the CPU keeps the small,
    exact settings the tests need; a GPU gets vLLM's serving settings."""

    strategy: str = "das"
    model_dir: Path | None = None
    num_speculative_tokens: int = DEFAULT_ENGINE_K
    max_model_len: int = 2048
    # CPU 16; GPU 256, vLLM's own default for serving.
    max_num_seqs: int | None = None
    # Tokens one engine step may schedule (vLLM's max_num_batched_tokens); None: vLLM's default. Below
    # max_num_seqs x (1 + K) the scheduler cuts drafts at full batch.
    max_num_batched_tokens: int | None = None
    # CPU float32 (bf16 changes greedy outputs at batch > 1 on the CPU, see NOTES); GPU "auto" (the checkpoint's).
    dtype: str | None = None
    seed: int = 0
    # CPU: 512 MiB holds ~11k tokens of SmolLM2 KV in fp32 (the CPU backend otherwise reserves a fraction of all
    # RAM). GPU: None, so gpu_memory_utilization sizes the cache.
    kv_cache_bytes: int | None = None
    # GPU only: the share of GPU memory vLLM may take (weights, activations, KV cache).
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    # CPU True; GPU False, so vLLM captures CUDA graphs.
    enforce_eager: bool | None = None
    tensor_parallel_size: int = 1
    # Prompt lookup n-gram sizes of the `ngram` baseline (the range measured in NOTES).
    ngram_min: int = 2
    ngram_max: int = 4
    # "priority": the worker admits problems the history separates longest first, submission order within a
    # block (`workers.rollout.priority`), so a known tail starts early when an epoch has more requests than
    # slots; "fcfs": vLLM's arrival order.
    scheduling_policy: str = "priority"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise InvalidInput(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.num_speculative_tokens < 1 or self.max_model_len < 16 or self.tensor_parallel_size < 1:
            raise InvalidInput(
                "num_speculative_tokens >= 1, max_model_len >= 16 and tensor_parallel_size >= 1 are required"
            )
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise InvalidInput(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise InvalidInput(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidInput(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InvalidInput(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidInput(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidInput(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise InvalidInput(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")


def engine_kwargs(options: EngineOptions, on_cpu: bool) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments for `options` on the CPU or a GPU (model path excluded)."""
    kwargs: dict[str, Any] = {
        "dtype": options.dtype or ("float32" if on_cpu else "auto"),
        "max_model_len": options.max_model_len,
        "max_num_seqs": options.max_num_seqs or (16 if on_cpu else 256),
        "seed": options.seed,
        "enforce_eager": on_cpu if options.enforce_eager is None else options.enforce_eager,
        "kv_cache_dtype": options.kv_cache_dtype,
        "tensor_parallel_size": options.tensor_parallel_size,
        "disable_log_stats": False,
        # The log probabilities a request asks for (`logprobs=0`: the sampled token's, which the records keep)
        # are those of the distribution the token was drawn from, after temperature; vLLM's default,
        # "raw_logprobs", reports the temperature-1 model instead.
        "logprobs_mode": "processed_logprobs",
        "scheduling_policy": options.scheduling_policy,
    }
    if options.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = options.max_num_batched_tokens
    kv_bytes = options.kv_cache_bytes or (512 * 2**20 if on_cpu else None)
    if kv_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_bytes
    if not on_cpu:
        kwargs["gpu_memory_utilization"] = options.gpu_memory_utilization
    k = options.num_speculative_tokens
    if options.strategy == "ngram":
        kwargs["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": options.ngram_min,
            "prompt_lookup_max": options.ngram_max,
        }
    elif options.strategy == "das":
        kwargs["speculative_config"] = {
            "method": "custom_class",
            "model": PROPOSER_CLASS,
            "num_speculative_tokens": k,
        }
        kwargs["worker_extension_cls"] = WORKER_EXTENSION
    return kwargs


def build_engine(options: EngineOptions) -> Any:
    """A `vllm.LLM` for `options` (spec metrics on, hub off). Call under `if __name__ == "__main__":` in
    scripts: vLLM spawns its workers.

    Raises:
        ModelError: the model folder is not a complete checkpoint (checked before vLLM starts).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # vLLM logs to stdout by default; commands print their results (JSON) there. Read when vllm is imported.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    model_dir = require_model(options.model_dir)
    from vllm import LLM
    from vllm.platforms import current_platform

    return LLM(model=str(model_dir), **engine_kwargs(options, current_platform.is_cpu()))


def shutdown_engine(llm: Any) -> None:
    """Stops the engine's worker processes now (rather than at interpreter exit)."""
    llm.llm_engine.engine_core.shutdown()


@dataclass(frozen=True)
class Problem:
    """One prompt of the problem set, already tokenized."""

    problem_id: str
    prompt_ids: tuple[int, ...]


# A small built-in set in the style of RL math and code rollouts: word problems with worked solutions and short
# programs, where samples of one problem share most of their phrasing.
BUILTIN_PROMPTS = (
    "Solve step by step: a train travels 60 km in 45 minutes. What is its average speed in km/h?",
    "Solve step by step: what is the sum of all integers from 1 to 100?",
    "Write a Python function that returns the n-th Fibonacci number, then explain how it works.",
    "Solve step by step: a rectangle has a perimeter of 30 cm and a length of 9 cm. What is its area?",
    "Write a Python function that checks whether a string is a palindrome, with two examples.",
    "Solve step by step: if 3x + 7 = 25, what is x? Check your answer.",
    "Explain step by step how to compute the greatest common divisor of 84 and 36.",
    "Solve step by step: a shop sells pens at 3 for $2. How much do 18 pens cost?",
)


def chat_prompt_ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    """Token ids of `text` as a user turn with the model's chat template and the assistant prefix."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return tuple(int(t) for t in ids)


def builtin_problems(tokenizer: Any, count: int = len(BUILTIN_PROMPTS)) -> list[Problem]:
    """The first `count` built-in problems (ids `builtin-0`, ...).

    Raises:
        ValueError: count is outside 1..len(BUILTIN_PROMPTS).
    """
    if not 1 <= count <= len(BUILTIN_PROMPTS):
        raise InvalidInput(f"count must be in 1..{len(BUILTIN_PROMPTS)}, got {count}")
    return [
        Problem(f"builtin-{i}", chat_prompt_ids(tokenizer, text))
        for i, text in enumerate(BUILTIN_PROMPTS[:count])
    ]


def load_problems(path: Path, tokenizer: Any) -> list[Problem]:
    """Problems from JSON Lines: each line has `problem_id` and either `prompt` (text, chat template applied)
    or `prompt_ids` (token ids).

    Raises:
        ValueError: a line is not such an object, or problem ids repeat (the message names the line).
    """
    problems: list[Problem] = []
    seen: set[str] = set()
    for number, line in numbered_lines(path):
        try:
            item = json.loads(line)
            problem_id = item["problem_id"]
            if not isinstance(problem_id, str) or not problem_id:
                raise InvalidInput("problem_id must be a non-empty string")
            if "prompt_ids" in item:
                ids = tuple(int(t) for t in item["prompt_ids"])
            else:
                ids = chat_prompt_ids(tokenizer, str(item["prompt"]))
            if not ids:
                raise InvalidInput("empty prompt")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(f"{path}:{number}: not a problem ({exc})") from exc
        if problem_id in seen:
            raise InvalidInput(f"{path}:{number}: problem_id {problem_id!r} repeats")
        seen.add(problem_id)
        problems.append(Problem(problem_id, ids))
    if not problems:
        raise InvalidInput(f"{path}: no problems")
    return problems


@dataclass
class EpochReport:
    """What one epoch cost and how drafting did. `mean_accepted_per_step` is accepted draft tokens per request
    per verification step (0 without drafting); every step commits that plus one token."""

    epoch: int
    strategy: str
    requests: int
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_per_step: float
    latency_p50_s: float
    latency_p99_s: float
    latency_max_s: float
    proposer: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Finished:
    """A finished request: its record and its latency (submission to last token)."""

    record: TrajectoryRecord
    latency_s: float


@dataclass
class _Pending:
    problem: Problem
    epoch: int
    sample: int
    submitted: float
    started_at: float = field(default_factory=time.time)


def _own_spec_counters(llm: Any) -> dict[str, int] | None:
    """The spec-decode counters of `llm`'s own Prometheus stat logger (vLLM 0.32's `SpecDecodingProm`), or None
    where the engine keeps no such logger."""
    manager = getattr(getattr(llm, "llm_engine", None), "logger_manager", None)
    for stat_logger in getattr(manager, "stat_loggers", ()):
        prom = getattr(stat_logger, "spec_decoding_prom", None)
        if prom is None:
            continue
        totals = dict.fromkeys(_SPEC_COUNTERS.values(), 0)
        if not getattr(prom, "spec_decoding_enabled", False):
            return totals  # an engine without drafts
        for metric, name in _SPEC_COUNTERS.items():
            attribute = "counter_" + metric.removeprefix("vllm:")
            for child in getattr(prom, attribute).values():
                totals[name] += int(child._value.get())
        return totals
    return None


def _registry_spec_counters(llm: Any) -> dict[str, int]:
    """The spec-decode counters vLLM's Prometheus registry holds (`LLM.get_metrics()`)."""
    totals = dict.fromkeys(_SPEC_COUNTERS.values(), 0)
    for metric in llm.get_metrics():
        name = _SPEC_COUNTERS.get(metric.name)
        if name is not None and hasattr(metric, "value"):
            totals[name] += int(metric.value)
    return totals


def sampled_logprobs(completion: Any) -> list[float] | None:
    """The log probability of each sampled token, where the request asked vLLM for them (`logprobs=0`: each
    position's dict then holds the sampled token, plus any top-k asked for); None otherwise."""
    if completion.logprobs is None:
        return None
    return [
        float(position[token].logprob)
        for position, token in zip(completion.logprobs, completion.token_ids, strict=True)
    ]


class RolloutWorker:
    """Runs rollout requests on one engine and hands each finished trajectory to `sink`."""

    def __init__(
        self,
        llm: Any,
        strategy: str,
        sink: Callable[[TrajectoryRecord], None] | None = None,
        worker: str | None = None,
        logprobs: bool = True,
    ) -> None:
        """`logprobs`: ask vLLM for each sampled token's log probability (`logprobs=0`) and keep them in the
        records' `response_logprobs`."""
        if strategy not in STRATEGIES:
            raise InvalidInput(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.llm = llm
        self.strategy = strategy
        self.sink = sink
        self.logprobs = logprobs
        self.worker = worker or f"{socket.gethostname()}:{os.getpid()}"
        # The weights the engine samples with (a learning run bumps it after each update); None: not tracked.
        self.policy_version: int | None = None
        self._ids = itertools.count()
        # Every finished length: what orders the next requests when the engine schedules by priority.
        self.predictor = LengthPredictor()
        self.tail_first = llm.llm_engine.vllm_config.scheduler_config.policy == "priority"

    def run(
        self,
        requests: Sequence[tuple[Problem, int, int]],
        sampling: dict[str, Any],
        extra_args: Callable[[Problem, int, int], Any] | None = None,
        between_steps: Callable[[int], None] | None = None,
    ) -> list[Finished]:
        """Runs (problem, epoch, sample) requests to completion; returns them in submission order.

        Args:
            sampling: SamplingParams fields (temperature, max_tokens, ...).
            extra_args: what each request carries in `SamplingParams.extra_args`; default: its problem id, epoch
                and sample (what DAS drafts by).
            between_steps: called with the step number after every engine step (history pushes, evictions).
        """
        from vllm import SamplingParams

        engine = self.llm.llm_engine
        pending: dict[str, _Pending] = {}
        order: list[str] = []
        self.predictor.max_tokens = sampling.get("max_tokens")
        priorities = (
            self.predictor.priorities([problem.problem_id for problem, _, _ in requests])
            if self.tail_first
            else [0] * len(requests)
        )
        if self.strategy == "das" and extra_args is None:
            # The budget counts requests still waiting for a slot as tail candidates: tell the proposer what
            # is coming before it comes (it then counts off each request that starts).
            submitted = Counter(problem.problem_id for problem, _, _ in requests)
            self.llm.collective_rpc("das_submitted", args=(dict(submitted), sampling.get("max_tokens")))
        for (problem, epoch, sample), priority in zip(requests, priorities, strict=True):
            request_id = f"{problem.problem_id}/{epoch}/{sample}/{next(self._ids)}"
            args = (
                extra_args(problem, epoch, sample)
                if extra_args
                else {"das_problem_id": problem.problem_id, "das_epoch": epoch, "das_sample": sample}
            )
            params = SamplingParams(**sampling, logprobs=0 if self.logprobs else None, extra_args=args)
            pending[request_id] = _Pending(problem, epoch, sample, time.perf_counter())
            engine.add_request(
                request_id, {"prompt_token_ids": list(problem.prompt_ids)}, params, priority=priority
            )
            order.append(request_id)
        done: dict[str, Finished] = {}
        step = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if not output.finished:
                    continue
                state = pending.pop(output.request_id)
                completion = output.outputs[0]
                record = TrajectoryRecord(
                    problem_id=state.problem.problem_id,
                    epoch=state.epoch,
                    sample=state.sample,
                    prompt_ids=list(state.problem.prompt_ids),
                    response_ids=[int(t) for t in completion.token_ids],
                    response_logprobs=sampled_logprobs(completion),
                    finish_reason=completion.finish_reason
                    if completion.finish_reason in ("stop", "length")
                    else None,
                    policy_version=self.policy_version,
                    started_at=state.started_at,
                    finished_at=time.time(),
                    worker=self.worker,
                )
                latency = time.perf_counter() - state.submitted
                done[output.request_id] = Finished(record, latency)
                self.predictor.observe(record.problem_id, len(record.response_ids))
                REQUEST_DURATION.observe(latency)
                if self.sink is not None:
                    self.sink(record)
            step += 1
            if between_steps is not None:
                between_steps(step)
        return [done[request_id] for request_id in order]

    def run_epoch(
        self, problems: Sequence[Problem], epoch: int, samples: int, sampling: dict[str, Any]
    ) -> tuple[EpochReport, list[Finished]]:
        """One epoch: every problem `samples` times, all submitted at once (one RL rollout batch).

        For `das`, the finished trajectories are pushed into the proposer's history at the end (idempotent with
        what the proposer already added itself), so the next epoch drafts from them.
        """
        if samples < 1:
            raise InvalidInput(f"samples must be >= 1, got {samples}")
        before = self.spec_counters()
        if self.strategy == "das":
            self.llm.collective_rpc("das_reset_stats")
        start = time.perf_counter()
        finished = self.run([(p, epoch, s) for p in problems for s in range(samples)], sampling)
        wall = time.perf_counter() - start
        EPOCH_MAKESPAN.set(wall)
        EPOCH.set(epoch)
        REQUEST_DURATION_MAX.set(max((f.latency_s for f in finished), default=0.0))
        after = self.spec_counters()
        proposer = None
        if self.strategy == "das":
            self.push_history([f.record for f in finished])
            proposer = self.llm.collective_rpc("das_stats")[0]
            proposer["step_costs"] = self.llm.collective_rpc("das_step_costs")[0]
            proposer["step_trace"] = self.llm.collective_rpc("das_step_trace")[0]
        return self.report(
            epoch, finished, wall, {k: after[k] - before[k] for k in after}, proposer
        ), finished

    def report(
        self,
        epoch: int,
        finished: Sequence[Finished],
        wall_s: float,
        spec: dict[str, int],
        proposer: dict[str, Any] | None = None,
    ) -> EpochReport:
        """The epoch's figures from its finished requests and the engine's spec-decode counter deltas."""
        output_tokens = sum(len(f.record.response_ids) for f in finished)
        accepted, drafted = spec["accepted_tokens"], spec["draft_tokens"]
        # Each request step commits its accepted draft tokens plus one: steps = tokens - accepted.
        request_steps = max(output_tokens - accepted, 1)
        latencies = np.array([f.latency_s for f in finished]) if finished else np.zeros(1)
        return EpochReport(
            epoch=epoch,
            strategy=self.strategy,
            requests=len(finished),
            wall_s=round(wall_s, 3),
            output_tokens=output_tokens,
            tokens_per_s=round(output_tokens / wall_s, 3) if wall_s > 0 else 0.0,
            draft_tokens=drafted,
            accepted_tokens=accepted,
            acceptance_rate=round(accepted / drafted, 4) if drafted else 0.0,
            mean_accepted_per_step=round(accepted / request_steps, 4),
            latency_p50_s=round(float(np.percentile(latencies, 50)), 3),
            latency_p99_s=round(float(np.percentile(latencies, 99)), 3),
            latency_max_s=round(float(latencies.max()), 3),
            proposer=proposer,
        )

    def spec_counters(self) -> dict[str, int]:
        """vLLM's spec-decode counters (drafts, draft tokens, accepted tokens) of this engine, summed over its
        data-parallel engines.

        Read from the engine's own Prometheus logger: each engine built in a process unregisters every `vllm:`
        metric before registering its own, so with several engines in one process (`das bench e2e`)
        `LLM.get_metrics()` reports only the newest one's. The registry is the fallback for a vLLM whose logger
        does not keep them where 0.32 does."""
        own = _own_spec_counters(self.llm)
        return own if own is not None else _registry_spec_counters(self.llm)

    def push_history(self, records: Iterable[TrajectoryRecord]) -> int:
        """Adds trajectories to the DAS proposer's history (embedded mode); returns how many were new.

        Raises:
            RuntimeError: the engine does not run the DAS proposer.
        """
        if self.strategy != "das":
            raise RuntimeError(f"strategy {self.strategy!r} has no history to push to")
        payload = [
            r.model_dump(include={"problem_id", "epoch", "sample", "prompt_ids", "response_ids"})
            for r in records
        ]
        return int(self.llm.collective_rpc("das_add_trajectories", args=(payload,))[0])

    def evict(self, problem_id: str, min_epoch: int) -> int:
        """Evicts a problem's history epochs below `min_epoch` in the proposer; returns how many left."""
        if self.strategy != "das":
            raise RuntimeError(f"strategy {self.strategy!r} has no history to evict from")
        return int(self.llm.collective_rpc("das_evict", args=(problem_id, min_epoch))[0])

    def proposer_stats(self) -> dict[str, Any]:
        """The DAS proposer's counters and budget state."""
        return self.llm.collective_rpc("das_stats")[0]


class EmbeddedReplica:
    """The one-machine history replica: an Indexer thread applying the embedded bus to a local HistoryStore.

    The DAS proposer in the engine process reads the same folder as a RocksDB secondary (`DAS_HISTORY_DIR`),
    so trajectories published by the rollout become draftable without a broker, and survive a restart.
    """

    def __init__(self, history_dir: Path) -> None:
        from history_store.durable.store import HistoryStore
        from pipeline.bus import embedded_bus
        from workers.replica.service import Indexer

        self.path = Path(history_dir)
        self.store = HistoryStore(self.path)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._indexer = Indexer(embedded_bus().subscribe(), self.store)
        self._thread = threading.Thread(target=self._run, name="das-embedded-indexer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._indexer.run(self._stop)
        except BaseException as exc:  # surfaced by close(): a dead indexer must not pass silently
            self._error = exc

    def close(self, timeout_s: float = 30.0) -> None:
        """Stops the indexer after it applied what was published, and closes the store.

        Raises:
            RuntimeError: the indexer thread failed (with its error as the cause).
        """
        from pipeline.bus import embedded_bus

        embedded_bus().flush(timeout_s)
        self._stop.set()
        self._thread.join(timeout_s)
        self.store.close()
        if self._error is not None:
            raise RuntimeError(f"embedded indexer for {self.path} failed: {self._error}") from self._error
