"""`das bench ingest`: the proposer's decode step while the node's replica ingests at fixed rates."""

from __future__ import annotations

import argparse
from typing import Any

from workers.cli.types import SECONDS, add_json_flag, integer, number, print_result, size_list


def register(cli) -> None:
    parser = cli.command(
        "bench",
        "ingest",
        help="Time the proposer's decode step (p50/p99/max, ingest work per step, draft freshness) while a real "
        "replica ingests synthetic trajectories at 0, 20k, 100k and 300k tokens/s, at batch 64 and 256.",
        run=run,
    )
    add_json_flag(parser)
    parser.add_argument(
        "--rates",
        type=_rates,
        default=(0, 20_000, 100_000, 300_000),
        help="comma-separated ingest rates in response tokens per second (0,20000,100000,300000)",
    )
    parser.add_argument(
        "--batches",
        type=size_list("batch sizes", "64,256"),
        default=(64, 256),
        help="comma-separated batch sizes (64,256)",
    )
    parser.add_argument("--seconds", type=SECONDS, default=30.0, help="seconds of ingest per rate (30)")
    parser.add_argument(
        "--interval-ms",
        type=number(minimum=0, maximum=1000),
        default=10.0,
        help="ms between steps, as a GPU step (10)",
    )
    parser.add_argument(
        "--preload-tokens",
        type=integer(0),
        default=6_000_000,
        help="response tokens in the store before the run (6000000: past the global tree's cap, three epochs)",
    )
    parser.add_argument(
        "--work-dir", help="folder for the stores (default: a temporary one, removed afterwards)"
    )


def _rates(raw: str) -> tuple[int, ...]:
    """Comma-separated ingest rates: whole numbers of tokens per second, 0 (no ingest) to 10 million."""
    try:
        rates = tuple(int(part) for part in raw.split(","))
    except ValueError:
        rates = ()
    if not rates or min(rates) < 0 or max(rates) > 10_000_000:
        raise argparse.ArgumentTypeError(
            f"rates must be whole tokens/s from 0 to 10000000 like 0,20000, got {raw!r}"
        )
    return rates


def run(args: argparse.Namespace) -> int:
    from workers.bench import ingest

    result = ingest.run(
        rates=args.rates,
        batches=args.batches,
        seconds=args.seconds,
        interval_ms=args.interval_ms,
        preload_tokens=args.preload_tokens,
        work_dir=args.work_dir,
    )
    return print_result(args, result, _text, indent=2)


def _text(result: dict[str, Any]) -> str:
    lines = []
    for r in result["runs"]:
        s, f = r["step_ms"], r["freshness_s"]
        lines.append(
            f"batch {r['batch']} at {r['rate_tokens_per_s']:>7.0f} tokens/s: step p50 {s['p50']} p99 {s['p99']} "
            f"max {s['max']} ms; most ingest in a step {r['max_ingest_ms_per_step']} ms; freshness p50 "
            f"{f['p50']} p99 {f['p99']} max {f['max']} s (load {r['load_average_1m']})"
        )
    return "\n".join(lines)
