"""Checkpoints of the history store (RocksDB checkpoint + manifest, last K kept, automatic at epoch
boundaries and on a timer) and restore into a fresh folder, through the API and `das history`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _store_workload import Workload

from history_store.durable.checkpoints import (
    Checkpointer,
    CheckpointError,
    create_backup,
    create_checkpoint,
    list_checkpoints,
    read_manifest,
    restore_checkpoint,
)
from history_store.durable.store import HistoryStore
from history_store.indexed_history import IndexedHistory
from workers.cli import main as das

WORKLOAD = Workload(problems=4, epochs=3, samples=4)


def test_checkpoint_restores_to_an_identical_store_and_keeps_the_last_k(tmp_path: Path) -> None:
    stream = WORKLOAD.stream()
    with HistoryStore(tmp_path / "h", window_epochs=2) as store:
        for i in range(0, len(stream), 16):
            store.apply(stream[i : i + 16], {("t", 0): i + 16})
            create_checkpoint(store, tmp_path / "ckpt", keep=2)
        digest, stats = store.content_digest(), store.stats()
        store.apply([WORKLOAD.record(0, 9, 0)], {("t", 0): 999})  # after the last checkpoint: not restored
    kept = list_checkpoints(tmp_path / "ckpt")
    assert len(kept) == 2
    manifest = read_manifest(kept[-1])
    assert manifest["trajectories"] == stats.trajectories and manifest["window_epochs"] == 2
    assert manifest["offsets"] == [{"topic": "t", "partition": 0, "offset": len(stream)}]

    info = restore_checkpoint(tmp_path / "ckpt", tmp_path / "restored")
    with HistoryStore(tmp_path / "restored") as restored:
        assert restored.content_digest() == digest
        assert restored.offsets() == {("t", 0): len(stream)}
        assert restored.window_epochs == 2
        # The restored store is a live writer of its own: it goes on from the checkpoint's offsets.
        assert restored.apply([WORKLOAD.record(0, 9, 0)]).applied == [("problem-0", 9, 0)]
    assert info.seconds > 0
    # The checkpoint itself is untouched by the restored store's writes (files are copied or immutable).
    second = restore_checkpoint(kept[-1], tmp_path / "restored-again")
    with HistoryStore(second.data_dir) as again:
        assert again.content_digest() == digest


def test_restore_refuses_a_non_empty_target_and_a_missing_checkpoint(tmp_path: Path) -> None:
    with HistoryStore(tmp_path / "h") as store:
        store.apply(WORKLOAD.stream()[:4])
        create_checkpoint(store, tmp_path / "ckpt")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not an empty folder"):
        restore_checkpoint(tmp_path / "ckpt", tmp_path / "busy")
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        restore_checkpoint(tmp_path / "nothing", tmp_path / "new")


def test_unfinished_checkpoint_without_manifest_is_ignored_and_cleaned(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    (root / ".tmp-ckpt-0000000000001-000000000000" / "db").mkdir(parents=True)
    (root / "ckpt-0000000000002-000000000000").mkdir()  # crashed before its manifest
    assert list_checkpoints(root) == []
    with HistoryStore(tmp_path / "h") as store:
        create_checkpoint(store, root)
    assert len(list_checkpoints(root)) == 1
    assert not (root / ".tmp-ckpt-0000000000001-000000000000").exists()


def test_checkpointer_fires_at_epoch_boundaries_and_on_its_timer(tmp_path: Path) -> None:
    with HistoryStore(tmp_path / "h") as store:
        auto = Checkpointer(store, tmp_path / "ckpt", every_seconds=3600, keep=5)
        store.apply([WORKLOAD.record(0, 0, 0)])
        assert auto.maybe_checkpoint(max_epoch=0) is None  # first epoch: a start, not a boundary
        store.apply([WORKLOAD.record(0, 1, 0)])
        info = auto.maybe_checkpoint(max_epoch=1)
        assert info is not None and info.manifest["max_epoch"] == 1
        assert auto.maybe_checkpoint(max_epoch=1) is None
        timed = Checkpointer(store, tmp_path / "ckpt", every_seconds=1e-6, keep=5, at_epoch_boundary=False)
        assert timed.maybe_checkpoint() is not None
        assert len(list_checkpoints(tmp_path / "ckpt")) == 2


def test_indexed_history_checkpoints_itself_when_a_new_epoch_starts(tmp_path: Path) -> None:
    with IndexedHistory.open(
        tmp_path / "h", checkpoint_dir=tmp_path / "ckpt", checkpoint_every_s=3600
    ) as history:
        history.apply([WORKLOAD.record(p, 0, s) for p in range(2) for s in range(2)])
        assert list_checkpoints(tmp_path / "ckpt") == []
        history.apply([WORKLOAD.record(0, 1, 0)])
        [checkpoint] = list_checkpoints(tmp_path / "ckpt")
        assert read_manifest(checkpoint)["trajectories"] == 5
    # After a restart the epoch already checkpointed is not a new boundary.
    with IndexedHistory.open(
        tmp_path / "h", checkpoint_dir=tmp_path / "ckpt", checkpoint_every_s=3600
    ) as history:
        history.apply([WORKLOAD.record(1, 1, 0)])
        assert len(list_checkpoints(tmp_path / "ckpt")) == 1


def test_das_history_commands_checkpoint_restore_stats_inspect_compact(tmp_path: Path, capsys) -> None:
    data = tmp_path / "h"
    with HistoryStore(data, window_epochs=2) as store:
        store.apply(WORKLOAD.stream(), {("das.trajectories", 0): len(WORKLOAD.stream())})

    def run(*argv: str) -> dict:
        assert das(list(argv)) == 0
        return json.loads(capsys.readouterr().out)

    stats = run("history", "stats", "--data", str(data), "--json")
    assert stats["trajectories"] == WORKLOAD.problems * 2 * WORKLOAD.samples and stats["window_epochs"] == 2
    problem = run("history", "inspect", "problem-1", "--data", str(data), "--json")
    assert (
        problem["epochs"] == [1, 2]
        and problem["samples"] == 2 * WORKLOAD.samples
        and problem["tree_bytes"] > 0
    )
    ckpt = run("history", "checkpoint", str(tmp_path / "ckpt"), "--data", str(data), "--json")
    assert ckpt["trajectories"] == stats["trajectories"]
    restored = run("history", "restore", ckpt["checkpoint"], str(tmp_path / "restored"), "--json")
    assert restored["trajectories"] == stats["trajectories"]
    assert run("history", "compact", "--data", str(tmp_path / "restored"), "--json")["disk_bytes_after"] > 0
    # Stats read through a secondary instance, so they work while a writer holds the folder.
    with HistoryStore(data):
        assert run("history", "stats", "--data", str(data), "--json")["trajectories"] == stats["trajectories"]
        assert das(["history", "compact", "--data", str(data)]) == 1
        assert "already open for writing" in capsys.readouterr().err


def test_checkpoints_and_backups_keep_response_logprobs(tmp_path: Path) -> None:
    records = [
        r.model_copy(update={"response_logprobs": [-0.25 * (i % 9) for i in range(len(r.response_ids))]})
        for r in WORKLOAD.stream()[:6]
    ]
    with HistoryStore(tmp_path / "h") as store:
        store.apply(records)
        create_checkpoint(store, tmp_path / "ckpt")
        backup = create_backup(store, tmp_path / "backups")
    for source, target in ((tmp_path / "ckpt", "from-ckpt"), (backup.path, "from-backup")):
        restored = restore_checkpoint(source, tmp_path / target)
        with HistoryStore(restored.data_dir) as store:
            for record in records:
                assert store.get(*record.key).response_logprobs.tolist() == record.response_logprobs
