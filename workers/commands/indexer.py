"""`das indexer run`: the node's history replica, consuming the Kafka bus into a RocksDB history store.

Runs until SIGTERM or SIGINT, then finishes the batch in hand and exits 0. A store write failure or a dead
letter Kafka does not acknowledge stops it with exit code 1 and a clear message; nothing past the last
durable batch is committed, so a restart resumes exactly there. Serves /metrics with --metrics-port.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from workers.cli_types import POSITIVE, SECONDS, add_metrics_arguments
from workers.commands.kafka import add_bus_arguments, kafka_client

DATA_ENV = "DAS_HISTORY_DIR"


def register(cli: Any) -> None:
    p = cli.command(
        "indexer", "run", help="Run the history replica: consume the bus into a history store.", run=run
    )
    add_bus_arguments(p)
    p.add_argument(
        "--data", default=os.environ.get(DATA_ENV), help=f"history store folder (default: ${DATA_ENV})"
    )
    p.add_argument("--topic", default="das.trajectories", help="trajectory topic")
    p.add_argument("--dlq-topic", default="das.trajectories.dlq", help="dead-letter topic")
    p.add_argument(
        "--replica",
        default=f"das-replica-{socket.gethostname()}",
        help="this replica's name: its Kafka consumer group (lag monitoring) and dead-letter origin header",
    )
    p.add_argument("--window-epochs", type=POSITIVE, default=None, help="epochs of history kept per problem")
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="write RocksDB checkpoints here at epoch boundaries and every --checkpoint-every seconds "
        "(same file system as --data: checkpoints are hard links)",
    )
    p.add_argument("--checkpoint-every", type=SECONDS, default=600.0, help="seconds between checkpoints")
    p.add_argument("--checkpoint-keep", type=POSITIVE, default=3, help="checkpoints kept")
    p.add_argument(
        "--max-record-tokens", type=POSITIVE, default=None, help="larger records are dead-lettered"
    )
    p.add_argument("--batch-records", type=POSITIVE, default=None, help="records applied per RocksDB write")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_metrics_arguments(p)


def run(args: argparse.Namespace) -> int:
    from history_store.checkpoints import Checkpointer
    from history_store.store import HistoryStore
    from monitoring.server import start_from_args
    from pipeline.consumer import KafkaTrajectorySource, ReplicaPublisher
    from workers.indexer import DEFAULT_BATCH_RECORDS, DEFAULT_MAX_RECORD_TOKENS, Indexer

    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # kafka-python narrates every connection at INFO and DEBUG; its warnings and errors still show.
    logging.getLogger("kafka").setLevel(logging.WARNING)
    if not args.data:
        raise ValueError(f"no store folder: pass --data or set {DATA_ENV}")
    if args.bus == "embedded":
        raise ValueError(
            "the embedded bus lives inside the rollout process; its indexer runs there "
            "(workers.indexer.Indexer over pipeline.bus.embedded_bus().subscribe()). Pass --bus kafka://..."
        )
    servers, settings = kafka_client(args)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = start_from_args(args)
    if server is not None:
        logging.getLogger("das.indexer").info(
            "metrics on http://%s:%d/metrics", args.metrics_host, server.server_port
        )
    with HistoryStore(args.data, window_epochs=args.window_epochs) as store:
        source = KafkaTrajectorySource(servers, topic=args.topic, group_id=args.replica, **settings)
        publisher = ReplicaPublisher(
            servers, replica=args.replica, dead_letter_topic=args.dlq_topic, **settings
        )
        checkpointer = (
            Checkpointer(store, args.checkpoint_dir, args.checkpoint_every, args.checkpoint_keep)
            if args.checkpoint_dir is not None
            else None
        )
        indexer = Indexer(
            source,
            store,
            publisher=publisher,
            max_record_tokens=args.max_record_tokens or DEFAULT_MAX_RECORD_TOKENS,
            batch_records=args.batch_records or DEFAULT_BATCH_RECORDS,
            checkpointer=checkpointer,
        )
        logging.getLogger("das.indexer").info(
            "replica %s: %s -> %s (window %d epochs)",
            args.replica,
            args.bus,
            args.data,
            store.window_epochs,
        )
        indexer.run(stop)
    return 0
