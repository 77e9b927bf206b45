"""The trajectory record: one finished rollout. Used by the bus, the indexer and the trace files alike."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1
# Token ids are non-negative and below 2**31 (int32 arrays on the drafting path).
MAX_TOKEN_ID = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID, strict=True)]
# Epochs and samples are stored as u32 in the history store's keys; a larger value could never be stored.
MAX_EPOCH = 2**32 - 1


class TrajectoryRecord(BaseModel):
    """A finished rollout of one problem. Trace files need only the first five fields."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    problem_id: Annotated[str, Field(min_length=1, max_length=512)]
    epoch: Annotated[int, Field(ge=0, le=MAX_EPOCH, strict=True)]
    sample: Annotated[int, Field(ge=0, le=MAX_EPOCH, strict=True)]
    prompt_ids: list[TokenId]
    response_ids: list[TokenId]
    response_logprobs: list[float] | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    policy_version: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None
    schema_version: Literal[1] = SCHEMA_VERSION

    @property
    def key(self) -> tuple[str, int, int]:
        """Identity of a record: applying the same key twice must change nothing."""
        return (self.problem_id, self.epoch, self.sample)
