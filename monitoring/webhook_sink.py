"""A webhook receiver that keeps what Alertmanager POSTs: the alert receiver of docker-compose.cpu.yml (service
alert-webhook), and a way to see exactly what an Alertmanager sends before pointing it at a real pager.

    python -m monitoring.webhook_sink --port 9500 [--log /var/lib/das-alerts/alerts.jsonl]

POST (any path): the JSON body is kept with its arrival time and path, and appended to the log file when one is
given (so a restarted receiver still lists what came before). GET /alerts: everything kept, as a JSON list, oldest
first. GET /-/healthy: 200.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class Sink:
    """The notifications received so far, in memory and optionally in a JSON Lines file."""

    def __init__(self, log: Path | None) -> None:
        self.log = log
        self.lock = threading.Lock()
        self.received: list[dict[str, Any]] = []
        if log is not None and log.exists():
            for line in log.read_text().splitlines():
                try:
                    self.received.append(json.loads(line))
                except ValueError:
                    continue  # a line cut by a crash mid-append

    def keep(self, path: str, body: Any) -> None:
        entry = {"received_at": time.time(), "path": path, "body": body}
        with self.lock:
            self.received.append(entry)
            if self.log is not None:
                self.log.parent.mkdir(parents=True, exist_ok=True)
                with open(self.log, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(entry) + "\n")

    def all(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.received)


def make_server(sink: Sink, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw)
            except ValueError:
                self._answer(400, {"error": "body is not JSON"})
                return
            sink.keep(self.path, body)
            self._answer(200, {"kept": True})

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/alerts":
                self._answer(200, sink.all())
            elif self.path == "/-/healthy":
                self._answer(200, {"healthy": True})
            else:
                self._answer(404, {"error": f"no {self.path}"})

        def log_message(self, fmt: str, *args: Any) -> None:
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9500)
    parser.add_argument(
        "--log", type=Path, default=None, help="JSON Lines file that keeps every notification"
    )
    args = parser.parse_args(argv)
    server = make_server(Sink(args.log), args.host, args.port)
    print(f"webhook sink: listening on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
