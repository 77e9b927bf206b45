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

    from workers.generator.model import require_model

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
    # The name users' engine args keep (workers.proposer re-exports the proposer after the move to generator/).
    assert vllm_kwargs.speculative_config.model == "workers.proposer.DasProposer"
    from workers.generator.proposer import DasProposer
    from workers.proposer import DasProposer as Exported

    assert Exported is DasProposer
    assert vllm_kwargs.worker_extension_cls == "workers.verl.extension.DasVerlWorkerExtension"
    assert rollout.disable_log_stats is False
    assert rollout.scheduling_policy == "priority"  # das_agent's priorities order vLLM's admission
    assert rollout.temperature == 1.0 and rollout.n == 8
    assert config.trainer.use_v1 is True  # verl's default trainer
    assert config.das.bus is None and "steps_per_epoch" not in config.das
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.DAS_HISTORY_DIR == ""
    # verl's own typed view of the rollout section (what its workers build) accepts every key we set.
    checked = omega_conf_to_dataclass(rollout)
    assert isinstance(checked, RolloutConfig)
    assert checked.agent.default_agent_loop == "das_agent"
    assert checked.scheduling_policy == "priority"
    assert checked.agent.agent_loop_config_path is None
    assert checked.agent.agent_loop_manager_class == "workers.verl.manager_v1.DasAgentLoopManagerTQ"


def test_verl_loads_both_managers_and_their_workers_register_das_agent_without_a_config_path() -> None:
    import subprocess
    import sys

    from verl.experimental.agent_loop import AgentLoopManager
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ
    from verl.utils.import_utils import load_class_from_fqn

    from workers.verl.manager import DasAgentLoopManager, DasAgentLoopWorker
    from workers.verl.manager_v1 import DasAgentLoopManagerTQ, DasAgentLoopWorkerTQ

    config = _compose()
    # As verl's TaskRunnerV1 and the legacy RayPPOTrainer load agent_loop_manager_class.
    manager = load_class_from_fqn(
        config.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager"
    )
    assert manager is DasAgentLoopManagerTQ and issubclass(manager, AgentLoopManagerTQ)
    assert issubclass(load_class_from_fqn("workers.verl.manager.DasAgentLoopManager", "m"), AgentLoopManager)
    assert DasAgentLoopManager and DasAgentLoopWorker and DasAgentLoopWorkerTQ
    # A worker process knows nothing but the pickled worker class: unpickling it must register das_agent.
    import cloudpickle

    for worker in (DasAgentLoopWorker, DasAgentLoopWorkerTQ):
        probe = (
            "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); "
            "from verl.experimental.agent_loop.agent_loop import _agent_loop_registry as r; "
            "print(r['das_agent']['_target_'])"
        )
        result = subprocess.run(
            [sys.executable, "-c", probe],
            input=cloudpickle.dumps(worker),
            capture_output=True,
            cwd="/",
            timeout=300,
        )
        assert result.returncode == 0, result.stderr.decode()[-2000:]
        assert result.stdout.decode().split()[-1] == "workers.verl.agent_loop.DasAgentLoop"


def _v1_batch(problem: str, step: int) -> Any:
    """A one-prompt batch as verl's V1 trainer hands it to the agent loop manager."""
    from verl.utils import tensordict_utils as tu

    return tu.get_tensordict(
        {
            "data_source": ["test"],
            "extra_info": [{"split": "train", "index": problem}],
            "raw_prompt": [[{"role": "user", "content": "Problem: what is 2 + 2?"}]],
            "uid": [uuid.uuid4().hex],
        },
        non_tensor_dict={"global_steps": step},
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


class _EngineServer:
    """verl's LLMServerClient.generate contract served by an in-process AsyncLLM: the same SamplingParams
    construction as vLLMHttpServer.generate (logprobs flag to count, max_tokens from the rollout config),
    without Ray and HTTP."""

    def __init__(self, engine: Any, max_tokens: int) -> None:
        self.engine = engine
        self.max_tokens = max_tokens
        # Problems whose next request is aborted after this many tokens, and the samples that were.
        self.abort_after: dict[str, int] = {}
        self.aborted: list[int] = []
        # Each request's (problem, priority), as vLLMHttpServer.generate hands it to the engine.
        self.priorities: list[tuple[str, int]] = []

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: dict, priority: int = 0, **_: Any
    ) -> Any:
        from verl.workers.rollout.replica import TokenOutput
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = dict(sampling_params)
        params["logprobs"] = 0 if params.pop("logprobs", False) else None
        extra = params.get("extra_args") or {}
        self.priorities.append((extra.get("das_problem_id"), priority))
        abort_after = self.abort_after.pop(extra.get("das_problem_id"), None)
        if abort_after is not None:
            # A request to abort runs far past the abort (a long-tail sample), so it cannot finish first.
            params |= {"max_tokens": 10 * self.max_tokens, "ignore_eos": True}
        final = None
        async for output in self.engine.generate(
            TokensPrompt(prompt_token_ids=prompt_ids),
            SamplingParams(**{"max_tokens": self.max_tokens, **params}),
            request_id,
            priority=priority,
        ):
            final = output
            if abort_after is not None and len(output.outputs[0].token_ids) >= abort_after:
                # What verl's abort_all_requests does to in-flight requests before a weight update.
                self.aborted.append(extra["das_sample"])
                await self.engine.abort(request_id)
                abort_after = None
        assert final is not None
        token_ids = final.outputs[0].token_ids
        log_probs = None
        if (
            params["logprobs"] is not None
        ):  # vLLMHttpServer.generate's extraction of the sampled tokens' entries
            log_probs = [lp[token_ids[i]].logprob for i, lp in enumerate(final.outputs[0].logprobs)]
        finish_reason = final.outputs[0].finish_reason
        # vLLMHttpServer.generate's mapping (a stream cut by the abort ends without a finish reason).
        if finish_reason == "abort":
            stop_reason = "aborted"
        elif finish_reason in ("stop", "length"):
            stop_reason = "completed"
        else:
            stop_reason = finish_reason
        return TokenOutput(
            token_ids=list(token_ids), log_probs=log_probs, stop_reason=stop_reason, num_preempted=0
        )


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
        "logprobs_mode": rollout.logprobs_mode,
        # vLLMHttpServer.launch_server sets it from the rollout config.
        "scheduling_policy": rollout.scheduling_policy,
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
    assert vllm_config.scheduler_config.policy == "priority"
    assert vllm_config.parallel_config.worker_extension_cls == "workers.verl.extension.DasVerlWorkerExtension"
    return AsyncLLM.from_vllm_config(vllm_config=vllm_config, disable_log_stats=engine_args.disable_log_stats)


@pytest.mark.vllm
def test_das_agent_runs_verls_single_turn_loop_on_a_real_engine_and_publishes_trajectories() -> None:
    import time

    import hydra
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, _agent_loop_registry
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from pipeline.bus import embedded_bus
    from workers.verl.identity import BatchAnnotator, PassLedger
    from workers.verl.manager_v1 import annotate_tq
    from workers.verl.stats import _read_stats, _stats_path

    # The embedded bus: this test's process is the agent loop worker and subscribes like an in-process replica.
    config = _compose("das.bus=embedded", "data.max_response_length=24", "data.max_prompt_length=256")
    subscription = embedded_bus().subscribe()
    engine = _engine_from_verl_args(config)
    server = _EngineServer(engine, max_tokens=config.actor_rollout_ref.rollout.response_length)
    annotator = BatchAnnotator(PassLedger(None))
    try:
        rollout = config.actor_rollout_ref.rollout
        tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
        problem, aborted = uuid.uuid4().hex[:6], uuid.uuid4().hex[:6]
        # Greedy makes the second step's outputs comparable with the first's.
        sampling = {
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "repetition_penalty": 1.0,
        }

        async def run_session(kwargs: dict[str, Any], logprobs: bool) -> Any:
            # As AgentLoopWorker._run_agent_loop builds it; `das_agent` is registered by importing our manager.
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
            return await loop.run({**sampling, "logprobs": logprobs}, **kwargs)

        async def run_step(pid: str, step: int, logprobs: bool = False) -> list[Any]:
            # verl's V1 trainer (the example config's): one prompt row, its n=2 samples run as sessions.
            batch = _v1_batch(pid, step=step)
            annotate_tq(batch, annotator, n=2)
            return list(await asyncio.gather(*(run_session(kw, logprobs) for kw in _v1_kwargs(batch, n=2))))

        async def run_all() -> tuple[list[Any], list[Any], list[dict], list[int]]:
            # Step 1 as with calculate_log_probs=true (verl's rollout_log_probs), step 2 without.
            first = await run_step(problem, 1, logprobs=True)
            second = await run_step(problem, 2)
            # What workers.verl.stats has verl's vLLMHttpServer.collective_rpc run in each worker (verl drops
            # the RPC's results), read back as its __ray_call__ does inside the server actor.
            path = _stats_path(None)
            await engine.collective_rpc("das_write_stats", args=(path,))
            stats = _read_stats(None, path)
            assert stats[0]["steps"] == (await engine.collective_rpc("das_stats"))[0]["steps"]
            server.abort_after[f"test/train/{aborted}"] = 4
            await run_step(aborted, 3)
            # The proposer sees requests leave at its next call; adding (nothing) reaps the ones that left.
            await engine.collective_rpc("das_add_trajectories", args=([],))
            (cut,) = server.aborted

            async def new_to_history(sample: int) -> int:
                record = {"problem_id": f"test/train/{aborted}", "epoch": 0, "sample": sample}
                record |= {"prompt_ids": [1], "response_ids": [2]}
                return (await engine.collective_rpc("das_add_trajectories", args=([record],)))[0]

            # Adding is idempotent by key: 0 means the proposer's own finish-time add already holds the key.
            return first, second, stats, [await new_to_history(1 - cut), await new_to_history(cut)]

        first, second, stats, added = asyncio.run(run_all())
        (aborted_sample,) = server.aborted
        priorities = list(server.priorities)
    finally:
        engine.shutdown()
        # Collected now, while vLLM's modules are alive (its __del__ shuts down again and fails at exit).
        engine = server = None
        gc.collect()
    kept_sample = 1 - aborted_sample
    messages = []
    deadline = time.monotonic() + 30
    while len(messages) < 5 and time.monotonic() < deadline:
        messages += subscription.poll(max_records=10, timeout_s=0.5)
    subscription.close()
    records = sorted((m.record for m in messages), key=lambda r: r.key)
    pid = f"test/train/{problem}"
    # One session of the aborted problem was cut mid-way: only its complete sibling is published.
    assert [r.key for r in records] == sorted(
        [(pid, e, s) for e in (0, 1) for s in (0, 1)] + [(f"test/train/{aborted}", 0, kept_sample)]
    )
    for record, output in zip([r for r in records if r.problem_id == pid], first + second, strict=True):
        assert record.response_ids == list(output.response_ids) and len(record.response_ids) > 0
        assert record.prompt_ids == list(output.prompt_ids)
        # verl's rollout_log_probs travel with the record, exactly (vLLM's float32 values fit the wire's).
        assert record.response_logprobs == output.response_logprobs
    assert all(len(o.response_logprobs) == len(o.response_ids) for o in first)
    assert all(o.response_logprobs is None for o in second)
    # Greedy outputs do not change when step 2 drafts from step 1's history: drafting is lossless.
    assert [list(o.response_ids) for o in second] == [list(o.response_ids) for o in first]
    # das_agent hands verl's priority (absent from this batch, so 0) on to vLLM unchanged; DAS's managers set it
    # for the whole batch (tests/test_verl_priority.py).
    assert priorities[:4] == [(pid, 0)] * 4
    # Step 2 drafted from the problem's history tree and the verifier accepted it: the identity in extra_args
    # reached the proposer through verl's sampling parameters and vLLM's SamplingParams, and the proposer's
    # RPC went through our worker extension.
    das = stats[0]
    assert das["history_problems"] == 1 and das["drafting_rank"]
    assert das["sources"]["history"] > 0 and das["accepted_tokens"] > 0
    assert das["errors"] == 0 and das["malformed_requests"] == 0
    # The proposer's own finish-time add took the complete sibling of the aborted request, not the cut one.
    assert added == [0, 1]


@pytest.mark.parametrize(
    ("response", "max_tokens", "expected"),
    [
        ([5, 6, 2], 10, 3),  # ended on EOS (2)
        ([5, 2, 7, 8], 10, 2),  # accepted drafts ran past EOS in the runner: cut after it
        ([5, 6, 7, 8], 4, 4),  # reached max_tokens
        ([5, 6, 7, 8, 2], 4, 4),  # drafts ran past max_tokens and then hit EOS: vLLM returned max_tokens
        ([5, 6, 7], 10, None),  # left early: aborted, or a stop string matched in vLLM's front end
    ],
)
def test_the_proposer_adds_only_requests_that_ended_by_themselves(response, max_tokens, expected) -> None:
    from workers.generator.proposer import _Live, _natural_end

    prompt = [1, 1]
    tokens = np.array(prompt + response, dtype=np.int32)
    live = _Live(0, "p", 0, 0, len(prompt), max_tokens, frozenset({2}))
    assert _natural_end(live, tokens) == expected
