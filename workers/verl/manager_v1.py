"""`DasAgentLoopManagerTQ`: verl's V1 (TransferQueue) agent loop manager with the DAS epoch.

The V1 trainer hands the manager a TensorDict of prompts with `global_steps` and `validate`; its workers run each
prompt's n samples as sessions 0..n-1 and give every field (and `session_id`) to the agent loop. This manager
adds one `das_epoch` value for the batch; `DasAgentLoop` takes the sample from `session_id`. Needs the
`transferqueue` package, as verl's V1 trainer does.

    actor_rollout_ref.rollout.agent.agent_loop_manager_class=workers.verl.manager_v1.DasAgentLoopManagerTQ
"""

from __future__ import annotations

from tensordict import TensorDict
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ
from verl.utils import tensordict_utils as tu

# Registers `das_agent` in this process too (the driver); worker processes load it by agent_loop_config_path.
from workers.verl import agent_loop as _agent_loop  # noqa: F401
from workers.verl.identity import EPOCH_FIELD, rollout_epoch, steps_per_epoch


def annotate_tq(prompts: TensorDict, per_epoch: int) -> None:
    """Adds the batch's `das_epoch` (NOT_HISTORY for validation) to a V1 prompt batch (in place)."""
    keys = set(prompts.keys())
    validate = bool(prompts["validate"]) if "validate" in keys else False
    step = prompts["global_steps"] if "global_steps" in keys else None
    tu.assign_non_tensor_data(prompts, EPOCH_FIELD, rollout_epoch(step, validate, per_epoch))


class DasAgentLoopManagerTQ(AgentLoopManagerTQ):
    """verl's AgentLoopManagerTQ plus the DAS epoch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.das_steps_per_epoch = steps_per_epoch(self.config.get("das"))

    def generate_sequences(self, prompts: TensorDict) -> None:
        """Annotates the batch, then dispatches it to verl's agent loop workers."""
        annotate_tq(prompts, self.das_steps_per_epoch)
        super().generate_sequences(prompts)
