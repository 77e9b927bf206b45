"""Shared by the monitoring and compose tests: repository paths, free loopback ports in our range, and a real
Prometheus started for one test with its HTTP API."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

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


# Long enough for a cold start on a loaded shared machine; a healthy run needs a few seconds.
STARTUP_DEADLINE_S = 120
# Grafana's $__rate_interval is at least four scrapes; the tests scrape every second.
RATE_INTERVAL = "30s"
T = TypeVar("T")


def require_binary(name: str) -> str:
    """The path of a Prometheus or Alertmanager binary; fails (never skips) with the way to install it."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"`{name}` not found on PATH: these tests run a real Prometheus and Alertmanager. Install them with "
            "`bash scripts/install_system_deps.sh` (Debian packages `prometheus`, `prometheus-alertmanager`)."
        )
    return path


def wait_for(what: str, check: Callable[[], T], deadline_s: float = STARTUP_DEADLINE_S) -> T:
    """Polls `check` until it returns something truthy; fails naming `what` if the deadline passes."""
    deadline = time.monotonic() + deadline_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what} after {deadline_s} s")
        time.sleep(0.5)


class PrometheusApi:
    """The HTTP API of a Prometheus on loopback."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; raises (HTTP 400) if the expression does not parse."""
        return self.get("/api/v1/query", query=expr)["result"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=5) as response:
                return response.status == 200
        except OSError:
            return False


@contextlib.contextmanager
def running_prometheus(
    workdir: Path, targets: dict[str, int], rule_files: tuple[Path, ...] = ()
) -> Iterator[PrometheusApi]:
    """A real Prometheus on a free loopback port scraping `targets` (job name -> local port) every second,
    with `rule_files` evaluated every second; stopped on exit."""
    binary = require_binary("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
            for job, port in targets.items()
        ],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    api_port = free_port(exclude=tuple(targets.values()))
    argv = [
        binary,
        f"--config.file={workdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{api_port}",
    ]
    with server_process(argv, workdir / "prometheus.log") as process:
        api = PrometheusApi(api_port)
        wait_for("Prometheus to be ready", lambda: process.poll() is None and api.ready())
        yield api


@contextlib.contextmanager
def server_process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`argv` started with its stderr in `log` (for the assertion that it failed) and stopped on exit."""
    with log.open("w") as handle:
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=handle)
    try:
        yield process
    finally:
        process.terminate()
        process.wait(timeout=60)
