"""`das kafka init|load|dlq`: create the bus topics (idempotent), publish synthetic load, read dead letters.

The bus URL comes from `--bus kafka://host:port[,host:port][?key=value&...]` or the environment variable DAS_BUS.
TLS and SASL come from URL parameters, DAS_KAFKA_* variables (`pipeline.kafka_config`) or
`--kafka-setting key=value` (kafka-python names, e.g. `security_protocol=SASL_SSL`, `ssl_cafile=/etc/ca.pem`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from typing import Any

from pipeline.schemas import MAX_EPOCH
from workers.cli.types import NON_NEGATIVE, POSITIVE, RATE, SECONDS, TIMEOUT, add_json_flag, integer
from workers.errors import InvalidInput

BUS_ENV = "DAS_BUS"
# Kafka's own ceiling on a topic's partitions is far lower in practice; this one keeps the request's 32-bit field
# (and the brokers) from ever seeing a number they cannot hold.
MAX_PARTITIONS = 100_000
# A one-shot command (init, dlq, load) has a person waiting: brokers that answer at all answer within seconds,
# so it gives up on bootstrapping after this instead of kafka-python's 30 s (bootstrap_timeout_ms overrides it).
ONE_SHOT_BOOTSTRAP_MS = 5000


def add_bus_arguments(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """Adds `--bus` (default: $DAS_BUS, else `default`) and repeatable `--kafka-setting key=value`."""
    parser.add_argument(
        "--bus",
        default=os.environ.get(BUS_ENV, default),
        help=f"bus URL: kafka://host:port[,host:port]{' or embedded' if default == 'embedded' else ''} "
        f"(default: ${BUS_ENV}{f', else {default}' if default else ''})",
    )
    parser.add_argument(
        "--kafka-setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="kafka-python client setting passed through (TLS/SASL), repeatable",
    )


def principal(raw: str) -> str:
    """A Kafka principal, `User:NAME` (argparse type)."""
    kind, sep, name = raw.partition(":")
    if not sep or kind != "User" or not name or any(c in name for c in ",;= \t"):
        raise argparse.ArgumentTypeError(f"expected a principal like User:das, got {raw!r}")
    return raw


def kafka_settings(pairs: list[str]) -> dict[str, object]:
    """`key=value` strings as client settings; integers and true/false become numbers and booleans.

    Raises ValueError on an entry without '='.
    """
    settings: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise InvalidInput(f"--kafka-setting takes key=value, got {pair!r}")
        value: object = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        elif raw.lstrip("-").isdigit():
            value = int(raw)
        settings[key.strip()] = value
    return settings


def kafka_client(args: argparse.Namespace, one_shot: bool = False) -> tuple[list[str], dict[str, object]]:
    """Broker addresses and client settings from `--bus` (URL parameters) and `--kafka-setting` (stronger),
    checked here, before any client is made. `one_shot` commands give up bootstrapping after
    ONE_SHOT_BOOTSTRAP_MS unless a setting says otherwise.

    Raises ValueError if the bus is missing or not a kafka:// URL, or a setting is malformed.
    """
    from pipeline.kafka_config import client_settings, parse_bus_url

    if not args.bus:
        raise InvalidInput(f"no bus given: pass --bus kafka://host:port or set {BUS_ENV}")
    servers, settings = parse_bus_url(args.bus)
    settings = {**settings, **kafka_settings(args.kafka_setting)}
    if one_shot:
        settings.setdefault("bootstrap_timeout_ms", ONE_SHOT_BOOTSTRAP_MS)
    client_settings(settings)
    return servers, settings


def register(cli: Any) -> None:
    p = cli.command(
        "kafka",
        "init",
        help="Create the trajectory and dead-letter topics (idempotent): compaction, sizes, and RF 3 with "
        "min.insync.replicas 2 on three or more brokers.",
        run=init,
    )
    add_bus_arguments(p)
    p.add_argument("--topic", default="das.trajectories", help="trajectory topic")
    p.add_argument("--dlq-topic", default="das.trajectories.dlq", help="dead-letter topic")
    p.add_argument(
        "--partitions",
        type=integer(1, MAX_PARTITIONS),
        default=6,
        help=f"partitions of the topics (default 6, at most {MAX_PARTITIONS})",
    )
    p.add_argument(
        "--no-epochs-topic",
        action="store_true",
        help="do not create the control topic <topic>.epochs of epoch advances (replicas then move each "
        "problem's window by samples: das indexer run --epochs samples)",
    )
    for role, what in (
        ("rollout", "Write on the trajectory topic (agent loops, das rollout)"),
        ("trainer", "Write on the control topic (epoch advances: verl's DAS manager, das rollout)"),
        (
            "replica",
            "Read on every topic, Write on the dead-letter and trajectory topics, Read on the replica groups",
        ),
    ):
        p.add_argument(
            f"--{role}-principal",
            metavar="User:NAME",
            type=principal,
            help=f"grant this principal {what}; needs the brokers' authorizer and a super user's login",
        )
    p.add_argument(
        "--replica-groups",
        default="das-replica-",
        help="prefix of the replicas' consumer groups (their --replica names) that --replica-principal may use",
    )
    p.add_argument(
        "--replication-factor",
        type=POSITIVE,
        default=None,
        help="replicas per partition (default: 3 on three or more brokers, else 1)",
    )
    add_json_flag(p)

    p = cli.command(
        "kafka",
        "dlq",
        help="Summarise the dead-letter topic: rejected messages by reason, and the last few with origin and detail.",
        run=dlq,
    )
    add_bus_arguments(p)
    p.add_argument("--dlq-topic", default="das.trajectories.dlq", help="dead-letter topic")
    p.add_argument("--last", type=NON_NEGATIVE, default=10, help="dead letters to show in full")
    p.add_argument(
        "--idle-s", type=SECONDS, default=1.0, help="stop reading after this long without a message"
    )
    add_json_flag(p)

    p = cli.command(
        "kafka",
        "load",
        help="Publish synthetic trajectories (load generation, smoke tests); prints a JSON summary.",
        run=load,
    )
    add_bus_arguments(p)
    p.add_argument("--topic", default="das.trajectories", help="trajectory topic")
    p.add_argument("--count", type=NON_NEGATIVE, required=True, help="records to publish")
    p.add_argument(
        "--worker",
        type=integer(0, 999),
        default=0,
        help="worker number 0..999 (keys never collide across workers)",
    )
    p.add_argument("--seed", type=NON_NEGATIVE, default=0, help="seed of the synthetic content")
    p.add_argument(
        "--rate", type=RATE, default=0.0, help="records per second, 0.001 to 1e6 (0: as fast as possible)"
    )
    p.add_argument("--problems", type=POSITIVE, default=64, help="distinct problems")
    p.add_argument(
        "--epochs",
        type=integer(1, MAX_EPOCH + 1),
        default=3,
        help="epochs the records spread over, in order (epochs are 0 to 2**32-2: a record's key holds them as u32)",
    )
    p.add_argument("--prompt-tokens", type=POSITIVE, default=200, help="mean prompt length")
    p.add_argument(
        "--response-tokens", type=POSITIVE, default=1000, help="median response length (log-normal)"
    )
    p.add_argument(
        "--publish-timeout-s",
        type=TIMEOUT,
        default=60.0,
        help="how long a publish waits for room while the brokers are away before the load stops (default 60)",
    )
    p.add_argument(
        "--close-timeout-s",
        type=TIMEOUT,
        default=60.0,
        help="how long the end waits for acknowledgements; unconfirmed records are counted unknown (default 60)",
    )


def dlq(args: argparse.Namespace) -> int:
    from collections import Counter

    from pipeline.consumer import read_dead_letters

    servers, settings = kafka_client(args, one_shot=True)
    letters = read_dead_letters(servers, args.dlq_topic, idle_s=args.idle_s, **settings)
    # Two replicas can dead-letter the same message; compaction merges them later, the summary at once. A letter
    # that does not name its origin (forged) counts on its own.
    unique = {
        (d.topic, d.partition, d.offset) if None not in (d.partition, d.offset) else n: d
        for n, d in enumerate(letters)
    }
    reasons = Counter(d.reason for d in unique.values())
    recent = [dataclasses.asdict(d) | {"key": d.key.decode("utf-8", "replace") if d.key else None}
              for d in list(unique.values())[-args.last :]]  # fmt: skip
    if args.json:
        print(json.dumps({"dead_letters": len(unique), "by_reason": dict(reasons), "last": recent}))
    else:
        print(
            f"{len(unique)} dead letters in {args.dlq_topic}: "
            + ", ".join(f"{r} {n}" for r, n in reasons.most_common())
        )
        for d in recent:
            origin = "/".join("?" if d[k] is None else str(d[k]) for k in ("topic", "partition", "offset"))
            print(f"  {origin} {d['reason']}: {d['detail'][:160]}")
    return 0


def init(args: argparse.Namespace) -> int:
    from pipeline.topics import Principals, ensure_topics, grant

    servers, settings = kafka_client(args, one_shot=True)
    states = ensure_topics(
        servers,
        topic=args.topic,
        dead_letter_topic=args.dlq_topic,
        partitions=args.partitions,
        replication_factor=args.replication_factor,
        epochs=not args.no_epochs_topic,
        **settings,
    )
    principals = Principals(
        args.rollout_principal, args.trainer_principal, args.replica_principal, args.replica_groups
    )
    granted = grant(servers, principals, topic=args.topic, dead_letter_topic=args.dlq_topic, **settings)
    if args.json:
        print(json.dumps({"topics": [dataclasses.asdict(s) for s in states], "acls": granted}))
    else:
        for s in states:
            print(
                f"{s.name}: {s.action} ({s.partitions} partitions, replication factor {s.replication_factor})"
            )
        if granted:
            print(f"{granted} ACLs granted: " + ", ".join(
                f"{role} {name}" for role, name in dataclasses.asdict(principals).items()
                if name and role != "replica_groups"
            ))  # fmt: skip
    return 0


def load(args: argparse.Namespace) -> int:
    """Publishes, then prints one JSON summary whose counts are exact: acknowledged + refused + unknown equals
    published, and `not_taken` counts the record refused by backpressure (publishing stops there).

    Where the topic has a control topic, it plays the trainer too: before a problem's first record of an epoch,
    it publishes (and waits for) that problem's epoch advance, with the trainer's login where
    DAS_KAFKA_CONTROL_SASL_USERNAME/PASSWORD are set (`advances` in the summary)."""
    from pipeline.epochs import epoch_publisher
    from pipeline.errors import BusBackpressureError, BusDeliveryError
    from pipeline.producer import KafkaBus
    from pipeline.synthetic import SyntheticShape, synthetic_records

    shape = SyntheticShape(
        problems=args.problems,
        epochs=args.epochs,
        prompt_tokens=args.prompt_tokens,
        response_tokens_median=args.response_tokens,
    )
    # The bus says when brokers stop answering and when they are back; kafka-python itself stays quiet.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    servers, settings = kafka_client(args, one_shot=True)
    bus = KafkaBus(servers, topic=args.topic, publish_timeout_s=args.publish_timeout_s, **settings)
    try:
        epochs = epoch_publisher(servers, args.topic, **settings)
    except BaseException:
        bus.close(0)
        raise
    advanced: dict[str, int] = {}
    sent_advances = 0
    error: Exception | None = None
    not_taken = 0
    started = time.perf_counter()
    try:
        for n, record in enumerate(synthetic_records(args.worker, args.count, shape, args.seed)):
            if args.rate > 0:
                delay = started + n / args.rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            if epochs is not None and advanced.get(record.problem_id, -1) < record.epoch:
                epochs.advance({record.problem_id: record.epoch})
                advanced[record.problem_id] = record.epoch
                sent_advances += 1
            bus.publish(record)
    except BusBackpressureError as exc:
        error, not_taken = exc, 1
    except BaseException:
        bus.close(0)
        raise
    finally:
        if epochs is not None:
            epochs.close()
    try:
        report = bus.close(args.close_timeout_s)
    except BusDeliveryError as exc:
        error, report = error or exc, exc.report
    seconds = time.perf_counter() - started
    summary = {
        **report.to_json(),
        "not_taken": not_taken,
        "seconds": round(seconds, 3),
        "records_per_s": round(report.published / seconds, 1),
        "wire_bytes": bus.wire_bytes,
        "advances": sent_advances,
    }
    print(json.dumps(summary), flush=True)
    if error is not None:
        raise error
    return 0
