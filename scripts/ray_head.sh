#!/usr/bin/env bash
# Entry point of the compose Ray head (docker-compose.yml, service ray-head):
#   ray_head.sh [ray start --head flags...] -- trainer command...
# 1. Starts this host's Ray head and keeps Prometheus' file_sd lists of verl's vLLM servers ($DAS_VLLM_TARGETS)
#    and of the DAS proposers' /metrics inside them (das-proposers.json beside it, from the notes in each node's
#    $DAS_PROPOSER_TARGETS) current in the background (`das monitoring vllm-targets`).
# 2. Waits until the cluster holds DAS_NODES x DAS_GPUS_PER_NODE GPUs (scripts/wait_for_gpus.py): verl's trainer
#    fails at once when its GPU nodes have not joined yet.
# 3. Runs the trainer with DAS_VERL_ARGS appended (shell words, e.g. "data.max_response_length=4096
#    trainer.total_training_steps=100"). A failure exits with the trainer's status, so compose restarts the head
#    and verl resumes from its checkpoint. After a normal finish Ray stays up until the container is stopped:
#    the Ray workers would otherwise lose their head and restart in a loop, and their targets would go down.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=ray_node_env.sh
source "$here/ray_node_env.sh"

ray_flags=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  ray_flags+=("$1")
  shift
done
[ $# -gt 1 ] || { echo "ray_head.sh: usage: ray_head.sh [ray start flags] -- command..." >&2; exit 2; }
shift
: "${DAS_NODES:?ray_head.sh: set DAS_NODES, the GPU nodes the trainer waits for}"
: "${DAS_GPUS_PER_NODE:?ray_head.sh: set DAS_GPUS_PER_NODE, the GPUs of each node}"
if [ -n "${DAS_VERL_ARGS:-}" ]; then
  # Split as a shell would (quotes group words) without evaluating anything.
  mapfile -d '' -t extra < <(python3 -c 'import os, shlex, sys; sys.stdout.write("\0".join(shlex.split(os.environ["DAS_VERL_ARGS"])))')
  set -- "$@" "${extra[@]}"
fi

ray start --head "${ray_flags[@]}" "${ray_node_flags[@]}"
if [ -n "${DAS_VLLM_TARGETS:-}" ]; then
  das monitoring vllm-targets --out "$DAS_VLLM_TARGETS" --proposers "${DAS_PROPOSER_TARGETS:-/tmp/das-proposers}" &
fi
python3 "$here/wait_for_gpus.py" "$DAS_NODES" "$DAS_GPUS_PER_NODE"

"$@" &
trainer=$!
trap 'kill -TERM "$trainer" 2>/dev/null || true' TERM INT
code=0
wait "$trainer" || code=$?
# A signal interrupts `wait` before the trainer is gone: wait again for its own status.
while kill -0 "$trainer" 2>/dev/null; do
  code=0
  wait "$trainer" || code=$?
done
[ "$code" -eq 0 ] || exit "$code"
echo "ray_head.sh: training finished; Ray stays up for its workers until the container stops" \
  "(docker compose stop ray-head)"
trap 'exit 0' TERM INT
sleep infinity &
wait $!
