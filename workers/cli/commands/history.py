"""`das history checkpoint|backup|restore|stats|inspect|verify|compact`: operate a node's history store folder.

Read-only commands (stats, inspect) open the folder as a RocksDB secondary and verify opens it as a read-only
primary (which opens every file: a secondary skips one it cannot open), so they work while the history replica
is running; checkpoint and compact need the write lock (the running replica checkpoints itself).
The data folder comes from `--data` or the environment variable DAS_HISTORY_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workers.cli.types import POSITIVE, add_json_flag
from workers.errors import InvalidInput

DATA_ENV = "DAS_HISTORY_DIR"


def _data_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data", default=os.environ.get(DATA_ENV), help=f"history store folder (default: ${DATA_ENV})"
    )
    add_json_flag(parser)


def register(cli: Any) -> None:
    p = cli.command(
        "history", "checkpoint", help="Write a checkpoint of the history store into DIR.", run=checkpoint
    )
    p.add_argument("dir", help="checkpoint root folder (checkpoints are ckpt-* folders inside)")
    p.add_argument("--keep", type=POSITIVE, default=3, help="checkpoints to keep in DIR (oldest deleted)")
    _data_arg(p)
    p = cli.command(
        "history",
        "restore",
        help="Restore a checkpoint or backup into an empty DATA_DIR (backups: every file's checksum checked; "
        "the restored store is read in full before it is reported good).",
        run=restore,
    )
    p.add_argument("checkpoint", help="a ckpt-*/backup-* folder, or a root of them (its newest is used)")
    p.add_argument("data_dir", help="folder to restore into (must not exist or be empty)")
    add_json_flag(p)
    p = cli.command(
        "history", "stats", help="Totals of the history store: problems, records, tokens, offsets.", run=stats
    )
    _data_arg(p)
    p = cli.command(
        "history", "inspect", help="One problem: epochs, samples, lengths, tree size.", run=inspect
    )
    p.add_argument("problem_id")
    _data_arg(p)
    p = cli.command(
        "history", "compact", help="Compact the history store (drops evicted data on disk).", run=compact
    )
    _data_arg(p)
    p = cli.command(
        "history",
        "verify",
        help="Read every block of the store with checksums verified; list the damaged files and the records "
        "they make unreadable. Exit 1 if anything is damaged.",
        run=verify,
    )
    _data_arg(p)
    p = cli.command(
        "history",
        "backup",
        help="Back the store up into DIR as real, checksummed copies (a checkpoint shares the store's files "
        "and its damage); restore with `das history restore DIR DATA_DIR`, which checks every file.",
        run=backup,
    )
    p.add_argument("dir", help="backup root folder, ideally on another disk (backups are backup-* inside)")
    p.add_argument("--keep", type=POSITIVE, default=3, help="backups to keep in DIR (oldest deleted)")
    p.add_argument(
        "--checkpoint",
        help="back up this checkpoint (a ckpt-* folder or a root: its newest) instead of --data: how to back up "
        "a store its running replica holds open (das indexer run --checkpoint-dir)",
    )
    _data_arg(p)


def _guarded(
    fn: Callable[[argparse.Namespace], dict[str, Any]], args: argparse.Namespace, needs_data: bool = True
) -> int:
    if needs_data and hasattr(args, "data") and not args.data:
        raise InvalidInput(f"no store folder: pass --data or set {DATA_ENV}")
    result = fn(args)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


def checkpoint(args: argparse.Namespace) -> int:
    def run(args: argparse.Namespace) -> dict[str, Any]:
        from history_store.durable.checkpoints import create_checkpoint

        with _open_writer(args.data) as store:
            info = create_checkpoint(store, args.dir, keep=args.keep)
        return {"checkpoint": str(info.path), "seconds": round(info.seconds, 4), **info.manifest}

    return _guarded(run, args)


def restore(args: argparse.Namespace) -> int:
    def run(args: argparse.Namespace) -> dict[str, Any]:
        from history_store.durable.checkpoints import restore_checkpoint

        info = restore_checkpoint(args.checkpoint, args.data_dir)
        return {
            "data_dir": str(info.data_dir),
            "seconds": round(info.seconds, 4),
            "trajectories": info.manifest["trajectories"],
            "offsets": info.manifest["offsets"],
        }

    return _guarded(run, args)


def _open_writer(data: str) -> Any:
    """The store as its writer, once it verifies: a writer's open replays the write-ahead log and, past a damaged
    record, silently keeps only what precedes it; a command must not build on (or back up) that."""
    from history_store.durable.store import HistoryStore, verify_store
    from history_store.errors import StoreCorruptionError

    if Path(data, "CURRENT").exists():
        report = verify_store(data)
        if not report.ok:
            raise StoreCorruptionError(
                f"history store {data} is damaged (files {', '.join(report.files) or 'none named'}): run `das history "
                "verify`; restore a backup (das history restore) or let the replica rebuild it from the topic"
            )
    return HistoryStore(data, create=False)


def _read(args: argparse.Namespace, fn: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    from history_store.durable.store import HistoryStore

    with (
        tempfile.TemporaryDirectory(prefix="das-history-secondary-") as secondary,
        HistoryStore.open_secondary(args.data, secondary) as reader,
    ):
        return fn(reader)


def stats(args: argparse.Namespace) -> int:
    return _guarded(lambda a: _read(a, lambda reader: reader.stats().to_json()), args)


def inspect(args: argparse.Namespace) -> int:
    def describe(reader: Any) -> dict[str, Any]:
        from history_store.automaton.problem_index import ProblemIndex

        window = reader.window(args.problem_id)
        if len(window) == 0:
            raise InvalidInput(f"no records of problem {args.problem_id!r} in {args.data}")
        # The problem's tree alone (no global tree): the size its history adds to a replica.
        index = ProblemIndex(window_epochs=reader.window_epochs, global_tokens=0)
        for record in reader.iter_trajectories(args.problem_id):
            index.add_trajectory(
                *record.key, record.prompt_ids, record.response_ids, record.response_logprobs
            )
        tree = index.problem_stats(args.problem_id)
        lengths = reader.length_stats(args.problem_id)
        return {
            "problem_id": args.problem_id,
            "epochs": sorted({int(e) for e in window["epoch"]}),
            "samples": len(window),
            "samples_per_epoch": {
                int(e): int((window["epoch"] == e).sum()) for e in sorted(set(window["epoch"]))
            },
            "response_lengths": {
                "mean": round(lengths.mean, 1),
                "p50": lengths.p50,
                "p90": lengths.p90,
                "max": lengths.max,
            },
            "prompt_tokens": int(window["prompt_len"].sum()),
            "response_tokens": int(window["response_len"].sum()),
            "tree_tokens": tree["tokens"],
            "tree_bytes": tree["tree_bytes"],
        }

    return _guarded(lambda a: _read(a, describe), args)


def verify(args: argparse.Namespace) -> int:
    if not args.data:
        raise InvalidInput(f"no store folder: pass --data or set {DATA_ENV}")
    from history_store.durable.store import verify_store

    report = verify_store(args.data)
    if args.json:
        print(json.dumps(report.to_json(), sort_keys=True))
    elif report.ok:
        print(
            f"{args.data}: ok ({sum(report.entries.values())} entries read, every checksum verified, the "
            "write-ahead log replayed)"
        )
    else:
        for damage in report.damaged:
            where = (
                f"{damage.family} after key {damage.after_key}"
                if damage.family
                else "write-ahead log (an open would drop every write from there on)"
                if damage.error.startswith("write-ahead log")
                else "a file, the store does not open"
            )
            print(f"damaged: {where}: {damage.error}")
        for name, keys in (
            ("unreadable", report.unreadable_records),
            ("missing", report.missing_records),
            ("corrupt", report.corrupt_records),
        ):
            for key in keys:
                print(f"{name} record: {key[0]} epoch {key[1]} sample {key[2]}")
        print(
            f"{args.data}: DAMAGED: files {', '.join(report.files) or 'none named'}; "
            f"{len(report.unreadable_records)} unreadable, {len(report.missing_records)} missing, "
            f"{len(report.corrupt_records)} corrupt records. Restore a backup (das history restore) or let "
            "the replica rebuild from the topic."
        )
    return 0 if report.ok else 1


def backup(args: argparse.Namespace) -> int:
    def run(args: argparse.Namespace) -> dict[str, Any]:
        from history_store.durable.checkpoints import create_backup

        if args.checkpoint:
            info = create_backup(args.checkpoint, args.dir, keep=args.keep)
        else:
            with _open_writer(args.data) as store:
                info = create_backup(store, args.dir, keep=args.keep)
        return {
            "backup": str(info.path),
            "seconds": round(info.seconds, 4),
            "files": len(info.manifest["files"]),
            "bytes": info.manifest["checkpoint_bytes"],
            "trajectories": info.manifest["trajectories"],
        }

    return _guarded(run, args, needs_data=not args.checkpoint)


def compact(args: argparse.Namespace) -> int:
    def run(args: argparse.Namespace) -> dict[str, Any]:

        with _open_writer(args.data) as store:
            before = store.stats().disk_bytes
            store.compact()
            after = store.stats().disk_bytes
        return {"disk_bytes_before": before, "disk_bytes_after": after}

    return _guarded(run, args)
