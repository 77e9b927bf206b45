"""`das bench ceiling TRACE --temperature T`: the budget's predictions against what only verification knows."""

from __future__ import annotations

import argparse
from typing import Any

from workers.cli.types import (
    POSITIVE,
    add_json_flag,
    add_model_dir_argument,
    add_temperature_arguments,
    epoch_temperatures,
    print_result,
)


def _text(result: dict[str, Any]) -> str:
    brier = result["brier"]
    return (
        f"{result['tokens']} verified draft tokens, acceptance {result['acceptance']}, mean target probability "
        f"{result['mean_target_probability']}\n"
        f"Brier: policy {brier['policy']}, recalibrated {brier['policy_recalibrated']}, with draft-time signals "
        f"{brier['with_draft_time_signals']}, target model's own probability {brier['target_probability']}"
    )


def _run(args: argparse.Namespace) -> int:
    from workers.bench.ceiling import ceiling
    from workers.bench.replay import load_traces
    from workers.generator.model import require_model

    records = load_traces(args.trace)
    temperatures = epoch_temperatures({r.epoch for r in records}, args.temperature, args.temperatures)
    result = {
        "trace": str(args.trace),
        "temperatures": {str(e): t for e, t in temperatures.items()},
        "k": args.max_draft,
        **ceiling(records, temperatures, require_model(args.model_dir), args.max_draft),
    }
    return print_result(args, result, _text)


def register(cli) -> None:
    parser = cli.command(
        "bench",
        "ceiling",
        help="Replay a trace with das and score the budget's acceptance predictions against the target model's "
        "own probabilities of the drafted tokens (what only verification knows).",
        run=_run,
    )
    parser.add_argument("trace", help="JSON Lines of trajectory records sampled by the prepared model")
    add_temperature_arguments(parser)
    parser.add_argument("--max-draft", type=POSITIVE, default=16, help="maximum draft tokens per step (K)")
    add_model_dir_argument(parser)
    add_json_flag(parser)
