"""The shipped Alertmanager configuration delivers alerts to the operator's webhook (issue 37, item 11): a real
Alertmanager (Debian's package, see scripts/install_system_deps.sh) loads monitoring/alertmanager/alertmanager.yml,
receives an alert on its API and POSTs it to a webhook on loopback whose URL sits in the file the config names.

Debian ships Alertmanager 0.25, whose amtool rejects `webhook_configs.url_file` ("field url_file not found"; compose
runs 0.27.0): on such a version the test hands the file's URL to `url` instead, the one field the older version
has for it. The route, grouping, receiver and resolved notices are the shipped file's; the group timings are cut."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from monitoring_support import REPO, free_port, require_binary, server_process, wait_for

ALERTMANAGER_CONFIG = REPO / "monitoring" / "alertmanager" / "alertmanager.yml"


class Webhook:
    """An HTTP endpoint on loopback that keeps every JSON body POSTed to it."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        received = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers["Content-Length"])
                received.append({"path": self.path, **json.loads(self.rfile.read(length))})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/das-alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    yield hook
    hook.close()


def _version(binary: str) -> tuple[int, int]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True)
    major, minor = re.search(r"version (\d+)\.(\d+)", out.stdout + out.stderr).groups()
    return int(major), int(minor)


def _config_for(tmp_path: Path, url: str, version: tuple[int, int]) -> Path:
    """The shipped config, its url_file pointed at a file holding `url` (the compose config's job), and its
    group timings (30 s before a group's first notice, 5 m before the next) cut to 1 s, not to wait them out."""
    config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    config["route"].update(group_wait="1s", group_interval="1s")
    (webhook_config,) = config["receivers"][0]["webhook_configs"]
    url_file = tmp_path / "webhook-url"
    url_file.write_text(url + "\n")
    del webhook_config["url_file"]
    if version >= (0, 26):
        webhook_config["url_file"] = str(url_file)
    else:
        webhook_config["url"] = url_file.read_text().strip()
    path = tmp_path / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_shipped_receiver_reads_its_url_from_the_file_compose_mounts() -> None:
    config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    assert config["route"]["receiver"] == "operator"
    (receiver,) = config["receivers"]
    (webhook_config,) = receiver["webhook_configs"]
    assert webhook_config == {"url_file": "/etc/alertmanager/webhook-url", "send_resolved": True}
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    mounted = {c["target"]: c["source"] for c in compose["services"]["alertmanager"]["configs"]}
    content = compose["configs"][mounted[webhook_config["url_file"]]]["content"]
    assert content.startswith("${DAS_ALERT_WEBHOOK_URL:-"), content
    image = compose["services"]["alertmanager"]["image"]
    assert tuple(map(int, re.search(r":v(\d+)\.(\d+)", image).groups())) >= (0, 26), image


def test_an_alert_reaches_the_operators_webhook_firing_then_resolved(
    tmp_path: Path, webhook: Webhook
) -> None:
    binary = require_binary("prometheus-alertmanager")
    amtool = require_binary("amtool")
    config = _config_for(tmp_path, webhook.url, _version(binary))
    check = subprocess.run([amtool, "check-config", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port(exclude=(webhook.server.server_port,))
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",  # no gossip port: one instance on a shared machine
    ]
    with server_process(argv, tmp_path / "alertmanager.log") as process:
        base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=5) as response:
                    return response.status == 200
            except OSError:
                return process.poll() is not None  # exited: the assertion below says so

        wait_for("Alertmanager to be ready", ready)
        assert process.poll() is None, (tmp_path / "alertmanager.log").read_text()
        alert = {
            "labels": {"alertname": "DASTargetDown", "instance": "history:9410", "severity": "warning"},
            "annotations": {"summary": "history replica down"},
        }

        def post(alerts: list[dict[str, Any]]) -> None:
            request = urllib.request.Request(
                f"{base}/api/v2/alerts",
                data=json.dumps(alerts).encode(),
                headers={"Content-Type": "application/json"},
                method="POST",
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                assert response.status == 200

        post([alert])
        firing = wait_for("the firing notice", lambda: [b for b in webhook.bodies if b["status"] == "firing"])
        body = firing[0]
        assert body["path"] == "/das-alerts" and body["receiver"] == "operator"
        assert body["groupLabels"] == {"alertname": "DASTargetDown", "instance": "history:9410"}
        assert body["alerts"][0]["labels"]["severity"] == "warning"
        # Prometheus ends an alert by sending it with an end time: the operator hears that it resolved.
        post([{**alert, "endsAt": "2000-01-01T00:00:00Z"}])
        wait_for("the resolved notice", lambda: [b for b in webhook.bodies if b["status"] == "resolved"])
