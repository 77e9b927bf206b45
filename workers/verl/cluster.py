"""Reading what each node of the connected Ray cluster holds on its own disk (history replicas, proposer notes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def on_every_node(function: Callable[..., T], *args: Any, timeout_s: float | None = None) -> list[T]:
    """`function(*args)` run once on every live node of the connected Ray cluster (pinned there: the point is to
    read that node's files), results in node order. Costs no CPU reservation, so it runs beside busy workers.

    `timeout_s`: the results of the nodes that answered within it, the others left out (a node that died or
    was cut off after the node list was read would otherwise hold the caller forever). None waits for all.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0)(function)
    refs = [
        remote.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)
        ).remote(*args)
        for node in ray.nodes()
        if node["Alive"]
    ]
    if timeout_s is None:
        return ray.get(refs)
    ready, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for ref in late:
        ray.cancel(ref, force=True)
    results = []
    for ref in refs:
        if ref in ready:
            try:
                results.append(ray.get(ref))
            except Exception:  # noqa: BLE001 - the node died with the task: it holds nothing to read now
                continue
    return results
