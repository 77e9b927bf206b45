"""`das bench proposer TRACE.jsonl`: the proposer's whole decode step outside vLLM, per request."""

from __future__ import annotations

import argparse
from typing import Any

from history_store.automaton.config import DEFAULT_ENGINE_K
from workers.cli.types import POSITIVE, add_json_flag, integer, print_result, size_list
from workers.errors import InvalidInput


def register(cli) -> None:
    parser = cli.command(
        "bench",
        "proposer",
        help="Time the proposer's whole decode step (commit, budget, draft, metrics) at batch 1, 64 and 256.",
        run=run,
    )
    parser.add_argument("trace", help="JSON Lines of trajectory records; the last epoch is decoded")
    add_json_flag(parser)
    parser.add_argument("--k", type=integer(1, 64), default=DEFAULT_ENGINE_K, help="num_speculative_tokens")
    parser.add_argument("--steps", type=POSITIVE, default=400, help="timed steps per batch size")
    parser.add_argument("--warmup", type=integer(0), default=50, help="untimed steps first")
    parser.add_argument(
        "--repeats", type=POSITIVE, default=3, help="runs per batch size; the least disturbed one is reported"
    )
    parser.add_argument(
        "--batches",
        type=size_list("batch sizes", "1,64,256"),
        default=(1, 64, 256),
        help="comma-separated batch sizes (1,64,256)",
    )
    parser.add_argument(
        "--against",
        metavar="REV",
        help="compare this checkout (uncommitted changes included) with git revision REV in interleaved runs "
        "of one repeat each (--repeats is not used)",
    )
    parser.add_argument(
        "--rounds", type=POSITIVE, default=5, help="with --against: runs of each side per batch size"
    )
    parser.add_argument(
        "--kernels-against",
        metavar="REV",
        help="compare this checkout's step kernels with git revision REV's in one process: two proposers "
        "decode the same workload stepping in turns, each steady step paired with its partner, drafts "
        "compared (--repeats is not used)",
    )


def run(args: argparse.Namespace) -> int:
    if args.against is not None and args.kernels_against is not None:
        raise InvalidInput("--against and --kernels-against are two ways to compare: pass one")
    if args.against is not None:
        return _run_against(args)
    if args.kernels_against is not None:
        return _run_kernels_against(args)
    from workers.bench import proposer

    result = proposer.run(
        args.trace, k=args.k, steps=args.steps, warmup=args.warmup, batches=args.batches, repeats=args.repeats
    )
    return print_result(args, result, _text, indent=2)


def _text(result: dict[str, Any]) -> str:
    rows = [" ".join(f"{key}={value}" for key, value in row.items()) for row in result["batches"]]
    return "\n".join([*rows, f"load average (1 min) before/after: {result['load_average_1m']}"])


def _run_against(args: argparse.Namespace) -> int:
    from workers.bench import proposer_ab

    result = proposer_ab.run(
        args.trace,
        args.against,
        rounds=args.rounds,
        k=args.k,
        steps=args.steps,
        warmup=args.warmup,
        batches=args.batches,
    )
    return print_result(args, result, lambda r: _against_text(r, args), indent=2)


def _against_text(result: dict[str, Any], args: argparse.Namespace) -> str:
    from workers.bench import proposer_ab

    lines = [
        f"this checkout against {args.against} ({result['against']['commit'][:12]}), {args.rounds} rounds:"
    ]
    for row in result["batches"]:
        for figure in proposer_ab.FIGURES:
            p = row[figure]
            lines.append(
                f"batch {row['batch']} {figure}: {p['this_checkout_median']} vs {p['against_median']} us, "
                f"ratio median {p['ratio_median']} (rounds {p['ratio_min']}-{p['ratio_max']}), "
                f"of the best rounds {p['ratio_of_best']}"
            )
    return "\n".join(lines)


def _run_kernels_against(args: argparse.Namespace) -> int:
    from workers.bench import proposer_kernels_ab

    result = proposer_kernels_ab.run(
        args.trace, args.kernels_against, k=args.k, steps=args.steps, warmup=args.warmup, batches=args.batches
    )
    return print_result(args, result, lambda r: _kernels_against_text(r, args), indent=2)


def _kernels_against_text(result: dict[str, Any], args: argparse.Namespace) -> str:
    commit = result["kernels_against"]["commit"][:12]
    lines = [f"this checkout's step kernels against {args.kernels_against} ({commit}), paired steady steps:"]
    for row in result["batches"]:
        lines.append(
            f"batch {row['batch']}: {row['this_checkout_median_us_per_request']} vs "
            f"{row['against_median_us_per_request']} us per request, ratio median {row['ratio_median']} "
            f"(quartiles {row['ratio_p25']}-{row['ratio_p75']}, {row['steady_steps_paired']} steps), "
            f"drafts {'identical' if row['drafts_identical'] else 'differ'}"
        )
    return "\n".join(lines)
