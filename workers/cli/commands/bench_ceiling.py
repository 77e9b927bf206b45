"""`das bench ceiling TRACE --temperature T`: the budget's predictions against what only verification knows."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from workers.cli.types import POSITIVE, epoch_temperatures, number, temperature_schedule


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
    if args.json:
        print(json.dumps(result))
        return 0
    brier = result["brier"]
    print(
        f"{result['tokens']} verified draft tokens, acceptance {result['acceptance']}, mean target probability "
        f"{result['mean_target_probability']}\n"
        f"Brier: policy {brier['policy']}, recalibrated {brier['policy_recalibrated']}, with draft-time signals "
        f"{brier['with_draft_time_signals']}, target model's own probability {brier['target_probability']}"
    )
    return 0


def register(cli) -> None:
    parser = cli.command(
        "bench",
        "ceiling",
        help="Replay a trace with das and score the budget's acceptance predictions against the target model's "
        "own probabilities of the drafted tokens (what only verification knows).",
        run=_run,
    )
    parser.add_argument("trace", help="JSON Lines of trajectory records sampled by the prepared model")
    parser.add_argument("--temperature", type=number(0), default=1.0, help="the trace's sampling temperature")
    parser.add_argument(
        "--temperatures",
        type=temperature_schedule,
        help="one temperature per epoch of the trace, comma-separated; replaces --temperature",
    )
    parser.add_argument("--max-draft", type=POSITIVE, default=16, help="maximum draft tokens per step (K)")
    parser.add_argument(
        "--model-dir",
        type=Path,
        help="the checkpoint that sampled the trace (default: das model prepare's folder)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
