"""Operators' mistakes and a hostile bus end in one line from `das`, fast: exit 2 for a usage error (the parser's
or one only the command can see), 1 for a failure, and never a traceback or a 30-second wait.

One table of command lines against the real single broker (and an address where no broker listens); then the
dead-letter summary against a forged letter, and the replica's lag while no broker answers.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import REPO, drop_topics, make_topics
from kafka import KafkaProducer

from pipeline.consumer import H_PARTITION, H_REASON
from workers.cli import main as das

pytestmark = pytest.mark.kafka
NOWHERE = "kafka://127.0.0.1:1"  # nothing listens on port 1

ERRORS = {
    "a count in the bus URL that is not a number": (
        "kafka load --count 1 --bus {bus}?request_timeout_ms=abc", 1, "request_timeout_ms must be a whole number"
    ),
    "a negative --kafka-setting": (
        "kafka load --count 1 --bus {bus} --kafka-setting request_timeout_ms=-5", 1, "got -5"
    ),
    "the replica with a count in the bus URL that is not a number": (
        "indexer run --data {store} --bus {bus}?request_timeout_ms=abc", 1, "request_timeout_ms must be a whole"
    ),
    "a flag setting that is not true or false": (
        "kafka init --bus {bus}?ssl_check_hostname=maybe", 1, "must be true or false"
    ),
    "a setting no Kafka client knows": (
        "kafka init --bus {bus} --kafka-setting request_timeot_ms=5", 1, "unknown Kafka client setting"
    ),
    "a rate whose interval overflows": ("kafka load --count 1 --rate 1e-300 --bus {bus}", 2, "--rate"),
    "more epochs than a record key holds": ("kafka load --count 1 --epochs 99999999999 --bus {bus}", 2, "--epochs"),
    "rollout: a problems file that does not exist": (
        "rollout --problems {store}/none.jsonl", 2, "no such file (see `das rollout --help`)"
    ),
    "traces generate: a problems file that does not exist": (
        "traces generate --problems {store}/none.jsonl --out {store}/t.jsonl", 2, "(see `das traces generate --help`)"
    ),
    "demo: a strategy that does not exist": ("demo --strategies bogus", 2, "strategies must be"),
    "bench pipeline without a broker": ("bench pipeline", 2, "no broker"),
    # Settings DAS sets itself, which kafka-python would get twice (a TypeError) or choke on (61 s, a traceback).
    "load: the brokers as a Kafka setting": (
        "kafka load --count 1 --bus {bus} --kafka-setting bootstrap_servers=127.0.0.1:1", 1,
        "bootstrap_servers is not yours to set",
    ),
    "the replica: a group id as a Kafka setting": (
        "indexer run --data {store} --bus {bus} --kafka-setting group_id=x", 1, "group_id is not yours to set"
    ),
    "the replica: a client id as a Kafka setting": (
        "indexer run --data {store} --bus {bus} --kafka-setting client_id=x", 1, "client_id is not yours to set"
    ),
    "load: a serializer as a Kafka setting": (
        "kafka load --count 1 --bus {bus} --kafka-setting key_serializer=x", 1, "key_serializer is not yours"
    ),
    "a request timeout of 0": (
        "kafka init --bus {bus} --kafka-setting request_timeout_ms=0", 1,
        "request_timeout_ms must be a whole number from 1",
    ),
    # Number flags are bounded: 1e308 used to overflow later, or kill the replica's verifier thread.
    "dlq: an idle time of 1e308 s": ("kafka dlq --bus {bus} --idle-s 1e308", 2, "--idle-s"),
    "load: a publish timeout of 1e308 s": (
        "kafka load --count 1 --bus {bus} --publish-timeout-s 1e308", 2, "--publish-timeout-s"
    ),
    "load: a close timeout of 1e308 s": (
        "kafka load --count 1 --bus {bus} --close-timeout-s 1e308", 2, "--close-timeout-s"
    ),
    "the replica: a verification period of 1e308 s": (
        "indexer run --data {store} --bus {bus} --verify-every 1e308", 2, "--verify-every"
    ),
    "init: more partitions than a request holds": (
        "kafka init --bus {bus} --partitions 99999999999", 2, "--partitions"
    ),
    "the replica: one confirming sample is no confirmation": (
        "indexer run --data {store} --bus {bus} --confirm-samples 1", 2, "--confirm-samples"
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ERRORS))
def test_a_bad_command_line_is_one_line_with_its_exit_code(
    name, kafka_servers, tmp_path, capsys, monkeypatch
):
    line, code, fragment = ERRORS[name]
    monkeypatch.delenv("DAS_BUS", raising=False)
    monkeypatch.delenv("DAS_KAFKA_BOOTSTRAP", raising=False)  # the broker bench pipeline would default to
    argv = line.format(bus=f"kafka://{','.join(kafka_servers)}", store=tmp_path).split()
    started = time.monotonic()
    try:
        assert das(argv) == code
    except SystemExit as exc:  # the parser's own refusals
        assert exc.code == code
    assert time.monotonic() - started < 10  # a local mistake is found before anything waits on a broker
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"das {argv[0]}") and fragment in err[0], err
    assert err[0].endswith("--help`)") == (code == 2)  # a usage error reads like the parser's own


@pytest.mark.parametrize("line", ["kafka dlq", "kafka init", "kafka load --count 1"])
def test_a_one_shot_command_against_no_broker_gives_up_in_seconds(line):
    # kafka-python waits 30 s to bootstrap by default; a one-shot command waits 5 s (and Python starts in a few).
    try:
        result = subprocess.run(
            [sys.executable, "-m", "workers.cli", *line.split(), "--bus", NOWHERE],
            cwd=REPO, capture_output=True, text=True, timeout=25,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"das {line} against {NOWHERE} still waited after 25 s")
    err = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(err) == 1 and "cannot reach Kafka" in err[0], result.stderr


def test_the_dead_letter_summary_survives_a_forged_letter(kafka_servers, capsys):
    topic, dlq = make_topics(kafka_servers, "forged-dlq")
    try:
        producer = KafkaProducer(bootstrap_servers=kafka_servers)
        forged = [(H_REASON, b"forged"), (H_PARTITION, b"not-a-number")]
        producer.send(dlq, key=b"x", value=b"y", headers=forged).get(timeout=30)
        producer.close()
        bus = f"kafka://{','.join(kafka_servers)}"
        assert das(["kafka", "dlq", "--bus", bus, "--dlq-topic", dlq, "--json"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["dead_letters"] == 1 and summary["by_reason"] == {"forged": 1}
        assert summary["last"][0]["partition"] is None
        assert das(["kafka", "dlq", "--bus", bus, "--dlq-topic", dlq]) == 0
        assert "?/?/? forged" in capsys.readouterr().out
    finally:
        drop_topics(kafka_servers, topic, dlq)


def test_the_replica_reports_its_lag_unknown_while_no_broker_answers(das_processes, tmp_path):
    replica = das_processes.start(
        "replica",
        "indexer",
        "run",
        "--bus",
        NOWHERE,
        "--data",
        str(tmp_path / "store"),
        "--metrics-port",
        "0",
    )
    deadline = time.monotonic() + 60
    while not (found := re.search(r"metrics on (http://\S+/metrics)", das_processes.log("replica"))):
        assert replica.poll() is None and time.monotonic() < deadline, das_processes.log("replica")
        time.sleep(0.1)
    while "brokers unreachable" not in das_processes.log("replica"):  # the first connection attempt failed
        assert replica.poll() is None and time.monotonic() < deadline, das_processes.log("replica")
        time.sleep(0.1)
    text = urllib.request.urlopen(found[1], timeout=10).read().decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("das_consumer_"))
    assert samples["das_consumer_up"] == "0.0"
    assert math.isnan(float(samples["das_consumer_lag_records"]))  # unknown, not "caught up"
    replica.send_signal(signal.SIGTERM)
    das_processes.wait_ok(replica, "replica", timeout_s=60)


def test_an_output_folder_that_cannot_be_written_is_refused_before_the_model_runs(tmp_path, capsys):
    # A read-only file system (root ignores permission bits, not a read-only mount).
    folder = tmp_path / "read-only"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], check=True)
    try:
        started = time.monotonic()
        code = das(
            ["traces", "annotate", str(REPO / "data" / "dev_rollouts.jsonl"), "-o", str(folder / "a.jsonl")]
        )
        assert code == 1 and time.monotonic() - started < 10
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            len(err) == 1 and err[0].startswith("das traces annotate: ") and "Read-only file system" in err[0]
        ), err
    finally:
        subprocess.run(["umount", str(folder)], check=True)
