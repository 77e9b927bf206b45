#!/usr/bin/env bash
# Runs the test suite against real services: installs Prometheus, prepares the model once, starts the local
# Kafka broker, the three-broker cluster and a TLS + SASL broker, runs pytest, and always stops the brokers (even when tests fail).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"

bash scripts/install_system_deps.sh   # Debian's prometheus + promtool, for the real-Prometheus tests
das model prepare
trap 'bash scripts/kafka.sh down' EXIT
bash scripts/kafka.sh up
bash scripts/kafka.sh up-secure   # a TLS + SASL/PLAIN broker for tests/test_kafka_security.py
# shellcheck disable=SC1091
source .kafka/env.sh   # exports DAS_KAFKA_BOOTSTRAP (single broker) and DAS_KAFKA_CLUSTER_BOOTSTRAP (three brokers)
# shellcheck disable=SC1091
source .kafka/secure/env.sh   # DAS_KAFKA_SECURE_BOOTSTRAP, _CAFILE, _USERNAME, _PASSWORD
# Three workers on two cores: much of the suite waits (brokers, Ray, engine start-ups), so modules overlap their
# waits; tests/conftest.py keeps each module on one worker and serialises the modules that share a cluster.
# The slowest tests are listed at the end, for whoever makes the suite faster next.
python -m pytest -q -n "${DAS_TEST_WORKERS:-3}" --dist loadgroup --durations=25 "$@"
