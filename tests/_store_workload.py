"""Deterministic trajectory workloads for the history store tests and the crash child process.

Every record's response tokens are unique to it (token = record number * 1000 + position), so a draft token
names the record it came from: the eviction tests use that to prove evicted records are never drafted.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

# The crash test runs this file as a child process from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.schemas import TrajectoryRecord  # noqa: E402

PROMPT_BASE = 900_000_000
TOKENS_PER_RECORD = 1000


@dataclass(frozen=True)
class Workload:
    problems: int
    epochs: int
    samples: int
    min_len: int = 20
    max_len: int = 200

    def record_number(self, problem: int, epoch: int, sample: int) -> int:
        return (epoch * self.problems + problem) * self.samples + sample

    def record(self, problem: int, epoch: int, sample: int) -> TrajectoryRecord:
        n = self.record_number(problem, epoch, sample)
        length = self.min_len + (n * 7919) % (self.max_len - self.min_len + 1)
        return TrajectoryRecord(
            problem_id=f"problem-{problem}",
            epoch=epoch,
            sample=sample,
            prompt_ids=[PROMPT_BASE + problem * 100 + i for i in range(12)],
            response_ids=[n * TOKENS_PER_RECORD + i for i in range(length)],
        )

    def stream(self) -> list[TrajectoryRecord]:
        """All records in bus order: epoch by epoch, problems interleaved within an epoch."""
        return [
            self.record(p, e, s)
            for e in range(self.epochs)
            for s in range(self.samples)
            for p in range(self.problems)
        ]


def owner_of(token: int, workload: Workload) -> tuple[int, int, int] | None:
    """(problem, epoch, sample) whose response holds `token`, or None for a prompt token."""
    if token >= PROMPT_BASE:
        return None
    n = token // TOKENS_PER_RECORD
    sample = n % workload.samples
    problem = (n // workload.samples) % workload.problems
    epoch = n // (workload.samples * workload.problems)
    return problem, epoch, sample


CRASH_WORKLOAD = Workload(problems=25, epochs=8, samples=16)  # 3,200 records
CRASH_WINDOW = 3
CRASH_TOPIC = "das.trajectories"
CRASH_BATCH = 16


CRASH_REWIND = 40  # records re-delivered after each restart, as a consumer whose bus commit lagged would
CRASH_CHECKPOINT_EVERY_S = 0.5


def _ingest(path: str, checkpoints: str) -> None:
    """Child process: resumes a little before the stored offset (at-least-once re-delivery), applies the
    stream in batches with automatic checkpoints, and prints "ack <next offset>" after each durable batch
    (the parent kills it at random points)."""
    from history_store.indexed_history import IndexedHistory

    stream = CRASH_WORKLOAD.stream()
    with IndexedHistory.open(
        path,
        window_epochs=CRASH_WINDOW,
        checkpoint_dir=checkpoints,
        checkpoint_every_s=CRASH_CHECKPOINT_EVERY_S,
    ) as history:
        stored = history.store.offsets().get((CRASH_TOPIC, 0), 0)
        print(f"start {stored}", flush=True)
        offset = max(0, stored - CRASH_REWIND)
        while offset < len(stream):
            batch = stream[offset : offset + CRASH_BATCH]
            history.apply(batch, {(CRASH_TOPIC, 0): offset + len(batch)})
            offset += len(batch)
            print(f"ack {offset}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    _ingest(sys.argv[1], sys.argv[2])
