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
    parser.add_argument(
        "--remembered-probs",
        action="store_true",
        help="trees keep remembered sampling probabilities (DAS_REMEMBERED_PROBS=on), every response token one",
    )


def run(args: argparse.Namespace) -> int:
    from workers.bench import tree

    result = tree.run(seed=args.seed, remembered_probs=args.remembered_probs)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:48s} {value}")
    return 0
