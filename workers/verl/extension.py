"""`DasVerlWorkerExtension`: the vLLM worker extension for verl rollouts with the DAS proposer.

verl passes its own `vLLMColocateWorkerExtension` as `worker_extension_cls` (weight sync from the trainer, LoRA,
FP8); a config that named DAS's extension instead would lose those. This class is both: verl's extension first
(its `__new__` applies verl's patches), then `DasWorkerExtension`'s RPCs (`das_stats`, `das_add_trajectories`,
`das_evict`, `das_reset_stats`), and `das_write_stats` for `workers.verl.stats`. The proposer finds the model
runner by itself on its first step (see `workers.generator.proposer`), so no RPC has to run before rollouts: verl's
server never calls one.

    actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=workers.verl.extension.DasVerlWorkerExtension
"""

from __future__ import annotations

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from workers.generator.proposer import DasWorkerExtension
from workers.verl.stats import write_rank_stats


class DasVerlWorkerExtension(vLLMColocateWorkerExtension, DasWorkerExtension):
    """verl's colocated worker extension with the DAS proposer's RPCs."""

    def das_write_stats(self, path: str) -> None:
        """Writes this rank's `das_stats` to `<path>.<rank>`: verl's server drops RPC results, so
        `workers.verl.stats` reads them from there."""
        write_rank_stats(self.das_stats(), int(self.rank), path)
