"""Shared by the monitoring and compose tests: repository paths and a free loopback port in our range."""

from __future__ import annotations

import socket
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
COMPOSE_SCHEMA = REPO / "monitoring" / "schemas" / "compose-spec.json"
PROMETHEUS_CONFIG = REPO / "monitoring" / "prometheus" / "prometheus.yml"
ALERT_RULES = REPO / "monitoring" / "prometheus" / "alerts.yml"
GRAFANA = REPO / "monitoring" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
METRICS_SOURCE = REPO / "tests" / "metrics_source.py"

# The machine is shared: test servers use only this port range, on loopback.
PORT_RANGE = range(39000, 39101)


def free_port(exclude: tuple[int, ...] = ()) -> int:
    """A port in PORT_RANGE that is free on 127.0.0.1 right now."""
    for port in PORT_RANGE:
        if port in exclude:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORT_RANGE.start}-{PORT_RANGE.stop - 1} on 127.0.0.1")
