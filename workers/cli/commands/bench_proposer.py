"""`das bench proposer TRACE.jsonl`: the proposer's whole decode step outside vLLM, per request."""

from __future__ import annotations

import argparse
import json

from workers.cli.types import POSITIVE, integer


def register(cli) -> None:
    parser = cli.command(
        "bench",
        "proposer",
        help="Time the proposer's whole decode step (commit, budget, draft, metrics) at batch 1, 64 and 256.",
        run=run,
    )
    parser.add_argument("trace", help="JSON Lines of trajectory records; the last epoch is decoded")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--k", type=integer(1, 64), default=8, help="num_speculative_tokens")
    parser.add_argument("--steps", type=POSITIVE, default=400, help="timed steps per batch size")
    parser.add_argument("--warmup", type=integer(0), default=50, help="untimed steps first")
    parser.add_argument(
        "--repeats", type=POSITIVE, default=3, help="runs per batch size; the least disturbed one is reported"
    )
    parser.add_argument(
        "--batches", type=_batch_sizes, default=(1, 64, 256), help="comma-separated batch sizes (1,64,256)"
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


def _batch_sizes(raw: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in raw.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers like 1,64,256, got {raw!r}")
    return sizes


def run(args: argparse.Namespace) -> int:
    if args.against is not None and args.kernels_against is not None:
        raise ValueError("--against and --kernels-against are two ways to compare: pass one")
    if args.against is not None:
        return _run_against(args)
    if args.kernels_against is not None:
        return _run_kernels_against(args)
    from workers.bench import proposer

    result = proposer.run(
        args.trace, k=args.k, steps=args.steps, warmup=args.warmup, batches=args.batches, repeats=args.repeats
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for row in result["batches"]:
            print(" ".join(f"{key}={value}" for key, value in row.items()))
        print(f"load average (1 min) before/after: {result['load_average_1m']}")
    return 0


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
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"this checkout against {args.against} ({result['against']['commit'][:12]}), {args.rounds} rounds:")
    for row in result["batches"]:
        for figure in proposer_ab.FIGURES:
            p = row[figure]
            print(
                f"batch {row['batch']} {figure}: {p['this_checkout_median']} vs {p['against_median']} us, "
                f"ratio median {p['ratio_median']} (rounds {p['ratio_min']}-{p['ratio_max']}), "
                f"of the best rounds {p['ratio_of_best']}"
            )
    return 0


def _run_kernels_against(args: argparse.Namespace) -> int:
    from workers.bench import proposer_kernels_ab

    result = proposer_kernels_ab.run(
        args.trace, args.kernels_against, k=args.k, steps=args.steps, warmup=args.warmup, batches=args.batches
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    commit = result["kernels_against"]["commit"][:12]
    print(f"this checkout's step kernels against {args.kernels_against} ({commit}), paired steady steps:")
    for row in result["batches"]:
        print(
            f"batch {row['batch']}: {row['this_checkout_median_us_per_request']} vs "
            f"{row['against_median_us_per_request']} us per request, ratio median {row['ratio_median']} "
            f"(quartiles {row['ratio_p25']}-{row['ratio_p75']}, {row['steady_steps_paired']} steps), "
            f"drafts {'identical' if row['drafts_identical'] else 'differ'}"
        )
    return 0
