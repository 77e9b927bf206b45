"""Topic administration: the trajectory topic and its dead-letter topic, created and configured idempotently.

`das.trajectories` is compacted on record keys (problem, epoch, sample): it keeps every record of the current
windows forever, and the tombstones replicas publish for evicted epochs remove the rest, so a new node rebuilds
its store from the topic alone. In a cluster (three or more brokers) it is replicated three times with
`min.insync.replicas=2`: with acks=all a write survives the loss of any one broker, and producers keep writing
while one broker is down.

`das.trajectories.dlq` keeps rejected messages with the reason in their headers. It is keyed by the rejected
message's origin (topic/partition/offset) and compacted as well as time-limited, so two replicas rejecting
the same message leave one copy after compaction.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.errors import KafkaError, TopicAlreadyExistsError, TopicAuthorizationFailedError

from pipeline.errors import BusError, InvalidInput
from pipeline.kafka_config import UNREACHABLE, client_settings


def epochs_topic(topic: str) -> str:
    """The control topic of a trajectory topic (`pipeline.epochs`)."""
    return topic + ".epochs"


TRAJECTORY_TOPIC = "das.trajectories"
DEAD_LETTER_TOPIC = "das.trajectories.dlq"
# Parallelism for consumers and brokers; problems hash over partitions, so more than the number of brokers
# times a few buys nothing for one global-table consumer per node.
DEFAULT_PARTITIONS = 6
# Raised together with the brokers' message.max.bytes and the clients' request and fetch sizes: a 100k-token
# trajectory at 4 bytes a token is 400 KB, and 16 MiB leaves room for very long agentic rollouts. A deployment
# that sets its brokers' limit sets the same value here (docker-compose.yml passes it to every DAS service).
MAX_MESSAGE_BYTES_ENV = "DAS_KAFKA_MAX_MESSAGE_BYTES"
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# Kafka's own default; below it a dead letter (the rejected bytes plus up to 64 KiB of headers) may not fit.
MIN_MESSAGE_BYTES = 1024 * 1024


def max_message_bytes() -> int:
    """The largest record clients send and fetch and the topic accepts: DAS_KAFKA_MAX_MESSAGE_BYTES, else 16 MiB.

    Raises ValueError when the variable is not a whole number of at least 1 MiB.
    """
    raw = os.environ.get(MAX_MESSAGE_BYTES_ENV)
    if raw is None:
        return DEFAULT_MAX_MESSAGE_BYTES
    if not raw.strip().isdigit() or int(raw) < MIN_MESSAGE_BYTES:
        raise InvalidInput(
            f"{MAX_MESSAGE_BYTES_ENV}={raw!r}: expected a whole number of bytes >= {MIN_MESSAGE_BYTES}"
        )
    return int(raw)


MAX_MESSAGE_BYTES = max_message_bytes()
# Two weeks of rejected messages: long enough to notice and diagnose them (`das kafka dlq`).
DLQ_RETENTION_MS = 14 * 24 * 3600 * 1000
# Client settings every kafka-python client kind accepts (TLS, SASL, how long to wait for brokers): they pass
# from the bus settings to the admin client and the replica's producers; the rest is specific to one kind.
SHARED_PREFIXES = ("security_protocol", "ssl_", "sasl_", "bootstrap_timeout_ms", "request_timeout_ms")


def shared_settings(settings: Mapping[str, object]) -> dict[str, object]:
    """The subset of kafka-python settings (TLS, SASL, timeouts) that every client kind accepts."""
    return {k: v for k, v in settings.items() if k.startswith(SHARED_PREFIXES)}


@dataclass(frozen=True, slots=True)
class TopicPlan:
    """How the topics are laid out for a cluster of a given size."""

    partitions: int
    replication_factor: int
    min_insync_replicas: int

    def configs(self, topic: str, dead_letter_topic: str, epochs: bool = True) -> dict[str, dict[str, str]]:
        """Topic name -> the topic-level configuration we own; with `epochs`, the control topic of epoch
        advances too (`pipeline.epochs`: compacted on the problem id, so it keeps each problem's latest)."""
        common = {
            "min.insync.replicas": str(self.min_insync_replicas),
            "max.message.bytes": str(MAX_MESSAGE_BYTES),
            "unclean.leader.election.enable": "false",
        }
        out = {
            topic: {**common, "cleanup.policy": "compact"},
            dead_letter_topic: {
                **common,
                "cleanup.policy": "compact,delete",
                "retention.ms": str(DLQ_RETENTION_MS),
            },
        }
        if epochs:
            out[epochs_topic(topic)] = {**common, "cleanup.policy": "compact"}
        return out


def plan_for(
    brokers: int, partitions: int = DEFAULT_PARTITIONS, replication_factor: int | None = None
) -> TopicPlan:
    """RF 3 with min.insync.replicas 2 on three or more brokers, RF 1 on a single broker; an explicit
    `replication_factor` overrides. Raises ValueError if the cluster is too small for it."""
    if partitions < 1:
        raise InvalidInput(f"partitions must be >= 1, got {partitions}")
    rf = replication_factor if replication_factor is not None else (3 if brokers >= 3 else 1)
    if not 1 <= rf <= brokers:
        raise InvalidInput(f"replication factor {rf} needs at least {rf} brokers; the cluster has {brokers}")
    return TopicPlan(partitions, rf, 2 if rf >= 3 else 1)


@dataclass(frozen=True, slots=True)
class TopicState:
    """Outcome of `ensure_topics` for one topic: "created" or "exists" (its config brought to the plan)."""

    name: str
    action: str
    partitions: int
    replication_factor: int


def admin_client(servers: list[str], **settings: object) -> KafkaAdminClient:
    """An admin client; raises BusError with the addresses when no broker answers."""
    try:
        return KafkaAdminClient(
            bootstrap_servers=servers, client_id="das-admin", **shared_settings(client_settings(settings))
        )
    except KafkaError as exc:
        raise BusError(f"cannot reach Kafka at {','.join(servers)}: {UNREACHABLE}: {exc}") from exc


def ensure_topics(
    servers: list[str],
    *,
    topic: str = TRAJECTORY_TOPIC,
    dead_letter_topic: str = DEAD_LETTER_TOPIC,
    partitions: int = DEFAULT_PARTITIONS,
    replication_factor: int | None = None,
    epochs: bool = True,
    **settings: object,
) -> list[TopicState]:
    """Creates the trajectory and dead-letter topics (and, with `epochs`, the control topic of epoch advances) if
    missing and sets their configuration; idempotent.

    Raises BusError if Kafka is unreachable or an existing topic has a different partition count (problems
    would move between partitions and lose their order; that needs an explicit migration, not this command).
    """
    admin = admin_client(servers, **settings)
    try:
        plan = plan_for(len(admin.describe_cluster()["brokers"]), partitions, replication_factor)
        configs = plan.configs(topic, dead_letter_topic, epochs)
        existing = {t["name"]: t for t in admin.describe_topics(list(configs)) if not t["error_code"]}
        missing = {
            name: {
                "num_partitions": plan.partitions,
                "replication_factor": plan.replication_factor,
                "configs": cfg,
            }
            for name, cfg in configs.items()
            if name not in existing
        }
        if missing:
            # Another `das kafka init` may win the race; its topics are then checked below like any other.
            with contextlib.suppress(TopicAlreadyExistsError):
                admin.create_topics(missing, timeout_ms=30_000)
            admin.wait_for_topics(list(missing), timeout_ms=30_000)
        states = []
        for name in configs:
            if name in existing:
                have = len(existing[name]["partitions"])
                if have != plan.partitions:
                    raise BusError(
                        f"topic {name} exists with {have} partitions, not {plan.partitions}; changing the count "
                        f"moves problems between partitions. Use --partitions {have} or migrate explicitly."
                    )
                replicas = len(existing[name]["partitions"][0]["replica_nodes"])
                states.append(TopicState(name, "exists", have, replicas))
            else:
                states.append(TopicState(name, "created", plan.partitions, plan.replication_factor))
        # Created topics got their configuration at creation; existing ones are brought to the plan (altering a
        # topic just created can race its metadata reaching the broker that answers).
        resources = [
            ConfigResource(ConfigResourceType.TOPIC, name, cfg)
            for name, cfg in configs.items()
            if name in existing
        ]
        if resources:
            admin.alter_configs(resources)
        return states
    except KafkaError as exc:
        raise BusError(f"topic administration on {','.join(servers)} failed: {exc}") from exc
    finally:
        admin.close()


def _not_authorised(topic: str, servers: list[str], settings: Mapping[str, object]) -> str:
    user = client_settings(settings).get("sasl_plain_username")
    who = f"User:{user}" if user else "this client's principal"
    return (
        f"{who} is not authorised to use topic {topic} on {','.join(servers)} (the brokers' ACLs: see "
        "docs/operations.md, Access control)"
    )


def topic_exists(servers: list[str], topic: str, **settings: object) -> bool:
    """Whether `topic` exists. Raises BusError if Kafka is unreachable or this client may not describe it."""
    admin = admin_client(servers, **settings)
    try:
        for info in admin.describe_topics([topic]):
            if info["name"] != topic:
                continue
            if info["error_code"] == TopicAuthorizationFailedError.errno:
                raise BusError(_not_authorised(topic, servers, settings))
            return not info["error_code"] and bool(info["partitions"])
        return False
    except KafkaError as exc:
        raise BusError(f"cannot describe topic {topic} on {','.join(servers)}: {exc}") from exc
    finally:
        admin.close()


def topic_partitions(servers: list[str], topic: str, wait_s: float = 5.0, **settings: object) -> int:
    """Partition count of `topic`. Raises BusError if Kafka is unreachable or the topic does not appear within
    `wait_s` (a topic just created reaches every broker's metadata a moment later)."""
    admin = admin_client(servers, **settings)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            for info in admin.describe_topics([topic]):
                if info["name"] == topic and info["error_code"] == TopicAuthorizationFailedError.errno:
                    raise BusError(_not_authorised(topic, servers, settings))
                if info["name"] == topic and not info["error_code"] and info["partitions"]:
                    return len(info["partitions"])
            if time.monotonic() >= deadline:
                break
            time.sleep(0.25)
    except KafkaError as exc:
        raise BusError(f"cannot describe topic {topic} on {','.join(servers)}: {exc}") from exc
    finally:
        admin.close()
    raise BusError(f"topic {topic} does not exist on {','.join(servers)}: create it with `das kafka init`")


@dataclass(frozen=True, slots=True)
class Principals:
    """Who may do what on a deployment's topics (Kafka principals, e.g. `User:das-rollout`). Any left None gets
    no grant."""

    rollout: str | None = None  # agent loops, `das rollout`: Write on the trajectory topic
    trainer: str | None = None  # epoch advances: Write on the control topic
    replica: str | None = None  # history replicas: see `acls`
    replica_groups: str = "das-replica-"  # prefix of the replicas' consumer groups (their --replica names)


def acls(principals: Principals, topic: str, dead_letter_topic: str) -> list[Any]:
    """The ACLs of a deployment. Replicas read every topic, write dead letters, and write the trajectory topic
    for what only the history's owners may send: tombstones of records an epoch advance retired, and the stored
    copy of a record that a later message (a tombstone or a different duplicate) would otherwise replace when
    the topic is compacted. Describe comes with Read and Write; idempotent producers need nothing more since
    Kafka 2.8."""
    from kafka.admin import (
        ACL,
        ACLOperation,
        ACLPermissionType,
        ACLResourcePatternType,
        ResourcePattern,
        ResourceType,
    )

    def allow(principal: str, operation: Any, kind: Any, name: str, prefixed: bool = False) -> Any:
        pattern = ACLResourcePatternType.PREFIXED if prefixed else ACLResourcePatternType.LITERAL
        return ACL(principal, "*", operation, ACLPermissionType.ALLOW, ResourcePattern(kind, name, pattern))

    out = []
    if principals.rollout:
        out.append(allow(principals.rollout, ACLOperation.WRITE, ResourceType.TOPIC, topic))
    if principals.trainer:
        out.append(allow(principals.trainer, ACLOperation.WRITE, ResourceType.TOPIC, epochs_topic(topic)))
    if principals.replica:
        for name in (topic, epochs_topic(topic), dead_letter_topic):
            out.append(allow(principals.replica, ACLOperation.READ, ResourceType.TOPIC, name))
        for name in (topic, dead_letter_topic):
            out.append(allow(principals.replica, ACLOperation.WRITE, ResourceType.TOPIC, name))
        out.append(
            allow(
                principals.replica,
                ACLOperation.READ,
                ResourceType.GROUP,
                principals.replica_groups,
                prefixed=True,
            )
        )
    return out


def grant(
    servers: list[str], principals: Principals, *, topic: str, dead_letter_topic: str, **settings: object
) -> int:
    """Creates the deployment's ACLs (idempotent: Kafka keeps one copy of an ACL); returns how many. Needs a
    client allowed to alter the cluster's ACLs (the brokers' super user). Raises BusError if one is refused."""
    wanted = acls(principals, topic, dead_letter_topic)
    if not wanted:
        return 0
    admin = admin_client(servers, **settings)
    try:
        result = admin.create_acls(wanted)
    except KafkaError as exc:
        raise BusError(f"creating ACLs on {','.join(servers)} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        admin.close()
    failed = result.get("failed") or []  # kafka-python 3.0.12 lists the error classes of the refused ones
    if failed:
        raise BusError(
            f"{len(failed)} of {len(wanted)} ACLs refused on {','.join(servers)}: {failed[0].__name__}"
        )
    return len(wanted)
