"""DAS inside verl 0.9.1 (vLLM rollouts through verl's agent loops).

Hooks, each selected by verl configuration (see `examples/verl/das_grpo.yaml`):
- `workers.verl.manager_v1.DasAgentLoopManagerTQ` (V1 trainer, verl's default) or
  `workers.verl.manager.DasAgentLoopManager` (legacy trainer), set as
  `actor_rollout_ref.rollout.agent.agent_loop_manager_class`: before a batch fans out to the agent loop workers,
  it gives each row its problem id, pass (epoch) and sample numbers (`workers.verl.identity`), and its workers
  register `das_agent`.
- `workers.verl.agent_loop.DasAgentLoop`, registered as `das_agent` (`rollout.agent.default_agent_loop`):
  verl's single-turn loop that puts `das_problem_id`, `das_epoch` and `das_sample` into each request's
  `SamplingParams.extra_args` and publishes complete trajectories (`workers.verl.publisher`).
- `workers.verl.router.ProblemAffinityLoadBalancer` (`rollout.router_config_path`): one problem, one server.
- `workers.verl.extension.DasVerlWorkerExtension` (`engine_kwargs.vllm.worker_extension_cls`): verl's vLLM worker
  extension (weight updates, LoRA, FP8) plus the DAS proposer's RPCs; `workers.verl.stats` reads them.

verl is imported only here, inside `workers`.
"""
