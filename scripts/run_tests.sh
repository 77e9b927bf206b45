#!/usr/bin/env bash
# Runs the test suite against real services: installs Prometheus and Alertmanager, prepares the model once, starts the local
# Kafka broker, the three-broker cluster and a TLS + SASL broker, runs pytest, and always stops the brokers (even when tests fail).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"

bash scripts/install_system_deps.sh   # Debian's prometheus, promtool, alertmanager, amtool: the real-monitoring tests
bash scripts/install_docker.sh --no-daemon >/dev/null   # Docker's client and Compose: tests/test_compose_cpu.py
das model prepare
trap 'bash scripts/kafka.sh down' EXIT
bash scripts/kafka.sh up
bash scripts/kafka.sh up-secure   # a TLS + SASL/PLAIN broker for tests/test_kafka_security.py
# shellcheck disable=SC1091
source .kafka/env.sh   # exports DAS_KAFKA_BOOTSTRAP (single broker) and DAS_KAFKA_CLUSTER_BOOTSTRAP (three brokers)
# shellcheck disable=SC1091
source .kafka/secure/env.sh   # DAS_KAFKA_SECURE_BOOTSTRAP, _CAFILE, _USERNAME, _PASSWORD
if [ "$#" -gt 0 ]; then
  python -m pytest -q "$@"
  exit 0
fi
# The modules that start a local Ray cluster or stop brokers of the three-broker cluster run one at a time.
# The rest run on three xdist workers, a module per worker (module-scoped engines and brokers
# stay shared): much of the suite waits on brokers and engine start-ups, and those waits overlap. Modules go out
# in collection order, the ones that start engines first (tests/conftest.py: LONGEST_FIRST), so no long module
# starts last and runs alone. Each run lists its slowest tests, for whoever makes the suite faster next.
serial=(tests/test_compose.py tests/test_compose_head.py tests/test_compose_rehearsal.py tests/test_verl_integration.py
  tests/test_verl_ray.py tests/test_verl_readme.py tests/test_kafka_cluster.py tests/test_kafka_outage.py
  tests/test_monitoring_kafka_jmx.py)
ignored=()
for module in "${serial[@]}"; do ignored+=(--ignore "$module"); done
# The one-at-a-time modules use only the three-broker cluster and Ray, which no other module touches, and spend
# most of their time waiting (outages, Ray start-ups): they run beside the xdist workers, their report after.
serial_log=$(mktemp)
python -m pytest -q --durations=10 "${serial[@]}" >"$serial_log" 2>&1 &
serial_pid=$!
status=0
python -m pytest -q -n "${DAS_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder --durations=15 "${ignored[@]}" || status=$?
wait "$serial_pid" || status=$?
cat "$serial_log"
rm -f "$serial_log"
exit "$status"
