"""Which problem, epoch and sample a verl rollout request is: the part of the verl hooks that needs no verl.

verl's batch knows the problem (`index`, from the dataset's `extra_info.index`) and the training step
(`meta_info["global_steps"]`); the agent loop sees only the per-row fields. DAS needs a stable problem id, an
epoch that grows by one each time the problem is rolled out again (the history window counts epochs), and a
sample number unique within the problem and epoch (the history key).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.schemas import TrajectoryRecord

EPOCH_FIELD = "das_epoch"
SAMPLE_FIELD = "das_sample"
V1_SESSION_FIELD = "session_id"
STEPS_PER_EPOCH_ENV = "DAS_STEPS_PER_EPOCH"
# Marks rows that must not enter the history: validation rollouts, greedy baselines (REMAX).
NOT_HISTORY = -1


def steps_per_epoch(das_config: Mapping[str, Any] | None = None) -> int:
    """Training steps per pass over the data: `das.steps_per_epoch` in the trainer config, else the
    DAS_STEPS_PER_EPOCH variable, else 1 (each step is an epoch: right when every step samples every problem).

    Raises:
        ValueError: the value is not a positive integer.
    """
    raw = das_config.get("steps_per_epoch") if das_config else None
    if raw is None:
        raw = os.environ.get(STEPS_PER_EPOCH_ENV, "1")
    try:
        value = int(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"das.steps_per_epoch / {STEPS_PER_EPOCH_ENV} must be an integer, got {raw!r}"
        ) from exc
    if value < 1:
        raise ValueError(f"das.steps_per_epoch / {STEPS_PER_EPOCH_ENV} must be >= 1, got {value}")
    return value


def rollout_epoch(global_step: Any, validate: bool, per_epoch: int) -> int:
    """The DAS epoch of a training step's rollouts: (step - 1) // per_epoch (verl counts steps from 1), or
    NOT_HISTORY for validation and batches without a step."""
    if validate or global_step is None or int(global_step) < 1:
        return NOT_HISTORY
    return (int(global_step) - 1) // per_epoch


def rollout_identity(
    index: Sequence[Any] | None,
    global_step: int | None,
    validate: bool,
    per_epoch: int,
    do_sample: Sequence[Any] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(epoch, sample) per batch row. verl's global steps start at 1, so epoch = (step - 1) // per_epoch.

    Samples count the rows of each problem in batch order (verl repeats each prompt n times); rows that must
    not enter the history (validation, greedy baselines, no step or index) get NOT_HISTORY in both.
    """
    n = len(index) if index is not None else 0
    epochs = np.full(n, NOT_HISTORY, dtype=np.int64)
    samples = np.full(n, NOT_HISTORY, dtype=np.int64)
    epoch = rollout_epoch(global_step, validate, per_epoch)
    if epoch == NOT_HISTORY or index is None:
        return epochs, samples
    seen: Counter[str] = Counter()
    for row, problem in enumerate(index):
        if do_sample is not None and not bool(do_sample[row]):
            continue
        key = str(problem)
        epochs[row] = epoch
        samples[row] = seen[key]
        seen[key] += 1
    return epochs, samples


@dataclass(frozen=True)
class RequestIdentity:
    """What one agent loop request carries to the proposer, built from the agent loop's keyword arguments."""

    problem_id: str | None
    epoch: int | None
    sample: int | None

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> RequestIdentity:
        """From verl's per-row fields: `index` (problem) and `das_epoch` (our managers); the sample is
        `das_sample` (legacy trainer: DasAgentLoopManager numbers the repeated rows) or verl's own `session_id`
        (V1 trainer: the worker runs a prompt's n samples as sessions 0..n-1)."""
        index = kwargs.get("index")
        problem_id = None if index is None else str(index.item() if hasattr(index, "item") else index)
        epoch = kwargs.get(EPOCH_FIELD)
        sample = kwargs.get(SAMPLE_FIELD, kwargs.get(V1_SESSION_FIELD))
        if epoch is None or sample is None or int(epoch) < 0 or int(sample) < 0:
            return cls(problem_id or None, None, None)
        return cls(problem_id or None, int(epoch), int(sample))

    @property
    def in_history(self) -> bool:
        """True when the finished trajectory belongs in the history (a training rollout with its key)."""
        return self.problem_id is not None and self.epoch is not None and self.sample is not None

    def extra_args(self) -> dict[str, Any]:
        """`SamplingParams.extra_args` entries for the DAS proposer (empty without a problem id)."""
        if self.problem_id is None:
            return {}
        out: dict[str, Any] = {"das_problem_id": self.problem_id}
        if self.in_history:
            out["das_epoch"], out["das_sample"] = self.epoch, self.sample
        return out

    def record(self, prompt_ids: Sequence[int], response_ids: Sequence[int], worker: str) -> TrajectoryRecord:
        """The finished trajectory as a bus record.

        Raises:
            ValueError: the request is not a history rollout (see `in_history`).
        """
        if not self.in_history:
            raise ValueError(f"{self} is not a training rollout with a problem, epoch and sample")
        return TrajectoryRecord(
            problem_id=self.problem_id,
            epoch=self.epoch,
            sample=self.sample,
            prompt_ids=[int(t) for t in prompt_ids],
            response_ids=[int(t) for t in response_ids],
            worker=worker,
        )


def with_extra_args(sampling_params: Mapping[str, Any], identity: RequestIdentity) -> dict[str, Any]:
    """A copy of verl's sampling parameters whose `extra_args` also carry the request's DAS identity (entries
    already there, such as verl's `kv_transfer_params`, are kept)."""
    params = dict(sampling_params)
    extra = identity.extra_args()
    if extra:
        params["extra_args"] = {**(params.get("extra_args") or {}), **extra}
    return params
