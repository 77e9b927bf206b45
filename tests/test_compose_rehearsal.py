"""The compose training topology rehearsed on loopback with processes instead of containers.

- the Ray head is started by the compose entrypoint (`scripts/ray_head.sh`, `ray start --head` flags, `--`, the
  trainer command) and waits for the GPU node; one Ray worker joins it through the compose worker's entrypoint
  (`scripts/ray_worker.sh`, its node address from DAS_NODE_IP) with one (declared) GPU, and only then does the
  trainer start; after it finishes, the head keeps Ray up until it is stopped;
- the node's history replica is `das indexer run` on the local Kafka broker, healthy as the compose check says
  (its RocksDB store exists and `/metrics` answers) before the node's engine starts;
- the trainer side composes the compose file's own verl config and goes through verl's `run_ppo` and
  `ray.init`, whose runtime environment carries DAS_HISTORY_DIR to the GPU node;
- on the GPU node, verl's `das_agent` loop runs on a real CPU vLLM engine; its trajectories go over the broker
  into the replica; a fresh engine for the next pass drafts from that replica, read as a RocksDB secondary.

Not rehearsed (needs GPUs and Docker): FSDP actors, weight sync into vLLM, verl's vLLMHttpServer over HTTP,
NCCL, images and container networking.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import IO

import pytest
from conftest import drop_topics, make_topics
from monitoring_support import free_port, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.vllm]

REPO = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))
DAS = str(Path(sys.executable).with_name("das"))
# Two engine starts and a replica on a 2-core machine shared with other work.
DEADLINE_S = 1500


def _log(path: Path) -> IO[str]:
    return open(path, "w")  # noqa: SIM115 - the process writing it outlives this call


def _kill_processes_naming(*paths: Path) -> None:
    """Stops the processes this test started in the background: their command lines name one of its folders
    (the Ray cluster's temp folder, the target list). `ray stop` would stop every Ray on the machine."""
    needles = [str(path).encode() for path in paths]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if any(needle in (proc / "cmdline").read_bytes() for needle in needles):
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def test_the_compose_topology_trains_on_loopback(kafka_servers: list[str], tmp_path: Path) -> None:
    # As `das kafka init` makes them for compose: with the control topic the trainer's epoch advances go to.
    topic, dlq = make_topics(kafka_servers, "rehearsal", partitions=2, epochs=True)
    node = tmp_path / "node-0"
    history = node / "history"
    ray_tmp = Path(f"/tmp/das-rehearsal-{os.getpid()}")
    out = tmp_path / "rehearsal.json"
    targets = tmp_path / "targets" / "vllm.json"
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}:{REPO / 'tests'}",
        # The image has `ray` and `das` on PATH; here they are this interpreter's.
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        # Token authentication (Ray's default for new clusters) would need the machine's shared token file.
        "RAY_AUTH_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        # Ray kills workers when the whole machine is above 95% memory: on a machine shared with other work that
        # says nothing about this test (its one engine needs about 2 GB).
        "RAY_memory_monitor_refresh_ms": "0",
    }
    metrics_port = free_port()
    replica = subprocess.Popen(
        [
            DAS,
            "indexer",
            "run",
            "--bus",
            f"kafka://{','.join(kafka_servers)}",
            "--topic",
            topic,
            "--dlq-topic",
            dlq,
            "--data",
            str(history),
            "--checkpoint-dir",
            str(node / "checkpoints"),
            "--replica",
            "das-replica-rehearsal",
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(metrics_port),
        ],
        env=env,
        stdout=_log(tmp_path / "replica.log"),
        stderr=subprocess.STDOUT,
    )
    head = worker = None
    try:
        # The compose health check: the store exists and /metrics answers.
        def healthy() -> bool:
            assert replica.poll() is None, (tmp_path / "replica.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).close()
            except OSError:
                return False
            return (history / "CURRENT").is_file()

        wait_for("the replica to be healthy", healthy, deadline_s=300)
        port = free_port(exclude=(metrics_port,))
        dashboard_port = free_port(exclude=(metrics_port, port))
        # As in the compose head: ray_head.sh keeps Prometheus' list of verl's vLLM servers in this file.
        head_env = {
            **env,
            "RAY_ADDRESS": f"127.0.0.1:{port}",
            "DAS_VLLM_TARGETS": str(targets),
            # The compose head's defaults, one node: the trainer waits for the worker's GPU.
            "DAS_NODES": "1",
            "DAS_GPUS_PER_NODE": "1",
        }
        head = subprocess.Popen(
            [
                "bash",
                str(REPO / "scripts" / "ray_head.sh"),
                f"--port={port}",
                "--num-gpus=0",
                "--num-cpus=1",
                "--node-ip-address=127.0.0.1",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={dashboard_port}",
                f"--temp-dir={ray_tmp}",
                "--disable-usage-stats",
                "--",
                sys.executable,
                str(REPO / "tests" / "_compose_rehearsal.py"),
                str(out),
                kafka_servers[0],
                topic,
                str(history),
            ],
            env=head_env,
            stdout=_log(tmp_path / "head.log"),
            stderr=subprocess.STDOUT,
        )
        head_log = tmp_path / "head.log"
        wait_for(
            "the head to wait for the GPU node",
            lambda: "waiting for 1 GPUs" in head_log.read_text() or head.poll() is not None,
            deadline_s=300,
        )
        assert head.poll() is None, head_log.read_text()[-3000:]
        assert not out.exists(), "the trainer started before its GPU node joined"
        # The GPU node, through the compose ray-worker's entrypoint. Its GPU is declared (vLLM runs on the CPU).
        worker = subprocess.Popen(
            [
                "bash",
                str(REPO / "scripts" / "ray_worker.sh"),
                f"--address=127.0.0.1:{port}",
                "--num-cpus=1",
                "--num-gpus=1",
                '--resources={"gpu_node": 1}',
                f"--temp-dir={ray_tmp}",
                "--disable-usage-stats",
            ],
            env={**env, "DAS_NODE_IP": "127.0.0.1"},
            stdout=_log(tmp_path / "worker.log"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for(
            "the trainer to finish",
            lambda: "training finished" in head_log.read_text() or head.poll() is not None,
            deadline_s=DEADLINE_S,
        )
        assert head.poll() is None, head_log.read_text()[-5000:]
        # Ray outlives the trainer (its worker stays joined) until the container is stopped.
        assert worker.poll() is None
        head.send_signal(signal.SIGTERM)
        assert head.wait(timeout=60) == 0
    finally:
        for process in (head, worker, replica):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in (head, worker, replica):
            if process is not None:
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
        _kill_processes_naming(ray_tmp, targets)
        drop_topics(kafka_servers, topic, dlq, f"{topic}.epochs")

    result = json.loads(out.read_text())
    first, second = result["passes"]
    for one_pass in (first, second):
        # Ray's runtime environment gave the GPU node's processes the node's replica folder.
        assert one_pass["node"] == result["node"] and one_pass["history_dir"] == str(history)
    # The first engine started with an empty replica; every trajectory it made went over Kafka into it.
    assert first["before"]["history_problems"] == 0
    assert first["replica_records"] == 4 and second["replica_records"] == 8
    # The second engine is fresh: what it knows at start it read from the replica (a RocksDB secondary).
    assert second["before"]["history_problems"] == 2
    # It drafted from that history (its problem trees or the global tree of all problems, both built from the
    # replica; the composed drafter takes the better), and the verifier accepted the drafts.
    history_drafts = second["after"]["sources"]["history"] + second["after"]["sources"]["global"]
    assert history_drafts > 0 and second["after"]["accepted_tokens"] > 0
    assert second["after"]["errors"] == 0
    # Greedy, and drafting is lossless: the second pass repeats the first.
    assert second["outputs"] == first["outputs"]
    # The head's target list for Prometheus was written through Ray's state API (file_sd format). The rehearsal's
    # engines are not verl's vLLMHttpServer actors (that needs GPUs), so the list is empty.
    assert json.loads(targets.read_text()) == [{"targets": [], "labels": {"job": "vllm"}}]


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0
