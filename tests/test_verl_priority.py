"""One priority scale through verl's V1 agent loop manager, across its agent loop worker processes.

verl's `AgentLoopManagerTQ` (the default V1 trainer's) splits each batch across its agent loop worker processes;
one vLLM server serves requests of all of them. DAS's `DasAgentLoopManagerTQ` gives every row a priority before the
batch fans out: its problem's length block on the scale the router actor keeps (from every complete response any
worker reported), x 2^24, plus the row's position in the whole batch. Run here for real: verl's V1 manager and
its agent loop workers (two Ray actors, separate processes),
TransferQueue, verl's LLM server client and DAS's router, on a local Ray cluster; the vLLM servers are actors with vLLMHttpServer.generate's
signature that answer with responses of a fixed length per problem and note the priority verl hands them (two CPU
vLLM engines do not fit this machine; the priority's way from verl's client into vLLM's scheduler is walked on a
real engine by tests/test_verl_integration.py).
"""

from __future__ import annotations

import os
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_DIR = REPO / "examples" / "verl"
STRIDE = 1 << 24
# Ray reads its settings from variables of this spelling.
_RAY_MEMORY_MONITOR = "RAY_memory_monitor_refresh_ms"


@pytest.fixture(scope="module")
def local_ray() -> Any:
    """A local Ray cluster of 4 CPUs (TransferQueue's controller and its storage unit hold one each), whose
    workers import this checkout. Ray's memory monitor is off: it kills workers at 95% of this shared machine's
    memory, which other jobs' engines fill, whatever this test takes."""
    import ray

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(_RAY_MEMORY_MONITOR, "0")
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
        )
        try:
            yield
        finally:
            ray.shutdown()


def _server_class() -> Any:
    """A server actor with vLLMHttpServer.generate's signature: a response of the problem's length (its last
    path part, in tokens), and each request's (problem, priority) noted."""
    import ray
    from verl.workers.rollout.replica import TokenOutput

    @ray.remote(num_cpus=0)
    class Server:
        def __init__(self) -> None:
            self.requests: list[tuple[str, int]] = []

        async def generate(
            self, request_id: str, prompt_ids: list[int], sampling_params: dict, priority: int = 0, **_: Any
        ) -> Any:
            problem = sampling_params["extra_args"]["das_problem_id"]
            self.requests.append((problem, priority))
            length = int(problem.rsplit("-", 1)[1])
            return TokenOutput(token_ids=[7] * length, stop_reason="completed", num_preempted=0)

        async def collective_rpc(
            self, method: str, timeout: float | None = None, args: tuple = (), **_: Any
        ) -> None:
            return None

        def received(self) -> list[tuple[str, int]]:
            return list(self.requests)

    return Server


def _batch(problems: list[str], step: int) -> Any:
    """A V1 prompt batch as verl's trainer hands it to the manager: one row per problem."""
    from verl.utils import tensordict_utils as tu

    return tu.get_tensordict(
        {
            "data_source": ["test"] * len(problems),
            "extra_info": [{"split": "train", "index": p} for p in problems],
            "raw_prompt": [[{"role": "user", "content": f"Problem {p}: what is 2 + 2?"}] for p in problems],
            "uid": [uuid.uuid4().hex for _ in problems],
            "index": list(range(len(problems))),
        },
        non_tensor_dict={"global_steps": step},
    )


def _wait(what: Any, until: Any, timeout: float = 600.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if until(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_verls_v1_manager_gives_every_worker_one_priority_scale_and_an_unseen_problem_the_middle(
    local_ray: None,
) -> None:
    import ray
    import transfer_queue as tq
    from hydra import compose, initialize_config_dir
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    from workers.generator.model import require_model
    from workers.verl.manager_v1 import DasAgentLoopManagerTQ

    with initialize_config_dir(config_dir=str(EXAMPLE_DIR), version_base=None):
        config = compose(
            config_name="das_grpo",
            overrides=[
                f"actor_rollout_ref.model.path={require_model()}",
                "actor_rollout_ref.rollout.agent.num_workers=2",
                "actor_rollout_ref.rollout.n=2",
                "data.max_prompt_length=64",
                "data.max_response_length=64",
                # verl's default is 8 storage units of a CPU each, more than this machine's cluster has.
                "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
            ],
        )
    try:
        tq.init(config.transfer_queue)
        server_cls = _server_class()
        servers = {f"server-{i}": server_cls.remote() for i in range(2)}
        router = get_router_handle(dict(servers), router_config_path=str(EXAMPLE_DIR / "das_router.yaml"))
        manager = DasAgentLoopManagerTQ.create(config=config, llm_client=LLMServerClient(config, router))
        pids = ray.get([w.__ray_call__.remote(lambda w: os.getpid()) for w in manager.agent_loop_workers])
        assert len(set(pids)) == 2  # verl's two agent loop worker processes, each with half of every batch

        def pool(balancer: Any) -> int:
            """In the router actor: how many lengths DAS's shared predictor holds (0 without one)."""
            lengths = getattr(balancer, "_das_lengths", None)
            return len(lengths._pool) if lengths is not None else 0

        def received(since: dict[str, int] | None = None) -> dict[str, list[tuple[str, int]]]:
            """Each server's requests, after the first `since[server]` of them."""
            got = {name: ray.get(s.received.remote()) for name, s in servers.items()}
            return {name: r[(since or {}).get(name, 0) :] for name, r in got.items()}

        def count(by_server: dict[str, list]) -> int:
            return sum(map(len, by_server.values()))

        # Problem `p<i>-<length>`: every response of it has that many tokens. verl's V1 manager hands the first
        # half of the rows to one worker and the second half to the other.
        long_first = [f"p{i}-{length}" for i, length in enumerate((60, 52, 44, 36, 28, 20, 12, 4))]
        manager.generate_sequences(_batch(long_first, step=1))
        first = _wait(received, lambda r: count(r) == 16)
        _wait(lambda: ray.get(router.__ray_call__.remote(pool)), lambda n: n == 16, timeout=60)

        # Next step: each problem on the other worker, and a problem never seen, of middle length.
        second = list(reversed(long_first))
        second.insert(4, "new-32")
        manager.generate_sequences(_batch(second, step=2))
        since = {name: len(r) for name, r in first.items()}
        later = _wait(lambda: received(since), lambda r: count(r) == 18)
        requests = [r for by_server in later.values() for r in by_server]
    finally:
        tq.close()

    by_problem: dict[str, set[int]] = defaultdict(set)
    for problem, priority in requests:
        by_problem[problem.removeprefix("test/train/")].add(priority)
    # One priority per row (its n samples share it), and each row's position in the whole batch below the block.
    assert all(len(p) == 1 for p in by_problem.values()), by_problem
    priority = {problem: next(iter(values)) for problem, values in by_problem.items()}
    assert {problem: p % STRIDE for problem, p in priority.items()} == {p: i for i, p in enumerate(second)}
    # One scale: the longer problem never gets the later block, whichever worker ran it before.
    block = {problem: p // STRIDE for problem, p in priority.items()}
    ranked = sorted(long_first, key=lambda p: -int(p.rsplit("-", 1)[1]))
    assert [block[p] for p in ranked] == sorted(block[p] for p in ranked) and block[ranked[0]] == 0
    assert len({block[p] for p in ranked}) == len(
        ranked
    )  # no spread within a problem: every length separates
    # The problem never seen sits in the middle of the scale, not at the top.
    assert block[ranked[0]] < block["new-32"] < block[ranked[-1]]
