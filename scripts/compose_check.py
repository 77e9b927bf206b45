#!/usr/bin/env python3
"""`make compose-check`: docker-compose.yml with docker-compose.cpu.yml, run for real on this machine and broken on
purpose, with every record accounted for (docs/deployment.md, "Run it on one machine without GPUs").

It starts the stack from empty volumes (project das-check, so it never touches a deployment named das), plays
training steps through the step driver in the Ray head (POST /step), and breaks things between and during steps:

  steps            several steps, nothing broken
  broker_kill      a broker container killed (SIGKILL) mid-step, then started again
  replica_kill     a replica's process killed with SIGKILL mid-ingest; Docker restarts it (restart policy)
  down_up          `docker compose down` with volumes kept, then `up`: the next step drafts from the restored
                   history (warm), which the proposers' counters show
  partition        node-1 (its Ray worker and its replica) cut from the network for a minute mid-step, then
                   reconnected with its address and names
  volume_wipe      node-1's history volume removed: its replica rebuilds from the topic, its Ray worker rejoins and
                   the step driver replaces the node's vLLM server
  monitoring       one more step (checked exact: `monitoring_step`), then every Prometheus target up; every query
                   of the shipped Grafana dashboard returns data from the live Prometheus; a stopped replica fires
                   DASTargetDown at the webhook, which resolves once the replica is back

Each phase's steps end with the exact check: the records the agent loops published (the step driver
reports each rollout's key and tokens) against the topic (acknowledged: the brokers hold them) and against every
replica's RocksDB store (read as a secondary inside the node's container), by key set and content digest.

It prints one JSON object (`checks`: each check true or false, with the counts beside it) and writes it to the report
folder with plots of acceptance, tail latency and freshness per step, the container logs and the step records.

    python scripts/compose_check.py [--report-dir reports/compose-check] [--keep] [--phases steps,broker_kill,...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOCKER = os.environ.get("DAS_DOCKER", "/usr/bin/docker")
PROJECT = "das-check"
FILES = ("docker-compose.yml", "docker-compose.cpu.yml")
PHASES = ("steps", "broker_kill", "replica_kill", "down_up", "partition", "volume_wipe", "monitoring")
NODES = {
    "node-0": ("history", "ray-worker", "history-data"),
    "node-1": ("history-1", "ray-worker-1", "history-data-1"),
}
TOPIC = "das.trajectories"
# Ports on 127.0.0.1 for what the drill reads from the host; none of them is one the tests' brokers use.
PORTS = {
    "DAS_PROMETHEUS_PORT": 49090,
    "DAS_ALERTMANAGER_PORT": 49093,
    "DAS_STEP_DRIVER_PORT": 49700,
    "DAS_ALERT_WEBHOOK_PORT": 49500,
}
RATE_INTERVAL = "1m"  # Grafana's $__rate_interval at a 15 s scrape interval (4 scrapes)
CUT_S = 60.0  # how long a node stays cut from the network


def log(message: str) -> None:
    print(f"[compose-check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------- the environment
def required_variables() -> list[str]:
    """Every `${NAME:?...}` of the compose files: the secrets a deployment must set."""
    names: set[str] = set()
    for name in FILES:
        names |= set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*):\?", (REPO / name).read_text()))
    return sorted(names)


def training_rows(problems: Path) -> list[dict[str, Any]]:
    """verl's RL data rows for a DAS problem file: the prompt as a chat, `extra_info.index` set per problem."""
    rows = []
    for index, line in enumerate(problems.read_text().splitlines()):
        problem = json.loads(line)
        rows.append(
            {
                "data_source": "das/" + problems.stem,
                "prompt": [{"role": "user", "content": problem["prompt"]}],
                "ability": problem.get("kind", "math"),
                "reward_model": {"style": "rule", "ground_truth": ""},
                "extra_info": {"split": "train", "index": index, "problem_id": problem["problem_id"]},
            }
        )
    return rows


def prepare(work: Path, model_dir: Path, problems: int) -> Path:
    """The env file (fresh secrets, this machine's ports, the model and data folders) and the training data."""
    import datasets

    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    rows = training_rows(REPO / "examples" / "problems" / "rl_problems.jsonl")[:problems]
    datasets.Dataset.from_list(rows).to_parquet(str(data / "train.parquet"))
    env = work / "env"
    lines = [f"{name}={secrets.token_hex(12)}" for name in required_variables()]
    lines += [f"{name}={port}" for name, port in PORTS.items()]
    lines += [f"DAS_MODEL_DIR={model_dir}", f"DAS_DATA_DIR={data}"]
    env.write_text("\n".join(lines) + "\n")
    env.chmod(0o600)
    return env


# --------------------------------------------------------------------------------------------- docker
class Stack:
    def __init__(self, env_file: Path, logs: Path) -> None:
        self.env_file = env_file
        self.logs = logs

    def compose(
        self, *args: str, timeout: float = 900, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        argv = [DOCKER, "compose", "-p", PROJECT, "--env-file", str(self.env_file)]
        for name in FILES:
            argv += ["-f", str(REPO / name)]
        done = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)
        if check and done.returncode != 0:
            raise RuntimeError(f"docker compose {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
        return done

    @staticmethod
    def docker(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
        return done

    @staticmethod
    def container(service: str) -> str:
        return f"{PROJECT}-{service}-1"

    def python(self, service: str, script: str, *args: str, timeout: float = 300, attempts: int = 1) -> Any:
        """Runs `script` with the container's Python (the DAS image) and returns the JSON its last line prints;
        `attempts` > 1 retries a failure (the drill's own Kafka reads while a broker it just killed comes back)."""
        for attempt in range(1, attempts + 1):
            done = subprocess.run(
                [DOCKER, "exec", "-i", self.container(service), "python3", "-", *args],
                input=script,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            if done.returncode == 0:
                return json.loads(done.stdout.strip().splitlines()[-1])
            if attempt < attempts:
                time.sleep(5)
        raise RuntimeError(f"python in {service} failed ({done.returncode}):\n{done.stderr[-3000:]}")

    def state(self, service: str) -> dict[str, Any]:
        out = self.docker("inspect", self.container(service), check=False)
        return json.loads(out.stdout)[0]["State"] if out.returncode == 0 else {}

    def save_logs(self, tag: str) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        names = self.docker(
            "ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}", "--format", "{{.Names}}"
        )
        for name in names.stdout.split():
            out = self.docker("logs", "--timestamps", name, check=False, timeout=120)
            (self.logs / f"{tag}-{name}.log").write_text(out.stdout + out.stderr)


# --------------------------------------------------------------------------------------------- reading records
DIGEST = """
import hashlib, json
def digest(problem_id, epoch, sample, prompt_ids, response_ids):
    body = json.dumps([problem_id, int(epoch), int(sample), [int(t) for t in prompt_ids],
                       [int(t) for t in response_ids]], separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()
def key_text(problem_id, epoch, sample):
    return f"{problem_id}|{int(epoch)}|{int(sample)}"
"""

READ_STORE = (
    DIGEST
    + """
import sys, tempfile
from history_store.durable.store import HistoryStore
with tempfile.TemporaryDirectory(prefix="das-check-reader-") as secondary:
    store = HistoryStore.open_secondary(sys.argv[1], secondary)
    try:
        records = {key_text(*r.key): digest(*r.key, r.prompt_ids.tolist(), r.response_ids.tolist())
                   for r in store.iter_trajectories()}
    finally:
        store.close()
print(json.dumps({"records": records}))
"""
)

READ_TOPIC = (
    DIGEST
    + """
import sys, time
from kafka import KafkaConsumer, TopicPartition
from pipeline.kafka_config import client_settings
from pipeline.wire import decode, parse_record_key
servers, topic = sys.argv[1].split(","), sys.argv[2]
consumer = KafkaConsumer(bootstrap_servers=servers, enable_auto_commit=False, group_id=None,
                         consumer_timeout_ms=2000, **client_settings({}))
parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
consumer.assign(parts)
consumer.seek_to_beginning(*parts)
end = consumer.end_offsets(parts)
seen, view, messages = {}, {}, 0
deadline = time.monotonic() + 120
while any(consumer.position(p) < end[p] for p in parts) and time.monotonic() < deadline:
    for message in consumer:
        messages += 1
        key = key_text(*parse_record_key(message.key))
        if message.value is None:
            view.pop(key, None)
            seen.setdefault(key, []).append(None)
        else:
            r = decode(message.value)
            d = digest(*r.key, r.prompt_ids.tolist(), r.response_ids.tolist())
            view[key] = d
            seen.setdefault(key, []).append(d)
        if all(consumer.position(p) >= end[p] for p in parts):
            break
complete = all(consumer.position(p) >= end[p] for p in parts)
# The trainer's epoch advances (pipeline/epochs.py), which alone move the replicas' windows: each problem's newest.
advances = {}
control = [TopicPartition(topic + ".epochs", p) for p in sorted(consumer.partitions_for_topic(topic + ".epochs") or [])]
if control:
    from pipeline.epochs import decode_advance
    consumer.assign(control)
    consumer.seek_to_beginning(*control)
    control_end = consumer.end_offsets(control)
    deadline = time.monotonic() + 60
    while any(consumer.position(p) < control_end[p] for p in control) and time.monotonic() < deadline:
        for message in consumer:
            advance = decode_advance(message.key, message.value)
            advances[advance.problem_id] = max(advances.get(advance.problem_id, -1), advance.epoch)
            if all(consumer.position(p) >= control_end[p] for p in control):
                break
consumer.close()
print(json.dumps({"messages": messages, "view": view, "seen": seen, "complete": complete,
                  "end_offsets": sum(end.values()), "advances": advances}))
"""
)

TOPIC_END = """
import json, sys
from kafka import KafkaConsumer, TopicPartition
from pipeline.kafka_config import client_settings
servers, topic = sys.argv[1].split(","), sys.argv[2]
consumer = KafkaConsumer(bootstrap_servers=servers, group_id=None, **client_settings({}))
parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
print(json.dumps(sum(consumer.end_offsets(parts).values())))
consumer.close()
"""

BROKERS = "kafka-1:19092,kafka-2:19092,kafka-3:19092"


def record_digest(record: dict[str, Any]) -> str:
    body = json.dumps(
        [
            record["problem_id"],
            record["epoch"],
            record["sample"],
            record["prompt_ids"],
            record["response_ids"],
        ],
        separators=(",", ":"),
    )
    return hashlib.sha256(body.encode()).hexdigest()


def key_text(record: dict[str, Any]) -> str:
    return f"{record['problem_id']}|{record['epoch']}|{record['sample']}"


def set_digest(records: dict[str, str]) -> str:
    """One digest of a key -> record digest map (order-free)."""
    h = hashlib.sha256()
    for key in sorted(records):
        h.update(f"{key}={records[key]}\n".encode())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------- the drill
class Drill:
    def __init__(self, stack: Stack, report: Path, window: int) -> None:
        self.stack = stack
        self.report = report
        self.window = window
        self.published: dict[str, str] = {}  # key -> digest, every record the agent loops reported
        self.steps: list[dict[str, Any]] = []
        self.checks: dict[str, Any] = {}
        self.details: dict[str, Any] = {}
        self.timings: dict[str, float] = {}
        self.driver = f"http://127.0.0.1:{PORTS['DAS_STEP_DRIVER_PORT']}"
        self.prometheus = f"http://127.0.0.1:{PORTS['DAS_PROMETHEUS_PORT']}"
        self.webhook = f"http://127.0.0.1:{PORTS['DAS_ALERT_WEBHOOK_PORT']}"

    # ------------------------------------------------------------------ http
    @staticmethod
    def http(url: str, data: bytes | None = None, timeout: float = 30) -> Any:
        request = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def wait_ready(self, timeout_s: float = 1500) -> float:
        """Seconds until the step driver answers ready (servers and agent loop workers up). A start that failed
        (a server killed while loading, e.g. by the kernel's OOM killer on a shared machine) is retried once with
        POST /rebuild, and counted."""
        started = time.monotonic()
        retried = False
        while time.monotonic() - started < timeout_s:
            try:
                status = self.http(f"{self.driver}/status", timeout=10)
                if status.get("error") and not retried:
                    log(f"the step driver failed to start; retrying once:\n{status['error'][-1500:]}")
                    self.timings["driver_start_retries"] = self.timings.get("driver_start_retries", 0) + 1
                    retried = True
                    self.http(f"{self.driver}/rebuild", data=b"", timeout=timeout_s)
                    continue
                if status.get("error"):
                    raise RuntimeError(f"the step driver failed to start:\n{status['error']}")
                if status.get("ready"):
                    return time.monotonic() - started
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass
            time.sleep(5)
        raise RuntimeError(f"the step driver was not ready within {timeout_s} s")

    # ------------------------------------------------------------------ steps
    def resume(self) -> None:
        """The records and summaries of the steps an earlier run of this stack saved."""
        for path in sorted((self.report / "steps").glob("step-*.json")):
            result = json.loads(path.read_text())
            for record in result["records"]:
                self.published[key_text(record)] = record_digest(record)
            summary = summarize_step(result)
            summary["phase"] = result.get("phase", "earlier")
            self.steps.append(summary)

    def step(self, phase: str) -> dict[str, Any]:
        try:
            result = self.http(f"{self.driver}/step", data=b"", timeout=1800)
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"step failed in {phase}: {exc.read().decode()[-4000:]}") from exc
        for record in result["records"]:
            self.published[key_text(record)] = record_digest(record)
        summary = summarize_step(result)
        summary["phase"] = phase
        self.steps.append(summary)
        (self.report / "steps").mkdir(parents=True, exist_ok=True)
        (self.report / "steps" / f"step-{result['step']:03d}.json").write_text(
            json.dumps({**result, "phase": phase})
        )
        log(
            f"step {result['step']} ({phase}): {len(result['records'])} rollouts in {result['wall_s']:.1f} s, "
            f"acceptance {summary['acceptance']:.3f}, drafts from history {summary['history_drafts']}"
        )
        return summary

    def step_during(self, phase: str, action: Callable[[], None], when: Callable[[], bool]) -> dict[str, Any]:
        """A step with `action` done once `when()` holds while the step runs (checked every 2 s)."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["step"] = self.step(phase)
            except Exception as exc:  # noqa: BLE001 - reported by the caller
                box["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        acted = False
        while thread.is_alive():
            if not acted and when():
                action()
                acted = True
            time.sleep(2)
        thread.join()
        if "error" in box:
            raise box["error"]
        if not acted:
            raise RuntimeError(f"{phase}: the step ended before the moment to act came")
        return box["step"]

    def topic_end(self) -> int:
        return int(self.stack.python("history", TOPIC_END, BROKERS, TOPIC, timeout=120, attempts=5))

    def grew(self, before: int) -> Callable[[], bool]:
        """True once the topic holds more records than `before`: the step's first trajectories are published."""

        def check() -> bool:
            try:
                return self.topic_end() > before
            except RuntimeError:
                return False

        return check

    # ------------------------------------------------------------------ the exact check
    def in_window(self, advances: dict[str, int] | None = None) -> dict[str, str]:
        """Published records inside each problem's epoch window: the replicas evict epochs below the newest the
        trainer advanced the problem to (its epoch advances; a step that failed half-way advanced its problems too)
        minus the window."""
        newest: dict[str, int] = dict(advances or {})
        for key in self.published:
            problem, epoch, _ = key.rsplit("|", 2)
            newest[problem] = max(newest.get(problem, -1), int(epoch))
        return {
            key: digest
            for key, digest in self.published.items()
            if int(key.rsplit("|", 2)[1]) > newest[key.rsplit("|", 2)[0]] - self.window
        }

    def exact(self, phase: str, nodes: tuple[str, ...] = tuple(NODES), deadline_s: float = 600) -> bool:
        """Waits until every replica holds the topic's records, then compares published, acknowledged and
        stored records by key set and digest."""
        started = time.monotonic()
        result: dict[str, Any] = {}
        while True:
            topic = self.stack.python("history", READ_TOPIC, BROKERS, TOPIC, timeout=300, attempts=5)
            stores = {}
            for node in nodes:
                service = NODES[node][0]
                try:
                    stores[node] = self.stack.python(service, READ_STORE, "/var/lib/das/history")["records"]
                except RuntimeError as exc:
                    stores[node] = {"__unreadable__": str(exc)[-500:]}
            view = topic["view"]
            equal = {node: records == view for node, records in stores.items()}
            if all(equal.values()) and topic["complete"]:
                break
            if time.monotonic() - started > deadline_s:
                break
            time.sleep(5)
        waited = time.monotonic() - started
        acknowledged = sum(
            1 for key, digest in self.published.items() if digest in (topic["seen"].get(key) or [])
        )
        window = self.in_window(topic.get("advances"))
        window_missing = sorted(key for key, digest in window.items() if view.get(key) != digest)
        per_node = {}
        for node, records in stores.items():
            per_node[node] = {
                "records": len(records),
                "missing": len(view.keys() - records.keys()),
                "extra": len(records.keys() - view.keys()),
                "different": sum(1 for k in view.keys() & records.keys() if view[k] != records[k]),
                "digest": set_digest(records),
                "equal": equal[node],
            }
        result = {
            "published": len(self.published),
            "acknowledged": acknowledged,
            "topic_messages": topic["messages"],
            "topic_records": len(view),
            "topic_digest": set_digest(view),
            "published_in_window": len(window),
            "published_in_window_missing": len(window_missing),
            "missing_examples": window_missing[:5],
            "epoch_advances": len(topic.get("advances") or {}),
            "replicas": per_node,
            "converged_s": round(waited, 1),
        }
        ok = (
            acknowledged == len(self.published)
            and not window_missing
            and all(equal.values())
            and topic["complete"]
        )
        self.details[phase] = result
        log(f"{phase}: {'exact' if ok else 'NOT EXACT'} {json.dumps(result)}")
        return ok

    # ------------------------------------------------------------------ phases
    def phase_steps(self) -> None:
        for _ in range(3):
            self.step("steps")
        self.checks["steps"] = self.exact("steps")

    def phase_broker_kill(self) -> None:
        victim = "kafka-2"
        before = self.topic_end()
        killed = {}

        def kill() -> None:
            killed["at"] = time.time()
            self.stack.docker("kill", "--signal", "KILL", self.stack.container(victim))
            log(f"broker_kill: {victim} killed")
            time.sleep(20)
            self.stack.compose("up", "-d", "--no-deps", victim)
            killed["restarted_at"] = time.time()
            log(f"broker_kill: {victim} started again")

        step = self.step_during("broker_kill", kill, self.grew(before))
        self.details["broker_kill_action"] = {**killed, "step_finished_at": step["finished_at"]}
        self.checks["broker_kill"] = self.exact("broker_kill")

    def phase_replica_kill(self) -> None:
        victim = "history-1"
        before = self.topic_end()
        killed = {}

        def kill() -> None:
            pid = self.stack.state(victim)["Pid"]
            restarts = self.stack.docker("inspect", "-f", "{{.RestartCount}}", self.stack.container(victim))
            killed.update(at=time.time(), pid=pid, restarts_before=int(restarts.stdout))
            # The replica's process itself, from the host: a crash, not a `docker stop`, so Docker's restart
            # policy (unless-stopped) brings it back by itself.
            os.kill(pid, 9)
            log(f"replica_kill: {victim} (pid {pid}) killed with SIGKILL")

        step = self.step_during("replica_kill", kill, self.grew(before))
        deadline = time.monotonic() + 300
        while not self.stack.state(victim).get("Running") and time.monotonic() < deadline:
            time.sleep(2)
        restarts = self.stack.docker("inspect", "-f", "{{.RestartCount}}", self.stack.container(victim))
        killed["restarts_after"] = int(restarts.stdout)
        self.details["replica_kill_action"] = {**killed, "step_finished_at": step["finished_at"]}
        restarted = killed["restarts_after"] > killed["restarts_before"]
        self.checks["replica_kill"] = self.exact("replica_kill") and restarted

    def phase_down_up(self) -> None:
        started = time.monotonic()
        self.stack.compose("down", timeout=600)
        down_s = time.monotonic() - started
        started = time.monotonic()
        self.stack.compose("up", "-d", timeout=1800)
        ready_s = self.wait_ready()
        self.timings["restart_down_s"] = round(down_s, 1)
        self.timings["restart_up_to_ready_s"] = round(time.monotonic() - started, 1)
        step = self.step("down_up")
        warm = step["history_drafts"] > 0 and step["history_problems_at_start"] > 0
        self.details["down_up_warm"] = {
            "history_problems_at_start": step["history_problems_at_start"],
            "history_drafts": step["history_drafts"],
            "accepted_tokens": step["accepted_tokens"],
            "acceptance": step["acceptance"],
            "ready_s": round(ready_s, 1),
        }
        self.checks["down_up"] = self.exact("down_up") and warm

    def phase_partition(self) -> None:
        network = f"{PROJECT}_default"
        services = NODES["node-1"][:2]
        before = self.topic_end()
        cut = {}

        def disconnect() -> None:
            saved = {}
            for service in services:
                name = self.stack.container(service)
                info = json.loads(self.stack.docker("inspect", name).stdout)[0]["NetworkSettings"][
                    "Networks"
                ][network]
                saved[service] = (
                    info["IPAddress"],
                    [a for a in (info.get("Aliases") or []) if a != info.get("EndpointID")],
                )
                self.stack.docker("network", "disconnect", network, name)
            cut.update(at=time.time(), addresses={s: a for s, (a, _) in saved.items()})
            log(f"partition: {', '.join(services)} cut from {network} for {CUT_S:.0f} s")
            time.sleep(CUT_S)
            for service, (address, aliases) in saved.items():
                args = ["network", "connect", "--ip", address]
                for alias in aliases:
                    args += ["--alias", alias]
                self.stack.docker(*args, network, self.stack.container(service))
            cut["reconnected_at"] = time.time()
            log("partition: reconnected")

        step = self.step_during("partition", disconnect, self.grew(before))
        self.details["partition_action"] = {**cut, "step_finished_at": step["finished_at"]}
        self.checks["partition"] = self.exact("partition")

    def phase_volume_wipe(self) -> None:
        history, worker, volume = NODES["node-1"]
        self.stack.compose("rm", "--stop", "--force", worker, history)
        self.stack.docker("volume", "rm", f"{PROJECT}_{volume}")
        log(f"volume_wipe: {PROJECT}_{volume} removed with {history} and {worker}")
        started = time.monotonic()
        self.stack.compose("up", "-d", "--no-deps", history, worker, timeout=900)
        step = self.step("volume_wipe")
        self.details["volume_wipe_rebuild"] = {
            "node_back_and_step_s": round(time.monotonic() - started, 1),
            "driver_rebuilt_servers": step["rebuilt"],
        }
        self.checks["volume_wipe"] = self.exact("volume_wipe")

    # ------------------------------------------------------------------ monitoring
    def prom(self, path: str, **params: str) -> Any:
        url = f"{self.prometheus}{path}?{urllib.parse.urlencode(params)}"
        body = self.http(url, timeout=30)
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus {path}: {body}")
        return body["data"]

    def targets(self) -> dict[str, Any]:
        active = self.prom("/api/v1/targets", state="active")["activeTargets"]
        down = [
            f"{t['labels'].get('job')} {t['scrapeUrl']}: {t.get('lastError')}"
            for t in active
            if t["health"] != "up"
        ]
        jobs = sorted({t["labels"].get("job") for t in active})
        return {"targets": len(active), "up": len(active) - len(down), "down": down, "jobs": jobs}

    def all_targets_up(self, wait_s: float = 180) -> dict[str, Any]:
        deadline = time.monotonic() + wait_s
        while True:
            state = self.targets()
            if not state["down"] and state["targets"] or time.monotonic() > deadline:
                return state
            time.sleep(10)

    def dashboard_queries(self, wait_s: float = 90) -> dict[str, Any]:
        """Every dashboard query against the live Prometheus; one that is empty is asked again for `wait_s`
        (a rate needs two scrapes of a series inside its window, and a server the last phase started has few)."""
        queries = []
        for path in sorted((REPO / "monitoring" / "grafana" / "dashboards").glob("*.json")):
            for panel in json.loads(path.read_text())["panels"]:
                for target in panel.get("targets", []):
                    expr = target.get("expr")
                    if not expr:
                        continue
                    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__interval", "15s")
                    expr = expr.replace("$__range", "1h")
                    queries.append((f"{panel['title']} {target.get('refId')}", expr))
        deadline = time.monotonic() + wait_s
        empty = queries
        while True:
            empty = [
                (name, expr) for name, expr in empty if not self.prom("/api/v1/query", query=expr)["result"]
            ]
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(15)
        return {
            "queries": len(queries),
            "with_data": len(queries) - len(empty),
            "empty": [f"{name}: {expr}" for name, expr in empty],
        }

    def phase_monitoring(self) -> None:
        # The dashboard is read while training runs, as its user reads it: one more step, counted like the others.
        self.step("monitoring")
        self.checks["monitoring_step"] = self.exact("monitoring")
        targets = self.all_targets_up()
        self.details["targets"] = targets
        self.checks["targets_up"] = not targets["down"] and targets["targets"] > 0
        queries = self.dashboard_queries()
        self.details["dashboard"] = queries
        self.checks["dashboard_queries"] = not queries["empty"]
        # The alert: a replica stopped long enough for DASTargetDown (2 m), then started again.
        victim = "history-1"
        since = time.time()
        self.stack.compose("stop", victim)
        log(f"monitoring: {victim} stopped; waiting for DASTargetDown at the webhook")
        fired = self.wait_alert("firing", since, victim, timeout_s=600)
        self.stack.compose("start", victim)
        log(f"monitoring: {victim} started again; waiting for the alert to resolve")
        resolved = self.wait_alert("resolved", since, victim, timeout_s=600)
        self.details["alert"] = {
            "stopped_at": since,
            "fired_after_s": None if fired is None else round(fired - since, 1),
            "resolved_after_s": None if resolved is None else round(resolved - since, 1),
        }
        self.checks["alert_fires_and_resolves"] = fired is not None and resolved is not None

    def wait_alert(self, status: str, since: float, victim: str, timeout_s: float) -> float | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for entry in self.http(f"{self.webhook}/alerts", timeout=10):
                if entry["received_at"] < since:
                    continue
                for alert in entry["body"].get("alerts", []):
                    labels = alert.get("labels", {})
                    if (
                        labels.get("alertname") == "DASTargetDown"
                        and labels.get("instance", "").startswith(f"{victim}:")
                        and alert.get("status") == status
                    ):
                        return float(entry["received_at"])
            time.sleep(5)
        return None

    # ------------------------------------------------------------------ freshness
    def freshness(self) -> list[tuple[float, float]]:
        """p99 freshness (publish to draftable) over the run, from the live Prometheus, one point per 15 s."""
        end = time.time()
        start = min((s["started_at"] for s in self.steps), default=end - 3600)
        data = self.prom(
            "/api/v1/query_range",
            query="histogram_quantile(0.99, sum by (le) (rate(das_freshness_seconds_bucket[1m])))",
            start=str(start),
            end=str(end),
            step="15",
        )
        points = []
        for series in data["result"]:
            points += [(float(t), float(v)) for t, v in series["values"] if v not in ("NaN", "+Inf")]
        return points


def summarize_step(result: dict[str, Any]) -> dict[str, Any]:
    """Acceptance, drafts by source and latency of one step, from the proposers' counters before and after it."""
    totals = {
        "draft_tokens": 0,
        "accepted_tokens": 0,
        "history": 0,
        "live": 0,
        "global": 0,
        "history_problems": 0,
    }
    for before_server, after_server in zip(result["das_before"], result["das_after"], strict=True):
        for before, after in zip(before_server, after_server, strict=True):
            totals["draft_tokens"] += after["draft_tokens"] - before["draft_tokens"]
            totals["accepted_tokens"] += after["accepted_tokens"] - before["accepted_tokens"]
            for source in ("history", "live", "global"):
                totals[source] += after["sources"].get(source, 0) - before["sources"].get(source, 0)
            totals["history_problems"] += before.get("history_problems", 0)
    timing = result["timing"]
    return {
        "step": result["step"],
        "started_at": result["started_at"],
        "finished_at": result["finished_at"],
        "wall_s": result["wall_s"],
        "rollouts": len(result["records"]),
        "draft_tokens": totals["draft_tokens"],
        "accepted_tokens": totals["accepted_tokens"],
        "acceptance": totals["accepted_tokens"] / totals["draft_tokens"] if totals["draft_tokens"] else 0.0,
        "history_drafts": totals["history"],
        "live_drafts": totals["live"],
        "global_drafts": totals["global"],
        "history_problems_at_start": totals["history_problems"],
        "latency_max_s": timing.get("agent_loop/generate_sequences/max"),
        "latency_mean_s": timing.get("agent_loop/generate_sequences/mean"),
        "rebuilt": result.get("rebuilt"),
        "failed_attempts": len(result.get("failed_attempts") or []),
    }


def plots(drill: Drill, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    steps = drill.steps
    x = [s["step"] for s in steps]
    labels = [s["phase"] for s in steps]
    for name, series, ylabel in (
        ("acceptance", [[s["acceptance"] for s in steps]], "accepted / drafted tokens"),
        (
            "tail_latency",
            [[s["latency_max_s"] for s in steps], [s["latency_mean_s"] for s in steps]],
            "seconds",
        ),
    ):
        fig, ax = plt.subplots(figsize=(8, 4))
        for values, legend in zip(
            series, ("max (tail)", "mean") if len(series) > 1 else ("acceptance",), strict=True
        ):
            ax.plot(x, values, marker="o", label=legend)
        ax.set_xticks(x, [f"{xi}\n{label}" for xi, label in zip(x, labels, strict=True)], fontsize=7)
        ax.set_xlabel("step and the drill phase it ran in")
        ax.set_ylabel(ylabel)
        ax.set_title(f"compose-check: {name.replace('_', ' ')} per step")
        ax.legend()
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path.name)
    points = drill.freshness()
    fig, ax = plt.subplots(figsize=(8, 4))
    if points:
        t0 = points[0][0]
        ax.plot([(t - t0) / 60 for t, _ in points], [v for _, v in points])
    ax.set_xlabel("minutes into the drill")
    ax.set_ylabel("p99 freshness, seconds (publish to draftable)")
    ax.set_title("compose-check: history freshness (replicas, from Prometheus)")
    fig.tight_layout()
    fig.savefig(out / "freshness.png", dpi=110)
    plt.close(fig)
    files.append("freshness.png")
    return files


def image_sizes() -> dict[str, Any]:
    report = REPO / "build" / "docker" / "images.json"
    return json.loads(report.read_text()) if report.exists() else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report-dir", type=Path, default=REPO / "reports" / "compose-check")
    parser.add_argument("--work-dir", type=Path, default=REPO / "build" / "compose-check")
    parser.add_argument("--model-dir", type=Path, default=None, help="prepared model (default: das's cache)")
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--problems", type=int, default=8, help="problems in the training data")
    parser.add_argument("--keep", action="store_true", help="leave the stack running at the end")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="use the running stack and the steps already in the report folder (to rerun phases while debugging)",
    )
    args = parser.parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    unknown = set(phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)}; known: {', '.join(PHASES)}")

    from history_store.automaton.config import DEFAULT_WINDOW_EPOCHS
    from workers.generator.model import default_model_dir, require_model

    model_dir = require_model(args.model_dir or default_model_dir())
    report = args.report_dir
    report.mkdir(parents=True, exist_ok=True)
    env = prepare(args.work_dir, model_dir, args.problems)
    stack = Stack(env, report / "logs")
    drill = Drill(stack, report, DEFAULT_WINDOW_EPOCHS)
    began = time.monotonic()
    failure = None
    try:
        if args.resume:
            drill.resume()
            log(f"resuming: {len(drill.published)} records published by {len(drill.steps)} earlier steps")
        else:
            log("starting from empty volumes")
            stack.compose("down", "--volumes", "--remove-orphans", timeout=600)
            for old in (report / "steps").glob("step-*.json"):
                old.unlink()
            started = time.monotonic()
            stack.compose("up", "-d", timeout=1800)
            drill.timings["up_s"] = round(time.monotonic() - started, 1)
            drill.timings["ready_s"] = round(drill.wait_ready() + drill.timings["up_s"], 1)
            log(
                f"stack up in {drill.timings['up_s']} s, step driver ready after {drill.timings['ready_s']} s"
            )
        for phase in phases:
            log(f"phase {phase}")
            phase_started = time.monotonic()
            try:
                getattr(drill, f"phase_{phase}")()
            except Exception as exc:  # noqa: BLE001 - a broken phase is a failed check, the drill goes on
                drill.checks[phase if phase != "monitoring" else "monitoring"] = False
                drill.details[f"{phase}_error"] = repr(exc)[-4000:]
                log(f"phase {phase} failed: {exc!r}"[-4000:])
            drill.timings[f"phase_{phase}_s"] = round(time.monotonic() - phase_started, 1)
            stack.save_logs(phase)
    except Exception as exc:  # noqa: BLE001 - the report says what broke
        failure = repr(exc)[-4000:]
        log(f"drill stopped: {failure}")
        stack.save_logs("failure")
    finally:
        drill.timings["drill_s"] = round(time.monotonic() - began, 1)
        files = []
        try:
            files = plots(drill, report)
        except Exception as exc:  # noqa: BLE001
            drill.details["plots_error"] = repr(exc)
        volumes = stack.docker("system", "df", "-v", "--format", "{{json .}}", check=False).stdout
        if not args.keep:
            stack.compose("down", "--volumes", timeout=600, check=False)
    first = drill.steps[0] if drill.steps else {}
    result = {
        "ok": failure is None and bool(drill.checks) and all(v is True for v in drill.checks.values()),
        "checks": drill.checks,
        "counts": drill.details,
        "timings_s": drill.timings,
        "first_step": {k: first.get(k) for k in ("wall_s", "rollouts", "latency_max_s")},
        "steps": drill.steps,
        "images": image_sizes(),
        "failure": failure,
        "plots": files,
        "command": " ".join(shlex.quote(a) for a in sys.argv),
    }
    (report / "report.json").write_text(json.dumps(result, indent=2))
    (report / "docker-system-df.json").write_text(volumes)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
