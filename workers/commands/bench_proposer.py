"""`das bench proposer TRACE.jsonl`: the proposer's whole decode step outside vLLM, per request."""

from __future__ import annotations

import argparse
import json

from workers.cli_types import POSITIVE, integer


def register(cli) -> None:
    parser = cli.command(
        "bench",
        "proposer",
        help="Time the proposer's whole decode step (commit, budget, draft, metrics) at batch 1, 64 and 256.",
        run=run,
    )
    parser.add_argument("trace", help="JSON Lines of trajectory records; the last epoch is decoded")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--k", type=integer(1, 64), default=8, help="num_speculative_tokens")
    parser.add_argument("--steps", type=POSITIVE, default=400, help="timed steps per batch size")
    parser.add_argument("--warmup", type=integer(0), default=50, help="untimed steps first")
    parser.add_argument(
        "--repeats", type=POSITIVE, default=3, help="runs per batch size; the least disturbed one is reported"
    )
    parser.add_argument(
        "--batches", type=_batch_sizes, default=(1, 64, 256), help="comma-separated batch sizes (1,64,256)"
    )


def _batch_sizes(raw: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in raw.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers like 1,64,256, got {raw!r}")
    return sizes


def run(args: argparse.Namespace) -> int:
    from workers.bench import proposer

    result = proposer.run(
        args.trace, k=args.k, steps=args.steps, warmup=args.warmup, batches=args.batches, repeats=args.repeats
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for row in result["batches"]:
            print(" ".join(f"{key}={value}" for key, value in row.items()))
        print(f"load average (1 min) before/after: {result['load_average_1m']}")
    return 0
