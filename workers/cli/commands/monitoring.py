"""`das monitoring vllm-targets`: keeps a Prometheus file_sd file listing the vLLM servers verl runs in Ray (and,
with --proposers, a second one listing the DAS proposers' own /metrics inside them, next to it).

Runs on a Ray node (docker-compose.yml: in the Ray head container, beside the trainer) and rewrites the file
every --interval seconds while the set of servers changes (start, restart, resume). `--once` writes it once.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

from workers.cli.types import SECONDS

PROPOSER_JOB = "das-proposer"
PROPOSER_FILE = "das-proposers.json"


def register(cli: Any) -> None:
    p = cli.command(
        "monitoring",
        "vllm-targets",
        help="Write the addresses of verl's vLLM servers in a Ray cluster as a Prometheus file_sd file.",
        run=run,
    )
    p.add_argument("--out", type=Path, required=True, help="file_sd JSON file Prometheus reads")
    p.add_argument("--ray-address", default="auto", help="Ray cluster to join (default: the local one)")
    p.add_argument("--job", default="vllm", help="Prometheus job label of the targets")
    p.add_argument("--interval", type=SECONDS, default=15.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="write the file once and exit")
    p.add_argument(
        "--proposers",
        metavar="DIR",
        help="node-local folder where DAS proposers note their /metrics address (DAS_PROPOSER_TARGETS): also "
        f"write their targets, job {PROPOSER_JOB}, to {PROPOSER_FILE} beside --out",
    )


def run(args: argparse.Namespace) -> int:
    import ray

    from workers.verl.vllm_targets import proposer_metric_addresses, vllm_server_addresses, write_file_sd

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    log = logging.getLogger("das.monitoring")
    ray.init(address=args.ray_address, log_to_driver=False, logging_level=logging.WARNING)
    written: list[str] | None = None
    proposers_written: list[str] | None = None
    while True:
        addresses = sorted(vllm_server_addresses())
        if addresses != written:
            write_file_sd(args.out, addresses, args.job)
            log.info("%d vLLM server(s) in %s: %s", len(addresses), args.out, ", ".join(addresses) or "none")
            written = addresses
        if args.proposers:
            proposers = sorted(proposer_metric_addresses(args.proposers))
            if proposers != proposers_written:
                out = args.out.with_name(PROPOSER_FILE)
                write_file_sd(out, proposers, PROPOSER_JOB)
                log.info("%d DAS proposer(s) in %s: %s", len(proposers), out, ", ".join(proposers) or "none")
                proposers_written = proposers
        if args.once:
            return 0
        time.sleep(args.interval)
