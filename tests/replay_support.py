"""Shared by the replay tests: small random workloads."""

from __future__ import annotations

import numpy as np

from pipeline.schemas import TrajectoryRecord


def random_records(seed: int, prompt_ids: list[int]) -> list[TrajectoryRecord]:
    """Two epochs of nine requests over three problems, each response 5 to 59 random tokens (seeded)."""
    rng = np.random.default_rng(seed)
    return [
        TrajectoryRecord(
            problem_id=f"p{i % 3}",
            epoch=e,
            sample=i,
            prompt_ids=prompt_ids,
            response_ids=rng.integers(10, 40, int(rng.integers(5, 60))).tolist(),
        )
        for e in range(2)
        for i in range(9)
    ]
