"""`das_agent`: verl's single-turn agent loop with DAS request identity and trajectory publishing.

Selected with `actor_rollout_ref.rollout.agent.default_agent_loop=das_agent` and loaded in verl's agent loop
worker processes through `agent_loop_config_path` (`examples/verl/das_agent_loops.yaml`), which names this class.
The bus comes from the trainer config's `das` block:

    das:
      bus: kafka://broker-1:9092,broker-2:9092   # null: publish nothing (the proposer still keeps its history)
      bus_settings: {security_protocol: SASL_SSL, ...}

Publishing never fails a rollout: DAS only speeds rollouts up, so a bus error is logged and the trajectory is
simply missing from the shared history.
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

from pipeline.bus import Bus, BusError, open_bus
from workers.verl.identity import RequestIdentity, with_extra_args

logger = logging.getLogger(__name__)

AGENT_LOOP_NAME = "das_agent"
# Agent loops are built per trajectory; the bus is opened once per worker process and shared.
_buses: dict[str, Bus] = {}
_buses_lock = threading.Lock()


def trajectory_bus(das_config: Any) -> Bus | None:
    """The process's bus for the trainer config's `das` block; None when `das.bus` is unset.

    Raises:
        ValueError: `das.bus` is not a bus URL (see `pipeline.bus.open_bus`).
        BusError: Kafka cannot be reached.
    """
    if not das_config or not das_config.get("bus"):
        return None
    url = str(das_config["bus"])
    settings = das_config.get("bus_settings") or {}
    if not isinstance(settings, dict):
        settings = OmegaConf.to_container(settings, resolve=True)
    with _buses_lock:
        if url not in _buses:
            _buses[url] = open_bus(url, **settings)
        return _buses[url]


@register(AGENT_LOOP_NAME)
class DasAgentLoop(SingleTurnAgentLoop):
    """Single-turn rollout whose request carries `das_problem_id`, `das_epoch`, `das_sample` in `extra_args`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bus = trajectory_bus(self.config.get("das"))
        self.worker = f"verl:{socket.gethostname()}:{os.getpid()}"

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """Runs verl's single-turn loop with the DAS identity in `extra_args`, then publishes the trajectory."""
        identity = RequestIdentity.from_kwargs(kwargs)
        output = await super().run(with_extra_args(sampling_params, identity), **kwargs)
        if self.bus is not None and identity.in_history:
            try:
                self.bus.publish(identity.record(output.prompt_ids, output.response_ids, self.worker))
            except BusError as exc:
                logger.warning("DAS: trajectory %s not published: %s", identity, exc)
        return output
