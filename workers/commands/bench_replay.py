"""`das bench replay TRACES.jsonl`: replay recorded rollouts with each drafting strategy."""

from __future__ import annotations

import argparse
import sys

from workers.cli_types import NON_NEGATIVE, POSITIVE, number


def register(cli) -> None:
    parser = cli.command(
        "bench",
        "replay",
        help="Replay recorded rollouts token by token and compare drafting strategies.",
        run=run,
    )
    parser.add_argument(
        "traces",
        help="JSON Lines of trajectory records (problem_id, epoch, sample, prompt_ids, response_ids)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--strategies", default=None, help="comma-separated subset (default: all)")
    parser.add_argument(
        "--max-draft", type=NON_NEGATIVE, default=16, help="maximum draft tokens per step (K)"
    )
    parser.add_argument("--window", type=POSITIVE, default=3, help="epochs of history per problem (das)")
    parser.add_argument("--depth", type=POSITIVE, default=64, help="longest context suffix matched")
    parser.add_argument("--min-token-prob", type=number(0, 1), default=0.1)
    parser.add_argument("--max-spec-factor", type=number(0), default=1.0)
    parser.add_argument("--max-spec-offset", type=number(), default=0.0)
    parser.add_argument(
        "--escape", type=number(0), default=1.0, help="pseudo-count of unseen continuations (das)"
    )
    parser.add_argument("--c-base", type=number(0), default=8e-3, help="verifier step cost, seconds")
    parser.add_argument(
        "--c-seq", type=number(0), default=1e-4, help="verifier cost per active request, seconds"
    )
    parser.add_argument(
        "--c-tok", type=number(0), default=3.5e-5, help="verifier cost per verified token, seconds"
    )


def run(args: argparse.Namespace) -> int:
    from history_store.suffix_tree import DraftConfig
    from workers.bench import replay

    strategies = [s.strip() for s in (args.strategies or ",".join(replay.STRATEGIES)).split(",") if s.strip()]
    unknown = [s for s in strategies if s not in replay.STRATEGIES]
    if unknown:
        print(f"unknown strategies {unknown}; choose from {', '.join(replay.STRATEGIES)}", file=sys.stderr)
        return 2
    config = DraftConfig(
        max_depth=args.depth,
        max_spec_tokens=args.max_draft,
        max_spec_factor=args.max_spec_factor,
        max_spec_offset=args.max_spec_offset,
        min_token_prob=args.min_token_prob,
        escape=args.escape,
    )
    cost = replay.CostModel(args.c_base, args.c_seq, args.c_tok)
    try:
        result = replay.run(args.traces, strategies, config, args.window, cost)
    except (OSError, ValueError) as exc:
        print(f"das bench replay: {exc}", file=sys.stderr)
        return 2
    print(replay.dumps(result) if args.json else replay.main_table(result))
    return 0
