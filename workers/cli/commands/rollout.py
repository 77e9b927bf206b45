"""`das rollout` (epochs through vLLM, trajectories to the bus) and `das traces generate` (the same, to JSON Lines)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from history_store.automaton.config import DEFAULT_ENGINE_K
from pipeline.trace_files import trace_line, trace_writer
from workers.cli.types import (
    NON_NEGATIVE,
    POSITIVE,
    UsageError,
    add_json_flag,
    add_model_dir_argument,
    add_temperature_arguments,
    integer,
    number,
    print_result,
)
from workers.errors import InvalidInput
from workers.rollout.worker import DTYPES, KV_CACHE_DTYPES, SCHEDULING_POLICIES


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--strategy", default="das", choices=["none", "ngram", "das"], help="drafting method")
    parser.add_argument("--epochs", type=POSITIVE, default=2, help="epochs over the problem set")
    parser.add_argument(
        "--first-epoch",
        type=NON_NEGATIVE,
        default=0,
        help="number of the first epoch (continue a run: its history epochs keep their numbers)",
    )
    parser.add_argument("--samples", type=POSITIVE, default=4, help="samples per problem per epoch (RL's n)")
    parser.add_argument("--problems", type=Path, help="JSON Lines of {problem_id, prompt | prompt_ids}")
    parser.add_argument(
        "--num-problems",
        type=POSITIVE,
        help="use the first N problems (default: all of --problems, or 4 built-in ones without it)",
    )
    add_temperature_arguments(
        parser,
        "sampling temperature (RL: 1.0)",
        "one temperature per epoch, comma-separated (e.g. 1.0,0.85,0.7,0.55: a policy that sharpens during RL)",
    )
    parser.add_argument("--seed", type=NON_NEGATIVE, default=0, help="engine-wide sampling seed")
    parser.add_argument("--max-tokens", type=POSITIVE, default=256, help="response length cap")
    parser.add_argument("--k", type=POSITIVE, default=DEFAULT_ENGINE_K, help="num_speculative_tokens")
    parser.add_argument(
        "--max-model-len", type=integer(16), default=2048, help="prompt plus response, in tokens"
    )
    add_model_dir_argument(
        parser,
        "any Hugging Face checkpoint folder: config.json, safetensors (one file or shards), tokenizer "
        "(default: das model prepare's folder)",
    )
    engine = parser.add_argument_group("engine (defaults: CPU exact and small, GPU vLLM's serving settings)")
    engine.add_argument(
        "--max-num-seqs", type=POSITIVE, default=None, help="engine batch size (default: CPU 16, GPU 256)"
    )
    engine.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="priority",
        help="vLLM admission: priority (problems the history separates longest first, the default) or fcfs "
        "(arrival order)",
    )
    engine.add_argument(
        "--dtype", choices=DTYPES, default=None, help="weights and compute (default: CPU float32, GPU auto)"
    )
    engine.add_argument(
        "--kv-cache-mib",
        type=POSITIVE,
        default=None,
        help="KV cache size (default: CPU 512, SmolLM2 float32 takes 45 KiB per token; GPU: sized by "
        "--gpu-memory-utilization)",
    )
    engine.add_argument(
        "--gpu-memory-utilization",
        type=number(above=0, maximum=1),
        default=0.9,
        help="GPU share for weights and KV cache",
    )
    engine.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    engine.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="no CUDA graphs (default: on for the CPU, off on a GPU)",
    )
    engine.add_argument("--tensor-parallel-size", type=POSITIVE, default=1)
    parser.add_argument(
        "--budget", default="on", choices=["on", "off"], help="DAS length-aware budget policy"
    )
    parser.add_argument(
        "--logprobs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="record each response token's sampling log probability (response_logprobs; vLLM logprobs=0)",
    )
    add_json_flag(parser, "print one JSON object instead of text lines")
    parser.add_argument(
        "--shard",
        type=shard,
        default=(0, 1),
        metavar="I/N",
        help="roll out only problems I, I+N, I+2N, ... of the set (0-based): workers sharing a bus take "
        "disjoint shards, so no two publish the same (problem, epoch, sample) key",
    )


def shard(raw: str) -> tuple[int, int]:
    """`I/N` as (index, count), with 0 <= I < N."""
    index, sep, count = raw.partition("/")
    if not sep or not index.isdigit() or not count.isdigit() or not 0 <= int(index) < int(count):
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N, got {raw!r}")
    return int(index), int(count)


def _check(args: argparse.Namespace) -> None:
    for name in ("epochs", "samples", "max_tokens", "k"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.temperature < 0 or args.first_epoch < 0:
        raise UsageError("--temperature and --first-epoch must be >= 0")
    if args.num_problems is not None and args.num_problems < 1:
        raise UsageError("--num-problems must be >= 1")
    # Before the engine is built: a missing file must not cost a model load (and a restart loop of them).
    if args.problems is not None and not args.problems.is_file():
        raise UsageError(f"--problems {args.problems}: no such file")
    if args.temperatures is not None and len(args.temperatures) != args.epochs:
        raise UsageError(f"--temperatures gives {len(args.temperatures)} values for {args.epochs} epochs")


def epoch_temperature(args: argparse.Namespace, index: int) -> float:
    """The sampling temperature of this run's `index`-th epoch: its entry of --temperatures, else --temperature."""
    return args.temperatures[index] if args.temperatures is not None else args.temperature


def _problems(args: argparse.Namespace) -> list[Any]:
    """This worker's problems (its --shard of the set), read before any engine is built: an incomplete model
    folder or a malformed --problems file fails in seconds rather than after the engine's start-up.

    Raises:
        ModelError: the model folder is incomplete.
        ValueError: the problems file is malformed, or the shard selects nothing.
    """
    from transformers import AutoTokenizer

    from workers.generator.model import require_model
    from workers.rollout.worker import builtin_problems, load_problems

    tokenizer = AutoTokenizer.from_pretrained(str(require_model(args.model_dir)))
    problems = (
        load_problems(args.problems, tokenizer)[: args.num_problems]
        if args.problems
        else builtin_problems(tokenizer, args.num_problems or 4)
    )
    index, count = args.shard
    problems = problems[index::count]
    if not problems:
        raise InvalidInput(f"--shard {index}/{count} selects no problem")
    return problems


def engine_options(args: argparse.Namespace) -> Any:
    """The engine the command's flags describe."""
    from workers.rollout.worker import EngineOptions

    return EngineOptions(
        strategy=args.strategy,
        model_dir=args.model_dir,
        num_speculative_tokens=args.k,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        seed=args.seed,
        dtype=args.dtype,
        kv_cache_bytes=args.kv_cache_mib * 2**20 if args.kv_cache_mib is not None else None,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        scheduling_policy=args.scheduling_policy,
    )


def _loop(
    args: argparse.Namespace,
    problems: list[Any],
    sink: Callable[[Any], None] | None,
    advance: Callable[[dict[str, int]], None] | None = None,
) -> list[dict[str, Any]]:
    """Builds the engine and runs the epochs; returns the per-epoch reports."""
    from workers.rollout.worker import build_engine, shutdown_engine

    options = engine_options(args)
    os.environ["DAS_BUDGET"] = args.budget
    llm = build_engine(options)
    try:
        return _epochs(args, llm, problems, sink, advance)
    finally:
        shutdown_engine(llm)


def _epochs(
    args: argparse.Namespace,
    llm: Any,
    problems: list[Any],
    sink: Callable[[Any], None] | None,
    advance: Callable[[dict[str, int]], None] | None = None,
) -> list[dict[str, Any]]:
    from workers.rollout.worker import RolloutWorker

    worker = RolloutWorker(llm, args.strategy, sink=sink, logprobs=args.logprobs)
    reports = []
    for nth in range(args.epochs):
        sampling = {"temperature": epoch_temperature(args, nth), "max_tokens": args.max_tokens}
        if advance is not None:  # the trainer's word that these problems are at this epoch (pipeline.epochs)
            advance({p.problem_id: args.first_epoch + nth for p in problems})
        report, _ = worker.run_epoch(problems, args.first_epoch + nth, args.samples, sampling)
        line = {**report.to_json(), "temperature": sampling["temperature"]}
        proposer = line.pop("proposer")
        if proposer is not None:
            line["proposer_errors"] = proposer["errors"]
            line["cost_model"] = proposer["policy"]["cost_model"]
            # The costs each step budgeted with, as the engine fitted them: `das bench fidelity` replays with them.
            line["step_costs"] = [list(step) for step in proposer["step_costs"]]
            # Each step's rows, held tokens and drafts: where a replay first parts from this engine.
            line["step_trace"] = [list(step) for step in proposer["step_trace"]]
        reports.append(line)
        if not args.json:
            print(
                f"epoch {report.epoch}: {line['requests']} requests, {line['wall_s']:.1f} s, {line['tokens_per_s']:.1f} tok/s, "
                f"acceptance {line['acceptance_rate']:.2f}, {line['mean_accepted_per_step']:.2f} accepted/step, "
                f"latency p50 {line['latency_p50_s']:.2f} s p99 {line['latency_p99_s']:.2f} s "
                f"max {line['latency_max_s']:.2f} s",
                flush=True,
            )
    return reports


def _rollout(args: argparse.Namespace) -> int:
    from monitoring.server import start_from_args
    from pipeline.bus import open_bus
    from pipeline.epochs import open_epoch_publisher
    from pipeline.topics import TRAJECTORY_TOPIC
    from workers.rollout.worker import EmbeddedReplica

    _check(args)
    problems = _problems(args)
    # The proposer's metrics come from vLLM's engine process: they reach this server when
    # PROMETHEUS_MULTIPROC_DIR is set before `das` starts (as docker-compose.yml does).
    server = start_from_args(args)
    if server is not None:
        print(f"metrics on http://{args.metrics_host}:{server.server_port}/metrics", file=sys.stderr)
    replica = None
    scratch = None
    if args.bus == "embedded":
        if args.history_dir is None:
            scratch = tempfile.TemporaryDirectory(prefix="das-history-")
            args.history_dir = Path(scratch.name) / "history"
        replica = EmbeddedReplica(args.history_dir)
    if args.history_dir is not None and args.strategy == "das":
        # The proposer runs in vLLM's engine process: it reads the replica folder as a RocksDB secondary.
        os.environ["DAS_HISTORY_DIR"] = str(Path(args.history_dir).resolve())
    bus = open_bus(args.bus)
    epochs = None
    try:
        epochs = open_epoch_publisher(args.bus, TRAJECTORY_TOPIC)
        reports = _loop(args, problems, bus.publish, None if epochs is None else epochs.advance)
        bus.flush()
    finally:
        bus.close()
        if epochs is not None:
            epochs.close()
        if replica is not None:
            replica.close()
        if scratch is not None:
            scratch.cleanup()
        if server is not None:
            server.shutdown()
    if args.json:
        print(json.dumps({"strategy": args.strategy, "bus": args.bus.split("://")[0], "epochs": reports}))
    return 0


def _engine_report(args: argparse.Namespace, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """What the engine measured per epoch, with the settings that produced it (what a replay must match)."""
    settings = {
        name: getattr(args, name)
        for name in (
            "k",
            "max_num_seqs",
            "max_tokens",
            "max_model_len",
            "budget",
            "seed",
            "samples",
            "logprobs",
            "scheduling_policy",
        )
    }
    settings["first_epoch"] = args.first_epoch
    settings["temperatures"] = [epoch_temperature(args, index) for index in range(args.epochs)]
    return {"strategy": args.strategy, "out": str(args.out), "settings": settings, "epochs": reports}


def _traces(args: argparse.Namespace) -> int:
    _check(args)
    problems = _problems(args)
    finished: list[Any] = []
    reports = _loop(args, problems, finished.append)
    # In the order the requests were submitted (each epoch, problem by problem, samples in order), not the order
    # they finished in: the order the engine admitted them, which a replay of the trace follows.
    rank = {p.problem_id: i for i, p in enumerate(problems)}
    with trace_writer(args.out) as handle:
        for record in sorted(finished, key=lambda r: (r.epoch, rank[r.problem_id], r.sample)):
            handle.write(trace_line(record))
    report = _engine_report(args, reports)
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return print_result(
        args, report, lambda _: f"wrote {sum(r['requests'] for r in reports)} trajectories to {args.out}"
    )


def register(cli) -> None:
    rollout = cli.command(
        "rollout",
        help="Run rollout epochs through vLLM (with the DAS proposer) and publish each trajectory to the bus.",
        run=_rollout,
    )
    _add_common(rollout)
    rollout.add_argument(
        "--bus", default="embedded", help="'embedded' (default) or kafka://host:port[,host:port]"
    )
    from workers.cli.types import add_metrics_arguments

    add_metrics_arguments(rollout)
    rollout.add_argument(
        "--history-dir",
        type=Path,
        help="history replica folder: embedded bus: written here by an in-process indexer (default: a temporary "
        "folder); Kafka: the node's replica (das indexer run) that the proposer reads",
    )
    traces = cli.command(
        "traces",
        "generate",
        help="Run rollout epochs through vLLM and write the trajectories as trace JSON Lines.",
        run=_traces,
    )
    _add_common(traces)
    traces.add_argument(
        "--out",
        type=Path,
        required=True,
        help="trace file to write (JSON Lines of TrajectoryRecord; gzip if .gz)",
    )
    traces.add_argument(
        "--report",
        type=Path,
        help="also write the engine's per-epoch figures (acceptance, accepted tokens per step) and settings here",
    )
