"""`das bench verifier`: time a decoder's verification forward and fit the replay's cost model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from workers.cli.types import NON_NEGATIVE, POSITIVE, add_json_flag, print_result, size_list


def _text(result: dict[str, Any], out: Path | None) -> str:
    c, fit = result["cost_model"], result["fit"]
    text = (
        f"{result['shape']} on {result['device_name']} ({result['dtype']}, context {result['context']}): "
        f"c_base {c['c_base'] * 1e3:.3f} ms, c_seq {c['c_seq'] * 1e3:.4f} ms, c_tok {c['c_tok'] * 1e3:.4f} ms "
        f"(R^2 {fit['r2']}, worst point {fit['max_relative_error']:.0%} off)"
    )
    if out is not None:
        text += f"\nwritten: {out} (das bench replay TRACE --cost-model {out} --cost-models default)"
    return text


def run(args: argparse.Namespace) -> int:
    from workers.bench import verifier

    result = verifier.measure(
        args.shape,
        args.batches,
        args.queries,
        args.context,
        args.repeats,
        args.device,
        args.dtype,
        args.seed,
    )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return print_result(args, result, lambda r: _text(r, args.out), indent=2)


def register(cli) -> None:
    from workers.bench.verifier import BATCHES, QUERIES, SHAPES

    parser = cli.command(
        "bench",
        "verifier",
        help="Time a decoder forward with random weights of a real shape at every batch size and query length "
        "and fit the replay's cost model (c_base, c_seq, c_tok).",
        run=run,
    )
    parser.add_argument(
        "--shape",
        default="qwen2.5-7b",
        help=f"a named shape ({', '.join(SHAPES)}) or the path of a transformers config.json",
    )
    parser.add_argument(
        "--batches",
        type=size_list("sizes", "1,2,4"),
        default=BATCHES,
        help="comma-separated batch sizes (running sequences)",
    )
    parser.add_argument(
        "--queries",
        type=size_list("sizes", "1,2,4"),
        default=QUERIES,
        help="comma-separated query tokens per sequence (1 + draft tokens)",
    )
    parser.add_argument("--context", type=POSITIVE, default=1024, help="KV cache tokens per sequence")
    parser.add_argument(
        "--repeats", type=POSITIVE, default=5, help="timed forwards per point (the fastest counts)"
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default=None,
        help="weights' dtype (default: bfloat16 on a GPU, float32 on the CPU)",
    )
    parser.add_argument("--seed", type=NON_NEGATIVE, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    add_json_flag(parser, "print the JSON")
