"""The one catalog of DAS metrics. Every part imports its metrics from here and never creates its own.

Conventions (Prometheus client practice): names start with `das_`, carry base units (`_seconds`, `_bytes`),
counters end in `_total`, latencies are histograms (quantiles come from `histogram_quantile` in PromQL, since
the Python `Summary` exports none), and every label has a small fixed set of values: never a problem, request or
record id.

Multi-process workers (vLLM spawns its workers; the proposer runs inside them) must set
`PROMETHEUS_MULTIPROC_DIR` before anything imports `prometheus_client`; `monitoring.server` then aggregates all
processes' values. Each gauge therefore declares how processes combine (`multiprocess_mode`).

Usage::

    from monitoring.metrics import RECORDS_INGESTED, FRESHNESS, SPEC_BUDGET
    RECORDS_INGESTED.inc(len(batch))
    FRESHNESS.observe(now - record_published_at)
    SPEC_BUDGET.labels(length_class="long").observe(budget)
"""

from __future__ import annotations

import math

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from monitoring.server import multiprocess_dir

# Fixed label values. Parts must use these; `position_label` bounds the draft position.
LENGTH_CLASSES = ("short", "medium", "long")
COST_COEFFICIENTS = ("c_base", "c_seq", "c_tok")
# Why a message was dead-lettered (pipeline.wire.REASONS; a test keeps the two equal) and why a stored record was
# quarantined (history_store's CorruptRecordError codes, "window" for a corrupt epoch window).
DEAD_LETTER_REASONS = (
    "encoding",
    "truncated",
    "schema_version",
    "invalid",
    "oversize",
    "key_mismatch",
    "stale",
    "sample_range",
    "epoch_range",
    "logprobs",
    "partition",
    "duplicate",
    "control",
)
QUARANTINE_REASONS = ("checksum", "header", "size", "window")
# Positions past this share one label value ("16+"): drafts rarely go deeper, and 17 series per metric is the
# most a dashboard panel can show legibly.
MAX_POSITION_LABEL = 16


def position_label(index: int) -> str:
    """The `position` label value of the draft token at 0-based `index`: "0".."15", then "16+"."""
    if index < 0:
        raise ValueError(f"draft position must be >= 0, got {index}")
    return str(index) if index < MAX_POSITION_LABEL else f"{MAX_POSITION_LABEL}+"


# Bucket sets. Each covers the range that matters for its alerts and dashboard panels.
# Drafting targets microseconds per request and low milliseconds per batch step.
_DRAFT_LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
# A verification step of a 7B model on one GPU takes tens of ms; on the CPU test model up to a second.
_STEP_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# Rollout requests run from under a second to an hour in the long tail; the tail is what the dashboard watches.
_REQUEST_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)
# Budgets are draft token counts per request per step (0 = no speculation).
_BUDGET_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)
# Freshness target is p99 under one second; buckets resolve around that bound and show backlogs up to minutes.
_FRESHNESS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# Checkpoints are hard-link snapshots: tens of ms for hundreds of MB, seconds when the disk is slow.
_CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Verifying reads the whole store: about a second per few hundred MB here, minutes for tens of GB.
_VERIFY_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)

# ---------------------------------------------------------------- generator (proposer, budget, rollout worker)
DRAFTS = Counter("das_drafts_total", "Drafts proposed (one per request per verification step with a draft).")
DRAFT_TOKENS = Counter("das_draft_tokens_total", "Draft tokens proposed for verification.")
ACCEPTED_TOKENS = Counter("das_accepted_tokens_total", "Draft tokens accepted by the verifier.")
VERIFIED_DRAFT_TOKENS = Counter(
    "das_verified_draft_tokens_total",
    "Draft tokens the verifier tried: those proposed less what vLLM's scheduler cut (its token budget, "
    "max_tokens) and drafts of requests that left first. Acceptance = accepted / this.",
)
DRAFT_TOKENS_BY_POSITION = Counter(
    "das_draft_position_tokens_total",
    "Draft tokens proposed, by 0-based position in the draft (see position_label).",
    ["position"],
)
ACCEPTED_TOKENS_BY_POSITION = Counter(
    "das_accepted_position_tokens_total",
    "Draft tokens accepted, by 0-based position in the draft (see position_label).",
    ["position"],
)
DRAFT_LATENCY = Histogram(
    "das_draft_duration_seconds",
    "Time to draft for one whole decode batch (one propose call).",
    buckets=_DRAFT_LATENCY_BUCKETS,
)
STEP_DURATION = Histogram(
    "das_step_duration_seconds",
    "Measured time of one verification (decode) step, drafting included.",
    buckets=_STEP_BUCKETS,
)
SPEC_BUDGET = Histogram(
    "das_speculation_budget_tokens",
    "Draft budget granted to a request for one step, by its predicted length class.",
    ["length_class"],
    buckets=_BUDGET_BUCKETS,
)
CLASS_PROMOTIONS = Counter(
    "das_length_class_promotions_total",
    "Requests that outlived their predicted length and were promoted, by the class promoted to.",
    ["length_class"],
)
COST_MODEL_COEFFICIENT = Gauge(
    "das_cost_model_coefficient_seconds",
    "Fitted verifier cost model: step time = c_base + c_seq * active requests + c_tok * tokens verified.",
    ["coefficient"],
    multiprocess_mode="livemostrecent",
)
PROPOSER_HISTORY_BACKLOG = Gauge(
    "das_proposer_history_backlog_tokens",
    "Tokens of history a drafting server has read from its replica but not yet taken into its trees (the work "
    "waiting for the room between decode steps).",
    multiprocess_mode="max",
)
REQUEST_DURATION = Histogram(
    "das_request_duration_seconds",
    "Wall time of one rollout request, from submission to its last token.",
    buckets=_REQUEST_BUCKETS,
)
REQUEST_DURATION_MAX = Gauge(
    "das_request_duration_max_seconds",
    "Longest rollout request of the current epoch so far (histograms cannot give the maximum).",
    multiprocess_mode="max",
)
EPOCH_MAKESPAN = Gauge(
    "das_epoch_makespan_seconds",
    "Makespan of the last finished rollout epoch: first submission to last request finished.",
    multiprocess_mode="max",
)
EPOCH = Gauge("das_rollout_epoch", "Index of the last finished rollout epoch.", multiprocess_mode="max")

# ---------------------------------------------------------------- pipeline (producers, bus, dead letters)
RECORDS_PUBLISHED = Counter(
    "das_records_published_total", "Trajectory records handed to the bus by producers."
)
PRODUCER_QUEUE_DEPTH = Gauge(
    "das_producer_queue_records",
    "Records buffered in the producer, not yet acknowledged by the brokers.",
    multiprocess_mode="livesum",
)
PRODUCER_SEND_ERRORS = Counter(
    "das_producer_send_errors_total", "Sends that failed after the producer's own retries."
)
DEAD_LETTERED = Counter(
    "das_dead_lettered_records_total",
    "Records sent to the dead-letter topic, by reason (a short fixed code, never record content).",
    ["reason"],
)
UNDELIVERED_DEAD_LETTERS = Counter(
    "das_undelivered_dead_letters_total",
    "Rejected messages whose dead letter the dead-letter topic refused for good: skipped, their coordinates kept "
    "in the store (das history stats).",
)
QUARANTINED = Counter(
    "das_quarantined_records_total",
    "Stored records found corrupt and skipped (quarantined) by the history store, by reason (fixed code).",
    ["reason"],
)

# ---------------------------------------------------------------- indexer (history replica, store)
RECORDS_INGESTED = Counter("das_records_ingested_total", "Trajectory records applied to the history store.")
BYTES_INGESTED = Counter(
    "das_ingested_bytes_total", "Bytes of trajectory records applied to the history store."
)
CONSUMER_UP = Gauge(
    "das_consumer_up",
    "1 while the history replica reaches its brokers, 0 while it waits out an outage (its store is kept).",
    multiprocess_mode="livemin",
)
STALE_RECORDS = Counter(
    "das_stale_records_total",
    "Records not stored because their epoch was already below their problem's window (late or replayed).",
)
CONSUMER_LAG = Gauge(
    "das_consumer_lag_records",
    "Records on the topic not yet applied by this replica, summed over partitions.",
    multiprocess_mode="livesum",
)
FRESHNESS = Histogram(
    "das_freshness_seconds",
    "Time from a record's publication to it being draftable in the replica.",
    buckets=_FRESHNESS_BUCKETS,
)
STORE_SIZE = Gauge(
    "das_store_size_bytes", "Size of the history store on disk (RocksDB).", multiprocess_mode="livemax"
)
STORE_TOKENS = Gauge(
    "das_store_tokens", "Response tokens held in the history (suffix trees).", multiprocess_mode="livemax"
)
EVICTIONS = Counter("das_evictions_total", "Trajectories evicted from the history (epoch window).")
STORE_APPLY_DURATION = Histogram(
    "das_store_apply_duration_seconds",
    "Time to apply one batch of records (one RocksDB WriteBatch) to the history store.",
    buckets=_STEP_BUCKETS,
)
STORE_WRITE_ERRORS = Counter(
    "das_store_write_errors_total", "History store writes that failed (disk full, read-only, I/O error)."
)
CHECKPOINT_DURATION = Histogram(
    "das_checkpoint_duration_seconds", "Time to write one store checkpoint.", buckets=_CHECKPOINT_BUCKETS
)
LAST_CHECKPOINT = Gauge(
    "das_last_checkpoint_timestamp_seconds",
    "Unix time of the last successful checkpoint (alert on its age); NaN until the first one.",
    multiprocess_mode="max",
)
# Not 0: a replica that has not checkpointed yet would look 56 years stale (DASCheckpointStale at every start).
# Only in single-process mode, where the history replica (the process that checkpoints) runs: the multi-process
# collector's `max` keeps the first value it reads, so a NaN from one process would hide another's timestamp.
if multiprocess_dir() is None:
    LAST_CHECKPOINT.set(math.nan)
STORE_DAMAGED = Gauge(
    "das_store_damaged",
    "1 when the last verification of the history store (at start, then every --verify-every seconds) found a "
    "file or block that fails its checksum: the replica is rebuilding it from the topic.",
    multiprocess_mode="livemax",
)
STORE_VERIFY_DURATION = Histogram(
    "das_store_verify_duration_seconds",
    "Time to verify every file and checksum of the history store.",
    buckets=_VERIFY_BUCKETS,
)
LAST_VERIFY = Gauge(
    "das_store_last_verify_timestamp_seconds",
    "Unix time of the last completed verification of the history store; NaN until the first one.",
    multiprocess_mode="max",
)
if multiprocess_dir() is None:  # as LAST_CHECKPOINT
    LAST_VERIFY.set(math.nan)
RESTORE_DURATION = Gauge(
    "das_restore_duration_seconds",
    "Time the last start took to restore the store and trees (from RocksDB or by replaying the topic).",
    multiprocess_mode="max",
)

PROPOSER_HISTORY_MISSING = Gauge(
    "das_proposer_history_missing",
    "1 while a vLLM server's proposer configured with DAS_HISTORY_DIR drafts without its history replica (the "
    "folder is missing, empty or does not open): it drafts from its own requests and retries the replica.",
    multiprocess_mode="livemax",
)
PROPOSER_HISTORY_OUTAGES = Counter(
    "das_proposer_history_outages",
    "Times a proposer found its history replica unavailable (at start, or when following it failed).",
)

CATALOG: tuple[MetricWrapperBase, ...] = (
    DRAFTS,
    DRAFT_TOKENS,
    ACCEPTED_TOKENS,
    VERIFIED_DRAFT_TOKENS,
    DRAFT_TOKENS_BY_POSITION,
    ACCEPTED_TOKENS_BY_POSITION,
    DRAFT_LATENCY,
    STEP_DURATION,
    SPEC_BUDGET,
    CLASS_PROMOTIONS,
    COST_MODEL_COEFFICIENT,
    PROPOSER_HISTORY_BACKLOG,
    REQUEST_DURATION,
    REQUEST_DURATION_MAX,
    EPOCH_MAKESPAN,
    EPOCH,
    RECORDS_PUBLISHED,
    PRODUCER_QUEUE_DEPTH,
    PRODUCER_SEND_ERRORS,
    DEAD_LETTERED,
    UNDELIVERED_DEAD_LETTERS,
    QUARANTINED,
    RECORDS_INGESTED,
    BYTES_INGESTED,
    CONSUMER_UP,
    STALE_RECORDS,
    CONSUMER_LAG,
    FRESHNESS,
    STORE_SIZE,
    STORE_TOKENS,
    EVICTIONS,
    STORE_APPLY_DURATION,
    STORE_WRITE_ERRORS,
    CHECKPOINT_DURATION,
    LAST_CHECKPOINT,
    STORE_DAMAGED,
    STORE_VERIFY_DURATION,
    LAST_VERIFY,
    RESTORE_DURATION,
    PROPOSER_HISTORY_MISSING,
    PROPOSER_HISTORY_OUTAGES,
)

# Series with fixed label sets exist from the start at 0: dashboards show 0 instead of "no data", and the first
# increment is a visible increase (a series born at 1 looks to `increase()` like no change, so a first burst of
# dead letters would never alert).
for _cls in LENGTH_CLASSES:
    SPEC_BUDGET.labels(length_class=_cls)
    CLASS_PROMOTIONS.labels(length_class=_cls)
for _reason in DEAD_LETTER_REASONS:
    DEAD_LETTERED.labels(reason=_reason)
for _reason in QUARANTINE_REASONS:
    QUARANTINED.labels(reason=_reason)


def exported_series(metric: MetricWrapperBase) -> dict[str, str]:
    """Series names a metric exports, mapped to its type: counters `<name>_total`, histograms `_bucket`,
    `_sum`, `_count`, gauges the bare name. Tests use it to check dashboards and alert rules."""
    name, kind = metric._name, metric._type
    if kind == "counter":
        return {f"{name}_total": kind}
    if kind == "histogram":
        return {f"{name}{suffix}": kind for suffix in ("_bucket", "_sum", "_count")}
    return {name: kind}


def catalog_series() -> dict[str, str]:
    """Every series name the catalog exports, mapped to its metric type."""
    series: dict[str, str] = {}
    for metric in CATALOG:
        series.update(exported_series(metric))
    return series
