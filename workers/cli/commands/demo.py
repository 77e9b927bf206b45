"""`das demo`: RL-style rollouts of built-in problems with each drafting strategy, history kept across runs, and
a projection of those rollouts under the replay's GPU cost models."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from workers.cli.types import NON_NEGATIVE, POSITIVE, UsageError, number


def _run(args: argparse.Namespace) -> int:
    from workers.demo.run import DemoConfig, run_demo

    try:
        config = DemoConfig(
            problems=args.problems,
            problems_file=Path(args.problems_file) if args.problems_file else None,
            epochs=args.epochs,
            samples=args.samples,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            strategies=tuple(s.strip() for s in args.strategies.split(",") if s.strip()),
            history_dir=Path(args.history_dir),
            report_dir=Path(args.report_dir),
            model_dir=Path(args.model_dir) if args.model_dir else None,
            check_problems=args.check_problems,
            check_tokens=args.check_tokens,
            seed=args.seed,
            progress=not args.no_progress,
            recorded_trace=None if args.no_recorded_trace else Path(args.recorded_trace),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc

    def metrics_server() -> str | None:
        from monitoring.server import start_from_args

        server = start_from_args(args)
        if server is None:
            return None
        return f"http://{args.metrics_host}:{server.server_port}/metrics"

    run_demo(config, metrics_server=metrics_server)  # a ModelError or StoreLockedError: cli.main prints it
    return 0


def register(cli: Any) -> argparse.ArgumentParser:
    from workers.cli.types import add_metrics_arguments
    from workers.demo.run import DEFAULT_HISTORY_DIR, DEFAULT_REPORT_DIR, DemoConfig

    defaults = DemoConfig()
    parser = cli.command(
        "demo",
        help="Rollouts of built-in math and code problems, epoch after epoch, with no drafting, n-gram and DAS; "
        "prints a table per epoch and strategy, then projections under GPU cost models (das bench replay) of "
        "the same rollouts and of a recorded multi-epoch trace, and writes a report folder (JSON, the "
        "rollouts, plots).",
        run=_run,
    )
    parser.add_argument(
        "--problems", type=POSITIVE, default=defaults.problems, help="how many problems to roll out"
    )
    parser.add_argument(
        "--problems-file",
        help="JSON Lines of {problem_id, prompt | prompt_ids} instead of the built-in problems",
    )
    parser.add_argument(
        "--epochs", type=POSITIVE, default=defaults.epochs, help="rollout epochs per strategy"
    )
    parser.add_argument(
        "--samples", type=POSITIVE, default=defaults.samples, help="samples per problem per epoch"
    )
    parser.add_argument(
        "--max-tokens", type=POSITIVE, default=defaults.max_tokens, help="response length cap"
    )
    parser.add_argument(
        "--temperature",
        type=number(0),
        default=defaults.temperature,
        help="sampling temperature (RL: 1.0; 0 is greedy, a best case for DAS: epochs repeat exactly)",
    )
    parser.add_argument(
        "--strategies", default=",".join(defaults.strategies), help="comma-separated: none, ngram, das"
    )
    parser.add_argument(
        "--history-dir",
        default=str(DEFAULT_HISTORY_DIR),
        help="RocksDB history store; kept across runs (a second run starts warm)",
    )
    parser.add_argument("--report-dir", default=str(DEFAULT_REPORT_DIR), help="where the report goes")
    parser.add_argument("--model-dir", help="prepared model folder (default: das model prepare's)")
    parser.add_argument(
        "--check-problems",
        type=NON_NEGATIVE,
        default=defaults.check_problems,
        help="problems in the greedy identical-output check (0: skip it)",
    )
    parser.add_argument(
        "--check-tokens",
        type=POSITIVE,
        default=defaults.check_tokens,
        help="greedy tokens per checked problem",
    )
    parser.add_argument("--seed", type=NON_NEGATIVE, default=defaults.seed, help="engine seed")
    parser.add_argument(
        "--recorded-trace",
        default=str(defaults.recorded_trace),
        help="the recorded multi-epoch trace the demo ends with, replayed unlimited and at 1/4 slots",
    )
    parser.add_argument(
        "--no-recorded-trace", action="store_true", help="end with this run's own projection only"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    # The demo shows its metrics by default: a free loopback port, printed at start.
    add_metrics_arguments(parser, default_port=0)
    return parser
