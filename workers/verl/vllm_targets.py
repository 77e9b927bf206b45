"""Finds the vLLM servers verl started in a Ray cluster and writes them as a Prometheus file_sd target file.

verl's `vLLMHttpServer` actors bind their OpenAI server (and vLLM's `/metrics`) to a free port chosen at start,
so no static Prometheus config can name them. verl's own `rollout.prometheus.enable` writes a whole
prometheus.yml on every node and reloads a Prometheus on each; ours keeps its own config, rules and jobs, so it
reads the addresses from a file_sd file instead, which Prometheus re-reads whenever it changes.

Each named `vLLMHttpServer` actor that is alive answers `get_server_address()`; servers of a multi-node replica
that run headless (no HTTP server) fail that call and are skipped. The DAS proposers inside those servers serve
their own `/metrics` and note the address on their node (`workers.generator.metrics_endpoint`):
`proposer_metric_addresses` collects the notes of every node.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

SERVER_CLASS = "vLLMHttpServer"
# A server that is still loading its model answers only after its engine is up; a stuck one must not stall
# the refresh of all others.
ADDRESS_TIMEOUT_S = 10.0
# How long one refresh waits for a node's proposer notes.
NODE_TIMEOUT_S = 30.0


def file_sd_document(addresses: Iterable[str], job: str) -> list[dict[str, object]]:
    """Prometheus file_sd content: one target group of `host:port` addresses (sorted, no duplicates)."""
    return [{"targets": sorted(set(addresses)), "labels": {"job": job}}]


def write_file_sd(path: Path, addresses: Iterable[str], job: str) -> None:
    """Writes the target file atomically: Prometheus may read it at any moment and rejects a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(file_sd_document(addresses, job), indent=2) + "\n")
    partial.replace(path)


def vllm_server_addresses() -> list[str]:
    """`host:port` of every live verl vLLM HTTP server in the connected Ray cluster."""
    import ray
    from ray.util.state import list_actors

    actors = list_actors(
        filters=[("class_name", "=", SERVER_CLASS), ("state", "=", "ALIVE")],
        limit=10_000,
        raise_on_missing_output=False,
    )
    addresses = []
    for actor in actors:
        if not actor.name:
            continue
        try:
            handle = ray.get_actor(actor.name, namespace=actor.ray_namespace)
            host, port = ray.get(handle.get_server_address.remote(), timeout=ADDRESS_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a headless, starting or dying server is simply not a target yet
            log.debug("vLLM server %s has no address yet: %s", actor.name, exc)
            continue
        addresses.append(f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}")
    return addresses


def _proposer_notes(folder: str) -> list[str]:
    """Runs on one node: the addresses noted in `folder` by proposers that still run; notes of exited ones are
    removed."""
    import json as _json

    addresses = []
    for note in Path(folder).glob("*.json"):
        try:
            entry = _json.loads(note.read_text())
            os.kill(int(entry["pid"]), 0)
        except ProcessLookupError:
            note.unlink(missing_ok=True)
            continue
        except (OSError, ValueError, KeyError, TypeError):  # a note being replaced, or another user's process
            continue
        addresses.append(str(entry["address"]))
    return addresses


def proposer_metric_addresses(folder: str) -> list[str]:
    """`host:port` of every DAS proposer's `/metrics` (`workers.generator.metrics_endpoint`) on every live node of
    the connected Ray cluster, read from each node's `folder`."""
    from workers.verl.cluster import on_every_node

    # A node that stops answering drops out of this refresh instead of stalling the target list for good.
    notes = on_every_node(_proposer_notes, folder, timeout_s=NODE_TIMEOUT_S)
    return [address for addresses in notes for address in addresses]
