"""A damaged SST file (16 bytes flipped, as a bad disk does) is detected, reported, and repaired, with the real
single broker and real stores:

- `das history verify` names the damaged file and exactly the records it makes unreadable (exit 1);
- `das history inspect` on a damaged problem says so in one line instead of crashing;
- the replica (`das indexer run`) finds the damage at start, rebuilds the store from the topic into a fresh
  folder, swaps it in and says so; the result equals a clean store of the same records;
- `das history backup` made before the damage restores to the same records, and a backup whose file was
  altered is refused on restore.
"""

from __future__ import annotations

import errno
import json
import shutil
import signal
import subprocess
import time

import pytest
from conftest import end_offsets, wait_caught_up

from history_store.durable import layout
from history_store.durable.store import HistoryStore, exchange_folders
from history_store.errors import StoreCorruptionError
from pipeline.bus import open_bus
from pipeline.synthetic import SyntheticShape, synthetic_records
from workers.cli import main as das

pytestmark = pytest.mark.kafka
SHAPE = SyntheticShape(problems=32, epochs=3, prompt_tokens=60, response_tokens_median=200)
COUNT = 1500


def _flip_bytes(path, count: int = 16) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(count):
        data[middle + i] ^= 0xFF
    path.write_bytes(bytes(data))


def _largest_sst(path):
    return max(path.glob("*.sst"), key=lambda f: f.stat().st_size)


def _replicate(das_processes, name, bus, topic, dlq, store_path, servers) -> str:
    proc = das_processes.start(
        name, "indexer", "run", "--bus", bus, "--topic", topic, "--dlq-topic", dlq, "--data", str(store_path),
        "--replica", "repair-replica", "--log-level", "info",
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while "replica repair-replica: " not in das_processes.log(name):  # replicating (after any rebuild)
        assert proc.poll() is None and time.monotonic() < deadline, das_processes.log(name)
        time.sleep(0.1)
    wait_caught_up(store_path, end_offsets(servers, topic), timeout_s=120, what=name)
    proc.send_signal(signal.SIGTERM)
    das_processes.wait_ok(proc, name, timeout_s=60)
    return das_processes.log(name)


def test_a_damaged_sst_is_reported_rebuilt_from_kafka_and_restored_from_a_verified_backup(
    kafka_servers, kafka_topics, das_processes, tmp_path, capsys
):
    bus_url, topic, dlq, store, digest = _compacted_replica(
        kafka_servers, kafka_topics, das_processes, tmp_path, worker=0
    )
    records = list(synthetic_records(0, COUNT, SHAPE))
    assert das(["history", "backup", str(tmp_path / "backups"), "--data", str(store), "--json"]) == 0
    backup = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["backup"]

    damaged = _largest_sst(store)
    _flip_bytes(damaged)
    assert das(["history", "verify", "--data", str(store), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["damaged_files"] == [str(damaged)]
    assert {d["family"] for d in report["damaged"]} == {layout.CF_TRAJECTORIES}
    unreadable = {tuple(k) for k in report["unreadable_records"]}
    assert 0 < len(unreadable) < COUNT
    with HistoryStore(store) as opened:  # exactly those: every other record reads back intact
        for record in records:
            if record.key in unreadable:
                with pytest.raises(StoreCorruptionError, match=damaged.name):
                    opened.get(*record.key)
            else:
                assert opened.get(*record.key).response_ids.tolist() == record.response_ids
        with pytest.raises(StoreCorruptionError, match="das history verify"):
            sum(1 for _ in opened.iter_trajectories())
    problem = sorted(unreadable)[0][0]
    assert das(["history", "inspect", problem, "--data", str(store)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("das history inspect: ") and len(err.splitlines()) == 1 and damaged.name in err

    log = _replicate(das_processes, "replica-restarted", bus_url, topic, dlq, store, kafka_servers)
    assert "rebuilding it from topic" in log and "swapped in" in log and "Traceback" not in log
    [kept] = tmp_path.glob("replica.corrupt-*")
    assert (kept / damaged.name).exists()
    assert das(["history", "verify", "--data", str(store)]) == 0
    with HistoryStore(store) as rebuilt:
        assert rebuilt.content_digest() == digest

    assert das(["history", "restore", backup, str(tmp_path / "restored"), "--json"]) == 0
    with HistoryStore(tmp_path / "restored") as restored:
        assert restored.content_digest() == digest
    _flip_bytes(_largest_sst(tmp_path / "backups" / backup.rsplit("/", 1)[1] / "db"), count=1)
    capsys.readouterr()
    assert das(["history", "restore", backup, str(tmp_path / "restored-again")]) == 1
    err = capsys.readouterr().err.strip()
    assert "fails its checksum" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "restored-again").exists()


def _compacted_replica(kafka_servers, kafka_topics, das_processes, tmp_path, worker):
    """Publishes COUNT records of `worker` (`synthetic_records(worker, COUNT, SHAPE)`), replicates them into a
    store compacted into SST files; returns (bus URL, topic, dead-letter topic, store folder, the content digest
    a clean store of those records has)."""
    topic, dlq = kafka_topics
    bus_url = f"kafka://{','.join(kafka_servers)}"
    records = list(synthetic_records(worker, COUNT, SHAPE))
    bus = open_bus(bus_url, topic=topic)
    for record in records:
        bus.publish(record)
    assert bus.close().acknowledged == COUNT
    with HistoryStore(tmp_path / "reference") as reference:
        reference.apply(records)
        digest = reference.content_digest()
    store = tmp_path / "replica"
    _replicate(das_processes, "replica", bus_url, topic, dlq, store, kafka_servers)
    assert das(["history", "compact", "--data", str(store)]) == 0
    return bus_url, topic, dlq, store, digest


def test_a_second_replica_started_mid_rebuild_is_refused_and_the_swap_keeps_the_store(
    kafka_servers, kafka_topics, das_processes, tmp_path
):
    bus_url, topic, dlq, store, digest = _compacted_replica(
        kafka_servers, kafka_topics, das_processes, tmp_path, worker=1
    )
    _flip_bytes(_largest_sst(store))
    replica = ("indexer", "run", "--bus", bus_url, "--topic", topic, "--dlq-topic", dlq, "--data", str(store))
    # One record per batch: the rebuild takes long enough for a second replica to start in the middle of it.
    first = das_processes.start("first", *replica, "--replica", "first", "--batch-records", "1")
    deadline = time.monotonic() + 120
    while "rebuilding it from topic" not in das_processes.log("first"):
        assert first.poll() is None and time.monotonic() < deadline, das_processes.log("first")
        time.sleep(0.05)
    second = das_processes.start("second", *replica, "--replica", "second")
    assert second.wait(60) == 1
    assert "swapped in" not in das_processes.log("first")  # refused while the rebuild was running
    [refusal] = das_processes.log("second").strip().splitlines()
    assert refusal.startswith("das indexer run: ") and "already open for writing" in refusal
    while "replica first: " not in das_processes.log("first"):  # replicating into the rebuilt store
        assert first.poll() is None and time.monotonic() < deadline + 240, das_processes.log("first")
        time.sleep(0.1)
    wait_caught_up(store, end_offsets(kafka_servers, topic), timeout_s=120, what="first")
    first.send_signal(signal.SIGTERM)
    das_processes.wait_ok(first, "first", timeout_s=60)
    assert len(list(tmp_path.glob("replica.corrupt-*"))) == 1 and not (tmp_path / ".replica.rebuild").exists()
    with HistoryStore(store) as rebuilt:
        assert rebuilt.content_digest() == digest


def test_damage_to_a_running_store_is_noticed_by_the_background_verification_and_rebuilt(
    kafka_servers, kafka_topics, das_processes, tmp_path
):
    bus_url, topic, dlq, store, digest = _compacted_replica(
        kafka_servers, kafka_topics, das_processes, tmp_path, worker=2
    )
    running = das_processes.start(
        "running", "indexer", "run", "--bus", bus_url, "--topic", topic, "--dlq-topic", dlq,
        "--data", str(store), "--replica", "running", "--verify-every", "0.5",
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while "replica running: " not in das_processes.log("running"):  # the check at start passed
        assert running.poll() is None and time.monotonic() < deadline, das_processes.log("running")
        time.sleep(0.1)
    damaged = _largest_sst(store)
    _flip_bytes(damaged)  # behind the running writer's back: its own handles keep the blocks they read
    while "swapped in" not in das_processes.log("running"):
        assert running.poll() is None and time.monotonic() < deadline + 120, das_processes.log("running")
        time.sleep(0.1)
    log = das_processes.log("running")
    assert "background verification" in log and damaged.name in log and "Traceback" not in log
    wait_caught_up(store, end_offsets(kafka_servers, topic), timeout_s=120, what="running")
    running.send_signal(signal.SIGTERM)
    das_processes.wait_ok(running, "running", timeout_s=60)
    [kept] = tmp_path.glob("replica.corrupt-*")
    assert (kept / damaged.name).exists()
    with HistoryStore(store) as rebuilt:
        assert rebuilt.content_digest() == digest


def test_a_damaged_store_in_an_overlay_lower_layer_is_rebuilt_and_swapped_in(
    kafka_servers, kafka_topics, das_processes, tmp_path
):
    # Container images and some volume drivers are overlays: a folder of the lower layer can be neither exchanged
    # nor renamed (EXDEV), only the files in it. The rebuild moves the files instead, and leaves nothing behind.
    bus_url, topic, dlq, store, digest = _compacted_replica(
        kafka_servers, kafka_topics, das_processes, tmp_path, worker=3
    )
    lower, upper, work, merged = (tmp_path / n for n in ("lower", "upper", "work", "merged"))
    for folder in (lower, upper, work, merged):
        folder.mkdir()
    shutil.move(store, lower / "replica")
    damaged = _largest_sst(lower / "replica")
    _flip_bytes(damaged)
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(merged)], check=True)
    try:
        store = merged / "replica"
        (merged / "probe").mkdir()
        with pytest.raises(OSError) as refused:  # the condition this test is about: no exchange, no rename
            exchange_folders(merged / "probe", store)
        assert refused.value.errno == errno.EXDEV
        (merged / "probe").rmdir()
        log = _replicate(das_processes, "overlay", bus_url, topic, dlq, store, kafka_servers)
        assert "rebuilding it from topic" in log and "moving the stores' files instead" in log
        assert "swapped in" in log and "Traceback" not in log
        left = {p.name for p in merged.iterdir()}  # besides the store: its .corrupt- copy and test helpers'
        assert ".replica.rebuild" not in left and ".replica.swap" not in left and "replica" in left, left
        [kept] = merged.glob("replica.corrupt-*")
        assert (kept / damaged.name).exists()
        assert das(["history", "verify", "--data", str(store)]) == 0
        with HistoryStore(store) as rebuilt:
            assert rebuilt.content_digest() == digest
    finally:
        subprocess.run(["umount", str(merged)], check=True)


def test_a_swap_a_crash_interrupted_is_finished_at_the_next_start(tmp_path):
    # What a crash leaves in the middle of a swap by moving files (`swap_in` on an overlay): the journal, part of
    # the damaged store's files moved out. The next start finishes it, and opens the rebuilt store.
    from history_store.durable.store import finish_swap

    records = list(synthetic_records(4, 300, SHAPE))
    store, fresh, kept = tmp_path / "replica", tmp_path / ".replica.rebuild", tmp_path / "replica.corrupt-1"
    with HistoryStore(store) as old:
        old.apply(records[:100])
    with HistoryStore(fresh) as new:
        new.apply(records)
        digest = new.content_digest()
    (tmp_path / ".replica.swap").write_text(
        json.dumps({"fresh": str(fresh), "kept": str(kept), "phase": "out"})
    )
    kept.mkdir()
    for entry in sorted(store.iterdir())[:3]:  # the crash came after three files
        entry.rename(kept / entry.name)
    assert finish_swap(store)
    assert not fresh.exists() and not (tmp_path / ".replica.swap").exists()
    assert not finish_swap(store)  # nothing left to finish
    with HistoryStore(store) as opened:
        assert opened.content_digest() == digest
    with HistoryStore(kept) as moved:
        assert moved.stats().trajectories == 100
