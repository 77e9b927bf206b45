"""verl on a two-node Ray cluster on loopback (`ray start --head` plus a second node, both on 127.0.0.1).

- DAS settings given as docs/verl.md does (`ray_kwargs.ray_init.runtime_env.env_vars.*`) go through verl's own
  `run_ppo` into `ray.init` and reach an actor on each node that is created the way verl's `vLLMReplica`
  creates its vLLM servers (node affinity, its own `runtime_env={"env_vars": <platform variables>}`), and the
  child processes it starts (as vLLM starts its engine and workers).
- Proposer metrics written in those processes (PROMETHEUS_MULTIPROC_DIR) reach one node-level `/metrics`
  registry.
- verl's LLM server client routes through verl's plugin loader to `ProblemAffinityLoadBalancer`: every
  request of a problem lands on one server, where verl's default router scatters a problem's samples.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from _verl_readme import measuring_overrides, readme_overrides

REPO = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    # --block keeps `ray start` in the foreground: stopping its process group stops exactly this node's
    # processes (never `ray stop`, which would stop every Ray on the machine).
    return subprocess.Popen(
        [RAY, "start", "--block", "--disable-usage-stats", *args],
        env=env,
        stdout=open(log, "w"),  # noqa: SIM115 - the node outlives this call
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory) -> Any:
    """Address of a two-node Ray cluster on loopback; this process is not connected to it."""
    import ray

    tmp = tmp_path_factory.mktemp("ray")
    port = _free_port()
    # Token authentication (Ray's default for new clusters) would need the machine's shared token file.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO)}
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=2", f"--temp-dir={tmp}"]
    nodes = [
        _ray_start(["--head", f"--port={port}", "--include-dashboard=false", *common], env, tmp / "head.log")
    ]
    address = f"127.0.0.1:{port}"
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or nodes[0].poll() is not None:
                    pytest.fail(f"Ray head did not start:\n{(tmp / 'head.log').read_text()[-3000:]}")
                time.sleep(1)
        nodes.append(_ray_start([f"--address={address}", *common], env, tmp / "worker.log"))
        ray.init(address=address, log_to_driver=False)
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            if time.monotonic() > deadline or nodes[1].poll() is not None:
                pytest.fail(f"second Ray node did not join:\n{(tmp / 'worker.log').read_text()[-3000:]}")
            time.sleep(1)
        ray.shutdown()
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for node in reversed(nodes):
            os.killpg(node.pid, signal.SIGTERM)
        for node in nodes:
            try:
                node.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)


# What the vLLM engine process of a verl server sees: its environment, and the proposer's metrics it writes.
_CHILD = (
    "import json, os\n"
    "from monitoring.metrics import DRAFTS\n"
    "DRAFTS.inc(3)\n"
    "names = ('DAS_HISTORY_DIR', 'DAS_BUDGET', 'DAS_WINDOW_EPOCHS', 'DAS_DRAFT_THREADS', 'VLLM_USE_V2_MODEL_RUNNER',"
    " 'VLLM_PROBE')\n"
    "print(json.dumps({k: os.environ.get(k) for k in names}))\n"
)


def _probe_runner(out: str) -> Any:
    """A verl TaskRunner stand-in whose `run` starts one server-like actor per node, as vLLMReplica does.
    Built inside a function so Ray ships the classes by value (the test module is not importable there)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    class ServerProbe:
        def report(self) -> dict[str, Any]:
            child = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True)
            return {
                "node": ray.get_runtime_context().get_node_id(),
                "actor": os.environ.get("DAS_HISTORY_DIR"),
                "child": json.loads(child.stdout.strip().splitlines()[-1]),
            }

    @ray.remote(num_cpus=0)
    class ProbeTaskRunner:
        def run(self, config: Any) -> None:
            nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
            servers = [
                ServerProbe.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
                    # vLLMReplica.launch_servers passes only platform variables of its own.
                    runtime_env={"env_vars": {"VLLM_PROBE": "1"}},
                ).remote()
                for node in nodes
            ]
            Path(out).write_text(json.dumps(ray.get([s.report.remote() for s in servers])))

    return ProbeTaskRunner


def test_readme_settings_reach_server_actors_and_their_processes_on_every_node(
    ray_cluster, tmp_path, monkeypatch
) -> None:
    import ray
    from hydra import compose, initialize_config_dir
    from prometheus_client import generate_latest
    from verl.trainer.main_ppo import run_ppo

    from monitoring.server import metrics_registry

    metrics_dir = tmp_path / "prom"
    metrics_dir.mkdir()
    config_path, config_name, overrides = readme_overrides(tmp_path)
    overrides += [
        # The measuring runs' override, exactly as documented (docs: "Trade-offs on a GPU").
        *measuring_overrides(),
        f"+ray_kwargs.ray_init.address={ray_cluster}",
        "+ray_kwargs.ray_init.runtime_env.env_vars.DAS_BUDGET=off",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.PROMETHEUS_MULTIPROC_DIR={metrics_dir}",
    ]
    with initialize_config_dir(config_dir=config_path, version_base=None):
        config = compose(config_name=config_name, overrides=overrides)
    out = tmp_path / "probe.json"
    try:
        run_ppo(config, task_runner_class=_probe_runner(str(out)))
    finally:
        ray.shutdown()
    reports = json.loads(out.read_text())
    assert len({r["node"] for r in reports}) == 2
    for report in reports:
        assert report["actor"] == "/var/lib/das/history"
        assert report["child"] == {
            "DAS_HISTORY_DIR": "/var/lib/das/history",
            "DAS_BUDGET": "off",
            # The documented numbers, quoted so Hydra keeps them strings: ray.init refuses anything else.
            "DAS_WINDOW_EPOCHS": "5",
            "DAS_DRAFT_THREADS": "2",
            "VLLM_USE_V2_MODEL_RUNNER": "0",
            "VLLM_PROBE": "1",
        }
    # A node's /metrics (das indexer run --metrics-port, started with the same PROMETHEUS_MULTIPROC_DIR) merges
    # what the server processes wrote.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics_dir))
    exposition = generate_latest(metrics_registry()).decode()
    assert "das_drafts_total 6.0" in exposition


def _serve_like_vllm() -> Any:
    """A server actor with vLLMHttpServer.generate's signature that answers at once, naming itself: routing is
    what this measures, and two CPU vLLM engines do not fit this machine."""
    import ray
    from verl.workers.rollout.replica import TokenOutput

    @ray.remote(num_cpus=0)
    class Server:
        def __init__(self, name: str) -> None:
            self.name = name

            self.rpcs: list[tuple[str, tuple]] = []

        async def generate(
            self, request_id: str, prompt_ids: list[int], sampling_params: dict, **_: Any
        ) -> Any:
            return TokenOutput(token_ids=[1], stop_reason="completed", extra_fields={"server": self.name})

        async def collective_rpc(
            self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
        ) -> None:
            self.rpcs.append((method, args))

        def rpcs_received(self) -> list[tuple[str, tuple]]:
            return self.rpcs

    return Server


def _rpcs_once_received(server: Any, count: int, timeout: float = 30.0) -> list[tuple[str, tuple]]:
    """The server's RPCs once it has received `count` (or at the timeout): `prefetch_placed` sends without
    waiting, and an async actor runs calls from different callers in no fixed order."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        rpcs = ray.get(server.rpcs_received.remote())
        if len(rpcs) >= count or time.monotonic() > deadline:
            return rpcs
        time.sleep(0.05)


async def _route(client: Any, problems: int, samples: int, passes: int) -> dict[str, list[str]]:
    """Which server each request of each problem went to, through verl's LLMServerClient.generate."""
    import uuid

    async def one(pid: str) -> tuple[str, str]:
        # As DasAgentLoop's request: a fresh request id, the problem in extra_args.
        output = await client.generate(
            uuid.uuid4().hex, prompt_ids=[1], sampling_params={"extra_args": {"das_problem_id": pid}}
        )
        return pid, output.extra_fields["server"]

    placement: dict[str, list[str]] = defaultdict(list)
    for _ in range(passes):
        for pid, server in await asyncio.gather(
            *(one(f"p{p}") for p in range(problems) for _ in range(samples))
        ):
            placement[pid].append(server)
    return placement


def test_problem_router_keeps_each_problems_requests_on_one_server(ray_cluster) -> None:
    import ray
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    ray.init(address=ray_cluster, log_to_driver=False)
    try:
        server_cls = _serve_like_vllm()
        servers = {f"server-{i}": server_cls.remote(f"server-{i}") for i in range(2)}
        config = OmegaConf.create(
            {"actor_rollout_ref": {"rollout": {"name": "vllm", "full_determinism": False}}}
        )
        problems, samples, passes = 16, 8, 3
        routers = {"verl_default": None, "das_problem_affinity": str(REPO / "examples/verl/das_router.yaml")}
        result = {}
        for name, router_path in routers.items():
            # verl's factory: the default balancer, or the plugin named by router_config_path.
            router = get_router_handle(dict(servers), router_config_path=router_path)
            client = LLMServerClient(config, load_balancer_handle=router)
            placement = asyncio.run(_route(client, problems, samples, passes))
            per_problem = [len(set(ids)) for ids in placement.values()]
            load: dict[str, int] = defaultdict(int)
            for ids in placement.values():
                for server in ids:
                    load[server] += 1
            result[name] = {
                "problems_on_one_server": sum(n == 1 for n in per_problem),
                "mean_servers_per_problem": sum(per_problem) / len(per_problem),
                "requests_per_server": dict(sorted(load.items())),
            }
        print(json.dumps({"problems": problems, "samples": samples, "passes": passes, **result}))
        assert result["das_problem_affinity"]["problems_on_one_server"] == problems
        # Least-loaded placement of new problems keeps both servers busy.
        assert min(result["das_problem_affinity"]["requests_per_server"].values()) >= samples * passes * 4
    finally:
        ray.shutdown()


def test_a_fresh_ledger_reads_stored_epochs_on_the_nodes_that_hold_a_replica(
    ray_cluster, tmp_path, monkeypatch
) -> None:
    """The compose head mounts no replica: the TaskRunner's manager reads the stored epochs on the cluster's nodes
    (here both loopback nodes see the same folder), so a fresh run's passes start after them, not at 0."""
    import ray

    from history_store.durable.store import HistoryStore
    from pipeline.schemas import TrajectoryRecord
    from workers.verl.identity import cluster_history_epochs, ledger_from_config

    history = tmp_path / "history"
    with HistoryStore(history) as store:
        store.apply(
            [
                TrajectoryRecord(problem_id=p, epoch=e, sample=0, prompt_ids=[1], response_ids=[2])
                for p, e in (("p", 3), ("p", 4), ("q", 0))
            ],
            {},
        )
    ray.init(address=ray_cluster, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        assert cluster_history_epochs(str(history)) == {"p": 4, "q": 0}
        # A node-local path this process does not have (the head's view): the ledger asks the cluster, which
        # has none either here, and starts at 0 instead of failing.
        monkeypatch.setenv("DAS_HISTORY_DIR", str(tmp_path / "elsewhere"))
        ledger = ledger_from_config({"trainer": {"default_local_dir": str(tmp_path / "run")}})
        assert ledger.assign(["p"], [1], step=1)[0].tolist() == [0]
    finally:
        ray.shutdown()


# An engine process of a verl vLLM server, as far as the proposer sees it: the proposer is built and loaded as
# vLLM does (its drafting rank), with DAS_PROPOSER_TARGETS from Ray's job-wide environment; it drafts 3 tokens.
_ENGINE = (
    "import sys, time\n"
    "from workers.generator.proposer import DasProposer\n"
    "from monitoring.metrics import DRAFTS\n"
    "DasProposer.standalone(8, 256).load_model()\n"
    "DRAFTS.inc(3)\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)


def test_proposer_metrics_are_discovered_on_every_node_beside_vllms_own(ray_cluster, tmp_path) -> None:
    """What `das monitoring vllm-targets --proposers` lists (this cluster has no dashboard, which its vLLM server
    listing needs: the proposers' part is called directly)."""
    import urllib.request

    import ray

    from workers.verl.vllm_targets import proposer_metric_addresses

    folder = tmp_path / "proposers"
    env = {**os.environ, "PYTHONPATH": str(REPO), "DAS_PROPOSER_TARGETS": str(folder)}
    engine = subprocess.Popen([sys.executable, "-c", _ENGINE], env=env, stdout=subprocess.PIPE, text=True)
    ray.init(address=ray_cluster, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        assert engine.stdout.readline().strip() == "ready"
        # Both loopback nodes read the same folder: the one engine is listed once per node.
        addresses = proposer_metric_addresses(str(folder))
        assert len(set(addresses)) == 1 and len(addresses) == 2
        exposition = urllib.request.urlopen(f"http://{addresses[0]}/metrics", timeout=30).read().decode()
        assert "das_drafts_total 3.0" in exposition
        engine.kill()
        engine.wait()
        # The note of an exited engine is dropped at the next refresh.
        assert proposer_metric_addresses(str(folder)) == []
        assert not list(folder.glob("*.json"))
    finally:
        engine.kill()
        engine.wait()
        ray.shutdown()


def test_each_server_hears_what_was_submitted_to_it_then_prefetches_and_releases_its_problems(
    ray_cluster,
) -> None:
    import ray
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    from workers.verl.router import prefetch_placed

    ray.init(address=ray_cluster, log_to_driver=False)
    try:
        server_cls = _serve_like_vllm()
        config = OmegaConf.create(
            {"actor_rollout_ref": {"rollout": {"name": "vllm", "full_determinism": False}}}
        )
        # verl's default router, then the plugin named by the YAML.
        for router_path in (None, str(REPO / "examples/verl/das_router.yaml")):
            servers = {f"server-{i}": server_cls.remote(f"server-{i}") for i in range(2)}
            router = get_router_handle(dict(servers), router_config_path=router_path)
            client = LLMServerClient(config, load_balancer_handle=router)
            placement = asyncio.run(_route(client, problems=6, samples=2, passes=1))
            # The next step's batch: the placed problems (one per sample row), one new problem, a row without one.
            rows = [pid for pid in placement for _ in range(2)] + ["new-problem", None]
            asked = prefetch_placed(router, rows, max_tokens=64)
            wanted = 0 if router_path is None else 2
            received = {sid: _rpcs_once_received(server, wanted) for sid, server in servers.items()}
            if router_path is None:  # verl's router places no problems: nothing to prefetch
                assert asked == 0 and all(not rpcs for rpcs in received.values())
                continue
            expected = defaultdict(list)
            for pid, ids in placement.items():
                expected[ids[0]].append(pid)
            assert asked == len(expected) == 2
            # First what the step submits there (two samples a problem, waited for), then the prefetch.
            assert received == {
                sid: [("das_submitted", (dict.fromkeys(problems, 2), 64)), ("das_prefetch", (problems,))]
                for sid, problems in expected.items()
            }

            def move_off_its_server(balancer: Any, problem: str) -> tuple[str, str]:
                """In the router actor: other requests load the problem's server, so its next request moves."""
                home = balancer._problem_to_server[problem]
                balancer._inflight_requests[home] += 100
                params = {"extra_args": {"das_problem_id": problem}}
                new, _ = balancer.acquire_server("moving", sampling_params=params)
                balancer.release_server(new, "moving")
                balancer._inflight_requests[home] -= 100
                return home, new

            moved = next(iter(placement))
            home, new = ray.get(router.__ray_call__.remote(move_off_its_server, moved))
            assert home != new
            prefetch_placed(router, [moved])
            # The server it left hears that nothing comes and drops its tree; the one it moved to builds it.
            assert _rpcs_once_received(servers[home], 4)[-2:] == [
                ("das_submitted", ({}, None)),
                ("das_release", ([moved],)),
            ]
            assert _rpcs_once_received(servers[new], 4)[-2:] == [
                ("das_submitted", ({moved: 1}, None)),
                ("das_prefetch", ([moved],)),
            ]
    finally:
        ray.shutdown()
