"""The replay's verifier cost models: what a decode step costs on the GPU the replay projects onto. No
numba here: `das bench replay`'s flags read these defaults when the CLI starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    """Verifier step cost in seconds: c_base + c_seq * active + c_tok * verified tokens."""

    c_base: float = 8e-3
    c_seq: float = 1e-4
    c_tok: float = 3.5e-5

    def step(self, active: int, verified: int) -> float:
        return self.c_base + self.c_seq * active + self.c_tok * verified


def cost_models(default: CostModel) -> dict[str, CostModel]:
    """The default model and the two that bracket it: memory-bound (verifying a token is nearly free) and
    compute-bound (tokens and sequences cost more)."""
    return {
        "default": default,
        "memory-bound": dataclasses.replace(default, c_tok=1e-5),
        "compute-bound": dataclasses.replace(default, c_tok=1e-4, c_seq=3e-4),
    }
