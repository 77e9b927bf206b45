"""`DasAgentLoopManager`: verl's legacy agent loop manager that tells each rollout row its DAS epoch and sample.

verl keeps the training step in the batch's `meta_info`, which agent loops never see, and repeats each prompt n
times without numbering the copies. Before the batch is split across agent loop workers, this manager adds
`das_epoch` and `das_sample` columns (as verl itself adds `priority`); `DasAgentLoop` reads them.

This is for verl's legacy trainer (`trainer.use_v1=false`); the default V1 trainer takes
`workers.verl.manager_v1.DasAgentLoopManagerTQ`.
"""

from __future__ import annotations

from verl.experimental.agent_loop import AgentLoopManager
from verl.protocol import DataProto
from verl.utils.ray_utils import auto_await

# Registers `das_agent` in this process too (the driver); worker processes load it by agent_loop_config_path.
from workers.verl import agent_loop as _agent_loop  # noqa: F401
from workers.verl.identity import EPOCH_FIELD, SAMPLE_FIELD, rollout_identity, steps_per_epoch


def annotate(batch: DataProto, per_epoch: int) -> None:
    """Adds the `das_epoch` and `das_sample` columns to a rollout batch (in place)."""
    epochs, samples = rollout_identity(
        batch.non_tensor_batch.get("index"),
        batch.meta_info.get("global_steps"),
        bool(batch.meta_info.get("validate", False)),
        per_epoch,
        batch.non_tensor_batch.get("__do_sample__"),
    )
    if len(epochs) != len(batch):
        # No `index` column: every row stays out of the history.
        epochs, samples = rollout_identity([None] * len(batch), None, True, per_epoch)
    batch.non_tensor_batch[EPOCH_FIELD] = epochs
    batch.non_tensor_batch[SAMPLE_FIELD] = samples


class DasAgentLoopManager(AgentLoopManager):
    """verl's AgentLoopManager plus the DAS epoch and sample columns."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.das_steps_per_epoch = steps_per_epoch(self.config.get("das"))

    @auto_await
    async def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Annotates the batch, then runs verl's dispatch to the agent loop workers."""
        annotate(prompts, self.das_steps_per_epoch)
        return await super().generate_sequences(prompts)
