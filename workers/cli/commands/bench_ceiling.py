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


def _remembered_text(result: dict[str, Any]) -> str:
    section = result["remembered"]
    return (
        f"{section['tokens']} verified draft tokens, acceptance {section['acceptance']}; "
        f"{section['share']:.0%} with a remembered probability (Brier {section['brier_remembered']}, the "
        f"budget's {section['brier_policy_where_known']} on them)\n"
        f"budget's Brier {section['brier_policy']} with them, {section['brier_policy_without']} without; "
        f"makespan {section['makespan_s']['with']} s with, {section['makespan_s']['without']} s without"
    )


def _run(args: argparse.Namespace) -> int:
    from workers.bench.ceiling import ceiling, remembered_only
    from workers.bench.replay import load_traces
    from workers.generator.model import require_model

    records = load_traces(args.trace)
    if args.remembered_only:
        result = {"trace": str(args.trace), "k": args.max_draft, **remembered_only(records, args.max_draft)}
        return print_result(args, result, _remembered_text)
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
    parser.add_argument(
        "--remembered-only",
        action="store_true",
        help="only the replay's side for an annotated trace (no model, no temperatures): the remembered "
        "probabilities against the outcomes, and the budget with and without them",
    )
    add_model_dir_argument(parser)
    add_json_flag(parser)
