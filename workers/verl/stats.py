"""The DAS proposer's statistics from the trainer's side of verl.

verl's `vLLMHttpServer.collective_rpc` awaits the engine's RPC but drops its results, and its other methods
return nothing of the proposer. So the RPC's callable (run by vLLM in every worker process of the server)
writes each rank's `das_stats` to a file next to the server, and Ray's `__ray_call__` reads them back inside
the server actor (which shares the node with its workers) and removes them.

    per_server = agent_loop_manager.das_stats()   # our managers: [[rank 0 stats, rank 1 ...], ...] per server
    per_server = das_stats(server_handles)        # any vLLMHttpServer actor handles
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

import ray

STATS_PREFIX = "das-stats-"


def _write_stats(worker: Any, path: str) -> None:
    """Runs in each vLLM worker process (vLLM passes the worker as the first argument)."""
    rank = int(getattr(worker, "rank", 0))
    target = Path(f"{path}.{rank}")
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(worker.das_stats()))
    tmp.replace(target)


def _read_stats(_server: Any, path: str) -> list[dict[str, Any]]:
    """Runs inside the server actor: the ranks' files in rank order, removed once read."""
    folder, name = os.path.split(path)
    files = sorted(Path(folder).glob(f"{name}.*"), key=lambda p: int(p.suffix[1:]))
    out = [json.loads(f.read_text()) for f in files if f.suffix[1:].isdigit()]
    for f in files:
        f.unlink(missing_ok=True)
    return out


def _stats_path(server: Any) -> str:
    """A fresh file prefix in the server node's temporary folder."""
    return os.path.join(tempfile.gettempdir(), f"{STATS_PREFIX}{uuid.uuid4().hex}")


def das_stats(servers: list[Any], timeout_s: float = 60.0) -> list[list[dict[str, Any]]]:
    """Each server's per-rank proposer statistics (see `DasProposer.stats`), in server order.

    Args:
        servers: verl's `vLLMHttpServer` actor handles (`LLMServerManager.server_handles`, or
            `router_servers` of the load balancer an agent loop manager routes through).
    """
    results = []
    for server in servers:
        path = ray.get(server.__ray_call__.remote(_stats_path))
        ray.get(server.collective_rpc.remote(_write_stats, timeout=timeout_s, args=(path,)))
        results.append(ray.get(server.__ray_call__.remote(_read_stats, path)))
    return results


def _servers_of(balancer: Any) -> list[Any]:
    return list(balancer._servers.values())


def router_servers(load_balancer: Any) -> list[Any]:
    """The server handles a verl load balancer actor routes to (its `_servers` registry, which verl's
    `GlobalRequestLoadBalancer` and our `ProblemAffinityLoadBalancer` keep; verl offers no public getter)."""
    return ray.get(load_balancer.__ray_call__.remote(_servers_of))
