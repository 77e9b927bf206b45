"""`das bench store`: history store ingest, disk footprint, checkpoint and restore figures."""

from __future__ import annotations

import argparse
import json
from typing import Any

from workers.cli.types import NON_NEGATIVE, add_json_flag, integer


def register(cli: Any) -> None:
    parser = cli.command(
        "bench",
        "store",
        help="Measure history store ingest rate, bytes per token, checkpoint and restore.",
        run=run,
    )
    add_json_flag(parser)
    parser.add_argument("--seed", type=NON_NEGATIVE, default=0)
    parser.add_argument(
        "--tokens-per-size",
        type=integer(16_000),
        default=4_000_000,
        help="response tokens ingested per record size",
    )
    parser.add_argument(
        "--startup-tokens",
        type=integer(64_000),
        default=1_000_000,
        help="response tokens in the store whose start-up is timed",
    )


def run(args: argparse.Namespace) -> int:
    from workers.bench import store

    result = store.run(
        seed=args.seed, tokens_per_size=args.tokens_per_size, startup_tokens=args.startup_tokens
    )
    if args.json:
        print(json.dumps(result))
    else:
        for row in result["ingest"]:
            print(
                f"ingest {row['tokens_per_record']:>6} tokens/record: {row['trajectories_per_s']:>8} traj/s "
                f"{row['mb_per_s']:>6} MB/s"
            )
        for section in ("disk", "checkpoint", "startup", "secondary"):
            for key, value in result[section].items():
                print(f"{section}.{key}: {value}")
    return 0
