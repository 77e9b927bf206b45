"""Synthetic trajectory records for load generation, benchmarks and pipeline tests.

Each record is a pure function of (seed, worker, index), so a test can regenerate exactly what a publisher
process sent and compare stores against it. Keys never collide across workers: sample = worker * 10**6 + i.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pipeline.errors import InvalidInput
from pipeline.schemas import TrajectoryRecord

SAMPLES_PER_WORKER = 10**6
POOL_TOKENS = 1 << 20


@dataclass(frozen=True, slots=True)
class SyntheticShape:
    """Size and spread of synthetic rollouts. Defaults resemble math RL rollouts of a 150k-vocabulary model:
    short prompts, responses of a few hundred to a few thousand tokens (log-normal, long tail)."""

    problems: int = 64
    epochs: int = 3
    prompt_tokens: int = 200
    response_tokens_median: int = 1000
    response_tokens_max: int = 8000
    vocab: int = 151_000


@functools.lru_cache(maxsize=4)
def _token_pool(seed: int, vocab: int) -> np.ndarray:
    """One million random token ids; records are slices of it at random offsets (cheap to cut, and a load
    generator that drew every token afresh would measure itself instead of the pipeline)."""
    return np.random.default_rng([seed, vocab]).integers(0, vocab, POOL_TOKENS)


def synthetic_record(
    worker: int, index: int, count: int, shape: SyntheticShape, seed: int = 0
) -> TrajectoryRecord:
    """Record `index` of `count` from one worker; epochs advance with the index, as in training.

    Built without per-token validation (`model_construct`): every field is valid by construction.
    """
    rng = np.random.Generator(np.random.PCG64([seed, worker, index]))
    response_len = int(
        min(shape.response_tokens_max, rng.lognormal(np.log(shape.response_tokens_median), 0.6))
    )
    response_len = max(1, min(response_len, POOL_TOKENS // 2))
    prompt_len = max(1, int(rng.integers(shape.prompt_tokens // 2, shape.prompt_tokens * 3 // 2 + 1)))
    pool = _token_pool(seed, shape.vocab)
    prompt_at, response_at = rng.integers(0, POOL_TOKENS - POOL_TOKENS // 2, 2)
    return TrajectoryRecord.model_construct(
        problem_id=f"problem-{index % shape.problems}",
        epoch=min(shape.epochs - 1, index * shape.epochs // max(1, count)),
        sample=worker * SAMPLES_PER_WORKER + index,
        prompt_ids=pool[prompt_at : prompt_at + prompt_len].tolist(),
        response_ids=pool[response_at : response_at + response_len].tolist(),
        finish_reason="stop",
        worker=f"synthetic-{worker}",
    )


def synthetic_records(
    worker: int, count: int, shape: SyntheticShape = SyntheticShape(), seed: int = 0
) -> Iterator[TrajectoryRecord]:
    """`count` records of one worker, in publication order."""
    if not 0 <= worker < 1000 or count > SAMPLES_PER_WORKER:
        raise InvalidInput(f"worker must be in 0..999 and count at most {SAMPLES_PER_WORKER}")
    for index in range(count):
        yield synthetic_record(worker, index, count, shape, seed)
