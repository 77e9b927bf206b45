"""Pipeline benchmark on a real Kafka broker: producer processes -> topic -> durable RocksDB replica.

Measurements, each on a fresh topic that is deleted afterwards:
- throughput: producer processes (`das kafka load`) publish as fast as they can while a replica in this
  process applies to a HistoryStore; trajectories/s and MB/s from the first publication to the last
  record durable in RocksDB (wire bytes, before lz4);
- rebuild: a second, empty replica reads the whole topic afterwards: the replica's capacity alone, and how
  fast a new node catches up;
- freshness: producers publish at a fixed rate (rollouts finish at a steady pace in training); p50/p99/max
  seconds from `publish` to the record applied and draftable in the replica;
- encoding: wire bytes per token against JSON arrays, and decode + validation time per record of each.
All processes share this machine's cores with the broker, so the figures are a floor for a real node.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from history_store.durable.store import HistoryStore
from pipeline.consumer import KafkaTrajectorySource, ReplicaPublisher
from pipeline.errors import BusError
from pipeline.schemas import TrajectoryRecord
from pipeline.synthetic import SyntheticShape, synthetic_record
from pipeline.topics import admin_client, ensure_topics
from pipeline.wire import decode, encode_record, measure_encoding
from workers.replica.service import Indexer

REPO = Path(__file__).resolve().parents[2]


def _start_producers(
    servers: list[str], topic: str, workers: int, count: int, rate: float, shape: SyntheticShape
):
    per = count // workers
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workers.cli",
                "kafka",
                "load",
                "--bus",
                f"kafka://{','.join(servers)}",
                "--topic",
                topic,
                "--count",
                str(per),
                "--worker",
                str(w),
                "--rate",
                str(rate / workers),
                "--problems",
                str(shape.problems),
                "--epochs",
                str(shape.epochs),
                "--prompt-tokens",
                str(shape.prompt_tokens),
                "--response-tokens",
                str(shape.response_tokens_median),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
            text=True,
        )  # fmt: skip
        for w in range(workers)
    ]


def _rebuild(servers: list[str], topic: str, path: Path, total: int) -> float:
    """Seconds a new replica takes to rebuild an empty store from the full topic (replica capacity alone)."""
    with HistoryStore(path) as store:
        source = KafkaTrajectorySource(servers, topic=topic, group_id=f"{topic}.rebuild")
        publisher = ReplicaPublisher(servers, replica=f"{topic}.rebuild", dead_letter_topic=f"{topic}.dlq")
        indexer = Indexer(source, store, publisher=publisher, poll_timeout_s=0.05, publish_tombstones=False)
        indexer.start()
        started, consumed = time.perf_counter(), 0
        try:
            while consumed < total:
                report = indexer.step()
                consumed += report.messages - report.advances  # epoch advances are not records
            return time.perf_counter() - started
        finally:
            indexer.close()


def _ingest(
    servers: list[str], workers: int, count: int, rate: float, shape: SyntheticShape, rebuild: bool = False
) -> dict[str, Any]:
    """Runs producers and a replica on a fresh topic until every record is durable; returns raw figures."""
    topic = f"das.bench.{uuid.uuid4().hex[:8]}"
    ensure_topics(servers, topic=topic, dead_letter_topic=f"{topic}.dlq")
    total = (count // workers) * workers
    try:
        with (
            tempfile.TemporaryDirectory(prefix="das-bench-") as tmp,
            HistoryStore(Path(tmp) / "store") as store,
        ):
            source = KafkaTrajectorySource(servers, topic=topic, group_id=f"{topic}.replica")
            publisher = ReplicaPublisher(
                servers, replica=f"{topic}.replica", dead_letter_topic=f"{topic}.dlq"
            )
            indexer = Indexer(source, store, publisher=publisher, poll_timeout_s=0.05)
            indexer.start()
            producers = _start_producers(servers, topic, workers, count, rate, shape)
            freshness: list[float] = []
            first_published = last_applied = None
            consumed, deadline = 0, time.monotonic() + 600
            try:
                while consumed < total:
                    if time.monotonic() > deadline:
                        raise BusError(f"replica applied {consumed} of {total} records in 600 s")
                    failed = [p for p in producers if p.poll() not in (None, 0)]
                    if failed:
                        raise BusError(
                            f"producer failed: {failed[0].stderr.read() if failed[0].stderr else ''}"
                        )
                    report = indexer.step()
                    consumed += report.messages - report.advances  # epoch advances are not records
                    if report.freshness_s:
                        now = time.time()
                        last_applied = now
                        oldest = now - max(report.freshness_s)
                        first_published = oldest if first_published is None else min(first_published, oldest)
                        freshness.extend(report.freshness_s)
            finally:
                outputs = [p.communicate(timeout=60)[0] for p in producers]
                indexer.close()
            summaries = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
            rebuild_s = _rebuild(servers, topic, Path(tmp) / "rebuilt", total) if rebuild else None
            return {
                "rebuild_seconds": rebuild_s,
                "records": total,
                "seconds": (last_applied or 0) - (first_published or 0),
                "wire_bytes": sum(s["wire_bytes"] for s in summaries),
                "producer_records_per_s": round(sum(s["records_per_s"] for s in summaries), 1),
                "freshness": freshness,
            }
    finally:
        admin = admin_client(servers)
        try:
            admin.delete_topics([topic, f"{topic}.dlq"], timeout_ms=30_000)
        finally:
            admin.close()


def _encoding(shape: SyntheticShape, samples: int = 200) -> dict[str, Any]:
    """Wire against JSON arrays: bytes per token, and decode + validation time per record (the replica's
    `decode` for the wire; `json.loads` + `TrajectoryRecord.model_validate` for JSON)."""
    records = [synthetic_record(0, i, samples, shape) for i in range(samples)]
    sizes = [measure_encoding(r) for r in records]
    tokens = sum(len(r.prompt_ids) + len(r.response_ids) for r in records)
    values = [encode_record(r) for r in records]
    as_json = [r.model_dump_json(exclude_none=True) for r in records]
    started = time.perf_counter()
    for value in values:
        decode(value)
    wire_s = time.perf_counter() - started
    started = time.perf_counter()
    for text in as_json:
        TrajectoryRecord.model_validate(json.loads(text))
    json_s = time.perf_counter() - started
    return {
        "vocab": shape.vocab,
        "tokens_per_record": round(tokens / samples, 1),
        "wire_bytes_per_token": round(sum(s.wire_bytes for s in sizes) / tokens, 3),
        "json_bytes_per_token": round(sum(s.json_bytes for s in sizes) / tokens, 3),
        "wire_decode_validate_us_per_record": round(wire_s / samples * 1e6, 1),
        "json_decode_validate_us_per_record": round(json_s / samples * 1e6, 1),
    }


def run(
    servers: list[str],
    *,
    producers: int = 2,
    records: int = 4_000,
    freshness_rate: float = 200.0,
    freshness_seconds: float = 10.0,
    shape: SyntheticShape | None = None,
) -> dict[str, Any]:
    """All measurements; see the module docstring. Raises RuntimeError if a run does not complete."""
    shape = shape or SyntheticShape()
    throughput = _ingest(servers, producers, records, 0.0, shape, rebuild=True)
    fresh_records = max(producers, int(freshness_rate * freshness_seconds))
    steady = _ingest(servers, producers, fresh_records, freshness_rate, shape)
    freshness = np.asarray(steady["freshness"])
    seconds = max(throughput["seconds"], 1e-9)
    return {
        "broker": ",".join(servers),
        "producers": producers,
        "throughput": {
            "records": throughput["records"],
            "seconds": round(seconds, 3),
            "trajectories_per_s": round(throughput["records"] / seconds, 1),
            "mb_per_s": round(throughput["wire_bytes"] / seconds / 1e6, 2),
            "producer_records_per_s": throughput["producer_records_per_s"],
            "wire_mb": round(throughput["wire_bytes"] / 1e6, 2),
        },
        "rebuild": {
            "seconds": round(throughput["rebuild_seconds"], 3),
            "trajectories_per_s": round(throughput["records"] / throughput["rebuild_seconds"], 1),
            "mb_per_s": round(throughput["wire_bytes"] / throughput["rebuild_seconds"] / 1e6, 2),
        },
        "freshness": {
            "rate_per_s": freshness_rate,
            "records": len(freshness),
            "p50_s": round(float(np.percentile(freshness, 50)), 4),
            "p99_s": round(float(np.percentile(freshness, 99)), 4),
            "max_s": round(float(freshness.max()), 4),
        },
        "encoding": [_encoding(shape), _encoding(SyntheticShape(vocab=49_152))],
    }
