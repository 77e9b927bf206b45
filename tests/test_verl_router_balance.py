"""`ProblemAffinityLoadBalancer` keeps a problem on one server only while that server is not overloaded.

The routing runs through the real balancer class (verl's `GlobalRequestLoadBalancer` underneath) with server
names in place of Ray handles; the rollout time of each server is simulated with the cost model of the design
(a decode step costs c_base + c_seq x active requests, every active request gains one token per step).

    pytest tests/test_verl_router_balance.py -k makespan -s     # prints the figures as JSON
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np

from workers.verl.router import ProblemAffinityLoadBalancer

SERVERS = 4
PROBLEMS = 512
PER_STEP = 64
SAMPLES = 8
STEPS = 30
# A 7B model on one H100-class GPU, as the replay's defaults (seconds).
C_BASE = 0.02
C_SEQ = 0.0004


def _params(problem: str) -> dict[str, Any]:
    return {"extra_args": {"das_problem_id": problem}}


def test_a_problem_leaves_an_overloaded_server_between_groups_but_a_group_never_splits() -> None:
    router = ProblemAffinityLoadBalancer({"a": "a", "b": "b"}, {"rebalance_min_requests": 2})
    random.seed(0)
    first = [router.acquire_server(f"p-{i}", sampling_params=_params("p"))[0] for i in range(2)]
    (home,) = set(first)
    other = "b" if home == "a" else "a"
    for i in range(2):
        router.release_server(home, f"p-{i}")
    # Other problems' requests fill `home`: 10 in flight there, none on the other server.
    router._inflight_requests[home] = 10
    # p's next group starts on the less loaded server and stays there as a group, however loaded it gets.
    moved = [router.acquire_server(f"p2-{i}", sampling_params=_params("p"))[0] for i in range(12)]
    assert moved == [other] * 12 and router.get_status()["problems_moved"] == 1
    # The server it left is told once (it may drop p's history tree).
    assert router.take_departures() == [(home, ["p"])] and router.take_departures() == []
    # Within the margin a problem stays put (its server is now the busier one by 2, the minimum is 2).
    for i in range(12):
        router.release_server(other, f"p2-{i}")
    router.acquire_server("r-0", sampling_params=_params("r"))
    assert router._problem_to_server["r"] == other
    router._inflight_requests[home] = 1
    router._inflight_requests[other] = 3
    assert router.acquire_server("p3-0", sampling_params=_params("p"))[0] == other


def test_a_problem_that_moves_back_is_released_only_where_it_no_longer_is() -> None:
    router = ProblemAffinityLoadBalancer({"a": "a", "b": "b"}, {"rebalance_min_requests": 2})
    home = router.acquire_server("p-0", sampling_params=_params("p"))[0]
    other = "b" if home == "a" else "a"
    router.release_server(home, "p-0")
    router._inflight_requests[home] = 10  # other problems' requests
    assert router.acquire_server("p-1", sampling_params=_params("p"))[0] == other
    router.release_server(other, "p-1")
    router._inflight_requests.update({home: 0, other: 10})
    assert router.acquire_server("p-2", sampling_params=_params("p"))[0] == home
    assert router.take_departures() == [(other, ["p"])]
    # verl's rebalance forgets every placement: a problem placed afresh elsewhere leaves its old server.
    router.acquire_server("q-0", sampling_params=_params("q"))
    router.clear_sticky_cache()
    router._inflight_requests.update({home: 10, other: 0})
    assert router.acquire_server("p-3", sampling_params=_params("p"))[0] == other
    departures = dict(router.take_departures())
    assert "p" in departures[home] and "p" not in departures.get(other, [])


def _server_time(lengths: list[int]) -> float:
    """One server's rollout time for requests that all start at once: steps while k requests are active cost
    C_BASE + C_SEQ * k each."""
    if not lengths:
        return 0.0
    ends = np.sort(np.asarray(lengths))
    steps = np.diff(np.concatenate([[0], ends]))
    active = len(ends) - np.arange(len(ends))
    return float(np.sum(steps * (C_BASE + C_SEQ * active)))


def _simulate(make_router: Any, problem_ids: bool) -> dict[str, float]:
    rng = np.random.default_rng(7)
    random.seed(7)
    # Response lengths differ by problem (lognormal, median 800 tokens) and by sample around the problem's.
    problem_length = rng.lognormal(np.log(800), 0.8, PROBLEMS)
    # Skewed mixes: each step draws its problems with Zipf-like weights over a reshuffled order, so which
    # problems recur together changes from step to step.
    weights = 1.0 / np.arange(1, PROBLEMS + 1) ** 0.8
    weights /= weights.sum()
    router = make_router()
    makespans, split = [], 0
    for step in range(STEPS):
        order = rng.permutation(PROBLEMS)
        mix = rng.choice(order, size=PER_STEP, replace=False, p=weights)
        per_server: dict[str, list[int]] = {f"s{i}": [] for i in range(SERVERS)}
        acquired = []
        for problem in mix:
            servers = set()
            for sample in range(SAMPLES):
                request_id = f"{step}-{problem}-{sample}"
                params = _params(f"p{problem}") if problem_ids else {}
                server, _ = router.acquire_server(request_id, sampling_params=params)
                servers.add(server)
                acquired.append((server, request_id))
                length = int(problem_length[problem] * rng.lognormal(0, 0.3))
                per_server[server].append(max(1, min(length, 8192)))
            split += len(servers) > 1
        makespans.append(max(_server_time(lengths) for lengths in per_server.values()))
        for server, request_id in acquired:
            router.release_server(server, request_id)
    return {
        "mean_makespan_s": round(float(np.mean(makespans)), 2),
        "max_makespan_s": round(float(np.max(makespans)), 2),
        "groups_split_share": round(split / (STEPS * PER_STEP), 3),
    }


def test_bounded_stickiness_keeps_groups_whole_and_is_no_slower_than_never_moving() -> None:
    servers = {f"s{i}": f"s{i}" for i in range(SERVERS)}

    class VerlDefault(ProblemAffinityLoadBalancer):
        def acquire_server(self, request_id: str, sampling_params: Any = None, **_: Any) -> Any:
            return super().acquire_server(request_id)  # verl's least-loaded rule: problems scatter

    result = {
        "servers": SERVERS,
        "problems": PROBLEMS,
        "problems_per_step": PER_STEP,
        "samples": SAMPLES,
        "steps": STEPS,
        "sticky_forever": _simulate(
            lambda: ProblemAffinityLoadBalancer(dict(servers), {"rebalance_margin": float("inf")}), True
        ),
        "bounded": _simulate(lambda: ProblemAffinityLoadBalancer(dict(servers)), True),
        "verl_least_loaded": _simulate(lambda: VerlDefault(dict(servers)), True),
    }
    print(json.dumps(result))
    bounded, sticky, scatter = result["bounded"], result["sticky_forever"], result["verl_least_loaded"]
    # The gain over never moving is small (request counts do not see lengths) and its sign follows the
    # router's hash order from run to run (172.2 vs 173.5 s in one, 173.1 vs 172.1 s in another): what holds
    # is that moving idle problems off loaded servers never costs more than noise.
    assert bounded["mean_makespan_s"] <= 1.01 * sticky["mean_makespan_s"]
    # A problem's group stays on one server (sibling drafting), which verl's own rule does not give.
    assert bounded["groups_split_share"] == 0 and scatter["groups_split_share"] > 0.5
