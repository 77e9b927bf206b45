#!/usr/bin/env bash
# Installs the system packages the tests run for real: Prometheus and promtool (Debian's `prometheus` package).
# Idempotent: does nothing when both binaries are present, and refreshes the apt index only when it must install.
# Debian's package would start a daemon on systemd hosts; we stop nothing and start nothing here: the tests run
# their own prometheus on a loopback port with a temporary config.
set -euo pipefail

missing=()
for binary in prometheus promtool; do
    command -v "$binary" >/dev/null 2>&1 || missing+=("$binary")
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1; then
    as_root=(sudo -n)
else
    echo "install_system_deps: ${missing[*]} missing and not root (no sudo): install Debian's 'prometheus' package" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_system_deps: ${missing[*]} missing and no apt-get: install Prometheus 2.x (prometheus, promtool) on PATH" >&2
    exit 1
fi

echo "install_system_deps: installing prometheus (missing: ${missing[*]})" >&2
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus
for binary in prometheus promtool; do
    command -v "$binary" >/dev/null 2>&1 || { echo "install_system_deps: $binary still missing after install" >&2; exit 1; }
done
