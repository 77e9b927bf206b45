#!/usr/bin/env bash
# Runs the test suite against real services: prepares the model once, starts the local Kafka broker and the
# three-broker cluster, runs pytest, and always stops the brokers (even when tests fail or are interrupted).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"

das model prepare
trap 'bash scripts/kafka.sh down' EXIT
bash scripts/kafka.sh up
# shellcheck disable=SC1091
source .kafka/env.sh   # exports DAS_KAFKA_BOOTSTRAP (single broker) and DAS_KAFKA_CLUSTER_BOOTSTRAP (three brokers)
python -m pytest -q "$@"
