"""`das indexer run`: the node's history replica, consuming the Kafka bus into a RocksDB history store.

Runs until SIGTERM or SIGINT, then finishes the batch in hand and exits 0. A store write failure stops it with
exit code 1 and a clear message; nothing past the last durable batch is committed, so a restart resumes exactly
there. A damaged store (found at start, or by the background verification every --verify-every seconds) is
rebuilt from the topic while the replica keeps the folder locked. A broker outage, at start or later, is waited out
(`das_consumer_up` 0 meanwhile). Serves /metrics with --metrics-port.
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

from workers.cli.commands.kafka import add_bus_arguments, kafka_client
from workers.cli.types import NON_NEGATIVE, POSITIVE, SECONDS, add_metrics_arguments, integer
from workers.errors import InvalidInput

DATA_ENV = "DAS_HISTORY_DIR"


def register(cli: Any) -> None:
    from pipeline.wire import (
        DEFAULT_CONFIRM_SAMPLES,
        DEFAULT_MAX_EPOCH,
        DEFAULT_MAX_RECORD_TOKENS,
        DEFAULT_MAX_SAMPLE,
    )

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
        "--max-record-tokens",
        type=POSITIVE,
        default=DEFAULT_MAX_RECORD_TOKENS,
        help=f"larger records are dead-lettered (default {DEFAULT_MAX_RECORD_TOKENS})",
    )
    p.add_argument(
        "--batch-records",
        type=POSITIVE,
        default=None,
        help="records applied per RocksDB write (default: workers.replica.service.DEFAULT_BATCH_RECORDS, 500)",
    )
    p.add_argument(
        "--epochs",
        choices=["auto", "control", "samples"],
        default="auto",
        help="what moves a problem's history window: epoch advances from the trainer on the control topic "
        "<topic>.epochs (control), or enough distinct samples of a newer epoch (samples); auto: control when that "
        "topic exists. No single record ever evicts history",
    )
    p.add_argument(
        "--confirm-samples",
        type=integer(2, 1 << 20),
        default=DEFAULT_CONFIRM_SAMPLES,
        help="--epochs samples: distinct samples of a newer epoch that move its problem's window there "
        f"(default {DEFAULT_CONFIRM_SAMPLES}; at most the samples per problem and epoch, RL's n)",
    )
    p.add_argument(
        "--max-sample",
        type=NON_NEGATIVE,
        default=DEFAULT_MAX_SAMPLE,
        help=f"records with a larger sample id are dead-lettered (default {DEFAULT_MAX_SAMPLE})",
    )
    p.add_argument(
        "--max-epoch",
        type=NON_NEGATIVE,
        default=DEFAULT_MAX_EPOCH,
        help="records (and epoch advances) with a larger epoch are dead-lettered instead of held back until the "
        f"trainer gets there (default {DEFAULT_MAX_EPOCH})",
    )
    p.add_argument(
        "--verify-every",
        type=SECONDS,
        default=3600.0,
        help="seconds between background verifications of every file and checksum of the store (damage found "
        "takes the rebuild path, as at start; default 3600)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_metrics_arguments(p)


def _one_line_for_kafka_client_errors(record: logging.LogRecord) -> bool:
    if record.name.startswith("kafka.") and record.exc_info:
        record.exc_info, record.exc_text = None, None
    return True


def run(args: argparse.Namespace) -> int:
    from history_store.durable.store import FolderLock, finish_swap
    from history_store.errors import StoreCorruptionError
    from monitoring.server import start_from_args
    from pipeline.consumer import KafkaTrajectorySource, ReplicaPublisher
    from workers.replica.service import DEFAULT_BATCH_RECORDS, RecordLimits, rebuild_store

    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # kafka-python narrates every connection at INFO and DEBUG; its warnings and errors still show, as one line
    # each: during an outage it logs every reset socket with a traceback, which the replica waits out anyway.
    logging.getLogger("kafka").setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_one_line_for_kafka_client_errors)
    if not args.data:
        raise InvalidInput(f"no store folder: pass --data or set {DATA_ENV}")
    if args.bus == "embedded":
        raise InvalidInput(
            "the embedded bus lives inside the rollout process; its indexer runs there "
            "(workers.replica.service.Indexer over pipeline.bus.embedded_bus().subscribe()). Pass --bus kafka://..."
        )
    servers, settings = kafka_client(args)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = start_from_args(args)
    log = logging.getLogger("das.indexer")
    if server is not None:
        log.info("metrics on http://%s:%d/metrics", args.metrics_host, server.server_port)

    def connect() -> tuple[KafkaTrajectorySource, ReplicaPublisher]:
        return (
            KafkaTrajectorySource(
                servers,
                topic=args.topic,
                group_id=args.replica,
                epochs={"auto": None, "control": True, "samples": False}[args.epochs],
                **settings,
            ),
            ReplicaPublisher(servers, replica=args.replica, dead_letter_topic=args.dlq_topic, **settings),
        )

    limits = {
        "limits": RecordLimits(
            max_record_tokens=args.max_record_tokens,
            batch_records=args.batch_records or DEFAULT_BATCH_RECORDS,
            max_sample=args.max_sample,
            max_epoch=args.max_epoch,
        ),
        "epochs": args.epochs,
        "confirm_samples": args.confirm_samples,
    }
    # The folder's lock is taken once and held until exit, through every rebuild and swap: no second replica
    # gets in while this one repairs the store.
    lock = FolderLock(Path(args.data))
    try:
        finish_swap(Path(args.data))  # a crash in the middle of swapping in a rebuilt store: finish it first
        while not stop.is_set():
            try:
                replicate(args, lock, connect, limits, stop)
                return 0
            except StoreCorruptionError as exc:
                # Kafka is the source of truth and the topic is compacted: replaying it rebuilds the store.
                log.error("%s; rebuilding it from topic %s into a fresh folder", exc, args.topic)
            rebuilt = rebuild_store(Path(args.data), lock, args.window_epochs, connect, stop, **limits)
            if rebuilt is None:
                return 0  # stopped while rebuilding; the damaged store stays and is rebuilt at the next start
            lock = rebuilt
        return 0
    finally:
        lock.release()


def replicate(
    args: argparse.Namespace, lock: Any, connect: Any, limits: dict[str, Any], stop: threading.Event
) -> None:
    """Opens the store under the caller's folder `lock` and verifies it, then replicates into it until `stop`.
    Raises StoreCorruptionError when the store is found damaged (at start or later), with the store closed."""
    from history_store.durable.checkpoints import Checkpointer
    from history_store.durable.store import HistoryStore
    from history_store.errors import StoreCorruptionError
    from workers.replica.service import Indexer, StoreVerifier, connect_waiting

    log = logging.getLogger("das.indexer")
    with HistoryStore(args.data, window_epochs=args.window_epochs, lock=lock) as store:
        verifier = StoreVerifier(store.path, args.verify_every)
        report = verifier.check()  # every file and checksum at start: damage is found here, not mid-draft
        if report is not None and not report.ok:
            raise StoreCorruptionError(
                f"history store {args.data} is damaged: files {', '.join(report.files) or 'none named'}, "
                f"{len(report.unreadable_records)} unreadable and {len(report.corrupt_records)} corrupt records"
            )
        clients = connect_waiting(connect, stop)
        if clients is None:
            return  # stopped while waiting for the brokers
        source, publisher = clients
        checkpointer = (
            Checkpointer(store, args.checkpoint_dir, args.checkpoint_every, args.checkpoint_keep)
            if args.checkpoint_dir is not None
            else None
        )
        indexer = Indexer(source, store, publisher=publisher, checkpointer=checkpointer, **limits)
        log.info(
            "replica %s: %s -> %s (window %d epochs)", args.replica, args.bus, args.data, store.window_epochs
        )
        verifier.start()
        try:
            indexer.run(stop, verifier=verifier)
        finally:
            verifier.close()
