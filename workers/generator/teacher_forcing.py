"""The target model teacher-forced over recorded trajectories: its logits at chosen positions of prompt +
response, for `das bench ceiling` (the probability of each drafted token) and `das traces annotate` (the log
probability each response token was sampled with).

It runs the checkpoint with transformers in float32, the dtype the CPU engine samples in, so its values match
the engine's to float rounding (or, asked for, under bfloat16 autocast: about 2.5x faster on CPUs with AMX, at
about 0.04 nats of error per token); the vocabulary head runs only at the positions asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.schemas import TrajectoryRecord
from workers.errors import InvalidInput

# Sequences per forward: long enough batches keep the matrix products efficient, short enough that a batch of
# 2k-token sequences stays a few hundred MB of activations.
FORWARD_BATCH = 8


class TeacherForcedModel:
    """A causal language model checkpoint loaded for teacher-forced scoring."""

    def __init__(self, model_dir: Path, bfloat16: bool = False) -> None:
        """bfloat16: run the forward under bfloat16 autocast (the weights stay float32)."""
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self._bfloat16 = bfloat16

    def logits(
        self, records: Sequence[TrajectoryRecord], rows: Callable[[TrajectoryRecord], Sequence[int]]
    ) -> Iterator[tuple[int, Any]]:
        """For each record, its index in `records` and the model's logits (a float32 tensor, one row per
        index) at the sequence indices `rows(record)` of prompt + response. Index i holds the prediction of
        sequence token i + 1. Records come shortest first, so a batch pads little."""
        torch = self._torch
        order = sorted(
            range(len(records)), key=lambda i: len(records[i].prompt_ids) + len(records[i].response_ids)
        )
        for start in range(0, len(order), FORWARD_BATCH):
            batch = order[start : start + FORWARD_BATCH]
            sequences = [list(records[i].prompt_ids) + list(records[i].response_ids) for i in batch]
            width = max(map(len, sequences))
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, seq in enumerate(sequences):
                ids[row, : len(seq)] = torch.tensor(seq)
                mask[row, : len(seq)] = 1
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=self._bfloat16):
                hidden = self.model.model(input_ids=ids, attention_mask=mask).last_hidden_state
                for row, i in enumerate(batch):
                    at = torch.as_tensor(rows(records[i]), dtype=torch.long)
                    yield i, self.model.lm_head(hidden[row, at]).float()

    def sampled_logprobs(
        self, records: Sequence[TrajectoryRecord], temperatures: Sequence[float]
    ) -> list[np.ndarray]:
        """Per record, the float32 log probability of each response token under the model at that record's
        sampling temperature: what vLLM returns for `logprobs=0` with `logprobs_mode="processed_logprobs"`.
        At temperature 0 that is the temperature-1 distribution, as vLLM reports greedy requests (greedy rows
        are not scaled).

        Raises:
            ValueError: a record with a response has an empty prompt (its first token has no prediction).
        """
        torch = self._torch
        for record in records:
            if record.response_ids and not record.prompt_ids:
                raise InvalidInput(f"{record.key}: an empty prompt leaves the first response token unscored")
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(records)

        def positions(record: TrajectoryRecord) -> range:
            # Response token p is predicted at sequence index prompt + p - 1.
            return range(len(record.prompt_ids) - 1, len(record.prompt_ids) + len(record.response_ids) - 1)

        scored = [i for i, r in enumerate(records) if r.response_ids]
        for j, logits in self.logits([records[i] for i in scored], positions):
            i = scored[j]
            temperature = temperatures[i] or 1.0
            logp = torch.log_softmax(logits / temperature, dim=-1)
            picked = logp[torch.arange(logp.shape[0]), torch.as_tensor(records[i].response_ids)]
            out[i] = picked.numpy().astype(np.float32)
        return out
