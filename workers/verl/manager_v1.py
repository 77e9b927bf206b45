"""`DasAgentLoopManagerTQ`: verl's V1 (TransferQueue) agent loop manager with the DAS identity.

The V1 trainer hands the manager a TensorDict with one row per prompt, plus `global_steps` and `validate`; its
workers run each prompt's n samples as sessions 0..n-1 and give every field (and `session_id`) to the agent
loop. This manager adds `das_problem_id`, `das_epoch` and `das_sample` (the row's first sample number; the
agent loop adds the session) per row. Its workers import `workers.verl.agent_loop`, so `das_agent` needs no
`agent_loop_config_path`. Needs the `transferqueue` package, as verl's V1 trainer does.

    actor_rollout_ref.rollout.agent.agent_loop_manager_class=workers.verl.manager_v1.DasAgentLoopManagerTQ
"""

from __future__ import annotations

import ray
import transfer_queue as tq
from tensordict import TensorDict
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ
from verl.utils import tensordict_utils as tu

from pipeline.epochs import advance_rows, trainer_epoch_publisher

# Registers `das_agent` wherever this module is imported: the driver and every agent loop worker process.
from workers.verl import agent_loop as _agent_loop  # noqa: F401
from workers.verl.identity import (
    EPOCH_FIELD,
    PROBLEM_FIELD,
    SAMPLE_FIELD,
    BatchAnnotator,
    ledger_from_config,
)
from workers.verl.priority import batch_priorities
from workers.verl.router import prefetch_placed
from workers.verl.stats import das_stats, router_servers

_ROW_FIELDS = ("data_source", "extra_info", "raw_prompt")


def annotate_tq(prompts: TensorDict, annotator: BatchAnnotator, n: int) -> None:
    """Adds the DAS fields to a V1 prompt batch (in place); each row stands for `n` sessions unless it
    carries its own `__rollout_n__`."""
    size = len(prompts)
    present = set(prompts.keys())
    columns = {k: tu.get(prompts, k) for k in _ROW_FIELDS if k in present}
    rows = [{k: v[i] for k, v in columns.items()} for i in range(size)]
    per_row = tu.get(prompts, "__rollout_n__", [n] * size)
    result = annotator.annotate(
        rows,
        tu.get(prompts, "global_steps"),
        bool(tu.get(prompts, "validate", False)),
        list(per_row),
        tu.get(prompts, "__do_sample__"),
    )
    tu.assign_non_tensor_stack(prompts, PROBLEM_FIELD, result.problem_ids)
    tu.assign_non_tensor_stack(prompts, EPOCH_FIELD, result.epochs.tolist())
    tu.assign_non_tensor_stack(prompts, SAMPLE_FIELD, result.samples.tolist())


class DasAgentLoopWorkerTQ(AgentLoopWorkerTQ.__ray_actor_class__):
    """verl's V1 agent loop worker, defined here so its processes import (and register) `das_agent`."""

    def __init__(self, *args, **kwargs) -> None:
        # verl's AgentLoopWorkerTQ.__init__ (verl decorates that class with @ray.remote), whose zero-argument
        # super() fails in a Ray actor built from this subclass: "super(type, obj): obj must be an instance or
        # subtype of type" (Ray 2.60; tests/test_verl_priority.py builds the workers through verl's manager).
        AgentLoopWorker.__init__(self, *args, **kwargs)
        tq.init()
        self.background_tasks = set()


class DasAgentLoopManagerTQ(AgentLoopManagerTQ):
    """verl's AgentLoopManagerTQ plus the DAS identity."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.agent_loop_workers_class = ray.remote(DasAgentLoopWorkerTQ)
        self.das = BatchAnnotator(ledger_from_config(self.config))
        # The ledger's epochs, to the replicas: the only thing that moves their history windows.
        self.das_epochs = trainer_epoch_publisher(self.config.get("das"))

    def generate_sequences(self, prompts: TensorDict) -> None:
        """Annotates the batch, then dispatches it to verl's agent loop workers."""
        annotate_tq(prompts, self.das, int(self.rollout_config.n))
        # One priority scale for every agent loop worker: the rows' blocks from the router actor's lengths.
        tu.assign_non_tensor_stack(
            prompts,
            "priority",
            batch_priorities(
                self.llm_client._load_balancer,
                tu.get(prompts, PROBLEM_FIELD),
                self.rollout_config.response_length,
            ),
        )
        advance_rows(self.das_epochs, tu.get(prompts, PROBLEM_FIELD), tu.get(prompts, EPOCH_FIELD))
        prefetch_placed(
            self.llm_client._load_balancer,
            tu.get(prompts, PROBLEM_FIELD),
            tu.get(prompts, "__rollout_n__", [int(self.rollout_config.n)] * len(prompts)),
            max_tokens=int(self.rollout_config.response_length),
        )
        super().generate_sequences(prompts)

    def das_stats(self) -> list[list[dict]]:
        """Per server, each rank's DAS proposer statistics (drafts, acceptance, sources, budget state)."""
        # verl hands the manager only the client; the client's router knows the servers.
        return das_stats(router_servers(self.llm_client._load_balancer))
