"""`ProblemAffinityLoadBalancer`: verl's request router that keeps one problem's requests on one vLLM server.

verl's default router (`GlobalRequestLoadBalancer`) sends each new request to the least-loaded server, and every
agent loop request has a fresh uuid, so a prompt's n samples (and its later passes) scatter over the replicas:
sibling drafting and each server's history then see 1/servers of the problem. This router keys on the request's
`das_problem_id` (from `sampling_params.extra_args`, which verl hands to routers that ask for it): a problem's
first request goes to the least-loaded server and the problem stays there while that server is in the pool and
not overloaded. Each step samples a different mix of problems, so a server whose problems all recur at once would
set every step's makespan: when a problem with no request in flight (a new group, in this step or a later one)
finds its server more than `rebalance_margin` x the mean load (and at least `rebalance_min_requests`) above the
least-loaded one, it moves there, for good. A group in flight never splits. Requests without a problem id fall
back to verl's own sticky + least-loaded rule.

The router also tells which server holds which problem (`placements`): at the start of each rollout step DAS's
agent loop managers send each server the step's problems placed on it (`prefetch_placed`, the proposer's
`das_prefetch`), so a server that loads history lazily has their trees built before their requests arrive, and
the servers problems moved off since the last step the list of them (`take_departures`, the proposer's
`das_release`), so a server holds the trees of its current problems only.

Selected through verl's router plugin hook, `actor_rollout_ref.rollout.router_config_path`, pointing at a YAML
with `router_class: workers.verl.router.ProblemAffinityLoadBalancer` (`examples/verl/das_router.yaml`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import ray
from cachetools import LRUCache
from verl.workers.rollout.router import DEFAULT_ROUTING_CACHE_SIZE, GlobalRequestLoadBalancer

# Problems remembered at once. A data set's problems recur once per pass, so this many keeps every problem of
# MATH-sized sets (12.5k) placed; older ones are placed afresh (least-loaded), which costs locality only.
PROBLEM_CACHE_SIZE = 100_000
# A problem moves off its server when that server's in-flight requests exceed the least-loaded server's by more
# than this share of the mean load: enough slack that a GRPO group (n requests) arriving does not bounce problems
# between evenly loaded servers, little enough that one server cannot carry much more than its share
# (tests/test_verl_router_balance.py measures makespans under skewed per-step mixes).
REBALANCE_MARGIN = 0.25
# ... and by at least this many requests: one group of verl's usual n=8 samples.
REBALANCE_MIN_REQUESTS = 8


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
        self._margin = float(config.get("rebalance_margin", REBALANCE_MARGIN))
        self._min_requests = int(config.get("rebalance_min_requests", REBALANCE_MIN_REQUESTS))
        # In-flight requests per problem, and the problem of each in-flight request (released by request id).
        self._problem_inflight: dict[str, int] = {}
        self._request_problem: dict[str, str] = {}
        self.moves = 0
        # Problems that moved off each server since `take_departures` (the server may drop their trees).
        self._departed: dict[str, set[str]] = {}

    def require_acquire_fields(self) -> list[str]:
        """verl serializes these `generate()` arguments into `acquire_server`."""
        return ["sampling_params"]

    def require_release_fields(self) -> list[str]:
        """verl passes the request id to `release_server`: it ends the request's share of its problem's load."""
        return ["request_id"]

    def _overloaded(self, server_id: str) -> bool:
        loads = self._inflight_requests
        excess = loads[server_id] - min(loads.values())
        return excess > max(self._min_requests, self._margin * sum(loads.values()) / len(loads))

    def acquire_server(
        self, request_id: str, sampling_params: dict[str, Any] | None = None, **_: Any
    ) -> tuple[str, Any]:
        """The problem's server if it is still in the pool, else the least-loaded one (remembered for the
        problem); requests without a problem id go through verl's rule."""
        problem = request_problem(sampling_params)
        if problem is None:
            return super().acquire_server(request_id)
        server_id = self._problem_to_server.get(problem)
        in_flight = self._problem_inflight.get(problem, 0)
        if server_id in self._inflight_requests and (in_flight or not self._overloaded(server_id)):
            self._inflight_requests[server_id] += 1
        else:
            left = server_id if server_id in self._inflight_requests else None
            # A fresh request id: verl's rule must not return a sticky server this request had before.
            self._request_id_to_server.pop(request_id, None)
            server_id, _ = super().acquire_server(request_id)
            self._problem_to_server[problem] = server_id
            if left is not None:
                self.moves += 1
                self._departed.setdefault(left, set()).add(problem)
            self._departed.get(server_id, set()).discard(problem)  # back where it had left: it stays
        self._problem_inflight[problem] = in_flight + 1
        self._request_problem[request_id] = problem
        return server_id, self._servers[server_id]

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        """verl's release, plus the end of the request's share of its problem's load."""
        problem = self._request_problem.pop(request_id, None) if request_id is not None else None
        if problem is not None:
            left = self._problem_inflight.pop(problem, 1) - 1
            if left > 0:
                self._problem_inflight[problem] = left
        super().release_server(server_id, request_id)

    def placements(self, problem_ids: Sequence[str]) -> list[tuple[Any, list[str]]]:
        """The servers in the pool that the given problems are placed on, each with its problems (problems not
        placed yet are left out): where their requests will go unless a server is overloaded by then."""
        by_server: dict[str, list[str]] = {}
        for problem in dict.fromkeys(problem_ids):
            server_id = self._problem_to_server.get(problem)
            if server_id in self._inflight_requests:
                by_server.setdefault(server_id, []).append(problem)
        return [(self._servers[server_id], problems) for server_id, problems in by_server.items()]

    def take_departures(self) -> list[tuple[Any, list[str]]]:
        """The servers in the pool that problems moved off since the last call, each with those problems (not
        placed back there since); forgets them."""
        departed, self._departed = self._departed, {}
        return [
            (self._servers[server_id], sorted(problems))
            for server_id, problems in departed.items()
            if problems and server_id in self._inflight_requests
        ]

    def clear_sticky_cache(self) -> dict:
        """verl clears stickiness when it rebalances (phase switches, elastic scaling): problems are placed
        afresh too, and each counts as departed from its server until it is placed there again."""
        for problem, server_id in self._problem_to_server.items():
            self._departed.setdefault(server_id, set()).add(problem)
        self._problem_to_server.clear()
        return super().clear_sticky_cache()

    def get_status(self) -> dict:
        status = super().get_status()
        status["problems_placed"] = len(self._problem_to_server)
        status["problems_moved"] = self.moves
        return status

    def servers_in_pool(self) -> list[Any]:
        """Every server requests may be routed to."""
        return [self._servers[server_id] for server_id in self._inflight_requests]


def _step_plan(balancer: Any, problem_ids: list[str]) -> tuple[list, list]:
    """Runs inside the router actor: the departures and, for every server in the pool, the problems placed on
    it (none for some) of a router that places problems; nothing for verl's own routers."""
    if not hasattr(balancer, "placements"):  # verl's own routers
        return [], []
    placed = balancer.placements(problem_ids)
    held = {id(server) for server, _ in placed}
    idle = [(server, []) for server in balancer.servers_in_pool() if id(server) not in held]
    return balancer.take_departures(), placed + idle


def prefetch_placed(
    load_balancer: Any,
    problem_ids: Iterable[str | None],
    samples: Iterable[int] | None = None,
    max_tokens: int | None = None,
) -> int:
    """At the start of a rollout step: tells every server the step's requests the router placed on it (the
    proposer's `das_submitted`, waited for: its budget counts the requests still queued as tail candidates and
    must hear before they start), then asks each to build the history trees of those problems (`das_prefetch`)
    and the servers problems moved off to drop theirs (`das_release`), without waiting. Returns how many
    servers were asked to prefetch. Problems new to the router are placed on their first request, so neither
    counted nor prefetched; verl's own routers place no problems, so nothing is sent.

    Args:
        load_balancer: the router actor handle of verl's LLM server client (`llm_client._load_balancer`).
        problem_ids: a batch's problem ids, one per row (None for a row without one).
        samples: the requests each row stands for (verl's V1 rows hold n sessions); one each by default.
        max_tokens: the requests' response cap (verl's `rollout.response_length`).
    """
    problem_ids = list(problem_ids)
    samples = list(samples) if samples is not None else [1] * len(problem_ids)
    counts: Counter[str] = Counter()
    for problem, n in zip(problem_ids, samples, strict=True):
        if isinstance(problem, str):
            counts[problem] += int(n)
    departures, plan = ray.get(load_balancer.__ray_call__.remote(_step_plan, list(counts)))
    # Every server in the pool hears, those without problems this step too: a problem that moved away never
    # starts where it was counted last step.
    ray.get(
        [
            server.collective_rpc.remote("das_submitted", args=({p: counts[p] for p in problems}, max_tokens))
            for server, problems in plan
        ]
    )
    # Fire and forget: each engine runs them between steps, and the step's requests must not wait here.
    for server, problems in departures:
        server.collective_rpc.remote("das_release", args=(problems,))
    placed = [(server, problems) for server, problems in plan if problems]
    for server, problems in placed:
        server.collective_rpc.remote("das_prefetch", args=(problems,))
    return len(placed)
