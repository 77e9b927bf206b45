#!/usr/bin/env bash
# The entrypoint of docker/kafka.Dockerfile, as apache/kafka's: the broker's properties come from KAFKA_*
# environment variables (KAFKA_FOO_BAR -> foo.bar, KAFKA_FOO__BAR -> foo_bar, KAFKA_FOO___BAR -> foo-bar), the
# storage is formatted once with CLUSTER_ID (an already formatted log folder is kept), then the broker runs in the
# foreground as PID 1's child-free replacement (exec), so `docker kill` reaches the JVM.
#   run-broker.sh                 configure, format once, run the broker
#   run-broker.sh --print-config  print the properties the environment gives, and exit (tests/test_compose_cpu.py)
set -euo pipefail
config=${DAS_KAFKA_CONFIG:-/opt/kafka/config/server.properties}
# The JVM's own settings, not broker properties (apache/kafka's list).
skip=" KAFKA_OPTS KAFKA_HEAP_OPTS KAFKA_LOG4J_OPTS KAFKA_JMX_OPTS KAFKA_JVM_PERFORMANCE_OPTS KAFKA_GC_LOG_OPTS KAFKA_DEBUG KAFKA_VERSION "
: >"$config"
while IFS='=' read -r -d '' name value; do
  case "$name" in KAFKA_*) ;; *) continue ;; esac
  [[ "$skip" == *" $name "* ]] && continue
  key=${name#KAFKA_}
  key=${key//___/-}
  key=${key//__/@}
  key=${key//_/.}
  key=${key//@/_}
  printf '%s=%s\n' "${key,,}" "$value" >>"$config"
done < <(env -0)
grep -q '^log.dirs=' "$config" || echo "log.dirs=/var/lib/kafka/data" >>"$config"
if [ "${1:-}" = --print-config ]; then
  cat "$config"
  exit 0
fi
: "${CLUSTER_ID:?run-broker.sh: set CLUSTER_ID (22 characters, base64 of 16 bytes)}"
classpath="/opt/kafka/libs/*"
# The storage tool's JVM must not load the JMX agent: the agent's port belongs to the broker.
KAFKA_OPTS= java -Xmx256m $KAFKA_LOG4J_OPTS -cp "$classpath" kafka.tools.StorageTool format \
  --cluster-id "$CLUSTER_ID" --config "$config" --ignore-formatted
# shellcheck disable=SC2086 - the *_OPTS variables are lists of JVM flags
exec java ${KAFKA_HEAP_OPTS:--Xmx1G -Xms1G} ${KAFKA_JVM_PERFORMANCE_OPTS:--XX:+UseG1GC -XX:MaxGCPauseMillis=20} \
  $KAFKA_LOG4J_OPTS ${KAFKA_OPTS:-} -cp "$classpath" kafka.Kafka "$config"
