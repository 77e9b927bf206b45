"""`das bench pipeline`: trajectories/s, MB/s and freshness from producers to a durable replica on real Kafka."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from workers.cli.commands.kafka import BUS_ENV
from workers.cli.types import POSITIVE, SECONDS, UsageError, add_json_flag

SINGLE_BROKER_ENV = "DAS_KAFKA_BOOTSTRAP"


def register(cli: Any) -> None:
    p = cli.command(
        "bench",
        "pipeline",
        help="Measure the Kafka pipeline on a real broker: throughput producer -> durable replica, p50/p99 "
        "freshness (publish to draftable), wire encoding against JSON.",
        run=run,
    )
    p.add_argument(
        "--bus",
        default=os.environ.get(BUS_ENV)
        or (f"kafka://{os.environ[SINGLE_BROKER_ENV]}" if os.environ.get(SINGLE_BROKER_ENV) else None),
        help=f"kafka://host:port of the broker (default: ${BUS_ENV}, else kafka://${SINGLE_BROKER_ENV})",
    )
    p.add_argument("--producers", type=POSITIVE, default=2, help="producer processes")
    p.add_argument("--records", type=POSITIVE, default=4000, help="trajectories in the throughput run")
    p.add_argument("--rate", type=SECONDS, default=200.0, help="trajectories/s in the freshness run")
    p.add_argument("--seconds", type=SECONDS, default=10.0, help="length of the freshness run")
    p.add_argument(
        "--response-tokens", type=POSITIVE, default=1000, help="median response length (log-normal)"
    )
    add_json_flag(p)


def run(args: argparse.Namespace) -> int:
    from pipeline.kafka_config import parse_bus_url
    from pipeline.synthetic import SyntheticShape
    from workers.bench import pipeline

    if not args.bus:
        raise UsageError(
            f"no broker: pass --bus kafka://host:port or set {BUS_ENV} or {SINGLE_BROKER_ENV} "
            "(bash scripts/kafka.sh up && source .kafka/env.sh starts a local one)"
        )
    if args.records < args.producers:
        raise UsageError(f"--records ({args.records}) must be at least --producers ({args.producers})")
    result = pipeline.run(
        parse_bus_url(args.bus)[0],
        producers=args.producers,
        records=args.records,
        freshness_rate=args.rate,
        freshness_seconds=args.seconds,
        shape=SyntheticShape(response_tokens_median=args.response_tokens),
    )
    if args.json:
        print(json.dumps(result))
    else:
        t, r, f = result["throughput"], result["rebuild"], result["freshness"]
        print(
            f"throughput: {t['trajectories_per_s']} trajectories/s, {t['mb_per_s']} MB/s ({t['records']} records)"
        )
        print(f"rebuild from the topic: {r['trajectories_per_s']} trajectories/s, {r['mb_per_s']} MB/s")
        print(f"freshness at {f['rate_per_s']}/s: p50 {f['p50_s']} s, p99 {f['p99_s']} s, max {f['max_s']} s")
        for e in result["encoding"]:
            print(
                f"encoding (vocab {e['vocab']}): {e['wire_bytes_per_token']} B/token, "
                f"{e['wire_decode_validate_us_per_record']} us/record; JSON {e['json_bytes_per_token']} B/token, "
                f"{e['json_decode_validate_us_per_record']} us/record"
            )
    return 0
