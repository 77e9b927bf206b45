#!/usr/bin/env bash
# Entry point of the compose Ray head (docker-compose.yml, service ray-head):
#   ray_head.sh [ray start --head flags...] -- trainer command...
# Starts this host's Ray head, keeps Prometheus' file_sd list of verl's vLLM servers current in the background
# ($DAS_VLLM_TARGETS, via `das monitoring vllm-targets`), then runs the trainer in the foreground: the container
# lives and exits with it, so a crash restarts it and verl resumes from its checkpoint.
set -euo pipefail

ray_flags=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  ray_flags+=("$1")
  shift
done
[ $# -gt 1 ] || { echo "ray_head.sh: usage: ray_head.sh [ray start flags] -- command..." >&2; exit 2; }
shift

ray start --head "${ray_flags[@]}"
if [ -n "${DAS_VLLM_TARGETS:-}" ]; then
  das monitoring vllm-targets --out "$DAS_VLLM_TARGETS" &
fi
exec "$@"
