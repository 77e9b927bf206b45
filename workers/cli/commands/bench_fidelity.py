"""`das bench fidelity TRACE --report R.json`: the replay's figures against the engine's on the engine's own trace."""

from __future__ import annotations

import argparse
from typing import Any

from workers.cli.types import add_json_flag, number, print_result


def _text(result: dict[str, Any]) -> str:
    lines = []
    for row in result["per_epoch"]:
        engine, replayed = row["engine"], row["replay"]
        lines.append(
            f"epoch {row['epoch']}: accepted/step engine {engine['accepted_per_step']:.3f} replay "
            f"{replayed['accepted_per_step']:.3f}; acceptance engine {engine['acceptance']:.3f} replay "
            f"{replayed['acceptance']:.3f}"
        )
    diff = result["relative_difference"]
    lines.append(
        f"{result['strategy']}: relative difference accepted/step {diff['accepted_per_step']}, acceptance "
        f"{diff['acceptance']} (tolerance {result['tolerance']}): "
        + ("within" if result["within_tolerance"] else "OUTSIDE")
    )
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    from workers.bench.fidelity import compare, load_report

    return print_result(args, compare(args.trace, load_report(args.report), args.tolerance), _text)


def register(cli) -> None:
    parser = cli.command(
        "bench",
        "fidelity",
        help="Replay a trace the engine recorded (das traces generate --report) and compare accepted tokens per "
        "step and acceptance with the engine's.",
        run=_run,
    )
    parser.add_argument("trace", help="the recorded trace (JSON Lines, .gz allowed)")
    parser.add_argument(
        "--report", required=True, help="the engine report written by das traces generate --report"
    )
    parser.add_argument(
        "--tolerance", type=number(minimum=0), default=0.10, help="allowed relative difference"
    )
    add_json_flag(parser)
