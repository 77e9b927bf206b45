"""DAS inside verl 0.9.1 (vLLM rollouts through verl's agent loops).

Three hooks, each selected by verl configuration (see `examples/verl/das_grpo.yaml`):
- `workers.verl.manager.DasAgentLoopManager` (`actor_rollout_ref.rollout.agent.agent_loop_manager_class`): before
  a batch fans out to the agent loop workers, it writes each row's rollout epoch and sample number next to the
  dataset's `index` (verl gives agent loops every non-tensor batch field as keyword arguments).
- `workers.verl.agent_loop.DasAgentLoop`, registered as `das_agent` (`rollout.agent.default_agent_loop` and
  `examples/verl/das_agent_loops.yaml`): verl's single-turn loop that puts `das_problem_id`, `das_epoch` and
  `das_sample` into each request's `SamplingParams.extra_args` and publishes the finished trajectory to the bus.
- `workers.verl.extension.DasVerlWorkerExtension` (`engine_kwargs.vllm.worker_extension_cls`): verl's vLLM worker
  extension (weight updates, LoRA, FP8) plus the DAS proposer's RPCs.

verl is imported only here, inside `workers`.
"""
