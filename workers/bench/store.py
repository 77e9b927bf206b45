"""`das bench store`: ingest rate, bytes on disk, checkpoint and restore times of the history store.

Workload: per problem a base response of Zipf-distributed token ids over a 32,000-token vocabulary; each of
its samples copies the base with 15% of positions redrawn, so samples of one problem share most of their
text as rollouts of one problem do (which matters for compression). Records are applied in batches of 16,
the size of a bus poll, through the real `HistoryStore.apply` (WAL on, unsynced: see store.py).

Startup is measured on a separate store: RocksDB open, reading every record, and rebuilding the per-problem
index (history and global trees) from them, against loading the same per-problem trees from their
serialized form (`SuffixTree.from_bytes`).
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from history_store.automaton.config import DEFAULT_WINDOW_EPOCHS
from history_store.automaton.problem_index import ProblemIndex
from history_store.automaton.suffix_tree import SuffixTree
from history_store.durable.checkpoints import create_checkpoint, restore_checkpoint
from history_store.durable.store import HistoryStore
from history_store.indexed_history import load_index

VOCAB = 32_000
PROMPT_TOKENS = 256
SAMPLES_PER_PROBLEM = 16
BATCH = 16
MUTATION = 0.15
RECORD_TOKENS = (2_000, 4_000, 8_000, 16_000)


@dataclass(frozen=True, slots=True)
class BenchRecord:
    problem_id: str
    epoch: int
    sample: int
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_logprobs: None = None  # the store keeps sampling log probabilities only when a record has them


def make_records(
    rng: np.random.Generator, tag: str, length: int, total_tokens: int, epochs: int = 1
) -> list[BenchRecord]:
    """Records of `length` response tokens, about `total_tokens` response tokens in all."""
    n = max(SAMPLES_PER_PROBLEM, total_tokens // length)
    problems = max(1, n // (SAMPLES_PER_PROBLEM * epochs))
    out = []
    for p in range(problems):
        prompt = np.minimum(rng.zipf(1.2, PROMPT_TOKENS), VOCAB).astype(np.int32)
        base = np.minimum(rng.zipf(1.2, length), VOCAB).astype(np.int32)
        for epoch in range(epochs):
            for s in range(SAMPLES_PER_PROBLEM):
                response = base.copy()
                redraw = rng.random(length) < MUTATION
                response[redraw] = np.minimum(rng.zipf(1.2, int(redraw.sum())), VOCAB)
                out.append(BenchRecord(f"{tag}-{p}", epoch, s, prompt, response))
    return out


def _tokens(records: list[BenchRecord]) -> int:
    return sum(r.prompt_ids.size + r.response_ids.size for r in records)


def bench_ingest(
    path: Path, rng: np.random.Generator, tokens_per_size: int
) -> tuple[list[dict[str, Any]], int]:
    rows = []
    stored = 0
    with HistoryStore(path, window_epochs=1) as store:
        for length in RECORD_TOKENS:
            records = make_records(rng, f"len{length}", length, tokens_per_size)
            tokens = _tokens(records)
            started = time.perf_counter()
            for i in range(0, len(records), BATCH):
                store.apply(records[i : i + BATCH], {("bench", 0): i + BATCH})
            # Include the flush to SST files (where compression happens): a memtable-only rate flatters.
            store._db.flush()  # noqa: SLF001
            seconds = time.perf_counter() - started
            stored += tokens
            rows.append(
                {
                    "tokens_per_record": length,
                    "records": len(records),
                    "trajectories_per_s": round(len(records) / seconds, 1),
                    "mb_per_s": round(4 * tokens / seconds / 1e6, 1),
                    "tokens_per_s": round(tokens / seconds),
                }
            )
    return rows, stored


def bench_disk(path: Path, stored_tokens: int) -> dict[str, Any]:
    with HistoryStore(path) as store:
        store._db.flush()  # noqa: SLF001 - the memtable counts as disk only once flushed
        before = store.stats().disk_bytes
        started = time.perf_counter()
        store.compact()
        compact_seconds = time.perf_counter() - started
        after = store.stats().disk_bytes
    return {
        "stored_tokens": stored_tokens,
        "bytes_per_token_before_compaction": round(before / stored_tokens, 3),
        "bytes_per_token": round(after / stored_tokens, 3),
        "raw_int32_bytes_per_token": 4,
        "compact_seconds": round(compact_seconds, 3),
    }


def bench_checkpoint(path: Path, work: Path) -> dict[str, Any]:
    with HistoryStore(path) as store:
        info = create_checkpoint(store, work / "ckpt", keep=1)
    restored = restore_checkpoint(info.path, work / "restored")
    return {
        "checkpoint_seconds": round(info.seconds, 4),
        "checkpoint_bytes": info.manifest["checkpoint_bytes"],
        "restore_checkpoint_seconds": round(restored.seconds, 4),
    }


def bench_startup(path: Path, rng: np.random.Generator, tokens: int, record_tokens: int) -> dict[str, Any]:
    with HistoryStore(path, window_epochs=DEFAULT_WINDOW_EPOCHS) as store:
        records = make_records(rng, "start", record_tokens, tokens, epochs=3)
        for i in range(0, len(records), BATCH):
            store.apply(records[i : i + BATCH])
    stored = _tokens(records)

    started = time.perf_counter()
    store = HistoryStore(path)
    open_seconds = time.perf_counter() - started
    started = time.perf_counter()
    read = sum(t.response_ids.size for t in store.iter_trajectories())
    read_seconds = time.perf_counter() - started
    index = ProblemIndex(window_epochs=store.window_epochs)
    report = load_index(store, index)
    problems = {p: list(store.iter_trajectories(p)) for p in store.problem_ids()}
    store.close()

    # The alternative: per-problem trees saved with to_bytes and loaded with from_bytes (no global tree).
    depth = index.config.max_depth
    serialized = []
    for stored_records in problems.values():
        tree = SuffixTree(index.config)
        for i, t in enumerate(stored_records):
            tree.extend(i, np.concatenate([t.prompt_ids[-depth:], t.response_ids]))
        serialized.append(tree.to_bytes())
        tree.close()
    started = time.perf_counter()
    loaded = [SuffixTree.from_bytes(b, index.config) for b in serialized]
    serialized_seconds = time.perf_counter() - started
    history_only = ProblemIndex(window_epochs=DEFAULT_WINDOW_EPOCHS, global_tokens=0)
    started = time.perf_counter()
    for stored_records in problems.values():
        for t in stored_records:
            history_only.add_trajectory(t.problem_id, t.epoch, t.sample, t.prompt_ids, t.response_ids)
    history_only_seconds = time.perf_counter() - started
    total = open_seconds + report.seconds
    return {
        "stored_tokens": stored,
        "response_tokens_read": read,
        "open_seconds": round(open_seconds, 4),
        "read_seconds": round(read_seconds, 4),
        "rebuild_seconds": round(report.seconds, 3),
        "restore_seconds_per_million_tokens": round(total / (stored / 1e6), 3),
        "history_trees_rebuild_seconds": round(history_only_seconds, 3),
        "history_trees_from_serialized_seconds": round(serialized_seconds, 3),
        "serialized_tree_bytes": sum(len(b) for b in serialized),
        "faster_history_tree_load": "serialized" if serialized_seconds < history_only_seconds else "rebuild",
        "loaded_trees": len(loaded),
    }


def bench_secondary(path: Path, work: Path, rng: np.random.Generator, rounds: int = 200) -> dict[str, Any]:
    """What the generator's proposer pays to follow the replica: an idle catch-up, and the time from a batch
    being applied to a secondary reader holding its tokens (apply + catch-up + reads; same machine)."""
    records = make_records(rng, "follow", 4_000, rounds * BATCH * 4_000)
    idle, fresh = [], []
    with HistoryStore(path) as store, HistoryStore.open_secondary(path, work / "secondary") as reader:
        for i in range(rounds):
            started = time.perf_counter()
            reader.catch_up()
            idle.append(time.perf_counter() - started)
            batch = records[i * BATCH : (i + 1) * BATCH]
            started = time.perf_counter()
            store.apply(batch)
            caught = reader.catch_up()
            got = [reader.get(*key) for key in caught.added]
            fresh.append(time.perf_counter() - started)
            if len(got) != len(batch) or any(t is None for t in got):
                raise RuntimeError("secondary reader missed records it should have caught up on")
    return {
        "catch_up_idle_us_p50": round(1e6 * float(np.percentile(idle, 50)), 1),
        "catch_up_idle_us_p99": round(1e6 * float(np.percentile(idle, 99)), 1),
        "apply_to_readable_ms_p50": round(1e3 * float(np.percentile(fresh, 50)), 3),
        "apply_to_readable_ms_p99": round(1e3 * float(np.percentile(fresh, 99)), 3),
        "batch_records": BATCH,
        "tokens_per_record": 4_000,
    }


def run(seed: int = 0, tokens_per_size: int = 4_000_000, startup_tokens: int = 1_000_000) -> dict[str, Any]:
    """Runs every measurement in a temporary folder (on the same disk as the system temp dir)."""
    rng = np.random.default_rng(seed)
    work = Path(tempfile.mkdtemp(prefix="das-bench-store-"))
    try:
        ingest, stored = bench_ingest(work / "ingest", rng, tokens_per_size)
        disk = bench_disk(work / "ingest", stored)
        checkpoint = bench_checkpoint(work / "ingest", work)
        startup = bench_startup(work / "startup", rng, startup_tokens, 4_000)
        secondary = bench_secondary(work / "follow", work, rng)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "benchmark": "store",
        "workload": {
            "vocab": VOCAB,
            "prompt_tokens": PROMPT_TOKENS,
            "samples_per_problem": SAMPLES_PER_PROBLEM,
            "batch": BATCH,
            "mutation": MUTATION,
            "tokens_per_size": tokens_per_size,
            "seed": seed,
        },
        "ingest": ingest,
        "disk": disk,
        "checkpoint": checkpoint,
        "startup": startup,
        "secondary": secondary,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
