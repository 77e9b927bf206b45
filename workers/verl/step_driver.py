"""The trainer's stand-in of docker-compose.cpu.yml: verl's rollout side of a training step, on CPU Ray nodes.

verl 0.9.1's trainer has no CPU platform (cuda, npu and rocm only), so the CPU profile runs everything of a
training step except the actor update on GPUs:

- verl's `LLMServerManager` starts verl's own vLLM servers (`vLLMHttpServer`, one standalone replica per Ray node
  that declares a (logical) GPU, with the DAS proposer and worker extension of the trainer config) and verl's
  router plugin, DAS's `ProblemAffinityLoadBalancer` (`rollout.router_config_path`);
- verl's legacy agent loop manager with the DAS identity (`workers.verl.manager.DasAgentLoopManager`; the V1 one
  needs the trainer's TransferQueue) runs `das_agent` loops, which publish every finished trajectory to the bus;
- each step takes the next `data.train_batch_size` prompts of verl's own dataset (`data.train_files`), repeats
  them `rollout.n` times and numbers the step as verl's trainer does (its global step is kept in the state
  folder, so a restarted driver continues it, as a resumed trainer does).

The policy is not updated between steps (no actor, no weight sync): every step samples from the same model.

It takes the trainer's own command line (the same Hydra config: `--config-path`, `--config-name`, overrides) and
serves a small HTTP control interface on DAS_STEP_DRIVER_PORT (default 8700) instead of looping over epochs:

    GET  /status   {"ready": ..., "step": ..., "servers": [...], "error": ...}
    POST /step     runs one step; answers its records (key, prompt and response tokens), timings, and the
                   DAS proposers' statistics before and after it, per server
    POST /rebuild  replaces every vLLM server (after a node was replaced); /step does it by itself when a server
                   is gone

    python -m workers.verl.step_driver --config-path=/opt/das/examples/verl --config-name=das_grpo ...
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from workers.errors import InvalidInput

logger = logging.getLogger("das.step_driver")

DEFAULT_PORT = 8700
STATE_FILE = "das_step_driver.json"
# A server that does not answer its address within this is taken for gone (its node died or was replaced).
SERVER_PROBE_TIMEOUT_S = 30.0
# A node alive for this long is taken to stay (see StepDriver._wait_for_nodes).
NODE_SETTLED_S = 30.0


def ray_init(config: Any) -> None:
    """`ray.init` exactly as verl's `run_ppo` does it: verl's default runtime environment merged with the
    config's `ray_kwargs.ray_init` (the job-wide environment that carries DAS_HISTORY_DIR to every node)."""
    import ray
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    default_runtime_env = get_ppo_ray_runtime_env(config)
    ray_init_kwargs = config.ray_kwargs.get("ray_init", {})
    runtime_env = OmegaConf.merge(default_runtime_env, ray_init_kwargs.get("runtime_env", {}))
    kwargs = OmegaConf.create({**ray_init_kwargs, "runtime_env": runtime_env})
    ray.init(**OmegaConf.to_container(kwargs))


def _unpadded(row: Any, mask: Any) -> list[int]:
    return [int(t) for t, m in zip(row.tolist(), mask.tolist(), strict=True) if m]


def step_records(gen_batch: Any, output: Any) -> list[dict[str, Any]]:
    """Each rollout of a step as `das_agent` published it: key, prompt and response tokens (padding removed by
    the output's attention mask), in batch order."""
    from workers.verl.identity import EPOCH_FIELD, PROBLEM_FIELD, SAMPLE_FIELD

    columns = gen_batch.non_tensor_batch
    prompts, responses = output.batch["prompts"], output.batch["responses"]
    mask = output.batch["attention_mask"]
    width = prompts.shape[1]
    records = []
    for i in range(len(output)):
        records.append(
            {
                "problem_id": str(columns[PROBLEM_FIELD][i]),
                "epoch": int(columns[EPOCH_FIELD][i]),
                "sample": int(columns[SAMPLE_FIELD][i]),
                "prompt_ids": _unpadded(prompts[i], mask[i, :width]),
                "response_ids": _unpadded(responses[i], mask[i, width:]),
            }
        )
    return records


def _transient(exc: BaseException) -> bool:
    """A failure a second attempt can get past: a server, router or node that went away (Ray's actor and node
    errors, vLLM's dead engine) or a call lost on the network (ActorUnavailableError: the node was cut off).
    Ray hands a remote failure over as RayTaskError(<cause>), a class named after its cause, with the cause's
    traceback in its text: both are looked at, along the exception's chain."""
    names = ("EngineDeadError", "ActorDiedError", "ActorUnavailableError", "NodeDiedError", "OwnerDiedError")
    seen: BaseException | None = exc
    while seen is not None:
        kinds = " ".join(kind.__name__ for kind in type(seen).__mro__)
        if any(name in kinds or name in str(seen) for name in names):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _engine_errored(server: Any) -> bool:
    """Runs inside a vLLMHttpServer actor: True when its engine has died."""
    engine = getattr(server, "engine", None)
    return engine is None or bool(engine.errored)


class StepDriver:
    """verl's servers, router and agent loop manager, and the next step's prompts."""

    def __init__(self, config: Any) -> None:
        self.config = config
        folder = config.das.get("state_dir") or config.trainer.default_local_dir
        self.state_path = Path(str(folder)) / STATE_FILE
        self.global_step = self._load_step()
        self.error: str | None = None
        self.ready = False
        self.server_manager: Any = None
        self.manager: Any = None
        self._lock = threading.Lock()
        self._rows: list[dict[str, Any]] = []
        self._next_row = 0

    # ------------------------------------------------------------------ state
    def _load_step(self) -> int:
        try:
            return int(json.loads(self.state_path.read_text())["global_step"])
        except FileNotFoundError:
            return 0

    def _save_step(self) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_name(f".{self.state_path.name}.tmp")
        tmp.write_text(json.dumps({"global_step": self.global_step, "next_row": self._next_row}))
        tmp.replace(self.state_path)

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Loads the data set and starts the servers and the manager (minutes on a CPU)."""
        try:
            self._load_rows()
            self._build()
            self.ready = True
            logger.info("step driver ready: %d prompts, servers %s", len(self._rows), self.server_addresses())
        except Exception:
            self.error = traceback.format_exc()
            logger.error("step driver failed to start:\n%s", self.error)

    def _load_rows(self) -> None:
        from verl.trainer.ppo.utils import create_rl_dataset
        from verl.utils import hf_tokenizer

        tokenizer = hf_tokenizer(self.config.actor_rollout_ref.model.path, trust_remote_code=False)
        dataset = create_rl_dataset(
            self.config.data.train_files, self.config.data, tokenizer, None, is_train=True
        )
        self._rows = [dataset[i] for i in range(len(dataset))]
        if not self._rows:
            raise InvalidInput(f"no prompts in {self.config.data.train_files}")
        try:
            self._next_row = int(json.loads(self.state_path.read_text()).get("next_row", 0)) % len(self._rows)
        except FileNotFoundError:
            self._next_row = 0

    def _build(self) -> None:
        from verl.workers.rollout.llm_server import LLMServerManager

        from workers.verl.manager import DasAgentLoopManager

        started = time.monotonic()
        self.server_manager = LLMServerManager.create(config=self.config)
        self.manager = DasAgentLoopManager.create(
            config=self.config, llm_client=self.server_manager.get_client()
        )
        logger.info("servers and agent loop workers up in %.1f s", time.monotonic() - started)

    def server_addresses(self) -> list[str]:
        return list(self.server_manager.server_addresses) if self.server_manager else []

    def healthy(self) -> bool:
        """The servers (`servers_alive`) and the router answer."""
        import ray

        if self.server_manager is None or not self.servers_alive():
            return False
        try:
            ray.get(
                self.server_manager.global_load_balancer.__ray_call__.remote(lambda _balancer: True),
                timeout=SERVER_PROBE_TIMEOUT_S,
            )
        except Exception as exc:  # noqa: BLE001 - a router that cannot answer cannot route this step
            logger.warning("the router is gone (%s)", exc)
            return False
        return True

    def servers_alive(self) -> bool:
        """Every server's actor answers and its engine has not died (vLLM's AsyncLLM.errored: an engine whose
        worker process was killed fails every request after)."""
        import ray

        try:
            for handle in self.server_manager.server_handles:
                if ray.get(handle.__ray_call__.remote(_engine_errored), timeout=SERVER_PROBE_TIMEOUT_S):
                    logger.warning("a vLLM server's engine is dead")
                    return False
        except Exception as exc:  # noqa: BLE001 - any failure means the server cannot serve this step
            logger.warning("a vLLM server is gone (%s)", exc)
            return False
        return True

    def rebuild(self) -> dict[str, Any]:
        """Kills every actor this driver started and removes its placement groups, then starts anew: a replaced
        node comes with new Ray resources, which the old placement groups would keep holding (also those of a
        start that failed half-way, which no handle here knows)."""
        import ray
        from ray.util.placement_group import PlacementGroup, remove_placement_group
        from ray.util.state import list_actors, list_placement_groups

        started = time.monotonic()
        self.ready = False
        self.server_manager = self.manager = None
        self._wait_for_nodes()
        job = ray.get_runtime_context().get_job_id()
        actors = list_actors(filters=[("job_id", "=", job), ("state", "!=", "DEAD")], limit=10_000)
        for actor in actors:
            if actor.name:  # unnamed ones (in placement groups) go with their group
                with contextlib.suppress(Exception):  # already dead with its node
                    ray.kill(ray.get_actor(actor.name, namespace=actor.ray_namespace))
        groups = list_placement_groups(filters=[("creator_job_id", "=", job)], limit=10_000)
        removed = 0
        for group in groups:
            if group.state != "REMOVED":
                with contextlib.suppress(Exception):
                    remove_placement_group(
                        PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group.placement_group_id)))
                    )
                    removed += 1
        logger.info("rebuild: %d actors killed, %d placement groups removed", len(actors), removed)
        self._build()
        self.ready = True
        self.error = None
        return {"rebuilt_s": round(time.monotonic() - started, 1), "servers": self.server_addresses()}

    def _wait_for_nodes(self, settled_s: float = NODE_SETTLED_S, timeout_s: float = 1800.0) -> None:
        """Waits until the nodes holding the servers' GPUs have all been alive for `settled_s`: a node that
        just joined may still be torn down (a Ray worker whose start timed out restarts its container), and an
        actor placed there would die with it."""
        from ray.util.state import list_nodes

        rollout = self.config.actor_rollout_ref.rollout
        needed = int(rollout.nnodes) * int(rollout.n_gpus_per_node)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now_ms = time.time() * 1000
            settled = [
                node
                for node in list_nodes(filters=[("state", "=", "ALIVE")], detail=True)
                if now_ms - float(node.start_time_ms or now_ms) >= settled_s * 1000
            ]
            if sum(float(node.resources_total.get("GPU", 0)) for node in settled) >= needed:
                return
            time.sleep(5)
        raise RuntimeError(
            f"the cluster did not hold {needed} GPUs on settled nodes within {timeout_s:.0f} s"
        )

    # ------------------------------------------------------------------ a step
    def _next_batch(self) -> Any:
        from verl import DataProto
        from verl.utils.dataset.rl_dataset import collate_fn

        size = int(self.config.data.train_batch_size)
        rows = [self._rows[(self._next_row + i) % len(self._rows)] for i in range(size)]
        self._next_row = (self._next_row + size) % len(self._rows)
        return DataProto.from_single_dict(collate_fn(rows))

    def step(self) -> dict[str, Any]:
        """One training step's rollout, as verl's trainer runs it (ray_trainer.fit, before the update). A step that
        fails because a server, the router or their node went away, or a call to a server was lost on the network,
        is run once more (on new servers if any is gone; verl's trainer would fail and resume from its checkpoint
        instead). The first attempt's published trajectories keep their keys (the ledger gives the second attempt
        fresh sample numbers), and the answer lists the failed attempt."""
        from workers.verl.stats import das_stats

        with self._lock:
            rebuilt = None
            if not self.healthy():
                rebuilt = self.rebuild()
            self.global_step += 1
            batch = self._next_batch()
            batch.meta_info["temperature"] = self.config.actor_rollout_ref.rollout.temperature
            batch.non_tensor_batch["uid"] = np.array(
                [str(uuid.uuid4()) for _ in range(len(batch))], dtype=object
            )
            keep = {"data_source", "reward_model", "extra_info", "uid"} & batch.non_tensor_batch.keys()
            gen_batch = batch.pop(
                batch_keys=[], non_tensor_batch_keys=list(batch.non_tensor_batch.keys() - keep)
            )
            gen_batch.non_tensor_batch.update(batch.non_tensor_batch)
            gen_batch.meta_info["global_steps"] = self.global_step
            gen_batch = gen_batch.repeat(
                repeat_times=int(self.config.actor_rollout_ref.rollout.n), interleave=True
            )
            failed_attempts = []
            while True:
                try:
                    handles = list(self.server_manager.server_handles)
                    before = das_stats(handles)
                    started = time.time()
                    output = self.manager.generate_sequences(gen_batch)
                    finished = time.time()
                    after = das_stats(handles)
                    break
                except Exception as exc:
                    if failed_attempts or not _transient(exc):
                        raise
                    failed_attempts.append(repr(exc)[-2000:])
                    if self.healthy():
                        logger.warning(
                            "step %d lost a call to a server (%r); once more", self.global_step, exc
                        )
                    else:
                        logger.warning(
                            "step %d lost a server; once more on new ones: %r", self.global_step, exc
                        )
                        rebuilt = self.rebuild()
            self._save_step()
            return {
                "step": self.global_step,
                "started_at": started,
                "finished_at": finished,
                "wall_s": round(finished - started, 3),
                "rebuilt": rebuilt,
                "failed_attempts": failed_attempts,
                "servers": self.server_addresses(),
                "timing": {k: float(v) for k, v in output.meta_info.get("timing", {}).items()},
                "records": step_records(gen_batch, output),
                "das_before": before,
                "das_after": after,
            }

    def status(self) -> dict[str, Any]:
        return {
            "ready": self.ready,
            "step": self.global_step,
            "servers": self.server_addresses(),
            "error": self.error,
        }


def serve(driver: StepDriver, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/status":
                self._answer(200, driver.status())
            else:
                self._answer(404, {"error": f"no {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            if not driver.ready and self.path != "/rebuild":
                self._answer(503, driver.status())
                return
            try:
                if self.path == "/step":
                    self._answer(200, driver.step())
                elif self.path == "/rebuild":
                    with driver._lock:
                        self._answer(200, driver.rebuild())
                else:
                    self._answer(404, {"error": f"no {self.path}"})
            except Exception:  # noqa: BLE001 - the caller gets the failure, the driver keeps serving
                trace = traceback.format_exc()
                logger.error("%s failed:\n%s", self.path, trace)
                self._answer(500, {"error": trace})

        def log_message(self, fmt: str, *args: Any) -> None:
            logger.info("%s %s", self.address_string(), fmt % args)

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    threading.Thread(target=server.serve_forever, name="step-driver-http", daemon=True).start()
    return server


def run(config: Any) -> None:
    from omegaconf import OmegaConf

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    OmegaConf.resolve(config)
    ray_init(config)
    driver = StepDriver(config)
    port = int(os.environ.get("DAS_STEP_DRIVER_PORT", DEFAULT_PORT))
    serve(driver, port)
    logger.info("step driver: control on port %d, starting servers", port)
    driver.start()
    while True:  # the container's life: Ray and the control interface stay up until it is stopped
        time.sleep(3600)


def main() -> None:
    import hydra

    hydra.main(config_path=None, config_name=None, version_base=None)(run)()


if __name__ == "__main__":
    main()
