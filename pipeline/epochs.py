"""Epoch advances: the trainer, not any data record, decides when a problem's history window moves.

An epoch advance says "problem P is now at epoch E": the trainer's pass ledger (verl's DAS managers, `das rollout`)
publishes one per problem when the problem starts a new pass, on the control topic `<topic>.epochs`, which only
the trainer's principal may write (docs/operations.md, "Access control"). Replicas judge data records against
the advances they have read: a record's epoch can only add history, never evict it (see
`HistoryStore.apply_judged`).

Wire format: key = the problem id (UTF-8), value = JSON `{"problem_id": ..., "epoch": ...}`, in the problem's
partition (`partition_for`, as for its data records). The topic is compacted on the key, so it keeps each
problem's latest advance: everything a rebuild needs.

`EpochPublisher` sends advances and waits for their acknowledgement; `BackgroundEpochPublisher` does it on a
thread, for callers that must never block or fail (a trainer: DAS only speeds rollouts up).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.errors import BusError, InvalidInput
from pipeline.kafka_config import UNREACHABLE, client_settings, control_settings, parse_bus_url
from pipeline.schemas import MAX_EPOCH
from pipeline.topics import epochs_topic, shared_settings
from pipeline.wire import partition_for

log = logging.getLogger(__name__)

# A control record is a few dozen bytes: anything much larger is not one.
MAX_ADVANCE_BYTES = 4096


@dataclass(frozen=True, slots=True)
class EpochAdvance:
    problem_id: str
    epoch: int


def encode_advance(advance: EpochAdvance) -> tuple[bytes, bytes]:
    """(key, value) of an advance on the control topic."""
    value = json.dumps({"problem_id": advance.problem_id, "epoch": advance.epoch}, separators=(",", ":"))
    return advance.problem_id.encode(), value.encode()


def decode_advance(key: bytes | None, value: bytes | None) -> EpochAdvance:
    """The advance in a control-topic message. Raises ValueError (with what is wrong) for anything else."""
    if value is None or key is None:
        raise InvalidInput("a control record needs a key and a value (tombstones are not advances)")
    if len(value) > MAX_ADVANCE_BYTES:
        raise InvalidInput(f"{len(value)} bytes: not an epoch advance (at most {MAX_ADVANCE_BYTES})")
    try:
        body = json.loads(value.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInput(f"not UTF-8 JSON: {exc}") from exc
    if not isinstance(body, dict) or set(body) != {"problem_id", "epoch"}:
        raise InvalidInput("expected a JSON object with exactly problem_id and epoch")
    problem, epoch = body["problem_id"], body["epoch"]
    if not isinstance(problem, str) or not problem:
        raise InvalidInput(f"problem_id must be a non-empty string, got {problem!r:.80}")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= MAX_EPOCH:
        raise InvalidInput(f"epoch must be an integer in 0..{MAX_EPOCH}, got {epoch!r:.40}")
    if key != problem.encode():
        raise InvalidInput(f"key {key!r:.80} is not the problem id {problem!r:.80}")
    return EpochAdvance(problem, epoch)


def newest_epochs(problem_ids: Iterable[Any], epochs: Iterable[Any]) -> dict[str, int]:
    """Problem -> the highest epoch among rows of a rollout batch (rows without a problem id or with a negative
    epoch, such as validation rows, are left out)."""
    out: dict[str, int] = {}
    for pid, epoch in zip(problem_ids, epochs, strict=True):
        if pid is None or epoch is None or int(epoch) < 0:
            continue
        out[str(pid)] = max(int(epoch), out.get(str(pid), -1))
    return out


def advance_rows(
    publisher: BackgroundEpochPublisher | None, problem_ids: Iterable[Any], epochs: Iterable[Any]
) -> None:
    """Hands the epochs of a rollout batch's rows (see `newest_epochs`) to `publisher`, if any: the one call
    verl's DAS managers make per batch."""
    if publisher is not None:
        publisher.advance(newest_epochs(problem_ids, epochs))


class EpochPublisher:
    """Publishes epoch advances to `<topic>.epochs` with the trainer's credentials (`control_settings`).

    Raises BusError at construction if no broker answers or the control topic does not exist.
    """

    def __init__(self, servers: list[str], *, topic: str, **settings: object) -> None:
        from kafka import KafkaProducer
        from kafka.errors import KafkaError

        from pipeline.topics import topic_partitions

        self.topic = epochs_topic(topic)
        self._where = f"Kafka at {','.join(servers)}, topic {self.topic}"
        settings = control_settings(settings)
        self._login = client_settings(settings)
        self._partitions = topic_partitions(servers, self.topic, **settings)
        try:
            self._producer = KafkaProducer(
                bootstrap_servers=list(servers),
                acks="all",
                enable_idempotence=True,
                linger_ms=5,
                client_id="das-epochs",
                **shared_settings(client_settings(settings)),
            )
        except KafkaError as exc:
            raise BusError(f"cannot reach {self._where}: {UNREACHABLE}: {exc}") from exc

    def advance(self, epochs: Mapping[str, int], timeout_s: float = 30) -> None:
        """Sends one advance per problem and waits until every one is acknowledged.

        Raises BusError if one is refused (an unauthorised principal) or not acknowledged in time.
        """
        from kafka.errors import KafkaError, TopicAuthorizationFailedError

        futures = []
        try:
            for problem, epoch in epochs.items():
                key, value = encode_advance(EpochAdvance(problem, int(epoch)))
                partition = partition_for(problem, self._partitions)
                futures.append(self._producer.send(self.topic, key=key, value=value, partition=partition))
            deadline = time.monotonic() + timeout_s
            for future in futures:
                future.get(timeout=max(0.1, deadline - time.monotonic()))
        except TopicAuthorizationFailedError as exc:
            user = self._login.get("sasl_plain_username")
            raise BusError(
                f"{f'User:{user}' if user else 'this client'} is not authorised to write epoch advances to "
                f"{self.topic} (only the trainer's user may: set DAS_KAFKA_CONTROL_SASL_USERNAME and _PASSWORD; "
                "docs/operations.md, Access control)"
            ) from exc
        except KafkaError as exc:
            raise BusError(f"epoch advances refused by {self._where}: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        self._producer.close(timeout=10)


def open_epoch_publisher(url: str, topic: str, **settings: object) -> EpochPublisher | None:
    """The publisher for a `kafka://` bus whose control topic exists; None for the embedded bus (one process, one
    trust domain: its records are the trainer's own) and for a topic without a control topic (a plain-data
    deployment, whose replicas confirm epochs by samples instead). Raises BusError if Kafka is unreachable,
    ValueError for a malformed URL or settings."""
    from pipeline.kafka_config import KAFKA_SCHEME

    if not url.startswith(KAFKA_SCHEME):
        return None
    servers, url_settings = parse_bus_url(url)
    return epoch_publisher(servers, topic, **{**url_settings, **settings})


def epoch_publisher(servers: list[str], topic: str, **settings: object) -> EpochPublisher | None:
    """`open_epoch_publisher` for brokers and settings already parsed."""
    from pipeline.topics import topic_exists

    if not topic_exists(servers, epochs_topic(topic), **control_settings(settings)):
        log.info("no control topic %s: replicas confirm epochs by their samples", epochs_topic(topic))
        return None
    return EpochPublisher(servers, topic=topic, **settings)


class BackgroundEpochPublisher:
    """Epoch advances sent by a daemon thread: `advance` never blocks and never raises. Advances waiting for a
    connection coalesce (one per problem, its highest epoch); a failed send is retried with backoff, and the
    first failure is logged once. Until an advance lands, replicas only hold the problem's new records back."""

    def __init__(self, url: str, topic: str, settings: Mapping[str, Any] | None = None) -> None:
        parse_bus_url(url)  # a malformed URL fails here, where the config is read
        self.url = url
        self.topic = topic
        self._settings = dict(settings or {})
        self._cond = threading.Condition()
        self._waiting: dict[str, int] = {}
        self.sent = 0
        self.publisher: EpochPublisher | None = None
        self.disabled = False
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="das-epoch-publisher", daemon=True)
        self._thread.start()

    def advance(self, epochs: Mapping[str, int]) -> None:
        if not epochs:
            return
        with self._cond:
            for problem, epoch in epochs.items():
                self._waiting[problem] = max(int(epoch), self._waiting.get(problem, -1))
            self._cond.notify()

    def flush(self, timeout_s: float = 30) -> bool:
        """Waits until nothing waits (True) or `timeout_s` passes (False); for tests and orderly shutdowns."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._waiting or self.disabled, timeout_s)

    def _run(self) -> None:
        delay = 1.0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._waiting))
                batch = dict(self._waiting)
            try:
                if self.publisher is None:
                    self.publisher = open_epoch_publisher(self.url, self.topic, **self._settings)
                    if self.publisher is None:
                        with self._cond:
                            self.disabled = True
                            self._waiting.clear()
                            self._cond.notify_all()
                        return
                self.publisher.advance(batch)
            except Exception as exc:  # retried: brokers may come back; the rollouts never wait on this
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "DAS: epoch advances to %s not sent yet (%s); retrying in the background",
                        self.url,
                        exc,
                    )
                time.sleep(delay)
                delay = min(2 * delay, 60.0)
                continue
            delay = 1.0
            with self._cond:
                for problem, epoch in batch.items():
                    if self._waiting.get(problem) == epoch:
                        del self._waiting[problem]
                self.sent += len(batch)
                self._cond.notify_all()


_background: dict[tuple[str, str], BackgroundEpochPublisher] = {}
_background_lock = threading.Lock()


def trainer_epoch_publisher(das_config: Any) -> BackgroundEpochPublisher | None:
    """The process's background publisher for a trainer config's `das` block (`das.bus`, `das.topic`,
    `das.bus_settings`); None when `das.bus` is unset or not Kafka."""
    if not das_config or not str(das_config.get("bus") or "").startswith("kafka://"):
        return None
    url = str(das_config["bus"])
    settings = {str(k): v for k, v in dict(das_config.get("bus_settings") or {}).items()}
    topic = str(settings.pop("topic", None) or "das.trajectories")
    for bus_only in ("max_queue_records", "publish_timeout_s"):  # the trajectory bus's, not a client setting
        settings.pop(bus_only, None)
    with _background_lock:
        if (url, topic) not in _background:
            _background[(url, topic)] = BackgroundEpochPublisher(url, topic, settings)
        return _background[(url, topic)]
