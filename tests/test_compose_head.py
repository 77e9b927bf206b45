"""The compose Ray head's entrypoint (`scripts/ray_head.sh`) on loopback: a real `ray start --head`, a Ray worker
that joins late with GPUs, and a trainer command that reports what it saw when it started.

- the trainer starts only once the cluster holds DAS_NODES x DAS_GPUS_PER_NODE GPUs (verl raises at once when
  they are missing);
- DAS_VERL_ARGS reaches the trainer's command line as shell words;
- after a normal finish Ray stays up (the workers keep their head) until the container is stopped;
- a failing trainer's status is the head's, so compose restarts it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from monitoring_support import free_port, wait_for

REPO = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))
# The trainer stand-in: the GPUs Ray had when it started, and its command line.
TRAINER = (
    "import json, sys, ray\n"
    "ray.init(log_to_driver=False)\n"
    "gpus = ray.cluster_resources().get('GPU', 0)\n"
    "ray.shutdown()\n"
    "open(sys.argv[1], 'w').write(json.dumps({'gpus': gpus, 'argv': sys.argv[2:]}))\n"
    "sys.exit(int(sys.argv[2]))\n"
)


def _ray_dir(tmp: Path) -> Path:
    """Ray's temp folder for this test: short, since Ray's socket paths must fit in 107 bytes."""
    return Path("/tmp") / f"das-head-{abs(hash(str(tmp))) % 10**8}"


def _env(port: int) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "RAY_AUTH_MODE": "disabled",
        "RAY_ADDRESS": f"127.0.0.1:{port}",
    }


def _start_head(tmp: Path, port: int, exit_code: int, extra_env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [
            "bash",
            str(REPO / "scripts" / "ray_head.sh"),
            f"--port={port}",
            "--num-gpus=0",
            "--num-cpus=1",
            "--node-ip-address=127.0.0.1",
            "--include-dashboard=false",
            f"--temp-dir={_ray_dir(tmp)}",
            "--disable-usage-stats",
            "--",
            sys.executable,
            "-c",
            TRAINER,
            str(tmp / "trainer.json"),
            str(exit_code),
        ],
        env={**_env(port), **extra_env},
        stdout=open(tmp / "head.log", "w"),  # noqa: SIM115 - the head outlives this call
        stderr=subprocess.STDOUT,
    )


def _start_gpu_node(tmp: Path, port: int, gpus: int) -> subprocess.Popen:
    """A Ray worker node with `gpus` (pretended) GPUs joining the head's cluster, as a GPU node of compose does."""
    return subprocess.Popen(
        [
            RAY,
            "start",
            f"--address=127.0.0.1:{port}",
            "--block",
            "--num-cpus=1",
            f"--num-gpus={gpus}",
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={_ray_dir(tmp)}",
            "--disable-usage-stats",
        ],
        env=_env(port),
        stdout=open(tmp / "worker.log", "w"),  # noqa: SIM115 - the worker outlives this call
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _stop(tmp: Path, *processes: subprocess.Popen | None) -> None:
    for process in processes:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        if process is not None:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
    # `ray start --head` daemonizes: stop exactly this cluster's processes (they name its temp folder).
    needle = str(_ray_dir(tmp)).encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if needle in (proc / "cmdline").read_bytes():
                    os.kill(int(proc.name), signal.SIGKILL)
            except OSError:
                continue
    shutil.rmtree(_ray_dir(tmp), ignore_errors=True)


def test_the_trainer_waits_for_every_gpu_gets_the_extra_args_and_ray_outlives_it(tmp_path: Path) -> None:
    port = free_port()
    head = worker = None
    try:
        head = _start_head(
            tmp_path,
            port,
            exit_code=0,
            extra_env={
                "DAS_NODES": "1",
                "DAS_GPUS_PER_NODE": "2",
                "DAS_VERL_ARGS": "data.max_response_length=4096 'trainer.experiment_name=\"a b\"'",
            },
        )
        log = tmp_path / "head.log"
        wait_for("the head to wait for GPUs", lambda: "waiting for 2 GPUs" in log.read_text() or head.poll())
        assert head.poll() is None, log.read_text()[-3000:]
        assert not (tmp_path / "trainer.json").exists()
        # The GPU node joins late, as a replica that is still rebuilding holds its Ray worker back.
        worker = _start_gpu_node(tmp_path, port, gpus=2)
        wait_for("the trainer to finish", lambda: "training finished" in log.read_text() or head.poll(), 300)
        assert head.poll() is None, log.read_text()[-3000:]
        started = json.loads((tmp_path / "trainer.json").read_text())
        assert started == {
            "gpus": 2.0,
            "argv": ["0", "data.max_response_length=4096", 'trainer.experiment_name="a b"'],
        }
        # Ray is still up for its worker after the trainer finished.
        assert worker.poll() is None
        head.send_signal(signal.SIGTERM)
        assert head.wait(timeout=60) == 0
    finally:
        _stop(tmp_path, head, worker)


def test_a_failing_trainer_fails_the_head_and_missing_settings_are_named(tmp_path: Path) -> None:
    port = free_port()
    missing = subprocess.run(
        ["bash", str(REPO / "scripts" / "ray_head.sh"), "--", "true"],
        env={k: v for k, v in _env(port).items() if not k.startswith("DAS_")},
        capture_output=True,
        text=True,
    )
    assert missing.returncode != 0 and "set DAS_NODES" in missing.stderr
    # With no GPU wanted beyond what the head has, the trainer starts at once.
    head = _start_head(tmp_path, port, exit_code=3, extra_env={"DAS_NODES": "1", "DAS_GPUS_PER_NODE": "1"})
    try:
        worker = None
        wait_for(
            "the head to wait for GPUs", lambda: "waiting for 1 GPUs" in (tmp_path / "head.log").read_text()
        )
        worker = _start_gpu_node(tmp_path, port, gpus=1)
        assert head.wait(timeout=300) == 3, (tmp_path / "head.log").read_text()[-3000:]
    finally:
        _stop(tmp_path, head, worker)


@pytest.mark.parametrize(("nodes", "gpus"), [("0", "1"), ("2", "x"), ("", "1")])
def test_gpu_counts_must_be_positive_integers(nodes: str, gpus: str) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "wait_for_gpus.py"), nodes, gpus],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "must be a positive integer" in result.stderr
