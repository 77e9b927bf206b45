"""`das traces learn`: traces from a policy that learns between epochs (a small GRPO loop on the CPU)."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from pipeline.trace_files import check_writable, trace_line, trace_writer
from workers.cli.commands.rollout import _problems, shard
from workers.cli.types import (
    NON_NEGATIVE,
    POSITIVE,
    UsageError,
    add_json_flag,
    add_model_dir_argument,
    integer,
    number,
    print_result,
)


def policy_report_path(out: Path) -> Path:
    """Where the per-epoch policy figures go: beside the trace, `<name>.policy.json`."""
    stem = out.name.removesuffix(".gz").removesuffix(".jsonl")
    return out.with_name(f"{stem}.policy.json")


def _settings(args: argparse.Namespace) -> Any:
    from workers.rollout.learn import LearnSettings

    return LearnSettings(
        reward=args.reward,
        epochs=args.epochs,
        samples=args.samples,
        max_tokens=args.max_tokens,
        overlong_buffer=args.overlong_buffer if args.overlong_buffer is not None else args.max_tokens // 2,
        lr=args.lr,
        train_layers=args.train_layers,
        micro_batch=args.micro_batch,
    )


def _learn(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from workers.generator.model import require_model
    from workers.rollout.learn import Learner, learn
    from workers.rollout.worker import EngineOptions, build_engine, shutdown_engine

    try:
        settings = _settings(args)
    except ValueError as exc:  # the settings' own checks, on what the flags combine to
        raise UsageError(str(exc)) from None
    if args.problems is not None and not args.problems.is_file():
        raise UsageError(f"--problems {args.problems}: no such file")
    problems = _problems(args)
    model_dir = require_model(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    learner = Learner(model_dir, settings.train_layers, settings.lr, settings.micro_batch)
    options = EngineOptions(
        strategy="none",
        model_dir=model_dir,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        seed=args.seed,
        # The trainer's dtype: the engine must sample from exactly the weights that are trained.
        dtype="float32",
        kv_cache_bytes=args.kv_cache_mib * 2**20 if args.kv_cache_mib is not None else None,
    )
    report_path = policy_report_path(args.out)
    header = {
        "out": str(args.out),
        "model_dir": str(model_dir),
        "problems": [p.problem_id for p in problems],
        "seed": args.seed,
        "settings": {**vars(settings), "temperature": 1.0},
    }
    epochs: list[dict[str, Any]] = []

    def on_epoch(line: dict[str, Any]) -> None:
        epochs.append(line)
        # Rewritten after every epoch: a run stopped midway still leaves the figures of what it finished.
        report_path.write_text(json.dumps({**header, "epochs": epochs}, indent=1) + "\n", encoding="utf-8")
        if not args.json:
            print(json.dumps(line), flush=True)

    check_writable(args.out)  # before the engine starts, not after the epochs
    scratch = tempfile.TemporaryDirectory(prefix="das-learn-") if args.work_dir is None else None
    work_dir = Path(scratch.name) if scratch is not None else args.work_dir
    work_dir.mkdir(parents=True, exist_ok=True)
    llm = build_engine(options)
    try:
        with trace_writer(args.out) as handle:
            learn(
                llm,
                problems,
                settings,
                learner,
                tokenizer,
                work_dir,
                lambda record: handle.write(trace_line(record)),
                on_epoch,
            )
    finally:
        shutdown_engine(llm)
        if scratch is not None:
            scratch.cleanup()
    return print_result(
        args,
        {**header, "report": str(report_path), "epochs": epochs},
        lambda r: (
            f"wrote {sum(e['responses'] for e in epochs)} trajectories to {args.out}, figures to {report_path}"
        ),
    )


def register(cli) -> None:
    learn = cli.command(
        "traces",
        "learn",
        help="Run a small RL loop (GRPO on the CPU) and write its rollouts as a trace: each epoch samples G "
        "responses per problem at T=1.0, scores them, updates the model and samples the next epoch from it.",
        run=_learn,
    )
    learn.add_argument(
        "--reward",
        required=True,
        choices=["overlong", "format"],
        help=(
            "overlong: DAPO's soft length penalty (moves the length distribution); format: 1 for answers laid out "
            "as numbered steps"
        ),
    )
    learn.add_argument("--out", type=Path, required=True, help="trace file (JSON Lines; gzip if .gz)")
    learn.add_argument("--epochs", type=POSITIVE, default=5, help="epochs (one update between each two)")
    learn.add_argument("--samples", type=POSITIVE, default=8, help="G: samples per problem per epoch")
    learn.add_argument("--problems", type=Path, help="JSON Lines of {problem_id, prompt | prompt_ids}")
    learn.add_argument("--num-problems", type=POSITIVE, help="use the first N problems")
    learn.add_argument("--shard", type=shard, default=(0, 1), metavar="I/N", help="problems I, I+N, ... only")
    learn.add_argument("--max-tokens", type=POSITIVE, default=256, help="response length cap")
    learn.add_argument(
        "--overlong-buffer",
        type=POSITIVE,
        help="overlong reward: the penalty rises from 0 at max-tokens minus this to -1 at the cap (default: "
        "half of --max-tokens)",
    )
    learn.add_argument(
        "--lr",
        type=number(above=0),
        default=3e-4,
        help="AdamW learning rate (one step per epoch; 3e-4 moves the top layers by about 0.1%% and the policy by about 0.01 nats of KL per token)",
    )
    learn.add_argument(
        "--train-layers",
        type=POSITIVE,
        default=4,
        help="decoder layers trained, from the top (the rest, embeddings and head stay frozen: CPU time)",
    )
    learn.add_argument("--micro-batch", type=POSITIVE, default=4, help="responses per forward in the update")
    learn.add_argument("--seed", type=NON_NEGATIVE, default=0, help="engine-wide sampling seed")
    learn.add_argument(
        "--max-num-seqs", type=POSITIVE, default=None, help="engine batch size (CPU default 16)"
    )
    learn.add_argument(
        "--max-model-len", type=integer(16), default=2048, help="prompt plus response, in tokens"
    )
    learn.add_argument("--kv-cache-mib", type=POSITIVE, default=None, help="KV cache size (CPU default 512)")
    add_model_dir_argument(learn, "checkpoint folder (default: das model prepare's)")
    learn.add_argument(
        "--work-dir",
        type=Path,
        help="folder for the updated weights (policy/, safetensors; kept); default: a temporary folder",
    )
    add_json_flag(learn, "print one JSON object at the end")
