"""Kafka with TLS, SASL/PLAIN and ACLs: the security settings DAS_KAFKA_* (or bus URL parameters) reach every
client, and each user may do only what its role needs.

The broker is `bash scripts/kafka.sh up-secure` (a single node that only speaks SASL_SSL, with a throwaway CA and
Kafka's KRaft authorizer); `make test` starts it. `das kafka init` (as the brokers' admin) creates the topics and
grants the rollout writers (`das`), the trainer (`das-trainer`) and the replicas (`das-replica`) their ACLs;
`das kafka load`, `das indexer run` and `das kafka dlq` then work through it with the environment alone. Without
credentials, with a wrong password, or with a user whose role may not do it, each command fails with one line and
exit 1, and nothing it sent lands.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from conftest import REPO

from history_store.durable.store import HistoryStore
from history_store.errors import StoreOpenError
from pipeline.kafka_config import client_settings

pytestmark = pytest.mark.kafka
SECURE_ENV = "DAS_KAFKA_SECURE_BOOTSTRAP"
SHAPE_ARGS = ("--problems", "8", "--epochs", "2", "--prompt-tokens", "16", "--response-tokens", "40")


@pytest.fixture(scope="module")
def secure() -> dict[str, str]:
    """The secure broker's address and a client login, as the DAS_KAFKA_* variables a deployment sets."""
    if not os.environ.get(SECURE_ENV):
        pytest.fail(
            f"{SECURE_ENV} is not set: this test needs the TLS + SASL broker. Start it with "
            "`bash scripts/kafka.sh up-secure && source .kafka/secure/env.sh` (make test does both)."
        )
    return {
        "bootstrap": os.environ[SECURE_ENV],
        "DAS_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "DAS_KAFKA_SASL_MECHANISM": "PLAIN",
        "DAS_KAFKA_SASL_USERNAME": os.environ["DAS_KAFKA_SECURE_USERNAME"],
        "DAS_KAFKA_SASL_PASSWORD": os.environ["DAS_KAFKA_SECURE_PASSWORD"],
        "DAS_KAFKA_SSL_CAFILE": os.environ["DAS_KAFKA_SECURE_CAFILE"],
    }


def _as(user: str) -> dict[str, str]:
    """The login of one of the secure broker's users, as the DAS_KAFKA_SASL_* variables."""
    password = {
        "admin": "DAS_KAFKA_SECURE_ADMIN_PASSWORD",
        "das": "DAS_KAFKA_SECURE_PASSWORD",
        "das-trainer": "DAS_KAFKA_SECURE_TRAINER_PASSWORD",
        "das-replica": "DAS_KAFKA_SECURE_REPLICA_PASSWORD",
    }[user]
    return {"DAS_KAFKA_SASL_USERNAME": user, "DAS_KAFKA_SASL_PASSWORD": os.environ[password]}


def _trainer(user: str = "das-trainer") -> dict[str, str]:
    """The login epoch advances go out with (DAS_KAFKA_CONTROL_SASL_*)."""
    login = _as(user)
    return {
        "DAS_KAFKA_CONTROL_SASL_USERNAME": login["DAS_KAFKA_SASL_USERNAME"],
        "DAS_KAFKA_CONTROL_SASL_PASSWORD": login["DAS_KAFKA_SASL_PASSWORD"],
    }


GRANTS = ("--rollout-principal", "User:das", "--trainer-principal", "User:das-trainer",
          "--replica-principal", "User:das-replica")  # fmt: skip


def _init(secure: dict[str, str], topic: str) -> None:
    done = _das(_env(secure, **_as("admin")), "kafka", "init", "--bus", f"kafka://{secure['bootstrap']}",
                "--topic", topic, "--dlq-topic", f"{topic}.dlq", *GRANTS)  # fmt: skip
    assert done.returncode == 0, done.stderr


def _env(secure: dict[str, str], **overrides: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAS_KAFKA_S")}
    env.update({k: v for k, v in secure.items() if k.startswith("DAS_")})
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _das(env: dict[str, str], *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


def _wait_for_offsets(store_path, total: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with HistoryStore.open_secondary(store_path, store_path.parent / "secondary") as reader:
                if sum(reader.offsets().values()) >= total:
                    return
        except StoreOpenError:
            pass  # not created yet, or created and its metadata not yet written: the replica is starting
        time.sleep(0.5)
    pytest.fail(f"the replica did not reach {total} records in {timeout_s} s")


def test_every_client_works_over_tls_and_sasl_from_the_environment(secure, tmp_path):
    topic = f"test.secure.{uuid.uuid4().hex[:8]}"
    bus = f"kafka://{secure['bootstrap']}"
    _init(secure, topic)
    # The load generator plays the rollout writers (das) and, for its epoch advances, the trainer.
    env = _env(secure, **_trainer())
    done = _das(env, "kafka", "load", "--bus", bus, "--topic", topic, "--count", "200", *SHAPE_ARGS)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["acknowledged"], summary["refused"], summary["unknown"]) == (200, 0, 0)
    assert summary["advances"] > 0
    env = _env(secure, **_as("das-replica"))
    store = tmp_path / "replica"
    replica = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "indexer", "run", "--bus", bus, "--topic", topic,
         "--dlq-topic", f"{topic}.dlq", "--data", str(store), "--replica", "das-replica-secure"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_for_offsets(store, 200, timeout_s=120)
    finally:
        replica.send_signal(signal.SIGTERM)
        _, err = replica.communicate(timeout=60)
    assert replica.returncode == 0, err
    with HistoryStore(store) as opened:
        assert opened.stats().trajectories == 200
    done = _das(env, "kafka", "dlq", "--bus", bus, "--dlq-topic", f"{topic}.dlq", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["dead_letters"] == 0, done.stderr


def test_bus_url_parameters_carry_the_security_settings_too(secure):
    env = _env(secure, DAS_KAFKA_SECURITY_PROTOCOL=None, DAS_KAFKA_SASL_MECHANISM=None, **_as("admin"))
    url = f"kafka://{secure['bootstrap']}?security_protocol=SASL_SSL&sasl_mechanism=PLAIN"
    done = _das(env, "kafka", "init", "--bus", url, "--topic", f"test.secure-url.{uuid.uuid4().hex[:8]}")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"DAS_KAFKA_SASL_PASSWORD": "wrong"}, "refuse this client's TLS/SASL settings"),
        ({"DAS_KAFKA_SASL_USERNAME": None}, "needs a user name and password"),
    ],
)
def test_bad_credentials_fail_with_one_line(secure, overrides, expected):
    env = _env(secure, **overrides)
    done = _das(
        env, "kafka", "init", "--bus", f"kafka://{secure['bootstrap']}", "--topic", "test.never",
        "--kafka-setting", "bootstrap_timeout_ms=5000",
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip().startswith("das kafka init: ") and len(done.stderr.strip().splitlines()) == 1
    assert expected in done.stderr


def test_a_plaintext_client_is_refused_by_the_secure_broker(secure):
    env = _env(
        secure, DAS_KAFKA_SECURITY_PROTOCOL=None, DAS_KAFKA_SASL_MECHANISM=None, DAS_KAFKA_SASL_USERNAME=None
    )
    done = _das(
        env, "kafka", "init", "--bus", f"kafka://{secure['bootstrap']}", "--topic", "test.never",
        "--kafka-setting", "bootstrap_timeout_ms=3000",
    )  # fmt: skip
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_client_settings_carry_a_complete_login(secure, monkeypatch):
    for key, value in secure.items():
        if key.startswith("DAS_"):
            monkeypatch.setenv(key, value)
    assert client_settings({})["sasl_plain_username"] == secure["DAS_KAFKA_SASL_USERNAME"]


def _ends(secure: dict[str, str], topic: str) -> dict[int, int]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=[secure["bootstrap"]], **_settings("admin"))
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        return {tp.partition: offset for tp, offset in consumer.end_offsets(parts).items()}
    finally:
        consumer.close()


def _settings(user: str) -> dict[str, object]:
    login = _as(user)
    return {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "PLAIN",
        "sasl_plain_username": login["DAS_KAFKA_SASL_USERNAME"],
        "sasl_plain_password": login["DAS_KAFKA_SASL_PASSWORD"],
        "ssl_cafile": os.environ["DAS_KAFKA_SECURE_CAFILE"],
    }


@pytest.mark.parametrize(
    "writes, user, control",
    [
        ("trajectories", "das-trainer", None),  # the trainer may write epoch advances only
        ("epoch advances", "das", "das"),  # a rollout writer may not move any window
        ("epoch advances", "das-replica", "das-replica"),
    ],
)
def test_a_user_whose_role_may_not_write_is_refused_in_one_line_and_nothing_lands(
    secure, writes, user, control
):
    from kafka import KafkaProducer
    from kafka.errors import TopicAuthorizationFailedError

    topic = f"test.acl.{uuid.uuid4().hex[:8]}"
    _init(secure, topic)
    target = topic if writes == "trajectories" else f"{topic}.epochs"
    before = _ends(secure, target)
    env = _env(secure, **_as(user), **(_trainer(control) if control else {}))
    started = time.monotonic()
    done = _das(env, "kafka", "load", "--bus", f"kafka://{secure['bootstrap']}", "--topic", topic, "--count", "20",
                *SHAPE_ARGS)  # fmt: skip
    assert done.returncode == 1 and time.monotonic() - started < 30, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("das kafka load: ") and f"User:{user} is not authorised" in line, line
    producer = KafkaProducer(bootstrap_servers=[secure["bootstrap"]], max_block_ms=10_000, **_settings(user))
    try:  # a plain producer with that login, too
        with pytest.raises(TopicAuthorizationFailedError):
            producer.send(
                target, key=b"problem-0", value=b'{"problem_id":"problem-0","epoch":9}', partition=0
            ).get(30)
    finally:
        producer.close()
    assert _ends(secure, target) == before  # nothing landed
