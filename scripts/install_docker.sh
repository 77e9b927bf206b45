#!/usr/bin/env bash
# Installs the container tooling `make compose-check` and docker-compose.cpu.yml need, on a Debian bookworm machine
# with no image registry (docs/deployment.md, "Run it on one machine without GPUs"). Idempotent: each step runs only
# when its result is missing, and every step says what it did.
#   1. Debian's Docker Engine (`docker.io`, 20.10) and debootstrap (the image base is built from Debian's packages);
#   2. the Compose v2 plugin, built from the Go module proxy at a pinned version (no package has Compose v2):
#      `go install` refuses the module (its go.mod has exclude directives), so the module is downloaded and built
#      inside its folder, then copied to ~/.docker/cli-plugins/docker-compose;
#   3. `dockerd`, started in the background when nothing answers on its socket (no init system starts it here), and
#      waited for.
# Prints the docker client the other scripts use (Debian's 20.10 client: it builds with BuildKit without buildx).
#   bash scripts/install_docker.sh [--no-daemon]
# --no-daemon stops after step 2: the test suite needs the client and the plugin (`docker compose config`), no engine.
set -euo pipefail

COMPOSE_MODULE=github.com/docker/compose/v5
COMPOSE_VERSION=${DAS_COMPOSE_VERSION:-v5.6.0}
PLUGIN_DIR=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins
DOCKERD_LOG=${DAS_DOCKERD_LOG:-/var/log/das-dockerd.log}
SOCKET=/var/run/docker.sock
# Debian's client; a docker 2x client elsewhere on PATH wants buildx for BuildKit, which bookworm does not package.
DOCKER=/usr/bin/docker

say() { echo "install_docker: $*" >&2; }

if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo -n)
else
  say "not root and no sudo: run as root"
  exit 1
fi

# 1. Debian's packages.
packages=()
[ -x /usr/sbin/dockerd ] && [ -x "$DOCKER" ] || packages+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || packages+=(debootstrap)
if [ ${#packages[@]} -gt 0 ]; then
  say "installing ${packages[*]} from Debian"
  "${as_root[@]}" apt-get update -qq
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${packages[@]}" >/dev/null
else
  say "docker.io and debootstrap already installed"
fi

# 2. The Compose plugin at the pinned version.
plugin="$PLUGIN_DIR/docker-compose"
have=""
[ -x "$plugin" ] && have=$("$plugin" version --short 2>/dev/null || true)
if [ "$have" = "${COMPOSE_VERSION#v}" ] || [ "$have" = "$COMPOSE_VERSION" ]; then
  say "compose plugin $COMPOSE_VERSION already in $plugin"
else
  command -v go >/dev/null 2>&1 || { say "Go is needed to build the compose plugin (go.dev/dl or Debian backports)"; exit 1; }
  say "building compose $COMPOSE_VERSION from the Go module proxy (found: ${have:-none})"
  # Outside any module, so the download is only this module and its dependencies.
  workdir=$(mktemp -d)
  trap 'rm -rf "$workdir"' EXIT
  (cd "$workdir" && GOFLAGS=-mod=mod go mod download "$COMPOSE_MODULE@$COMPOSE_VERSION")
  moddir="$(go env GOMODCACHE)/$COMPOSE_MODULE@$COMPOSE_VERSION"
  (cd "$moddir" && CGO_ENABLED=0 go build -trimpath \
    -ldflags "-s -w -X $COMPOSE_MODULE/internal.Version=$COMPOSE_VERSION" -o "$workdir/docker-compose" ./cmd)
  mkdir -p "$PLUGIN_DIR"
  install -m 0755 "$workdir/docker-compose" "$plugin"
  say "installed $("$plugin" version --short) in $plugin"
fi

if [ "${1:-}" = "--no-daemon" ]; then
  say "ready: client $("$DOCKER" --version), compose $("$DOCKER" compose version --short) (dockerd not started)"
  echo "$DOCKER"
  exit 0
fi

# 3. The engine.
if "$DOCKER" info >/dev/null 2>&1; then
  say "dockerd already answers on $SOCKET"
else
  say "starting dockerd (log: $DOCKERD_LOG)"
  # setsid: the daemon outlives this script and the shell that ran it.
  "${as_root[@]}" setsid /usr/sbin/dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
  for _ in $(seq 1 120); do
    "$DOCKER" info >/dev/null 2>&1 && break
    sleep 1
  done
  "$DOCKER" info >/dev/null 2>&1 || { say "dockerd did not answer within 120 s: see $DOCKERD_LOG"; exit 1; }
  say "dockerd answers on $SOCKET"
fi
say "ready: $("$DOCKER" version --format 'engine {{.Server.Version}}'), compose $("$DOCKER" compose version --short)," \
  "storage $("$DOCKER" info --format '{{.Driver}}')"
echo "$DOCKER"
