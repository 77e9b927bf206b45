"""`ProblemAffinityLoadBalancer`: verl's request router that keeps one problem's requests on one vLLM server.

verl's default router (`GlobalRequestLoadBalancer`) sends each new request to the least-loaded server, and every
agent loop request has a fresh uuid, so a prompt's n samples (and its later passes) scatter over the replicas:
sibling drafting and each server's history then see 1/servers of the problem. This router keys on the request's
`das_problem_id` (from `sampling_params.extra_args`, which verl hands to routers that ask for it): a problem's
first request goes to the least-loaded server and the problem stays there while that server is in the pool.
Requests without a problem id fall back to verl's own sticky + least-loaded rule.

Selected through verl's router plugin hook, `actor_rollout_ref.rollout.router_config_path`, pointing at a YAML
with `router_class: workers.verl.router.ProblemAffinityLoadBalancer` (`examples/verl/das_router.yaml`).
"""

from __future__ import annotations

from typing import Any

from cachetools import LRUCache
from verl.workers.rollout.router import DEFAULT_ROUTING_CACHE_SIZE, GlobalRequestLoadBalancer

# Problems remembered at once. A data set's problems recur once per pass, so this many keeps every problem of
# MATH-sized sets (12.5k) placed; older ones are placed afresh (least-loaded), which costs locality only.
PROBLEM_CACHE_SIZE = 100_000


def request_problem(sampling_params: Any) -> str | None:
    """The DAS problem id a verl request carries, or None."""
    extra = (sampling_params or {}).get("extra_args") if isinstance(sampling_params, dict) else None
    problem = extra.get("das_problem_id") if isinstance(extra, dict) else None
    return problem if isinstance(problem, str) and problem else None


class ProblemAffinityLoadBalancer(GlobalRequestLoadBalancer):
    """Problem-affine routing with verl's sticky least-loaded rule as the fallback."""

    def __init__(self, servers: dict[str, Any], config: dict[str, Any] | None = None) -> None:
        """verl's plugin constructor: the servers and the router YAML as a dict."""
        config = config or {}
        super().__init__(
            servers, max_cache_size=int(config.get("request_cache_size", DEFAULT_ROUTING_CACHE_SIZE))
        )
        self._problem_to_server: LRUCache = LRUCache(
            maxsize=int(config.get("problem_cache_size", PROBLEM_CACHE_SIZE))
        )

    def require_acquire_fields(self) -> list[str]:
        """verl serializes these `generate()` arguments into `acquire_server`."""
        return ["sampling_params"]

    def acquire_server(
        self, request_id: str, sampling_params: dict[str, Any] | None = None, **_: Any
    ) -> tuple[str, Any]:
        """The problem's server if it is still in the pool, else the least-loaded one (remembered for the
        problem); requests without a problem id go through verl's rule."""
        problem = request_problem(sampling_params)
        if problem is None:
            return super().acquire_server(request_id)
        server_id = self._problem_to_server.get(problem)
        if server_id not in self._inflight_requests:
            server_id, _ = super().acquire_server(request_id)
            self._problem_to_server[problem] = server_id
            return server_id, self._servers[server_id]
        self._inflight_requests[server_id] += 1
        return server_id, self._servers[server_id]

    def clear_sticky_cache(self) -> dict:
        """verl clears stickiness when it rebalances (phase switches, elastic scaling): problems are placed
        afresh too."""
        self._problem_to_server.clear()
        return super().clear_sticky_cache()

    def get_status(self) -> dict:
        status = super().get_status()
        status["problems_placed"] = len(self._problem_to_server)
        return status
