#!/usr/bin/env bash
# Installs the system packages the tests run for real: Prometheus and promtool (Debian's `prometheus` package),
# Alertmanager and amtool (`prometheus-alertmanager`). Idempotent: does nothing when the binaries are present,
# and refreshes the apt index only when it must install.
# Debian's packages would start daemons on systemd hosts; we stop nothing and start nothing here: the tests run
# their own prometheus and alertmanager on loopback ports with temporary configs.
set -euo pipefail

missing=()
binaries=(prometheus promtool prometheus-alertmanager amtool)
for binary in "${binaries[@]}"; do
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
    echo "install_system_deps: ${missing[*]} missing and not root (no sudo): install Debian's 'prometheus' and 'prometheus-alertmanager' packages" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_system_deps: ${missing[*]} missing and no apt-get: install Prometheus 2.x (prometheus, promtool) and Alertmanager (prometheus-alertmanager, amtool) on PATH" >&2
    exit 1
fi

echo "install_system_deps: installing prometheus, prometheus-alertmanager (missing: ${missing[*]})" >&2
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    prometheus prometheus-alertmanager
for binary in "${binaries[@]}"; do
    command -v "$binary" >/dev/null 2>&1 || { echo "install_system_deps: $binary still missing after install" >&2; exit 1; }
done
