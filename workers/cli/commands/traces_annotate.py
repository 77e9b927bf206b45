"""`das traces annotate TRACE --temperature T -o OUT`: a copy of a trace with every response token's sampling
log probability (`response_logprobs`), from the model teacher-forced over it."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.trace_files import check_writable, open_trace, trace_writer
from workers.cli.types import (
    add_json_flag,
    add_model_dir_argument,
    add_temperature_arguments,
    add_trace_out_argument,
    epoch_temperatures,
    print_result,
)


def _shortest(values: np.ndarray) -> list[float]:
    """float32 values as the shortest decimals that read back to the same float32 (about half the digits of
    their float64 repr), so an annotated trace stays small and exact."""
    return [float(str(v)) for v in values.astype(np.float32)]


def annotate(
    trace: Path,
    out: Path,
    temperature: float,
    temperatures: tuple[float, ...] | None,
    model_dir: Path | None,
    bfloat16: bool = False,
) -> dict[str, Any]:
    """Writes `out`: `trace` line by line, each object with `response_logprobs` added (or replaced); every
    other field is kept as it was, including fields the record model does not know.

    Raises:
        ValueError: a malformed line, or temperatures that do not fit the trace's epochs.
    """
    from workers.bench.replay import load_traces
    from workers.generator.model import require_model
    from workers.generator.teacher_forcing import TeacherForcedModel

    check_writable(out)  # before the model pass (minutes), not after
    records = load_traces(trace)  # validates every line first: nothing is written from a malformed trace
    by_epoch = epoch_temperatures({r.epoch for r in records}, temperature, temperatures)
    started = time.perf_counter()
    logprobs = TeacherForcedModel(require_model(model_dir), bfloat16).sampled_logprobs(
        records, [by_epoch[r.epoch] for r in records]
    )
    seconds = time.perf_counter() - started
    with open_trace(trace) as source, trace_writer(out) as sink:
        lines = (line for line in source if line.strip())
        # load_traces read the same non-blank lines in the same order.
        for line, values in zip(lines, logprobs, strict=True):
            fields = json.loads(line)
            fields["response_logprobs"] = _shortest(values)
            sink.write(json.dumps(fields, separators=(",", ":"), ensure_ascii=False) + "\n")
    tokens = sum(len(r.response_ids) for r in records)
    return {
        "trace": str(trace),
        "out": str(out),
        "temperatures": {str(e): t for e, t in by_epoch.items()},
        "records": len(records),
        "response_tokens": tokens,
        "dtype": "bfloat16 autocast" if bfloat16 else "float32",
        "seconds": round(seconds, 1),
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
    }


def _text(report: dict[str, Any]) -> str:
    return (
        f"wrote {report['records']} records ({report['response_tokens']} response tokens) with their sampling "
        f"log probabilities to {report['out']} in {report['seconds']} s"
    )


def _run(args: argparse.Namespace) -> int:
    report = annotate(
        args.trace, args.out, args.temperature, args.temperatures, args.model_dir, args.dtype == "bfloat16"
    )
    return print_result(args, report, _text)


def register(cli) -> None:
    parser = cli.command(
        "traces",
        "annotate",
        help="Copy a trace with every response token's sampling log probability (response_logprobs), from the "
        "model that sampled it, teacher-forced.",
        run=_run,
    )
    parser.add_argument("trace", type=Path, help="JSON Lines of trajectory records (gzip if .gz)")
    add_trace_out_argument(parser, "annotated copy to write (gzip if .gz)")
    add_temperature_arguments(parser)
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="float32: the CPU engine's own values; bfloat16: autocast, about 2.5x faster with AMX, about 0.04 "
        "nats off per token",
    )
    add_model_dir_argument(parser)
    add_json_flag(parser)
