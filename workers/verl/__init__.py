"""DAS inside verl 0.9.1 (vLLM rollouts through verl's agent loops).

Three hooks, each selected by verl configuration (see `examples/verl/das_grpo.yaml`):
- `workers.verl.manager_v1.DasAgentLoopManagerTQ` (V1 trainer, verl's default) or
  `workers.verl.manager.DasAgentLoopManager` (legacy trainer), set as
  `actor_rollout_ref.rollout.agent.agent_loop_manager_class`: before a batch fans out to the agent loop workers,
  it writes the rollout epoch (and, for the legacy trainer, each row's sample number) next to the dataset's
  `index` (verl gives agent loops every batch field as keyword arguments; V1 adds the sample as `session_id`).
- `workers.verl.agent_loop.DasAgentLoop`, registered as `das_agent` (`rollout.agent.default_agent_loop` and
  `examples/verl/das_agent_loops.yaml`): verl's single-turn loop that puts `das_problem_id`, `das_epoch` and
  `das_sample` into each request's `SamplingParams.extra_args` and publishes the finished trajectory to the bus.
- `workers.verl.extension.DasVerlWorkerExtension` (`engine_kwargs.vllm.worker_extension_cls`): verl's vLLM worker
  extension (weight updates, LoRA, FP8) plus the DAS proposer's RPCs.

verl is imported only here, inside `workers`.
"""
