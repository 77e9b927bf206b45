"""Waits until the Ray cluster this process reaches (RAY_ADDRESS) holds the GPUs the trainer will ask for.

verl's trainer raises at once when its resource pool needs more GPUs than the cluster has ("Total available
GPUs ... is less than total desired GPUs"), and the compose Ray head starts before its GPU nodes join. So
scripts/ray_head.sh runs this between `ray start --head` and the trainer:

    python3 scripts/wait_for_gpus.py NODES GPUS_PER_NODE

It polls `ray.cluster_resources()` and says every 30 s what it has and what it waits for. It never gives up: a
node that is late (a replica still rebuilding from the topic, an image still pulling) only delays training.
"""

from __future__ import annotations

import sys
import time

# Ray's view of a joining node is refreshed about once a second; polling faster only loads the GCS.
POLL_S = 2.0
# How often the wait is logged: often enough to see it is alive, rarely enough to read the log.
REPORT_S = 30.0


def wanted_gpus(nodes: str, gpus_per_node: str) -> int:
    """NODES x GPUS_PER_NODE, both positive integers (the trainer's trainer.nnodes and n_gpus_per_node).

    Raises:
        ValueError: either is not a positive integer.
    """
    counts = []
    for name, value in (("DAS_NODES", nodes), ("DAS_GPUS_PER_NODE", gpus_per_node)):
        if not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
        counts.append(int(value))
    return counts[0] * counts[1]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: wait_for_gpus.py NODES GPUS_PER_NODE", file=sys.stderr)
        return 2
    try:
        want = wanted_gpus(*argv)
    except ValueError as exc:
        print(f"wait_for_gpus: {exc}", file=sys.stderr)
        return 2
    import ray

    ray.init(log_to_driver=False)
    try:
        last_report = 0.0
        while True:
            have = ray.cluster_resources().get("GPU", 0.0)
            if have >= want:
                print(f"wait_for_gpus: {have:g} GPUs in the cluster, {want} needed: starting", flush=True)
                return 0
            if time.monotonic() - last_report >= REPORT_S:
                alive = sum(1 for node in ray.nodes() if node["Alive"])
                print(
                    f"wait_for_gpus: waiting for {want} GPUs (DAS_NODES x DAS_GPUS_PER_NODE); "
                    f"{have:g} in the cluster, {alive} Ray nodes alive",
                    flush=True,
                )
                last_report = time.monotonic()
            time.sleep(POLL_S)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
