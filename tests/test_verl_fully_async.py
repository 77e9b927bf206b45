"""verl's fully-async rollout client (`FullyAsyncLLMServerClient`, used by verl's async trainers and its fully-async
rollouter) driving `das_agent` on a real CPU vLLM engine with the DAS proposer.

That client hides an interrupted request from the agent loop: it re-sends prompt + partial output with a smaller
`max_tokens` and the same `extra_args`, merges the pieces, and says `stop_reason="length"` when the whole response
reached its cap. So:
- the resumed segment (its prompt holds the partial output) is never stored by the proposer as a trajectory;
- the merged response is published whole, under its own prompt;
- a response that reached its cap is complete and published.
"""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from typing import Any

import pytest
from test_verl_integration import _compose, _engine_from_verl_args, _EngineServer, _v1_batch, _v1_kwargs

pytestmark = pytest.mark.vllm

SAMPLES = 2


class _Local:
    """An in-process object behind Ray's handle calling convention (`handle.method.remote(...)`): what verl's
    client awaits gets a finished future or the coroutine, what it fires and forgets runs at once."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        if name == "__ray_call__":  # Ray runs fn(actor, *args) inside the actor
            target = self._target

            def method(fn: Any, *args: Any, **kwargs: Any) -> Any:
                return fn(target, *args, **kwargs)
        else:
            method = getattr(self._target, name)

        class _Remote:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                result = method(*args, **kwargs)
                if asyncio.iscoroutine(result):
                    return result
                future = asyncio.get_running_loop().create_future()
                future.set_result(result)
                return future

        return _Remote


def test_fully_async_resumes_are_not_history_and_capped_responses_are_published() -> None:
    import hydra
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, _agent_loop_registry
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    from pipeline.bus import embedded_bus
    from workers.verl.identity import BatchAnnotator, PassLedger
    from workers.verl.manager_v1 import annotate_tq
    from workers.verl.router import ProblemAffinityLoadBalancer

    config = _compose("das.bus=embedded", "data.max_response_length=16", "data.max_prompt_length=256")
    subscription = embedded_bus().subscribe()
    engine = _engine_from_verl_args(config)
    server = _EngineServer(engine, max_tokens=config.actor_rollout_ref.rollout.response_length)
    # verl's real client and DAS's real router, with Ray's handles replaced by in-process calls.
    balancer = _Local(ProblemAffinityLoadBalancer({"server-0": _Local(server)}))
    client = FullyAsyncLLMServerClient(config, load_balancer_handle=balancer)
    problem = uuid.uuid4().hex[:6]
    pid = f"test/train/{problem}"
    try:
        rollout = config.actor_rollout_ref.rollout
        tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
        # ignore_eos: every sample runs to its cap, where verl's client reports "length".
        sampling = {
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "repetition_penalty": 1.0,
            "logprobs": False,
            "ignore_eos": True,
        }

        async def run_session(kwargs: dict[str, Any]) -> tuple[Any, str | None]:
            loop = hydra.utils.instantiate(
                config=_agent_loop_registry[rollout.agent.default_agent_loop],
                trainer_config=DictConfigWrap(config=config),
                server_manager=client,
                tokenizer=tokenizer,
                processor=None,
                hf_model_type="llama",
                dataset_cls=RLHFDataset,
                data_config=DictConfigWrap(config.data),
            )
            output = await loop.run(dict(sampling), **kwargs)
            return output, loop.server_manager.stop_reason

        async def run_all() -> tuple[list[tuple[Any, str | None]], list[int]]:
            batch = _v1_batch(problem, step=1)
            annotate_tq(batch, BatchAnnotator(PassLedger(None)), n=SAMPLES)
            # One of the problem's samples is aborted after 4 tokens, as verl aborts for a weight update.
            server.abort_after[pid] = 4
            outputs = list(await asyncio.gather(*(run_session(kw) for kw in _v1_kwargs(batch, n=SAMPLES))))
            # The proposer sees requests leave at its next call; adding (nothing) reaps the ones that left.
            await engine.collective_rpc("das_add_trajectories", args=([],))

            async def new_to_history(sample: int) -> int:
                record = {
                    "problem_id": pid,
                    "epoch": 0,
                    "sample": sample,
                    "prompt_ids": [1],
                    "response_ids": [2],
                }
                return (await engine.collective_rpc("das_add_trajectories", args=([record],)))[0]

            # 1: the proposer did not hold the key; 0: its own finish-time add had stored it.
            return outputs, [await new_to_history(sample) for sample in range(SAMPLES)]

        outputs, added = asyncio.run(run_all())
        (resumed,) = server.aborted
    finally:
        engine.shutdown()
        engine = server = client = None
        gc.collect()
    messages = []
    deadline = time.monotonic() + 30
    while len(messages) < SAMPLES and time.monotonic() < deadline:
        messages += subscription.poll(max_records=10, timeout_s=0.5)
    subscription.close()
    records = {m.record.sample: m.record for m in messages}
    response_length = config.actor_rollout_ref.rollout.response_length
    # Both samples ran to their cap: verl's client says "length".
    assert [reason for _, reason in outputs] == ["length"] * SAMPLES
    assert [len(o.response_ids) for o, _ in outputs] == [response_length] * SAMPLES
    # Both were published whole, the resumed one under its own prompt with its full response.
    assert sorted(records) == list(range(SAMPLES))
    for sample, (output, _) in enumerate(outputs):
        assert records[sample].key == (pid, 0, sample)
        assert records[sample].prompt_ids == list(output.prompt_ids)
        assert records[sample].response_ids == list(output.response_ids)
    # The proposer stored the sample that ran in one piece, never the resumed segment (prompt + partial output).
    assert added == [1 if sample == resumed else 0 for sample in range(SAMPLES)]
