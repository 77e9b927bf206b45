"""The DAS proposer's statistics from the trainer's side of verl.

verl's `vLLMHttpServer.collective_rpc` awaits the engine's RPC but drops its results, and its other methods
return nothing of the proposer. So the RPC names `das_write_stats` (our worker extension's method; vLLM
refuses to ship a callable unless VLLM_ALLOW_INSECURE_SERIALIZATION=1), which writes each rank's `das_stats` to
a file next to the server, and Ray's `__ray_call__` reads them back inside the server actor (which shares the
node with its workers) and removes them.

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


def write_rank_stats(stats: dict[str, Any], rank: int, path: str) -> None:
    """Writes one rank's statistics to `<path>.<rank>` (atomically: the reader never sees half a file)."""
    target = Path(f"{path}.{rank}")
    tmp = Path(f"{path}.{rank}.tmp")
    tmp.write_text(json.dumps(stats))
    tmp.replace(target)


def _read_stats(_server: Any, path: str) -> list[dict[str, Any]]:
    """Runs inside the server actor: the ranks' files in rank order, removed once read."""
    folder, name = os.path.split(path)
    files = sorted(
        (p for p in Path(folder).glob(f"{name}.*") if p.suffix[1:].isdigit()), key=lambda p: int(p.suffix[1:])
    )
    out = [json.loads(f.read_text()) for f in files]
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
        ray.get(server.collective_rpc.remote("das_write_stats", timeout=timeout_s, args=(path,)))
        results.append(ray.get(server.__ray_call__.remote(_read_stats, path)))
    return results


def _servers_of(balancer: Any) -> list[Any]:
    return list(balancer._servers.values())


def router_servers(load_balancer: Any) -> list[Any]:
    """The server handles a verl load balancer actor routes to (its `_servers` registry, which verl's
    `GlobalRequestLoadBalancer` and our `ProblemAffinityLoadBalancer` keep; verl offers no public getter)."""
    return ray.get(load_balancer.__ray_call__.remote(_servers_of))
