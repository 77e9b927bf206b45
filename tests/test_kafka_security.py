"""Kafka with TLS and SASL/PLAIN: the security settings DAS_KAFKA_* (or bus URL parameters) reach every client.

The broker is `bash scripts/kafka.sh up-secure` (a single node that only speaks SASL_SSL, with a throwaway CA);
`make test` starts it. `das kafka init`, `das kafka load`, `das indexer run` and `das kafka dlq` all work
through it with the environment alone; without credentials, or with a wrong password, each command fails with
one line and exit 1 instead of hanging or retrying forever.
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
    env = _env(secure)
    topic = f"test.secure.{uuid.uuid4().hex[:8]}"
    bus = f"kafka://{secure['bootstrap']}"
    done = _das(env, "kafka", "init", "--bus", bus, "--topic", topic, "--dlq-topic", f"{topic}.dlq")
    assert done.returncode == 0, done.stderr
    done = _das(env, "kafka", "load", "--bus", bus, "--topic", topic, "--count", "200", *SHAPE_ARGS)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["acknowledged"], summary["refused"], summary["unknown"]) == (200, 0, 0)
    store = tmp_path / "replica"
    replica = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "indexer", "run", "--bus", bus, "--topic", topic,
         "--dlq-topic", f"{topic}.dlq", "--data", str(store), "--replica", "secure-replica"],
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
    env = _env(secure, DAS_KAFKA_SECURITY_PROTOCOL=None, DAS_KAFKA_SASL_MECHANISM=None)
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
