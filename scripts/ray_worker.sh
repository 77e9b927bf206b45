#!/usr/bin/env bash
# Entry point of the compose Ray worker (docker-compose.yml, service ray-worker): this host's GPU node.
#   ray_worker.sh [ray start flags...]
# Joins the head with `ray start --block` plus the cluster network settings (scripts/ray_node_env.sh).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=ray_node_env.sh
source "$here/ray_node_env.sh"
exec ray start --block "${ray_node_flags[@]}" "$@"
