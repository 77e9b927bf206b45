"""Serves `/metrics` for one DAS process, aggregating child processes when `PROMETHEUS_MULTIPROC_DIR` is set.

Every long-running command (`das indexer run`, `das rollout ...`) adds `--metrics-host/--metrics-port`
(`workers.cli.types.add_metrics_arguments`) and calls `start_from_args` once at start. The server binds to loopback unless told otherwise: a metrics port open to the
network is a choice the operator makes (docker compose sets `DAS_METRICS_HOST=0.0.0.0` inside its network).

Multi-process mode (vLLM workers, where the proposer runs in spawned processes): the launching process calls
`monitoring.multiproc.prepare_multiprocess_dir()` before anything imports `prometheus_client`, children inherit
PROMETHEUS_MULTIPROC_DIR, and the server here merges every process's values. Counters and histograms add up; gauges combine as each
declares in the catalog. When a child exits, call `mark_process_dead(pid)` so its live gauges disappear.
"""

from __future__ import annotations

import argparse
import os
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, multiprocess, start_http_server

from monitoring.multiproc import MULTIPROC_ENV

HOST_ENV = "DAS_METRICS_HOST"
PORT_ENV = "DAS_METRICS_PORT"
DEFAULT_HOST = "127.0.0.1"


def multiprocess_dir() -> str | None:
    """The multi-process folder from the environment, or None in single-process mode."""
    return os.environ.get(MULTIPROC_ENV) or os.environ.get(MULTIPROC_ENV.lower()) or None


def metrics_registry() -> CollectorRegistry:
    """The registry to expose: all processes' values in multi-process mode, else this process's default one."""
    directory = multiprocess_dir()
    if directory is None:
        return REGISTRY
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"{MULTIPROC_ENV}={directory!r} is not a folder; create it (empty) before start"
        )
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)
    return registry


def start_metrics_server(port: int, host: str = DEFAULT_HOST) -> tuple[WSGIServer, threading.Thread]:
    """Serves `/metrics` on `host:port` from a daemon thread; port 0 picks a free port (read `server.server_port`).

    Raises OSError when the address is taken, so a misconfigured port fails at start, not silently.
    """
    try:
        return start_http_server(port, addr=host, registry=metrics_registry())
    except OSError as exc:
        raise OSError(exc.errno, f"cannot serve /metrics on {host}:{port}: {exc.strerror or exc}") from exc


def mark_process_dead(pid: int) -> None:
    """Drops an exited child's live gauges in multi-process mode; does nothing in single-process mode."""
    directory = multiprocess_dir()
    if directory is not None:
        multiprocess.mark_process_dead(pid, path=directory)


def start_from_args(args: argparse.Namespace) -> WSGIServer | None:
    """Starts the server `--metrics-host/--metrics-port` ask for; None when the port is negative (-1)."""
    if args.metrics_port < 0:
        return None
    server, _thread = start_metrics_server(args.metrics_port, args.metrics_host)
    return server
