"""Response-length statistics of a problem's window: what the length-aware speculation budget reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class LengthStats:
    """Response lengths (tokens) of the records in a problem's window. Quantiles are nearest-rank."""

    count: int
    mean: float
    p50: int
    p90: int
    max: int
    min_epoch: int
    max_epoch: int

    @classmethod
    def from_window(cls, entries: np.ndarray) -> LengthStats | None:
        """Statistics of a WINDOW_ENTRY array; None for an empty window."""
        if len(entries) == 0:
            return None
        lengths = entries["response_len"].astype(np.int64)
        p50, p90 = np.percentile(lengths, [50, 90], method="inverted_cdf")
        return cls(
            count=int(lengths.size),
            mean=float(lengths.mean()),
            p50=int(p50),
            p90=int(p90),
            max=int(lengths.max()),
            min_epoch=int(entries["epoch"].min()),
            max_epoch=int(entries["epoch"].max()),
        )
