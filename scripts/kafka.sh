#!/usr/bin/env bash
# Local Apache Kafka 4.x (KRaft, no ZooKeeper, no Docker) for development and tests, all on loopback:
#   - one single broker        127.0.0.1:19092 (controller 19093)
#   - a three-broker cluster   127.0.0.1:29092,29093,29094 (controllers 29192-29194)
# Usage:
#   bash scripts/kafka.sh up               resolve Kafka (once), format storage (once), start all, wait until ready,
#                                          write .kafka/env.sh (DAS_KAFKA_BOOTSTRAP, DAS_KAFKA_CLUSTER_BOOTSTRAP)
#   bash scripts/kafka.sh down             stop everything (safe to call twice)
#   bash scripts/kafka.sh stop-broker N    stop cluster broker N (1..3) gracefully; start-broker N brings it back
#   bash scripts/kafka.sh status           which nodes run
#   bash scripts/kafka.sh clean            down, then delete the brokers' data (the resolved jars stay)
#   bash scripts/kafka.sh up-secure        one more single broker, TLS + SASL/PLAIN only, on 127.0.0.1:39092
#                                          (controller 39093), with Kafka's KRaft authorizer (StandardAuthorizer):
#                                          a throwaway CA and broker certificate (openssl) and random passwords under
#                                          .kafka/secure for the users admin (super user), das (rollout writers),
#                                          das-trainer (epoch advances) and das-replica (history replicas); nothing
#                                          is allowed until `das kafka init` grants it. Writes .kafka/secure/env.sh
#                                          (DAS_KAFKA_SECURE_BOOTSTRAP, _CAFILE, _USERNAME, _PASSWORD, and
#                                          _ADMIN_PASSWORD, _TRAINER_PASSWORD, _REPLICA_PASSWORD). `down` stops it.
#   bash scripts/kafka.sh restart-secure   stop the secure broker and start it with the current configuration
# Kafka and its runtime dependencies come from Maven Central through scripts/kafka/pom.xml into .kafka/lib, and the
# Prometheus JMX exporter agent into .kafka/agent: every node serves broker metrics (rules in
# monitoring/prometheus/kafka-jmx.yml) on 127.0.0.1:19099 (single) and 29095-29097 (cluster), listed in
# DAS_KAFKA_JMX_TARGETS of .kafka/env.sh.
# Env: DAS_KAFKA_HEAP (JVM -Xmx per node, default 320m: the machine has 2 cores and other work runs beside it),
#      PYTHON (interpreter with kafka-python for the readiness check; default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
KDIR=$ROOT/.kafka
LIB=$KDIR/lib
AGENT=$KDIR/agent
JMX_RULES=$ROOT/monitoring/prometheus/kafka-jmx.yml
RUN=$KDIR/run
PY=${PYTHON:-$ROOT/${VENV:-.venv}/bin/python}
HEAP=${DAS_KAFKA_HEAP:-320m}
READY_TIMEOUT_S=${DAS_KAFKA_READY_TIMEOUT_S:-120}

SINGLE_BOOTSTRAP=127.0.0.1:19092
CLUSTER_BOOTSTRAP=127.0.0.1:29092,127.0.0.1:29093,127.0.0.1:29094
CLUSTER_VOTERS=1@127.0.0.1:29192,2@127.0.0.1:29193,3@127.0.0.1:29194
JMX_TARGETS=127.0.0.1:19099,127.0.0.1:29095,127.0.0.1:29096,127.0.0.1:29097

die() { echo "kafka.sh: $*" >&2; exit 1; }

resolve() {
  [ -f "$LIB/.complete" ] && return 0
  command -v mvn >/dev/null || die "mvn not found: install Maven (apt-get install maven) to resolve Kafka"
  command -v java >/dev/null || die "java not found: Kafka 4.x needs Java 17+ (apt-get install openjdk-17-jre-headless)"
  echo "kafka.sh: resolving Kafka from Maven Central into $LIB" >&2
  rm -rf "$LIB.tmp"
  mvn -q -B -Dstyle.color=never -f scripts/kafka/pom.xml dependency:copy-dependencies -DincludeScope=runtime \
    -DexcludeArtifactIds=jmx_prometheus_javaagent -DoutputDirectory="$LIB.tmp" ||
    die "resolving Kafka with Maven failed (see above)"
  rm -rf "$LIB"
  mv "$LIB.tmp" "$LIB"
  touch "$LIB/.complete"
}

# The agent stays off the broker's classpath (it bundles its own Prometheus client): a folder of its own.
resolve_agent() {
  [ -f "$AGENT/.complete" ] && return 0
  command -v mvn >/dev/null || die "mvn not found: install Maven (apt-get install maven) to resolve the JMX exporter"
  echo "kafka.sh: resolving the Prometheus JMX exporter agent from Maven Central into $AGENT" >&2
  rm -rf "$AGENT.tmp"
  mvn -q -B -Dstyle.color=never -f scripts/kafka/pom.xml dependency:copy-dependencies -DincludeScope=runtime \
    -DincludeArtifactIds=jmx_prometheus_javaagent -Dmdep.stripVersion=true -DoutputDirectory="$AGENT.tmp" ||
    die "resolving the JMX exporter agent with Maven failed (see above)"
  [ -f "$AGENT.tmp/jmx_prometheus_javaagent.jar" ] || die "Maven did not produce jmx_prometheus_javaagent.jar"
  rm -rf "$AGENT"
  mv "$AGENT.tmp" "$AGENT"
  touch "$AGENT/.complete"
}

# node NAME -> "node_id port controller_port voters replication_factor min_isr jmx_exporter_port"
node() {
  case "$1" in
    single) echo "1 19092 19093 1@127.0.0.1:19093 1 1 19099" ;;
    c1) echo "1 29092 29192 $CLUSTER_VOTERS 3 2 29095" ;;
    c2) echo "2 29093 29193 $CLUSTER_VOTERS 3 2 29096" ;;
    c3) echo "3 29094 29194 $CLUSTER_VOTERS 3 2 29097" ;;
    secure) echo "1 39092 39093 1@127.0.0.1:39093 1 1 39099" ;;
    *) die "unknown node $1" ;;
  esac
}

write_config() {
  local name=$1 id port cport voters rf isr _jmx
  read -r id port cport voters rf isr _jmx <<<"$(node "$name")"
  mkdir -p "$KDIR/config" "$KDIR/data/$name" "$KDIR/logs"
  # Small thread pools and buffers: four nodes share two cores and a few GiB with the test suite.
  cat >"$KDIR/config/$name.properties" <<EOF
process.roles=broker,controller
node.id=$id
controller.quorum.voters=$voters
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$KDIR/data/$name
auto.create.topics.enable=false
num.partitions=6
default.replication.factor=$rf
min.insync.replicas=$isr
offsets.topic.replication.factor=$rf
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=$rf
transaction.state.log.min.isr=$isr
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=$rf
share.coordinator.state.topic.min.isr=$isr
group.initial.rebalance.delay.ms=0
message.max.bytes=16777216
replica.fetch.max.bytes=16777216
num.network.threads=2
num.io.threads=2
background.threads=2
num.replica.fetchers=1
num.recovery.threads.per.data.dir=1
log.cleaner.threads=1
log.cleaner.dedupe.buffer.size=16777216
EOF
}

# Cluster ids come from Kafka's own generator (`kafka-storage random-uuid`): it never draws one that begins with
# "-", which kafka-storage's argument parser would read as an option ("--cluster-id: expected one argument").
# A hand-rolled base64 uuid4 here once did, one fresh checkout in 64; an id file holding one is replaced.
cluster_id() {
  local group=$1 file="$KDIR/config/$1.cluster-id"
  if [ ! -f "$file" ] || [ "$(head -c1 "$file")" = "-" ]; then
    java -Xmx64m -cp "$LIB/*" -Dlog4j2.configurationFile="$ROOT/scripts/kafka/log4j2.properties" \
      -Dkafka.log.file="$KDIR/logs/$group.cluster-id.log" \
      kafka.tools.StorageTool random-uuid >"$file.new" 2>"$KDIR/logs/$group.cluster-id.err" &&
      mv "$file.new" "$file" || die "kafka-storage random-uuid failed (see $KDIR/logs/$group.cluster-id.err)"
  fi
  cat "$file"
}

format() {
  local name=$1 group=$2
  [ -f "$KDIR/data/$name/meta.properties" ] && return 0
  java -Xmx128m -cp "$LIB/*" -Dlog4j2.configurationFile="$ROOT/scripts/kafka/log4j2.properties" \
    -Dkafka.log.file="$KDIR/logs/$name.format.log" kafka.tools.StorageTool format \
    -t "$(cluster_id "$group")" -c "$KDIR/config/$name.properties" >"$KDIR/logs/$name.format.out" 2>&1 ||
    die "formatting $name failed: $(tail -5 "$KDIR/logs/$name.format.out")"
}

pid_of() { [ -f "$RUN/$1.pid" ] && cat "$RUN/$1.pid"; }
# A pid file can outlive its broker (machine restart) and the pid be reused: check it is our broker.
running() {
  local pid
  pid=$(pid_of "$1") && kill -0 "$pid" 2>/dev/null &&
    grep -q "$KDIR/config/$1.properties" "/proc/$pid/cmdline" 2>/dev/null
}

# A port that answers before our node starts belongs to someone else, most often another checkout's broker left
# running: the readiness check would then pass against it (a stale cluster, another CA), so refuse and name it.
port_holder() {
  local port=$1 inode pid
  inode=$(awk -v p="$(printf '%04X' "$port")" '$2 ~ ":"p"$" && $4 == "0A" {print $10; exit}' /proc/net/tcp)
  [ -n "$inode" ] || return 0
  for pid in /proc/[0-9]*; do
    if ls -l "$pid/fd" 2>/dev/null | grep -q "socket:\[$inode\]"; then
      echo "pid ${pid#/proc/}: $(tr '\0\n' '  ' <"$pid/cmdline" | cut -c1-200)"
      return 0
    fi
  done
  echo "an unknown process"
}

check_ports_free() {
  local name=$1 id port cport _v _rf _isr jmx holder
  read -r id port cport _v _rf _isr jmx <<<"$(node "$name")"
  for port in "$port" "$cport" "$jmx"; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      holder=$(port_holder "$port")
      die "port $port (node $name) is already in use by ${holder:-an unknown process}; another checkout's brokers? stop them with its 'bash scripts/kafka.sh down'"
    fi
  done
}

start_node() {
  local name=$1 jmx
  running "$name" && return 0
  check_ports_free "$name"
  mkdir -p "$RUN"
  jmx=$(node "$name" | cut -d' ' -f7)
  # setsid: the broker outlives this script and is not hit by a Ctrl-C meant for the caller.
  setsid nohup java -Xms64m -Xmx"$HEAP" -XX:+UseSerialGC -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true \
    -javaagent:"$AGENT/jmx_prometheus_javaagent.jar=127.0.0.1:$jmx:$JMX_RULES" \
    -Dlog4j2.configurationFile="$ROOT/scripts/kafka/log4j2.properties" -Dkafka.log.file="$KDIR/logs/$name.log" \
    -cp "$LIB/*" kafka.Kafka "$KDIR/config/$name.properties" >"$KDIR/logs/$name.out" 2>&1 </dev/null &
  echo $! >"$RUN/$name.pid"
}

stop_nodes() {
  local name pid pids=()
  for name in "$@"; do
    if running "$name"; then
      pid=$(pid_of "$name")
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$name:$pid")
    fi
  done
  # A graceful stop moves partition leadership away first; give it 30 s, then kill what is left.
  local deadline=$((SECONDS + 30)) entry
  for entry in "${pids[@]}"; do
    pid=${entry#*:}
    while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "kafka.sh: ${entry%%:*} did not stop in 30 s, killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  for name in "$@"; do rm -f "$RUN/$name.pid"; done
}

# A real readiness check: the brokers answer a metadata request listing at least the expected number of live
# (unfenced) brokers and an elected controller (and, with a node id, that this node is among them).
wait_ready() {
  local bootstrap=$1 brokers=$2 node_id=${3:-} names=$4
  "$PY" - "$bootstrap" "$brokers" "$node_id" "$READY_TIMEOUT_S" "$KDIR/logs" "$names" <<'EOF' || exit 1
import sys, time, logging
from kafka import KafkaAdminClient
from kafka.errors import KafkaError
logging.disable(logging.CRITICAL)  # connection refusals while the brokers start are expected
bootstrap, want, node_id, timeout, logs, names = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5], sys.argv[6]
import json, os
settings = json.loads(os.environ.get("DAS_KAFKA_READY_SETTINGS") or "{}")  # client TLS/SASL (up-secure)
deadline, last = time.monotonic() + timeout, "no answer"
while time.monotonic() < deadline:
    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","), request_timeout_ms=5000, **settings)
        try:
            info = admin.describe_cluster()
        finally:
            admin.close()
        ids = sorted(b["broker_id"] for b in info["brokers"] if not b.get("is_fenced"))
        last = f"brokers {ids}, controller {info.get('controller_id')}"
        if len(ids) >= want and info.get("controller_id", -1) >= 0 and (not node_id or int(node_id) in ids):
            sys.exit(0)
    except (KafkaError, OSError) as exc:
        last = f"{type(exc).__name__}: {exc}"
    time.sleep(0.5)
sys.exit(f"kafka.sh: {bootstrap} not ready after {timeout:.0f} s ({last}); logs: {logs}/{{{names}}}.log")
EOF
}

write_env() {
  cat >"$KDIR/env.sh" <<EOF
# Written by scripts/kafka.sh up: the local brokers the tests and benchmarks use.
export DAS_KAFKA_BOOTSTRAP=$SINGLE_BOOTSTRAP
export DAS_KAFKA_CLUSTER_BOOTSTRAP=$CLUSTER_BOOTSTRAP
export DAS_KAFKA_JMX_TARGETS=$JMX_TARGETS
EOF
}

up() {
  [ -x "$PY" ] || die "python with kafka-python not found at $PY (build the venv first, or set PYTHON)"
  resolve
  resolve_agent
  local name
  for name in single c1 c2 c3; do write_config "$name"; done
  # Formatting starts one JVM per node: in parallel it takes the time of one.
  cluster_id cluster >/dev/null
  local pids=() pid
  format single single & pids+=($!)
  for name in c1 c2 c3; do format "$name" cluster & pids+=($!); done
  for pid in "${pids[@]}"; do wait "$pid" || die "formatting KRaft storage failed (see $KDIR/logs/*.format.out)"; done
  for name in single c1 c2 c3; do start_node "$name"; done
  wait_ready "$SINGLE_BOOTSTRAP" 1 "" single
  wait_ready "$CLUSTER_BOOTSTRAP" 3 "" c1,c2,c3
  write_env
  echo "kafka.sh: single broker $SINGLE_BOOTSTRAP and cluster $CLUSTER_BOOTSTRAP ready; source $KDIR/env.sh" >&2
}

# The secure broker: TLS on its client listener (certificate from a throwaway CA made here with openssl), SASL/PLAIN
# logins (the broker itself as "admin"; "das" for rollout writers, "das-trainer" for epoch advances, "das-replica"
# for replicas) and the KRaft authorizer, so only what ACLs grant is allowed. Separate from the plain setup above.
SECURE=$KDIR/secure
SECURE_BOOTSTRAP=127.0.0.1:39092

secure_material() {
  [ -f "$SECURE/.complete" ] && return 0
  command -v openssl >/dev/null || die "openssl not found (apt-get install openssl)"
  rm -rf "$SECURE" && mkdir -p "$SECURE" && chmod 700 "$SECURE"
  (
    cd "$SECURE"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=DAS test CA" \
      -keyout ca.key -out ca.pem 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout broker.key -out broker.csr 2>/dev/null
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' >san.ext
    openssl x509 -req -in broker.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile san.ext -out broker.pem 2>/dev/null
    "$PY" -c 'import secrets; print(secrets.token_urlsafe(18)); print(secrets.token_urlsafe(18))' >passwords
    openssl pkcs12 -export -in broker.pem -inkey broker.key -certfile ca.pem -name broker \
      -passout "pass:$(sed -n 1p passwords)" -out broker.p12
  ) || die "making the secure broker's certificates failed"
  touch "$SECURE/.complete"
}

# One password per line: admin, das, das-trainer, das-replica (material made before the last two gets them added).
secure_passwords() {
  while [ "$(wc -l <"$SECURE/passwords")" -lt 4 ]; do
    "$PY" -c 'import secrets; print(secrets.token_urlsafe(18))' >>"$SECURE/passwords"
  done
}

write_secure_config() {
  local admin_pw das_pw trainer_pw replica_pw
  secure_passwords
  admin_pw=$(sed -n 1p "$SECURE/passwords")
  das_pw=$(sed -n 2p "$SECURE/passwords")
  trainer_pw=$(sed -n 3p "$SECURE/passwords")
  replica_pw=$(sed -n 4p "$SECURE/passwords")
  mkdir -p "$KDIR/config" "$KDIR/data/secure" "$KDIR/logs"
  # Only what makes this node secure differs from the plain single broker.
  cat >"$KDIR/config/secure.properties" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:39093
listeners=SASL_SSL://127.0.0.1:39092,CONTROLLER://127.0.0.1:39093
advertised.listeners=SASL_SSL://127.0.0.1:39092
controller.listener.names=CONTROLLER
inter.broker.listener.name=SASL_SSL
listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT
sasl.enabled.mechanisms=PLAIN
sasl.mechanism.inter.broker.protocol=PLAIN
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username="admin" password="$admin_pw" user_admin="$admin_pw" user_das="$das_pw" user_das-trainer="$trainer_pw" user_das-replica="$replica_pw";
# Only what ACLs allow (das kafka init --*-principal grants it). The controller listener is plaintext on loopback:
# its connections are User:ANONYMOUS, which the controller must trust.
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:admin;User:ANONYMOUS
allow.everyone.if.no.acl.found=false
ssl.keystore.type=PKCS12
ssl.keystore.location=$SECURE/broker.p12
ssl.keystore.password=$admin_pw
ssl.truststore.type=PEM
ssl.truststore.location=$SECURE/ca.pem
ssl.client.auth=none
log.dirs=$KDIR/data/secure
auto.create.topics.enable=false
num.partitions=6
default.replication.factor=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
message.max.bytes=16777216
num.network.threads=2
num.io.threads=2
background.threads=2
num.recovery.threads.per.data.dir=1
log.cleaner.threads=1
log.cleaner.dedupe.buffer.size=16777216
# Compaction within seconds of a segment rolling (the default checks every 15 s): tests compact topics and rebuild.
log.cleaner.backoff.ms=1000
EOF
  chmod 600 "$KDIR/config/secure.properties"
  cat >"$SECURE/env.sh" <<EOF
# Written by scripts/kafka.sh up-secure: the TLS + SASL/PLAIN test broker and a client login for it.
export DAS_KAFKA_SECURE_BOOTSTRAP=$SECURE_BOOTSTRAP
export DAS_KAFKA_SECURE_CAFILE=$SECURE/ca.pem
export DAS_KAFKA_SECURE_USERNAME=das
export DAS_KAFKA_SECURE_PASSWORD=$das_pw
export DAS_KAFKA_SECURE_ADMIN_PASSWORD=$admin_pw
export DAS_KAFKA_SECURE_TRAINER_PASSWORD=$trainer_pw
export DAS_KAFKA_SECURE_REPLICA_PASSWORD=$replica_pw
EOF
}

up_secure() {
  [ -x "$PY" ] || die "python with kafka-python not found at $PY (build the venv first, or set PYTHON)"
  resolve
  resolve_agent
  secure_material
  write_secure_config
  cluster_id secure >/dev/null
  format secure secure
  start_node secure
  # shellcheck disable=SC1091
  source "$SECURE/env.sh"
  DAS_KAFKA_READY_SETTINGS=$(printf '{"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_plain_username": "admin", "sasl_plain_password": "%s", "ssl_cafile": "%s"}' \
    "$DAS_KAFKA_SECURE_ADMIN_PASSWORD" "$DAS_KAFKA_SECURE_CAFILE") wait_ready "$SECURE_BOOTSTRAP" 1 "" secure
  echo "kafka.sh: TLS + SASL broker $SECURE_BOOTSTRAP ready; source $SECURE/env.sh" >&2
}

broker_name() {
  case "${1:-}" in
    1 | 2 | 3) echo "c$1" ;;
    *) die "broker number must be 1, 2 or 3 (cluster brokers), got '${1:-}'" ;;
  esac
}

case "${1:-}" in
  up) up ;;
  up-secure) up_secure ;;
  restart-secure)
    stop_nodes secure
    up_secure
    ;;
  down) stop_nodes single c1 c2 c3 secure ;;
  stop-broker)
    name=$(broker_name "${2:-}")
    running "$name" || die "cluster broker $2 is not running"
    stop_nodes "$name"
    ;;
  start-broker)
    name=$(broker_name "${2:-}")
    [ -f "$KDIR/config/$name.properties" ] || die "run 'bash scripts/kafka.sh up' first"
    resolve_agent
    start_node "$name"
    # Ready when this broker is back in the cluster's metadata; others may still be down on purpose.
    wait_ready "${CLUSTER_BOOTSTRAP}" 1 "${2}" "$name"
    ;;
  status)
    for name in single c1 c2 c3 secure; do
      if running "$name"; then echo "$name running (pid $(pid_of "$name"))"; else echo "$name stopped"; fi
    done
    ;;
  clean)
    stop_nodes single c1 c2 c3 secure
    rm -rf "$KDIR/data" "$KDIR/config" "$KDIR/run" "$KDIR/logs" "$KDIR/env.sh" "$SECURE"
    ;;
  *) die "usage: $0 up | up-secure | restart-secure | down | stop-broker N | start-broker N | status | clean" ;;
esac
