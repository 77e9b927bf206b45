"""Which problem, pass and sample a verl rollout request is: the part of the verl hooks that needs no verl.

Problem ids (`problem_id`), stable across runs and unique across data sets:
- `<data_source>/<split>/<index>` when the row's `extra_info` has an `index` (verl's own preprocessing scripts,
  `examples/data_preprocess/gsm8k.py` and `math_dataset.py`, write `data_source`, `extra_info.split` and
  `extra_info.index`, numbering each split from 0: the index alone collides across data sets and splits);
- `<data_source>/prompt-<hash>` otherwise: a hash of the row's chat messages (`raw_prompt`, what the agent
  loop tokenizes), so identical prompts share a history and different ones never do.
verl's own `index` column is not used: `RLHFDataset` sets it to 0 when `extra_info.index` is missing.

Epochs are passes: a problem's epoch is the number of earlier training steps that rolled it out, counted per
problem by `PassLedger` (durable in a small append-only file, so a resumed run continues the numbering). All
rows of a problem within one training step are one pass, even when they arrive in separate batches (DAPO
refills, `gen_batch_size=1`); their samples are numbered on, never reused, so every history key is distinct.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.schemas import TrajectoryRecord
from pipeline.trace_files import numbered_lines

logger = logging.getLogger(__name__)

PROBLEM_FIELD = "das_problem_id"
EPOCH_FIELD = "das_epoch"
SAMPLE_FIELD = "das_sample"
# The length of the prompt the agent loop asked for. verl's fully-async client resumes an interrupted request as
# a new one whose prompt is that prompt plus the partial output (same extra_args, smaller max_tokens): a request
# whose prompt is longer than this is such a resumed segment, which the proposer never stores as a trajectory.
PROMPT_TOKENS_FIELD = "das_prompt_tokens"
V1_SESSION_FIELD = "session_id"
# Marks rows that must not enter the history: validation rollouts, greedy baselines (REMAX), rows of a batch
# without a training step.
NOT_HISTORY = -1
LEDGER_FILE = "das_passes.jsonl"
# The ledger appends a line per problem and pass; it is rewritten once it holds this many times more lines
# than problems, so its size stays proportional to the data set, not to the run's length.
_COMPACT_RATIO = 4


def _plain(value: Any) -> Any:
    """`value` with numpy arrays and scalars turned into lists and numbers (for canonical JSON)."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def prompt_digest(raw_prompt: Any) -> str:
    """16 hex digits of SHA-256 over the prompt's canonical JSON (chat messages or text)."""
    canonical = json.dumps(_plain(raw_prompt), sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def problem_id(row: Mapping[str, Any]) -> str | None:
    """The DAS problem id of one dataset row (its non-tensor fields), or None when it has neither an
    `extra_info.index` nor a `raw_prompt` (such rows draft from their own context and stay out of the history).
    """
    source = _plain(row.get("data_source")) or "data"
    extra = _plain(row.get("extra_info")) or {}
    index = extra.get("index") if isinstance(extra, Mapping) else None
    if index is not None:
        split = extra.get("split") or "all"
        return f"{source}/{split}/{index}"
    raw_prompt = row.get("raw_prompt")
    if raw_prompt is None:
        return None
    return f"{source}/prompt-{prompt_digest(raw_prompt)}"


@dataclass(frozen=True)
class Collisions:
    """Problem ids that named more than one distinct prompt in one batch."""

    ids: int
    prompts: int
    example: str | None

    def __bool__(self) -> bool:
        return self.ids > 0


def find_collisions(ids: Sequence[str | None], prompts: Sequence[Any]) -> Collisions:
    """Which ids in a batch name different prompts (rows repeated for n samples share a prompt: fine)."""
    digests: dict[str, set[str]] = defaultdict(set)
    for pid, prompt in zip(ids, prompts, strict=True):
        if pid is not None:
            digests[pid].add(prompt_digest(prompt))
    clashing = {pid: len(d) for pid, d in digests.items() if len(d) > 1}
    return Collisions(len(clashing), sum(clashing.values()), next(iter(clashing), None))


class CollisionWarning:
    """Warns once per process, with counts, when problem ids repeat for different prompts."""

    def __init__(self) -> None:
        self.warned = False

    def check(self, ids: Sequence[str | None], prompts: Sequence[Any]) -> Collisions:
        found = find_collisions(ids, prompts)
        if found and not self.warned:
            self.warned = True
            logger.warning(
                "DAS: %d problem ids name %d different prompts in one batch (e.g. %r): those prompts share one "
                "history and their drafts mix. Give every problem a unique extra_info.index within its "
                "data_source and extra_info.split, or drop extra_info.index to id problems by prompt hash. "
                "(Warned once.)",
                found.ids,
                found.prompts,
                found.example,
            )
        return found


@dataclass
class _Pass:
    epoch: int
    step: int
    next_sample: int


class PassLedger:
    """Each problem's current pass (epoch), the training step it belongs to, and its next free sample number.

    Kept in `<state_dir>/das_passes.jsonl` (one JSON line `[problem, epoch, step, next_sample]` per change, the
    last line of a problem wins), so a resumed run continues every problem's numbering. Epochs only grow:
    steps that a resume replays start new passes (or continue the pass of the same step with fresh sample
    numbers), so no key is ever reused.
    """

    def __init__(self, state_dir: Path | None, history_epochs: Mapping[str, int] | None = None) -> None:
        """Loads the ledger from `state_dir` (None: in memory only).

        `history_epochs` (problem -> highest stored epoch) seeds problems the ledger does not know, so a fresh
        run over an existing history numbers its passes after the stored ones rather than below its window.
        """
        self.path = state_dir / LEDGER_FILE if state_dir is not None else None
        self._passes: dict[str, _Pass] = {}
        self._lines = 0
        if self.path is not None and self.path.exists():
            self._load()
            logger.info(
                "DAS: continuing pass numbering from %s (%d problems, highest epoch %d)",
                self.path,
                len(self._passes),
                max((p.epoch for p in self._passes.values()), default=-1),
            )
        seeded = 0
        for pid, epoch in (history_epochs or {}).items():
            if pid not in self._passes:
                self._passes[pid] = _Pass(int(epoch), step=-1, next_sample=0)
                seeded += 1
        if seeded:
            logger.info("DAS: %d problems continue after their stored history epochs", seeded)
        if not self._passes:
            logger.info(
                "DAS: pass numbering starts at epoch 0 (%s)",
                f"no {self.path}" if self.path is not None else "no state directory",
            )

    def _load(self) -> None:
        assert self.path is not None
        torn = False
        for number, line in numbered_lines(self.path):
            try:
                pid, epoch, step, next_sample = json.loads(line)
                self._passes[str(pid)] = _Pass(int(epoch), int(step), int(next_sample))
            except (ValueError, TypeError) as exc:
                # A line cut by a crash mid-append is the expected damage (and only the last line can be).
                logger.warning("DAS: %s:%d unreadable (%s); ignored", self.path, number, exc)
                torn = True
            self._lines += 1
        if torn:
            # Appending after a torn line would glue the next record onto it: start from a clean file.
            self._rewrite()

    def epoch_of(self, pid: str) -> int | None:
        """The problem's current pass, or None before its first."""
        state = self._passes.get(pid)
        return None if state is None or state.step < 0 else state.epoch

    def assign(
        self, pids: Sequence[str | None], counts: Sequence[int], step: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(epoch, first sample) for each row; a row takes `counts[row]` consecutive sample numbers.

        Rows with a None id get NOT_HISTORY. The change is appended to the ledger before returning.
        """
        epochs = np.full(len(pids), NOT_HISTORY, dtype=np.int64)
        firsts = np.full(len(pids), NOT_HISTORY, dtype=np.int64)
        changed: dict[str, _Pass] = {}
        for row, (pid, count) in enumerate(zip(pids, counts, strict=True)):
            if pid is None or count < 1:
                continue
            state = self._passes.get(pid)
            if state is None:
                state = self._passes[pid] = _Pass(epoch=0, step=step, next_sample=0)
            elif state.step != step:
                state.epoch, state.step, state.next_sample = state.epoch + 1, step, 0
            epochs[row], firsts[row] = state.epoch, state.next_sample
            state.next_sample += int(count)
            changed[pid] = state
        self._append(changed)
        return epochs, firsts

    def _append(self, changed: Mapping[str, _Pass]) -> None:
        if self.path is None or not changed:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._lines + len(changed) > _COMPACT_RATIO * max(len(self._passes), 1024):
            self._rewrite()
            return
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(_lines(changed.items()))
        self._lines += len(changed)

    def _rewrite(self) -> None:
        assert self.path is not None
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(_lines(self._passes.items()))
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(self.path)
        self._lines = len(self._passes)


def _lines(items: Iterable[tuple[str, _Pass]]) -> str:
    return "".join(json.dumps([pid, p.epoch, p.step, p.next_sample]) + "\n" for pid, p in items)


def history_epochs(history_dir: str | os.PathLike[str]) -> dict[str, int]:
    """Highest stored epoch per problem in a history folder, read as a RocksDB secondary (the replica may be
    running); {} when the folder does not exist."""
    import tempfile

    from history_store.durable.store import HistoryStore

    path = Path(history_dir)
    if not path.exists():
        return {}
    with (
        tempfile.TemporaryDirectory(prefix="das-ledger-secondary-") as secondary,
        HistoryStore.open_secondary(path, secondary) as reader,
    ):
        epochs = {}
        for pid in reader.problem_ids():
            window = reader.window(pid)
            if len(window):
                epochs[pid] = int(window["epoch"].max())
        return epochs


def cluster_history_epochs(history_dir: str) -> dict[str, int]:
    """Highest stored epoch per problem over the replicas of every live node of the connected Ray cluster (each
    node reads its own `history_dir`; nodes without one contribute nothing). The trainer's node often has no
    replica (the compose head), while every GPU node has one."""
    from workers.verl.cluster import on_every_node

    merged: dict[str, int] = {}
    for epochs in on_every_node(history_epochs, history_dir):
        for pid, epoch in epochs.items():
            merged[pid] = max(epoch, merged.get(pid, epoch))
    return merged


def ledger_from_config(config: Mapping[str, Any]) -> PassLedger:
    """The pass ledger for a trainer config: in `das.state_dir`, else verl's checkpoint folder
    (`trainer.default_local_dir`, which a resumed run reads too).

    A fresh run (no ledger there) with a history replica (`DAS_HISTORY_DIR`) continues each problem's numbering
    after its stored epochs: read here when this node has the replica, else on the Ray cluster's nodes that do
    (`cluster_history_epochs`). Otherwise passes start at 0, and the log says which.
    """
    das = config.get("das") or {}
    trainer = config.get("trainer") or {}
    folder = das.get("state_dir") or trainer.get("default_local_dir")
    state_dir = Path(str(folder)).expanduser() if folder else None
    seeds: dict[str, int] = {}
    history_dir = os.environ.get("DAS_HISTORY_DIR")
    if history_dir and not (state_dir is not None and (state_dir / LEDGER_FILE).exists()):
        import ray

        local = Path(history_dir).exists() or not ray.is_initialized()
        seeds = history_epochs(history_dir) if local else cluster_history_epochs(history_dir)
        logger.info(
            "DAS: history at %s holds %d problems; a fresh ledger continues after them",
            history_dir,
            len(seeds),
        )
    return PassLedger(state_dir, seeds)


@dataclass(frozen=True)
class Annotation:
    """Per-row DAS columns for a rollout batch: problem id, epoch (pass) and first sample number."""

    problem_ids: list[str | None]
    epochs: np.ndarray
    samples: np.ndarray


class BatchAnnotator:
    """Numbers a trainer's rollout batches: the driver-side half of the verl hooks (see `workers.verl`)."""

    def __init__(self, ledger: PassLedger) -> None:
        self.ledger = ledger
        self.collisions = CollisionWarning()

    def annotate(
        self,
        rows: Sequence[Mapping[str, Any]],
        step: Any,
        validate: bool,
        samples_per_row: Sequence[int],
        do_sample: Sequence[Any] | None = None,
    ) -> Annotation:
        """Ids for every row; epochs and samples for training rows (NOT_HISTORY for validation, rows without
        a training step, and greedy rows of REMAX's `__do_sample__`, which still draft from the history).

        Args:
            rows: each row's non-tensor fields (`data_source`, `extra_info`, `raw_prompt`, ...).
            step: the trainer's global step (verl counts from 1); None outside training.
            samples_per_row: how many rollouts each row stands for (1 for the legacy trainer, which repeats
                rows n times; n for V1, whose worker runs n sessions per row).
        """
        pids = [problem_id(row) for row in rows]
        self.collisions.check(pids, [row.get("raw_prompt") for row in rows])
        history = not validate and step is not None and int(step) >= 1
        counts = [
            int(n) if history and (do_sample is None or bool(do_sample[i])) else 0
            for i, n in enumerate(samples_per_row)
        ]
        epochs, samples = self.ledger.assign(pids, counts, int(step) if history else NOT_HISTORY)
        return Annotation(pids, epochs, samples)


@dataclass(frozen=True)
class RequestIdentity:
    """What one agent loop request carries to the proposer, built from the agent loop's keyword arguments."""

    problem_id: str | None
    epoch: int | None
    sample: int | None

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> RequestIdentity:
        """From the row fields our managers add: `das_problem_id`, `das_epoch`, and `das_sample` (the first
        sample of the row; verl's V1 worker runs a prompt's n samples as sessions 0..n-1, `session_id`, added
        to it). Without `das_problem_id` (a manager other than ours) the row's own fields give the id."""
        pid = kwargs.get(PROBLEM_FIELD)
        pid = str(pid) if pid is not None else problem_id(kwargs)
        epoch, sample = kwargs.get(EPOCH_FIELD), kwargs.get(SAMPLE_FIELD)
        if epoch is None or sample is None or int(epoch) < 0 or int(sample) < 0:
            return cls(pid or None, None, None)
        return cls(pid or None, int(epoch), int(sample) + int(kwargs.get(V1_SESSION_FIELD) or 0))

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

    def record(
        self,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        worker: str,
        response_logprobs: Sequence[float] | None = None,
    ) -> TrajectoryRecord:
        """The finished trajectory as a bus record, with the sampled tokens' log probabilities when verl has
        them (its `rollout_log_probs`, asked of vLLM when `calculate_log_probs` is set).

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
            response_logprobs=None if response_logprobs is None else [float(v) for v in response_logprobs],
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


def with_prompt_tokens(sampling_params: Mapping[str, Any], prompt_tokens: int) -> dict[str, Any]:
    """A copy of verl's sampling parameters whose `extra_args` also say how long the request's own prompt is
    (`PROMPT_TOKENS_FIELD`); requests without a DAS problem id are left as they are."""
    extra = sampling_params.get("extra_args") or {}
    if PROBLEM_FIELD not in extra:
        return dict(sampling_params)
    return {**sampling_params, "extra_args": {**extra, PROMPT_TOKENS_FIELD: int(prompt_tokens)}}
