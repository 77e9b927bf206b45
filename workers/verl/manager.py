"""`DasAgentLoopManager`: verl's legacy agent loop manager that tells each rollout row its DAS identity.

verl keeps the training step in the batch's `meta_info`, which agent loops never see, and repeats each prompt n
times without numbering the copies. Before the batch is split across agent loop workers, this manager adds
`das_problem_id`, `das_epoch` and `das_sample` columns, and `priority` on DAS's one scale
(`workers.verl.priority`; verl keeps a `priority` column it finds); `DasAgentLoop` reads them. Its agent loop
workers import `workers.verl.agent_loop`, so `das_agent` is registered in every worker process without an
`agent_loop_config_path` (no file that must exist at the same path on every node).

This is for verl's legacy trainer (`trainer.use_v1=false`); the default V1 trainer takes
`workers.verl.manager_v1.DasAgentLoopManagerTQ`.
"""

from __future__ import annotations

import numpy as np
import ray
from verl.experimental.agent_loop import AgentLoopManager
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.protocol import DataProto
from verl.utils.ray_utils import auto_await

from pipeline.epochs import advance_rows, trainer_epoch_publisher

# Registers `das_agent` wherever this module is imported: the driver and, by unpickling the worker class
# below, every agent loop worker process.
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


def annotate(batch: DataProto, annotator: BatchAnnotator) -> None:
    """Adds the DAS columns to a legacy rollout batch (in place); each row is one rollout."""
    columns = batch.non_tensor_batch
    rows = [{k: columns[k][i] for k in _ROW_FIELDS if k in columns} for i in range(len(batch))]
    result = annotator.annotate(
        rows,
        batch.meta_info.get("global_steps"),
        bool(batch.meta_info.get("validate", False)),
        [1] * len(batch),
        columns.get("__do_sample__"),
    )
    columns[PROBLEM_FIELD] = np.array(result.problem_ids, dtype=object)
    columns[EPOCH_FIELD] = result.epochs
    columns[SAMPLE_FIELD] = result.samples


class DasAgentLoopWorker(AgentLoopWorker):
    """verl's agent loop worker, defined here so its processes import (and register) `das_agent`."""


class DasAgentLoopManager(AgentLoopManager):
    """verl's AgentLoopManager plus the DAS identity columns."""

    def __init__(self, *args, **kwargs) -> None:
        self.agent_loop_workers_class = ray.remote(DasAgentLoopWorker)
        super().__init__(*args, **kwargs)
        self.das = BatchAnnotator(ledger_from_config(self.config))
        # The ledger's epochs, to the replicas: the only thing that moves their history windows.
        self.das_epochs = trainer_epoch_publisher(self.config.get("das"))

    @auto_await
    async def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Annotates the batch, then runs verl's dispatch to the agent loop workers."""
        annotate(prompts, self.das)
        # One priority scale for every agent loop worker (verl keeps a `priority` column it finds).
        prompts.non_tensor_batch["priority"] = np.asarray(
            batch_priorities(
                self.llm_client._load_balancer,
                prompts.non_tensor_batch[PROBLEM_FIELD],
                self.rollout_config.response_length,
            ),
            dtype=np.int64,
        )
        advance_rows(
            self.das_epochs, prompts.non_tensor_batch[PROBLEM_FIELD], prompts.non_tensor_batch[EPOCH_FIELD]
        )
        prefetch_placed(
            self.llm_client._load_balancer,
            prompts.non_tensor_batch[PROBLEM_FIELD],
            max_tokens=int(self.rollout_config.response_length),
        )
        return await super().generate_sequences(prompts)

    def das_stats(self) -> list[list[dict]]:
        """Per server, each rank's DAS proposer statistics (drafts, acceptance, sources, budget state)."""
        # verl hands the manager only the client; the client's router knows the servers.
        return das_stats(router_servers(self.llm_client._load_balancer))
