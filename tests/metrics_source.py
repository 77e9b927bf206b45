"""A multi-process DAS metrics workload for the monitoring tests, run as a script (never imported by pytest).

It works the way a rollout worker does: `PROMETHEUS_MULTIPROC_DIR` is set before `prometheus_client` is
imported, child processes (like vLLM's workers) record through the catalog, and the parent serves the merged
values with `monitoring.server`. One child plays a generator, the other an indexer, so every catalog metric
carries samples.

    python tests/metrics_source.py serve PORT MULTIPROC_DIR   # record continuously, serve /metrics on PORT
    python tests/metrics_source.py dump MULTIPROC_DIR         # fixed workload, print the merged exposition
"""

from __future__ import annotations

import multiprocessing
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from monitoring.multiproc import prepare_multiprocess_dir  # noqa: E402

if __name__ == "__main__":
    # The catalog must see the folder at import time. Only the launcher prepares (empties) it: spawned children
    # re-import this file as `__mp_main__` and inherit PROMETHEUS_MULTIPROC_DIR.
    prepare_multiprocess_dir(sys.argv[-1])

from prometheus_client import generate_latest  # noqa: E402

from monitoring import metrics as m  # noqa: E402
from monitoring.server import mark_process_dead, metrics_registry, start_metrics_server  # noqa: E402

# The fixed workload of `dump`: each child records this many generator steps (DRAFTS_PER_STEP drafts each) or
# indexer batches, so the test can compute the merged totals.
DUMP_STEPS = 10
DRAFTS_PER_STEP = 4


def record_generator_step(rng: random.Random, epoch: int) -> None:
    """One verification step of a generator: a few drafts, their acceptance, budget and timings."""
    for _ in range(DRAFTS_PER_STEP):
        length = rng.randint(1, 8)
        verified = length if rng.random() < 0.8 else rng.randint(0, length)  # the scheduler cut the rest
        accepted = rng.randint(0, verified)
        m.DRAFTS.inc()
        m.DRAFT_TOKENS.inc(length)
        m.VERIFIED_DRAFT_TOKENS.inc(verified)
        m.ACCEPTED_TOKENS.inc(accepted)
        for position in range(length):
            m.DRAFT_TOKENS_BY_POSITION.labels(position=m.position_label(position)).inc()
            if position < accepted:
                m.ACCEPTED_TOKENS_BY_POSITION.labels(position=m.position_label(position)).inc()
        length_class = rng.choice(m.LENGTH_CLASSES)
        m.SPEC_BUDGET.labels(length_class=length_class).observe(0 if length_class == "short" else length)
    m.DRAFT_LATENCY.observe(rng.uniform(2e-5, 5e-4))
    m.STEP_DURATION.observe(rng.uniform(0.02, 0.2))
    if rng.random() < 0.1:
        m.CLASS_PROMOTIONS.labels(length_class="long").inc()
    for name, value in zip(m.COST_COEFFICIENTS, (0.015, 2e-4, 3e-5), strict=True):
        m.COST_MODEL_COEFFICIENT.labels(coefficient=name).set(value)
    duration = rng.lognormvariate(2.0, 1.0)
    m.REQUEST_DURATION.observe(duration)
    m.REQUEST_DURATION_MAX.set(max(duration, 30.0))
    m.EPOCH_MAKESPAN.set(120.0)
    m.EPOCH.set(epoch)
    m.RECORDS_PUBLISHED.inc()
    m.PRODUCER_QUEUE_DEPTH.set(rng.randint(0, 20))
    if rng.random() < 0.05:
        m.PRODUCER_SEND_ERRORS.inc()
    m.PROPOSER_HISTORY_MISSING.set(0)
    m.PROPOSER_HISTORY_OUTAGES.inc(0)  # a server that found its replica at start
    m.PROPOSER_HISTORY_BACKLOG.set(0)  # and has taken in all of it


def record_indexer_batch(rng: random.Random, stored_tokens: int) -> None:
    """One applied batch of an indexer: records, bytes, freshness, store state, dead letters, checkpoints."""
    records = rng.randint(1, 10)
    m.RECORDS_INGESTED.inc(records)
    m.BYTES_INGESTED.inc(records * 4096)
    for _ in range(records):
        m.FRESHNESS.observe(rng.uniform(0.005, 0.8))
    m.CONSUMER_LAG.set(rng.randint(0, 100))
    m.STORE_SIZE.set(50_000_000 + rng.randint(0, 1_000_000))
    m.STORE_TOKENS.set(stored_tokens)
    m.EVICTIONS.inc(rng.randint(0, 2))
    m.STORE_APPLY_DURATION.observe(rng.uniform(0.002, 0.05))
    if rng.random() < 0.02:
        m.STORE_WRITE_ERRORS.inc()
    m.DEAD_LETTERED.labels(reason="invalid").inc()
    m.QUARANTINED.labels(reason="checksum").inc()
    m.CHECKPOINT_DURATION.observe(rng.uniform(0.02, 0.3))
    m.LAST_CHECKPOINT.set(time.time())
    m.RESTORE_DURATION.set(1.5)
    m.STORE_DAMAGED.set(0)
    m.STORE_VERIFY_DURATION.observe(rng.uniform(0.5, 5.0))
    m.LAST_VERIFY.set(time.time())
    if rng.random() < 0.02:
        m.UNDELIVERED_DEAD_LETTERS.inc()


def run_child(role: str, seed: int, steps: int | None) -> None:
    """Records `steps` generator steps or indexer batches (forever when None, pausing between them).
    An indexer child holds 1000 x (seed + 1) stored tokens, so tests can tell the children's gauges apart."""
    rng = random.Random(seed)
    done = 0
    while steps is None or done < steps:
        if role == "generator":
            record_generator_step(rng, epoch=done // 50)
        else:
            record_indexer_batch(rng, stored_tokens=1000 * (seed + 1))
        done += 1
        if steps is None:
            time.sleep(0.05)


def serve(port: int) -> None:
    """Serves the merged metrics of two recording children until stdin closes (the test ends it)."""
    context = multiprocessing.get_context("spawn")
    children = [
        context.Process(target=run_child, args=(role, seed, None), daemon=True)
        for seed, role in enumerate(("generator", "indexer"))
    ]
    for child in children:
        child.start()
    server, _thread = start_metrics_server(port)
    print(f"ready {server.server_port}", flush=True)
    sys.stdin.read()
    for child in children:
        child.terminate()
        child.join()
        mark_process_dead(child.pid)
    server.shutdown()


def dump() -> None:
    """Runs two generator and two indexer children (seeds 0-3) to completion, then prints the merged exposition,
    a line `---`, and the exposition after the last indexer (seed 3) is marked dead."""
    context = multiprocessing.get_context("spawn")
    roles = ("generator", "generator", "indexer", "indexer")
    children = [
        context.Process(target=run_child, args=(role, seed, DUMP_STEPS)) for seed, role in enumerate(roles)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"child {child.pid} failed with exit code {child.exitcode}")
    sys.stdout.write(generate_latest(metrics_registry()).decode())
    mark_process_dead(children[3].pid)
    sys.stdout.write("---\n")
    sys.stdout.write(generate_latest(metrics_registry()).decode())


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    elif sys.argv[1] == "dump":
        dump()
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}: use serve or dump")
