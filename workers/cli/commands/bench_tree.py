"""`das bench tree`: suffix tree insert and drafting speed, and memory per token."""

from __future__ import annotations

import argparse
import json

from workers.cli.types import NON_NEGATIVE, add_json_flag


def register(cli) -> None:
    parser = cli.command(
        "bench", "tree", help="Measure suffix tree insertion, batched drafting and memory.", run=run
    )
    add_json_flag(parser)
    parser.add_argument("--seed", type=NON_NEGATIVE, default=0)


def run(args: argparse.Namespace) -> int:
    from workers.bench import tree

    result = tree.run(seed=args.seed)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:48s} {value}")
    return 0
