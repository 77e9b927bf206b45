"""`das_agent`: verl's single-turn agent loop with DAS request identity and trajectory publishing.

Selected with `actor_rollout_ref.rollout.agent.default_agent_loop=das_agent`; registered in every agent loop
worker process by our managers (`workers.verl.manager*`), which import this module there. The bus comes from
the trainer config's `das` block:

    das:
      bus: kafka://broker-1:9092,broker-2:9092   # null: publish nothing (the proposer still keeps its history)
      bus_settings: {security_protocol: SASL_SSL, ...}

With `actor_rollout_ref.rollout.calculate_log_probs=true` verl asks vLLM for each sampled token's log
probability (its `rollout_log_probs`, at the sampling temperature: verl's `logprobs_mode` default is
"processed_logprobs"); the published records carry them as `response_logprobs`.

Publishing never blocks or fails a rollout (`workers.verl.publisher`). Only complete trajectories are
published: a request vLLM aborted (verl's `stop_reason="aborted"`, e.g. a partial rollout interrupted for a
weight update) or a response verl cut to `response_length` would store a truncated sample under a real key.
verl's fully-async client resumes an aborted request itself and hands back the whole response, with
`stop_reason="length"` when it reached its cap: such a response is complete.

The tail first: verl hands each row's `priority` through the agent loop to the server's
`generate(..., priority=...)` and vLLM, which admits lower values first under
`actor_rollout_ref.rollout.scheduling_policy=priority`. DAS's managers set it for the whole batch before it fans
out to the agent loop workers, on one scale (`workers.verl.priority`: the problem's length block, from the
lengths the router actor keeps, ahead of the row's position); `das_agent` passes it on unchanged and reports the
length of every complete response to that actor.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from workers.verl.identity import RequestIdentity, with_extra_args, with_prompt_tokens
from workers.verl.priority import report_length
from workers.verl.publisher import BackgroundPublisher

logger = logging.getLogger(__name__)

AGENT_LOOP_NAME = "das_agent"
# verl's TokenOutput.stop_reason for a request that ran to its end: "completed" (EOS, stop string or max_tokens),
# or "length" from the fully-async client (FullyAsyncLLMServerClient) when the resumed response reached its cap.
COMPLETED = frozenset({"completed", "length"})
# Agent loops are built per trajectory; the publisher is opened once per worker process and shared.
_publishers: dict[str, BackgroundPublisher] = {}
_publishers_lock = threading.Lock()


def trajectory_publisher(das_config: Any) -> BackgroundPublisher | None:
    """The process's publisher for the trainer config's `das` block; None when `das.bus` is unset.

    Raises:
        ValueError: `das.bus` is not a bus URL.
    """
    if not das_config or not das_config.get("bus"):
        return None
    url = str(das_config["bus"])
    settings = das_config.get("bus_settings") or {}
    if not isinstance(settings, dict):
        settings = OmegaConf.to_container(settings, resolve=True)
    with _publishers_lock:
        if url not in _publishers:
            _publishers[url] = BackgroundPublisher(url, settings)
        return _publishers[url]


class _StopReasonRecorder:
    """verl's LLM server client, remembering the stop reason and length of the request it served."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.stop_reason: str | None = None
        self.generated = 0

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        # Tagged here, above verl's client: a fully-async client's resumed segments keep these extra_args.
        if "prompt_ids" in kwargs and "sampling_params" in kwargs:
            kwargs["sampling_params"] = with_prompt_tokens(
                kwargs["sampling_params"], len(kwargs["prompt_ids"])
            )
        output = await self._client.generate(*args, **kwargs)
        self.stop_reason = getattr(output, "stop_reason", None)
        self.generated = len(output.token_ids)
        return output

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@register(AGENT_LOOP_NAME)
class DasAgentLoop(SingleTurnAgentLoop):
    """Single-turn rollout whose request carries `das_problem_id`, `das_epoch`, `das_sample` in `extra_args`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.publisher = trajectory_publisher(self.config.get("das"))
        self.server_manager = _StopReasonRecorder(self.server_manager)
        self.worker = f"verl:{socket.gethostname()}:{os.getpid()}"

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """Runs verl's single-turn loop with the DAS identity in `extra_args`, then publishes the trajectory
        if it is complete."""
        identity = RequestIdentity.from_kwargs(kwargs)
        output = await super().run(with_extra_args(sampling_params, identity), **kwargs)
        if self.complete(output):
            # The lengths behind every worker's priorities (workers.verl.priority), in the router actor.
            report_length(self.server_manager, identity.problem_id, len(output.response_ids))
        if self.publisher is not None and identity.in_history and self.complete(output):
            record = identity.record(
                output.prompt_ids, output.response_ids, self.worker, output.response_logprobs
            )
            self.publisher.publish(record)
        return output

    def complete(self, output: AgentLoopOutput) -> bool:
        """True when the request ran to its end and verl kept all of its tokens."""
        recorder = self.server_manager
        return recorder.stop_reason in COMPLETED and recorder.generated <= self.response_length
