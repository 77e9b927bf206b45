"""`das traces import`: a user's own verl rollout dumps (`trainer.rollout_data_dir`) as a trace for the replay."""

from __future__ import annotations

import argparse
import os
from collections import Counter
from pathlib import Path

from pipeline.trace_files import check_writable, trace_line, trace_writer
from workers.cli.types import add_json_flag, add_trace_out_argument, print_result
from workers.errors import InvalidInput


def _import(args: argparse.Namespace) -> int:
    from workers.verl.dumps import import_dumps

    if not args.model.is_dir():
        raise InvalidInput(f"--model {args.model} is not a folder (the run's model or tokenizer folder)")
    check_writable(args.out)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    records = import_dumps(args.dir, tokenizer)
    with trace_writer(args.out) as handle:
        for record in records:
            handle.write(trace_line(record))
    epochs = Counter(r.epoch for r in records)
    summary = {
        "out": str(args.out),
        "records": len(records),
        "problems": len({r.problem_id for r in records}),
        "response_tokens": sum(len(r.response_ids) for r in records),
        "records_per_epoch": {str(e): epochs[e] for e in sorted(epochs)},
    }
    return print_result(
        args,
        summary,
        lambda s: (
            f"wrote {s['records']} trajectories of {s['problems']} problems ({s['response_tokens']} response "
            f"tokens) to {args.out}; next: das bench replay {args.out}"
        ),
    )


def register(cli) -> None:
    command = cli.command(
        "traces",
        "import",
        help="Turn verl's rollout dumps (the {step}.jsonl files trainer.rollout_data_dir holds) into a trace "
        "for das bench replay: problems by prompt, epochs counted per problem, text re-tokenized with the "
        "run's tokenizer.",
        run=_import,
    )
    command.add_argument("dir", type=Path, help="verl's trainer.rollout_data_dir")
    command.add_argument(
        "--model", type=Path, required=True, help="the run's model folder (its tokenizer re-encodes the text)"
    )
    add_trace_out_argument(command, "trace file to write (JSON Lines; gzip if .gz)")
    add_json_flag(command)
