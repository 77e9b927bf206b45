"""`das bench e2e`: end-to-end tokens/s of none / ngram / das in a real vLLM engine (see workers/bench/e2e.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from workers.cli.types import NON_NEGATIVE, POSITIVE, add_json_flag, number


def _ints(raw: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in raw.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {raw!r}") from None
    if any(value < 0 for value in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {raw!r}")
    return values


def _bench(args: argparse.Namespace) -> int:
    from workers.bench.e2e import E2eConfig, run, table

    config = E2eConfig(
        strategies=tuple(args.strategies),
        batches=args.batches,
        repeats=args.repeats,
        seed=args.seed,
        history_epochs=args.history_epochs,
        samples=args.samples,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        k=args.k,
        max_model_len=args.max_model_len,
        budget=args.budget,
        model_dir=Path(args.model_dir) if args.model_dir else None,
    )
    summary = run(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(summary) if args.json else table(summary))
    return 0


def register(cli) -> None:
    from workers.bench.e2e import STRATEGIES, E2eConfig

    defaults = E2eConfig()
    parser = cli.command(
        "bench",
        "e2e",
        help="End-to-end tokens/s of none/ngram/das in vLLM (CPU, SmolLM2), sampled at temperature 1.0 as RL "
        "rollouts are, at several batch sizes and seeds.",
        run=_bench,
    )
    add_json_flag(parser)
    parser.add_argument(
        "--temperature",
        type=number(minimum=0),
        default=defaults.temperature,
        help="sampling temperature (0: greedy, the best case: epochs repeat exactly)",
    )
    parser.add_argument(
        "--batches",
        type=_ints,
        default=defaults.batches,
        help="comma-separated batch sizes (concurrent requests)",
    )
    parser.add_argument(
        "--repeats",
        type=POSITIVE,
        default=defaults.repeats,
        help="independent sampled replicates per strategy",
    )
    parser.add_argument("--seed", type=NON_NEGATIVE, default=defaults.seed, help="engine-wide sampling seed")
    parser.add_argument(
        "--history-epochs",
        type=NON_NEGATIVE,
        default=defaults.history_epochs,
        help="sampled epochs that build history before the measured one",
    )
    parser.add_argument(
        "--samples",
        type=POSITIVE,
        default=defaults.samples,
        help="samples per problem (siblings) at batch >= it",
    )
    parser.add_argument(
        "--max-tokens", type=POSITIVE, default=defaults.max_tokens, help="response length cap"
    )
    parser.add_argument(
        "--k", type=POSITIVE, default=defaults.k, help="num_speculative_tokens for ngram and das"
    )
    parser.add_argument("--max-model-len", type=POSITIVE, default=defaults.max_model_len)
    parser.add_argument(
        "--budget", default=defaults.budget, choices=["on", "off"], help="DAS length-aware budget"
    )
    parser.add_argument(
        "--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES, help="strategies to measure"
    )
    parser.add_argument("--model-dir", help="prepared model (default: das model prepare's folder)")
