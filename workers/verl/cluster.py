"""Reading what each node of the connected Ray cluster holds on its own disk (history replicas, proposer notes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def on_every_node(function: Callable[..., T], *args: Any) -> list[T]:
    """`function(*args)` run once on every live node of the connected Ray cluster (pinned there: the point is to
    read that node's files), results in node order. Costs no CPU reservation, so it runs beside busy workers."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0)(function)
    return ray.get(
        [
            remote.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)
            ).remote(*args)
            for node in ray.nodes()
            if node["Alive"]
        ]
    )
