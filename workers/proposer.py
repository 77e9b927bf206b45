"""The DAS proposer for vLLM's `custom_class` speculative method, and the worker extension that feeds it.

Engine arguments::

    speculative_config={"method": "custom_class", "model": "workers.proposer.DasProposer",
                        "num_speculative_tokens": K}
    worker_extension_cls="workers.proposer.DasWorkerExtension"

Each decode step vLLM calls `propose` once for the whole batch. The proposer keeps one `ProblemIndex` (history
trees per problem, a global tree of recent responses, a live overlay per request that also serves in-flight
siblings of the same problem), registers requests that joined the batch, appends the tokens they committed,
asks the budget policy how many tokens each row may draft, and drafts all rows in one native call.

Request identity: row i of the batch is `runner.input_batch.req_ids[i]`; `runner.requests[id]` holds the
prompt and `SamplingParams.extra_args` (`das_problem_id`, optional `das_epoch`, `das_sample`). vLLM builds the
proposer inside the model runner's constructor and then calls `propose` from a runner method, so the runner is
found once, on the first call, as the caller's `self` (checked by `runner.drafter is self`): no engine
argument or RPC is needed for it, and servers that never call `collective_rpc` (verl's) work unchanged.

History freshness:
- embedded: the rollout driver pushes finished trajectories with `collective_rpc("das_add_trajectories")`;
  a request carrying `das_epoch` and `das_sample` is also added to its problem's history by the proposer itself
  when it finishes (adding is idempotent by key, so the later push changes nothing).
- distributed: with `DAS_HISTORY_DIR` set, the proposer opens the node's history replica (RocksDB) as a
  secondary instance, loads it at start and catches up between steps (at most every
  `DAS_CATCH_UP_INTERVAL_S`), extending and evicting its trees incrementally.

Nothing a request carries can crash the engine: malformed `extra_args` give one warning and own-context
drafting; an unexpected error in drafting is logged, counted, and that step drafts nothing.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from history_store.problem_index import ProblemIndex
from history_store.suffix_tree import DraftConfig
from monitoring.metrics import (
    ACCEPTED_TOKENS,
    ACCEPTED_TOKENS_BY_POSITION,
    DRAFT_LATENCY,
    DRAFT_TOKENS,
    DRAFT_TOKENS_BY_POSITION,
    DRAFTS,
    LENGTH_CLASSES,
    SPEC_BUDGET,
    STEP_DURATION,
    position_label,
)
from workers.budget import MEDIUM, BudgetConfig, BudgetPolicy

logger = logging.getLogger(__name__)

# Sources reported by ProblemIndex.draft_batch, in its numbering.
SOURCE_NAMES = ("none", "problem", "live", "global")
MAX_PROBLEM_ID_LEN = 512


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not a number") from exc


@dataclass(frozen=True)
class ProposerSettings:
    """Proposer configuration. Worker processes are spawned by vLLM, so it comes from the environment.

    budget: use the length-aware budget policy (off: every row may draft up to K, cut only by the tree's
        min_token_prob, SuffixDecoding's rule).
    history_dir: the node's history replica (distributed mode); None in embedded mode.
    """

    budget: bool = True
    window_epochs: int = 3
    # SuffixDecoding's defaults except depth: 64 lets long reasoning repeats match deep (see DraftConfig).
    max_depth: int = 64
    min_token_prob: float = 0.1
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    history_dir: str | None = None
    # Secondary catch-up costs a RocksDB manifest read (~1 ms): a few per second keep history fresher than the
    # one-second freshness target without taxing every step.
    catch_up_interval_s: float = 0.2

    @classmethod
    def from_env(cls) -> ProposerSettings:
        """Settings from `DAS_*` variables; raises ValueError naming the variable that does not parse."""
        budget = os.environ.get("DAS_BUDGET", "on").lower()
        if budget not in ("on", "off"):
            raise ValueError(f"DAS_BUDGET must be 'on' or 'off', got {budget!r}")
        return cls(
            budget=budget == "on",
            window_epochs=int(_env_float("DAS_WINDOW_EPOCHS", 3)),
            max_depth=int(_env_float("DAS_MAX_DEPTH", 64)),
            # With the budget on, its calibrated pay-off rule decides where a draft ends: a fixed floor on the
            # tree's raw probabilities would cut first (one trajectory of history halves them per token).
            min_token_prob=_env_float("DAS_MIN_TOKEN_PROB", 0.0 if budget == "on" else 0.1),
            max_spec_factor=_env_float("DAS_MAX_SPEC_FACTOR", 1.0),
            max_spec_offset=_env_float("DAS_MAX_SPEC_OFFSET", 0.0),
            history_dir=os.environ.get("DAS_HISTORY_DIR") or None,
            catch_up_interval_s=_env_float("DAS_CATCH_UP_INTERVAL_S", 0.2),
        )


@dataclass
class _Live:
    """A request the proposer has registered in the index."""

    problem_id: str | None
    epoch: int | None
    sample: int | None
    prompt_len: int
    fed: int  # tokens of prompt + output handed to the index so far
    max_tokens: int | None
    slot: int  # the budget policy's name for it
    stop_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    # Prompt and output, kept only when the request names its (epoch, sample): added to history when it ends.
    chunks: list[np.ndarray] | None = None


@dataclass
class _LastStep:
    """What the previous step drafted, to learn acceptance and step cost from the next call."""

    keys: list[str] = field(default_factory=list)
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    ended_at: float | None = None


def parse_extra_args(extra_args: Any) -> tuple[str | None, int | None, int | None, str | None]:
    """(problem_id, epoch, sample, problem) from `SamplingParams.extra_args`; the last item is a warning text
    when they are malformed (then everything is None and the request drafts from its own context)."""
    if extra_args is None:
        return None, None, None, None
    if not isinstance(extra_args, dict):
        return None, None, None, f"extra_args is {type(extra_args).__name__}, not a dict"
    problem_id = extra_args.get("das_problem_id")
    if problem_id is None:
        return None, None, None, None
    if not isinstance(problem_id, str) or not 0 < len(problem_id) <= MAX_PROBLEM_ID_LEN:
        return (
            None,
            None,
            None,
            f"das_problem_id must be a non-empty str of at most {MAX_PROBLEM_ID_LEN} chars",
        )
    numbers = []
    for name in ("das_epoch", "das_sample"):
        value = extra_args.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            return None, None, None, f"{name} must be a non-negative int, got {value!r}"
        numbers.append(value)
    return problem_id, numbers[0], numbers[1], None


def _is_output_rank() -> bool:
    """True on the tensor-parallel rank whose drafts vLLM's executor uses (rank 0; also outside a
    distributed setup)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().rank_in_group == 0
    except (ImportError, AssertionError):  # no vLLM, or no process group (a proposer built outside an engine)
        return True


def _natural_end(live: _Live, tokens: np.ndarray | None) -> int | None:
    """The response length vLLM returned if the request ended by itself: through its first stop token at or
    after min_tokens (accepted drafts may have run past it in the runner), or at max_tokens. None when it ended
    otherwise (aborted, or a stop string), or when the proposer kept no tokens to tell."""
    fed = live.fed - live.prompt_len
    if tokens is not None and live.stop_ids:
        response = tokens[live.prompt_len : live.fed]
        stops = np.flatnonzero(np.isin(response[live.min_tokens :], list(live.stop_ids)))
        if stops.size:
            return live.min_tokens + int(stops[0]) + 1
    if live.max_tokens is not None and fed >= live.max_tokens:
        return live.max_tokens
    return None


class DasProposer:
    """vLLM `custom_class` proposer: per-problem history drafts with a length-aware budget."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.settings = ProposerSettings.from_env()
        # With tensor parallelism every rank builds a proposer, but vLLM's executor takes drafts only from the
        # first rank of the last pipeline stage and sends them to every rank with the next schedule; the other
        # ranks neither draft nor load the history (asynchronous scheduling, which would use local drafts, is
        # off for custom_class).
        self.drafting = _is_output_rank()
        self.draft_config = DraftConfig(
            max_depth=self.settings.max_depth,
            max_spec_tokens=self.k,
            max_spec_factor=self.settings.max_spec_factor,
            max_spec_offset=self.settings.max_spec_offset,
            min_token_prob=self.settings.min_token_prob,
        )
        self.index = ProblemIndex(window_epochs=self.settings.window_epochs, config=self.draft_config)
        self.policy = BudgetPolicy(BudgetConfig(max_tokens=self.k))
        self.runner: Any = None
        self._live: dict[str, _Live] = {}
        self._last = _LastStep()
        self._warned: set[str] = set()
        self._replica: Any = None
        self._next_catch_up = 0.0
        # Label children resolved once: `labels()` costs a dict lookup and a lock per call.
        self._draft_by_pos = [
            DRAFT_TOKENS_BY_POSITION.labels(position=position_label(j)) for j in range(self.k)
        ]
        self._accept_by_pos = [
            ACCEPTED_TOKENS_BY_POSITION.labels(position=position_label(j)) for j in range(self.k)
        ]
        self._budget_by_class = [SPEC_BUDGET.labels(length_class=c) for c in LENGTH_CLASSES]
        self.reset_stats()
        # Compile the index's native kernels now, so the first real decode step is not slow.
        self.index.start_request("__warmup__", None, np.arange(8, dtype=np.int32))
        self.index.draft_batch(["__warmup__"], np.full(1, self.k, dtype=np.int32))
        self.index.finish_request("__warmup__")

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model: drafts come from suffix trees. vLLM's CPU runner calls this unconditionally."""
        if self.settings.history_dir and self.drafting:
            self._open_replica(Path(self.settings.history_dir))

    # ------------------------------------------------------------------ statistics
    def reset_stats(self) -> None:
        """Zeroes the counters `stats` reports (not the Prometheus metrics, which only grow)."""
        self._stats = {
            "steps": 0,
            "rows": 0,
            "drafts": 0,
            "draft_tokens": 0,
            "accepted_tokens": 0,
            "verified_drafts": 0,
            "draft_seconds": 0.0,
            "budget_tokens": 0,
            "errors": 0,
            "malformed_requests": 0,
            "sources": dict.fromkeys(SOURCE_NAMES, 0),
            "accepted_by_position": [0] * self.k,
            "drafted_by_position": [0] * self.k,
        }

    def stats(self) -> dict[str, Any]:
        """Counters since the last reset, the live request count, and the budget policy's state."""
        out = dict(self._stats)
        out["live_requests"] = len(self._live)
        out["budget_enabled"] = self.settings.budget
        out["drafting_rank"] = self.drafting
        out["policy"] = self.policy.snapshot()
        out["history_problems"] = len(self.index.problem_ids())
        return out

    # ------------------------------------------------------------------ history
    def add_trajectories(self, records: list[dict[str, Any]]) -> int:
        """Adds finished trajectories (TrajectoryRecord fields) to the history; returns how many were new.

        Raises:
            ValueError: a record misses a field or has the wrong types (checked by TrajectoryRecord).
        """
        from pipeline.schemas import TrajectoryRecord

        if self.runner is not None:
            self._reap(set())
        added = 0
        for raw in records:
            record = raw if isinstance(raw, TrajectoryRecord) else TrajectoryRecord.model_validate(raw)
            added += self._add(
                record.problem_id, record.epoch, record.sample, record.prompt_ids, record.response_ids
            )
        return added

    def _add(self, problem_id: str, epoch: int, sample: int, prompt_ids: Any, response_ids: Any) -> int:
        new = self.index.add_trajectory(problem_id, epoch, sample, prompt_ids, response_ids)
        if new:
            self.policy.observe_length(problem_id, len(response_ids))
        return int(new)

    def evict(self, problem_id: str, min_epoch: int) -> int:
        """Drops a problem's history epochs below `min_epoch`; returns how many trajectories left."""
        evicted = self.index.evict_epochs_before(problem_id, min_epoch)
        if evicted:
            self.policy.forget_problem(problem_id)
        return len(evicted)

    def _open_replica(self, path: Path) -> None:
        from history_store.store import HistoryStore

        secondary = Path(
            os.environ.get("DAS_SECONDARY_DIR") or path.parent / f".{path.name}.secondary-{os.getpid()}"
        )
        self._replica = HistoryStore.open_secondary(path, secondary)
        for item in self._replica.iter_trajectories():
            self._add(item.problem_id, item.epoch, item.sample, item.prompt_ids, item.response_ids)

    def _catch_up(self, now: float) -> None:
        self._next_catch_up = now + self.settings.catch_up_interval_s
        change = self._replica.catch_up()
        if change.reset:
            for item in self._replica.iter_trajectories():
                self._add(item.problem_id, item.epoch, item.sample, item.prompt_ids, item.response_ids)
            return
        for problem_id, epoch, sample in change.added:
            item = self._replica.get(problem_id, epoch, sample)
            if item is not None:
                self._add(problem_id, epoch, sample, item.prompt_ids, item.response_ids)
        # The replica removes whole epochs from the bottom of a problem's window.
        lowest_kept: dict[str, int] = {}
        for problem_id, epoch, _ in change.removed:
            lowest_kept[problem_id] = max(lowest_kept.get(problem_id, 0), epoch + 1)
        for problem_id, min_epoch in lowest_kept.items():
            self.evict(problem_id, min_epoch)

    # ------------------------------------------------------------------ the decode step
    def _find_runner(self) -> Any:
        # propose <- the runner's propose_draft_token_ids (self = runner); see the module docstring.
        caller = sys._getframe(2).f_locals.get("self")
        if getattr(caller, "drafter", None) is self and hasattr(caller, "input_batch"):
            self.runner = caller
        return self.runner

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """Draft tokens per batch row (each at most K and within max_model_len), or [] where none."""
        started = time.perf_counter()
        n = len(sampled_token_ids)
        if not self.drafting:
            return [[] for _ in range(n)]
        try:
            if self.runner is None and self._find_runner() is None:
                self._warn_once("runner", "DasProposer could not find the model runner: drafting disabled")
                return [[] for _ in range(n)]
            drafts = self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, started)
        except Exception:
            # The engine must survive whatever a request or the history holds; the error is logged and counted
            # (tests assert none happen) and this step simply drafts nothing.
            self._stats["errors"] += 1
            logger.exception("DAS drafting failed; this step drafts nothing")
            self._last = _LastStep(ended_at=time.perf_counter())
            return [[] for _ in range(n)]
        elapsed = time.perf_counter() - started
        self._stats["draft_seconds"] += elapsed
        DRAFT_LATENCY.observe(elapsed)
        self._last.ended_at = time.perf_counter()
        return drafts

    def _propose(
        self, sampled: list[list[int]], num_tokens: np.ndarray, token_ids: np.ndarray, started: float
    ) -> list[list[int]]:
        runner = self.runner
        n = len(sampled)
        keys = [str(k) for k in runner.input_batch.req_ids[:n]]
        # Requests that joined prefilled in the step just verified, and partial prefills commit nothing: either
        # way that step's time does not measure decoding.
        clean = all(sampled) and all(k in self._live for k in keys)
        self._learn_from_last_step(keys, sampled, started, clean)
        self._reap(set(keys))
        committed = []
        for i, key in enumerate(keys):
            live = self._live.get(key)
            if live is None:
                live = self._start(key, runner.requests[key], token_ids[i])
            count = int(num_tokens[i])
            new = token_ids[i, live.fed : max(count, live.fed)]
            committed.append(new)
            if new.size:
                if live.chunks is not None:
                    live.chunks.append(new.copy())
                live.fed = count
        # One native call commits the whole batch's new tokens to the live trees.
        self.index.append_batch(keys, committed)
        if self._replica is not None and started >= self._next_catch_up:
            self._catch_up(started)

        # Rows that just prefilled part of a prompt commit nothing and must not draft.
        headroom = np.array(
            [min(self.k, self.max_model_len - int(num_tokens[i]) - 1) if sampled[i] else 0 for i in range(n)],
            dtype=np.int64,
        )
        lives = [self._live[k] for k in keys]
        output_lens = np.array([live.fed - live.prompt_len for live in lives], dtype=np.int64)
        if self.settings.budget:
            slots = np.array([live.slot for live in lives], dtype=np.int64)
            budgets = self.policy.budgets(slots, output_lens, headroom)
            classes = self.policy.last_classes
        else:
            budgets, classes = np.maximum(headroom, 0).astype(np.int32), np.full(n, MEDIUM, dtype=np.int64)
        result = self.index.draft_batch(keys, budgets)
        lengths = np.minimum(np.asarray(result.lengths[:n], dtype=np.int32), budgets)
        probs = np.asarray(result.probs[:n], dtype=np.float32)
        if self.settings.budget:
            lengths = self.policy.truncate(
                lengths, probs[:, : self.k], result.match_lens[:n], result.sources[:n]
            )
        tokens = np.asarray(result.tokens)

        stats = self._stats
        stats["steps"] += 1
        stats["rows"] += n
        stats["budget_tokens"] += int(budgets.sum())
        drafted = int((lengths > 0).sum())
        total = int(lengths.sum())
        stats["drafts"] += drafted
        stats["draft_tokens"] += total
        for source, count in zip(
            *np.unique(np.asarray(result.sources[:n])[lengths > 0], return_counts=True), strict=True
        ):
            stats["sources"][SOURCE_NAMES[int(source)]] += int(count)
        if drafted:
            DRAFTS.inc(drafted)
            DRAFT_TOKENS.inc(total)
            per_position = np.bincount(np.concatenate([np.arange(m) for m in lengths if m]), minlength=self.k)
            for j, count in enumerate(per_position[: self.k]):
                if count:
                    self._draft_by_pos[j].inc(int(count))
                    stats["drafted_by_position"][j] += int(count)
        for c, budget in zip(classes, lengths, strict=True):
            self._budget_by_class[c].observe(int(budget))

        self._last = _LastStep(keys=keys, lengths=lengths)
        return [tokens[i, : lengths[i]].tolist() if lengths[i] else [] for i in range(n)]

    def _learn_from_last_step(
        self, keys: list[str], sampled: list[list[int]], now: float, clean: bool
    ) -> None:
        """Acceptance of the previous step's drafts (a row commits accepted + 1 tokens) and the step's cost."""
        last = self._last
        if not last.keys:
            return
        row_of = {key: i for i, key in enumerate(keys)}
        rows, accepted = [], []
        for j, key in enumerate(last.keys):
            i = row_of.get(key)
            if i is None or not sampled[i]:
                continue
            rows.append(j)
            accepted.append(min(len(sampled[i]) - 1, int(last.lengths[j])))
        if rows:
            acc = np.asarray(accepted, dtype=np.int64)
            idx = np.asarray(rows)
            drafted = last.lengths[idx] > 0
            total = int(acc.sum())
            self._stats["accepted_tokens"] += total
            self._stats["verified_drafts"] += int(drafted.sum())
            ACCEPTED_TOKENS.inc(total)
            for j, count in enumerate(np.bincount(np.concatenate([np.arange(a) for a in acc]), minlength=1)):
                if count and j < self.k:
                    self._accept_by_pos[j].inc(int(count))
                    self._stats["accepted_by_position"][j] += int(count)
            if self.settings.budget:
                # Every verified row teaches the policy, drafted or not (its drafted / accepted rates decay).
                self.policy.observe_acceptance(idx, acc)
        # The interval from the previous return to this call is the verification step of the previous drafts
        # (an idle engine between batches always resumes with joining requests, so `clean` excludes it too).
        if clean and last.ended_at is not None:
            seconds = now - last.ended_at
            active = len(last.keys)
            STEP_DURATION.observe(seconds)
            self.policy.observe_step(active, active + int(last.lengths.sum()), seconds)

    def _start(self, key: str, request: Any, row_tokens: np.ndarray) -> _Live:
        sampling = request.sampling_params
        problem_id, epoch, sample, problem = parse_extra_args(getattr(sampling, "extra_args", None))
        if problem is not None:
            self._stats["malformed_requests"] += 1
            self._warn_once(f"malformed:{key}", f"request {key}: {problem}; drafting from its own context")
        prompt_len = int(request.num_prompt_tokens)
        self.index.start_request(key, problem_id, row_tokens[:prompt_len])
        live = _Live(
            problem_id,
            epoch,
            sample,
            prompt_len,
            prompt_len,
            getattr(sampling, "max_tokens", None),
            self.policy.start(problem_id),
            frozenset(getattr(sampling, "all_stop_token_ids", None) or ()),
            int(getattr(sampling, "min_tokens", 0) or 0),
        )
        if problem_id is not None and epoch is not None and sample is not None:
            live.chunks = [np.array(row_tokens[:prompt_len], dtype=np.int32)]
        self._live[key] = live
        return live

    def _finish(self, key: str) -> None:
        live = self._live.pop(key)
        response_len = None
        if live.problem_id is not None:
            tokens = np.concatenate(live.chunks) if live.chunks is not None else None
            response_len = _natural_end(live, tokens)
        self.index.finish_request(key)
        self.policy.finish(live.slot)
        # Aborted requests (verl's partial rollouts, a client gone) and stop strings (matched in vLLM's front
        # end, which then aborts the request here) end early for reasons the runner does not show: they must
        # neither feed short lengths to the budget nor enter the history under a real key. A natural end is
        # a sibling revealing how long this epoch runs: the budget learns it now (through the history when
        # the request names its epoch and sample, else directly).
        if response_len is not None and live.chunks is None:
            self.policy.observe_length(live.problem_id, response_len)
        if live.chunks is not None and response_len is not None:
            prompt, response = (
                tokens[: live.prompt_len],
                tokens[live.prompt_len : live.prompt_len + response_len],
            )
            self._add(live.problem_id, int(live.epoch or 0), int(live.sample or 0), prompt, response)

    def _reap(self, present: set[str]) -> None:
        """Finishes requests that left the engine (gone from `runner.requests`; preempted ones stay there)."""
        for key in [k for k in self._live if k not in present and k not in self.runner.requests]:
            self._finish(key)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)


class DasWorkerExtension:
    """Methods mixed into vLLM's worker (`worker_extension_cls`), reachable with `collective_rpc(name)`."""

    def _das(self) -> DasProposer:
        drafter = getattr(self.model_runner, "drafter", None)  # type: ignore[attr-defined]
        if not isinstance(drafter, DasProposer):
            raise RuntimeError(
                "the engine does not run DasProposer: pass speculative_config="
                '{"method": "custom_class", "model": "workers.proposer.DasProposer", ...}'
            )
        return drafter

    def das_add_trajectories(self, records: list[dict[str, Any]]) -> int:
        """Adds finished trajectories to the proposer's history; returns how many were new."""
        return self._das().add_trajectories(records)

    def das_evict(self, problem_id: str, min_epoch: int) -> int:
        """Evicts a problem's history epochs below `min_epoch`; returns how many trajectories left."""
        return self._das().evict(problem_id, min_epoch)

    def das_stats(self) -> dict[str, Any]:
        """The proposer's counters and budget policy state."""
        return self._das().stats()

    def das_reset_stats(self) -> None:
        """Zeroes the proposer's counters (e.g. between benchmark epochs)."""
        self._das().reset_stats()
