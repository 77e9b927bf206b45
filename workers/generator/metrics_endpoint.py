"""The proposer's own `/metrics` in training, found by discovery (issue 37, item 7).

verl starts its vLLM servers as Ray actors, and the proposer runs in their engine processes, whose DAS series no
`/metrics` serves: vLLM's own endpoint shows only its registry, and a job-wide PROMETHEUS_MULTIPROC_DIR would move
vLLM's endpoint to one folder shared by every server of the node. So the drafting proposer of each engine serves
its process's registry on a port of its own, on the node's address, and leaves a note of that address in
`$DAS_PROPOSER_TARGETS` (a node-local folder, set for every process through Ray's job-wide runtime environment).
`workers.verl.vllm_targets.proposer_metric_addresses` collects the notes of every Ray node for Prometheus
(`das monitoring vllm-targets --proposers DIR`), as it lists verl's vLLM servers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from monitoring.server import start_metrics_server

TARGETS_ENV = "DAS_PROPOSER_TARGETS"


def node_address() -> str:
    """The address other hosts reach this node at: Ray's choice for the node (its --node-ip-address)."""
    from ray.util import get_node_ip_address

    return get_node_ip_address()


def serve_proposer_metrics() -> str | None:
    """Serves this process's `/metrics` on a free port of the node's address and notes `host:port` in
    `$DAS_PROPOSER_TARGETS/<pid>.json`; None (and nothing served) when the variable is unset.

    Raises:
        OSError: the port or the folder cannot be used.
    """
    folder = os.environ.get(TARGETS_ENV)
    if not folder:
        return None
    host = node_address()
    server, _thread = start_metrics_server(0, host=host)
    address = f"[{host}]:{server.server_port}" if ":" in host else f"{host}:{server.server_port}"
    notes = Path(folder)
    notes.mkdir(parents=True, exist_ok=True)
    partial = notes / f".{os.getpid()}.tmp"
    partial.write_text(json.dumps({"address": address, "pid": os.getpid()}))
    partial.replace(notes / f"{os.getpid()}.json")
    return address
