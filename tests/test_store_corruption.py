"""A stored record whose bytes were altered fails its checksum: it is quarantined with the reason, counted
in a metric, and the store goes on serving everything else. A damaged table file fails verify, backup and
restore, and a failed restore leaves nothing behind. A write-ahead log damaged before its end fails verify and
backup too (verify replays it as an open does, in a copy); one cut short, as a crash leaves it, does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from _store_workload import Workload
from prometheus_client import REGISTRY
from rocksdict import Options, Rdict

from history_store.durable import layout
from history_store.durable.store import HistoryStore, verify_store
from workers.cli import main as das

WORKLOAD = Workload(problems=3, epochs=2, samples=4)


def _quarantined_total(code: str) -> float:
    return REGISTRY.get_sample_value("das_quarantined_records_total", {"reason": code}) or 0.0


def _alter_stored_bytes(path: Path, key: bytes, mutate, family_name: str = layout.CF_TRAJECTORIES) -> None:
    """Rewrites one raw value behind the store's back, as bit rot or a buggy writer would."""
    families = {name: Options(raw_mode=True) for name in layout.COLUMN_FAMILIES}
    db = Rdict(str(path), Options(raw_mode=True), column_families=families)
    family = db.get_column_family(family_name)
    family[key] = mutate(family[key])
    del family
    db.close()


def _flip_a_token_bit(raw: bytes) -> bytes:
    body = bytearray(raw)
    body[-5] ^= 0x10
    return bytes(body)


def test_altered_record_is_quarantined_with_reason_counted_and_others_still_served(tmp_path: Path) -> None:
    path = tmp_path / "h"
    with HistoryStore(path, window_epochs=3) as store:
        store.apply(WORKLOAD.stream())
        digest_before = store.content_digest()
    bad = ("problem-1", 1, 2)
    _alter_stored_bytes(path, layout.trajectory_key(*bad), _flip_a_token_bit)
    before = _quarantined_total("checksum")
    with HistoryStore(path, window_epochs=3) as store:
        assert store.get(*bad) is None
        assert _quarantined_total("checksum") == before + 1
        [record] = store.quarantined()
        assert record.key == bad and record.code == "checksum" and "checksum mismatch" in record.reason
        # Everything else is intact and served; the bad record left its window and statistics.
        served = [t.key for t in store.iter_trajectories()]
        assert len(served) == len(WORKLOAD.stream()) - 1 and bad not in served
        assert store.length_stats("problem-1").count == 2 * WORKLOAD.samples - 1
        assert store.content_digest() != digest_before
        assert store.stats().quarantined == 1
        # The bus replays the record (after a rebuild or from the topic): it is stored again, intact.
        result = store.apply([WORKLOAD.record(1, 1, 2)])
        assert result.applied == [bad]
        assert store.content_digest() == digest_before


def test_truncated_record_is_quarantined_as_size_error_on_iteration(tmp_path: Path) -> None:
    path = tmp_path / "h"
    with HistoryStore(path) as store:
        store.apply(WORKLOAD.stream())
    bad = ("problem-0", 0, 0)
    _alter_stored_bytes(path, layout.trajectory_key(*bad), lambda raw: raw[:-3])
    with HistoryStore(path) as store:
        keys = [t.key for t in store.iter_trajectories("problem-0")]
        assert bad not in keys and len(keys) == 2 * WORKLOAD.samples - 1
        assert [q.code for q in store.quarantined()] == ["size"]


def test_secondary_reader_skips_a_corrupt_record_without_crashing(tmp_path: Path) -> None:
    path = tmp_path / "h"
    with HistoryStore(path) as store:
        store.apply(WORKLOAD.stream())
    bad = ("problem-2", 0, 3)
    _alter_stored_bytes(path, layout.trajectory_key(*bad), _flip_a_token_bit)
    with HistoryStore.open_secondary(path, tmp_path / "secondary") as reader:
        assert reader.get(*bad) is None
        assert sum(1 for _ in reader.iter_trajectories()) == len(WORKLOAD.stream()) - 1


def test_corrupt_window_value_is_rebuilt_from_the_records_and_rewritten_on_the_next_apply(
    tmp_path: Path,
) -> None:
    path = tmp_path / "h"
    with HistoryStore(path) as store:
        store.apply(WORKLOAD.stream())
        expected = store.length_stats("problem-2")
    _alter_stored_bytes(path, layout.problem_prefix("problem-2"), _flip_a_token_bit, layout.CF_WINDOWS)
    before = _quarantined_total("window")
    with HistoryStore(path) as store:
        assert store.length_stats("problem-2") == expected
        assert _quarantined_total("window") > before
        store.apply([WORKLOAD.record(2, 1, 99)])
        counted = _quarantined_total("window")
        assert store.length_stats("problem-2").count == expected.count + 1
        assert _quarantined_total("window") == counted  # the rewritten window passes its check again


def _offsets_sst(store: HistoryStore) -> Path:
    """The table file of the offsets column family (its keys start with the topic name)."""
    [name] = [f["name"] for f in store._db.live_files() if f["start_key"].startswith(b"topic\x00")]
    return store.path / name.lstrip("/")


def test_damage_in_the_offsets_table_fails_verify_backup_and_restore_and_restore_leaves_nothing(
    tmp_path: Path, capsys
) -> None:
    path = tmp_path / "h"
    with HistoryStore(path) as store:
        for epoch in range(2):  # offsets of 200 partitions: a table file with an index worth damaging
            store.apply([WORKLOAD.record(p, epoch, s) for p in range(3) for s in range(4)],
                        {("topic", p): 100 * epoch + p for p in range(200)})  # fmt: skip
        store.compact()
        offsets = _offsets_sst(store)
    assert das(["history", "checkpoint", str(tmp_path / "ckpts"), "--data", str(path)]) == 0
    capsys.readouterr()
    # 16 bytes past the data blocks (index, filter, properties): a RocksDB secondary instance cannot open the
    # file and treats it as absent, so verifying through one reported this store sound. The checkpoint shares
    # the file by hard link, as it shares every damage of the disk.
    data = bytearray(offsets.read_bytes())
    for i in range(len(data) - 100, len(data) - 84):
        data[i] ^= 0xFF
    offsets.write_bytes(bytes(data))

    assert das(["history", "verify", "--data", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["damaged_files"] == [str(offsets)]
    assert das(["history", "backup", str(tmp_path / "backups"), "--checkpoint", str(tmp_path / "ckpts")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not backed up" in err[0] and offsets.name in err[0]
    assert not list((tmp_path / "backups").glob("backup-*"))
    assert das(["history", "restore", str(tmp_path / "ckpts"), str(tmp_path / "restored")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "damaged" in err[0]
    assert not (tmp_path / "restored").exists() and not (tmp_path / ".restored.restoring").exists()


_CRASHED_WRITER = """
import os, sys
from history_store.durable.store import HistoryStore
from pipeline.synthetic import SyntheticShape, synthetic_records
records = list(synthetic_records(0, 4000, SyntheticShape(problems=32, epochs=3, prompt_tokens=20,
                                                           response_tokens_median=50)))
store = HistoryStore(sys.argv[1])
for i in range(0, 4000, 100):
    store.apply(records[i:i + 100], {("t", 0): i + 100})
os._exit(0)  # as kill -9 would: every batch is in the write-ahead log only
"""


def _crashed_store(path: Path) -> Path:
    """A store whose 4,000 records live only in its write-ahead log (its writer died without closing)."""
    subprocess.run(
        [sys.executable, "-c", _CRASHED_WRITER, str(path)], check=True, cwd=Path(__file__).parent.parent
    )
    [log] = [f for f in path.glob("*.log") if f.stat().st_size]
    return log


def test_a_damaged_write_ahead_log_fails_verify_and_backup(tmp_path: Path, capsys) -> None:
    # A flipped block in the middle of the log: the writer's open would silently keep only what precedes it.
    store = tmp_path / "flipped"
    log = _crashed_store(store)
    data = bytearray(log.read_bytes())
    for i in range(16):
        data[len(data) // 2 + i] ^= 0xFF
    log.write_bytes(bytes(data))
    files_before = sorted(p.name for p in store.iterdir())
    assert das(["history", "verify", "--data", str(store)]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED: files {log}" in out and "write-ahead log" in out, out
    assert das(["history", "backup", str(tmp_path / "backups"), "--data", str(store)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and log.name in err, err
    assert sorted(p.name for p in store.iterdir()) == files_before  # verify replays a copy, never the store

    # A log cut short is what a crash leaves: a normal open keeps the prefix, and verify agrees.
    store = tmp_path / "truncated"
    log = _crashed_store(store)
    os.truncate(log, log.stat().st_size // 2)
    assert das(["history", "verify", "--data", str(store)]) == 0
    assert "write-ahead log replayed" in capsys.readouterr().out


def test_verifying_a_store_while_its_writer_applies_finds_no_damage(tmp_path: Path) -> None:
    # The log of a live store is copied mid-write (a torn last record): never taken for damage.
    from pipeline.synthetic import SyntheticShape, synthetic_records

    records = list(
        synthetic_records(0, 3000, SyntheticShape(problems=16, epochs=3, response_tokens_median=80))
    )
    stop = threading.Event()
    with HistoryStore(tmp_path / "live") as store:

        def write() -> None:
            for i in range(0, len(records), 50):
                if stop.is_set():
                    return
                store.apply(records[i : i + 50], {("t", 0): i + 50})

        writer = threading.Thread(target=write)
        writer.start()
        reports = []
        while writer.is_alive():
            reports.append(verify_store(tmp_path / "live"))
        writer.join()
    assert reports and all(r.ok for r in reports), [r.damaged for r in reports if not r.ok]
