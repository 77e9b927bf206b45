"""verl's rollout dumps as a trace: what `das traces import` reads, so `das bench replay` can say what DAS would
do for a user's own run before they wire it in.

With `trainer.rollout_data_dir` set, verl 0.9.1 writes one `{step}.jsonl` per training step
(`_write_generations` in `verl/trainer/ppo/ray_trainer.py` and `verl/trainer/ppo/v1/trainer_base.py`): one
line per rollout with `input` and `output` (the prompt and response decoded with `skip_special_tokens=True`),
`gts`, `score`, `step`, and reward extras. Token ids are not dumped, so they are recovered by encoding the text
with the run's own tokenizer: special tokens (the chat template's markers, the final EOS) are gone from the
text and so from the ids, and a response re-encodes to its sampled ids except where the model sampled a
non-canonical split (rare; lengths then differ by a token or so).

Problems are identified by their prompt text (`prompt-<hash>`); epochs are passes counted per problem by the
same `PassLedger` the live verl hooks use: a problem's epoch is the number of earlier steps that rolled it out,
and its samples within a step are numbered in file order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.schemas import TrajectoryRecord
from pipeline.trace_files import numbered_lines
from workers.errors import InvalidInput
from workers.verl.identity import PassLedger, prompt_digest


@dataclass(frozen=True)
class DumpRow:
    """One dumped rollout: its step, prompt text and response text."""

    step: int
    prompt: str
    response: str


def step_files(folder: Path) -> list[tuple[int, Path]]:
    """verl's `{step}.jsonl` files in `folder`, in step order.

    Raises:
        ValueError: `folder` is not a folder or holds no such file.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise InvalidInput(f"{folder} is not a folder")
    files = sorted((int(p.stem), p) for p in folder.glob("*.jsonl") if p.stem.isdigit())
    if not files:
        raise InvalidInput(
            f"{folder} holds no verl rollout dump ({{step}}.jsonl files: set trainer.rollout_data_dir)"
        )
    return files


def read_rows(folder: Path) -> Iterator[DumpRow]:
    """Every dumped rollout, step by step, in file order.

    Raises:
        ValueError: a line is not a dump row (the message names the file and line).
    """
    for step, path in step_files(folder):
        for number, line in numbered_lines(path):
            try:
                item = json.loads(line)
                prompt, response = item["input"], item["output"]
                if not isinstance(prompt, str) or not isinstance(response, str):
                    raise TypeError("input and output must be strings")
                row_step = item.get("step")  # absent or null: the file's own step
                row_step = step if row_step is None else row_step
                if isinstance(row_step, bool) or not isinstance(row_step, int) or row_step < 0:
                    raise TypeError(f"step must be a whole number >= 0, got {row_step!r:.40}")
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise InvalidInput(f"{path}:{number}: not a verl rollout dump line ({exc})") from exc
            yield DumpRow(row_step, prompt, response)


def problem_id(prompt: str) -> str:
    """A problem's id from its dumped prompt text."""
    return f"prompt-{prompt_digest(prompt)}"


def import_dumps(folder: Path, tokenizer: Any) -> list[TrajectoryRecord]:
    """The trace of a verl rollout dump folder (module docstring), with `tokenizer` the run's own."""
    rows = list(read_rows(folder))
    ledger = PassLedger(None)
    prompts = sorted({row.prompt for row in rows})
    prompt_ids = dict(zip(prompts, _encode(tokenizer, prompts), strict=True))
    response_ids = _encode(tokenizer, [row.response for row in rows])
    records = []
    start = 0
    while start < len(rows):
        step = rows[start].step
        end = start
        while end < len(rows) and rows[end].step == step:
            end += 1
        batch = rows[start:end]
        pids = [problem_id(row.prompt) for row in batch]
        epochs, samples = ledger.assign(pids, [1] * len(batch), step)
        for offset, (row, pid) in enumerate(zip(batch, pids, strict=True)):
            records.append(
                TrajectoryRecord(
                    problem_id=pid,
                    epoch=int(epochs[offset]),
                    sample=int(samples[offset]),
                    prompt_ids=prompt_ids[row.prompt],
                    response_ids=response_ids[start + offset],
                )
            )
        start = end
    return records


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return [list(map(int, ids)) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
