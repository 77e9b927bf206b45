"""The DAS proposer for vLLM's `custom_class` speculative method, and the worker extension that feeds it.

Engine arguments::

    speculative_config={"method": "custom_class", "model": "workers.proposer.DasProposer",
                        "num_speculative_tokens": K}
    worker_extension_cls="workers.proposer.DasWorkerExtension"

Each decode step vLLM calls `propose` once for the whole batch. The proposer keeps one `ProblemIndex` (history
trees per problem, a global tree of recent responses, a live overlay per request that also serves in-flight
siblings of the same problem), registers requests that joined the batch, and then works in one native call
for the whole batch (`workers.generator.step.decode_step`): it learns from the previous step's verification,
asks the budget policy how many tokens each row may draft, appends the tokens the rows committed, drafts and
counts. Its tables travel as one packed value (`StepTables`), packed again only after something outside the
call may have replaced an array.

Request identity: row i of the batch is `runner.input_batch.req_ids[i]`; `runner.requests[id]` holds the
prompt and `SamplingParams.extra_args` (`das_problem_id`, optional `das_epoch`, `das_sample`). vLLM builds the
proposer inside the model runner's constructor and then calls `propose` from a runner method, so the runner is
found once, on the first call, up the calling stack: the first `self` that has an input batch and whose
`drafter` is this proposer, or a wrapper holding it as `user_proposer` (some vLLM versions wrap custom
proposers in `CustomClassProposer`). No engine argument or RPC is needed, so servers that never call
`collective_rpc` (verl's) work unchanged; `collective_rpc("das_attach")` attaches explicitly.

The step itself (`DasProposer.step`) needs no engine: request ids, token counts, the token matrix and the
requests' descriptions, and a clock (`clock`: the verifier's step is the interval between a return and the
next call). It registers joiners, finishes leavers, learns from the previous step's verification
(`before_draft`), then budgets, commits every row's new tokens, drafts, applies the pay-off rule and counts
(`draft_step`), both inside `decode_step`; metrics reach Prometheus as running totals a few times a second.

History freshness:
- embedded: the rollout driver pushes finished trajectories with `collective_rpc("das_add_trajectories")`;
  a request carrying `das_epoch` and `das_sample` is also added to its problem's history by the proposer itself
  when it finishes (adding is idempotent by key, so the later push changes nothing).
- distributed: with `DAS_HISTORY_DIR` set, the proposer opens the node's history replica (RocksDB) as a
  secondary instance and loads it at start; from then on a thread of its own (`history_feed`) catches up every
  `DAS_CATCH_UP_INTERVAL_S`, decodes what changed and extends and evicts the trees in bounded pieces between
  decode steps, never inside one (a step waits at most for the piece under way). With `DAS_HISTORY_LOAD=lazy`
  (the default) the start loads every problem's bookkeeping and the global tree, and a problem's history tree
  is built from the replica when its first request arrives, or earlier through `das_prefetch` (verl's managers
  send each server the problems of the step that the router placed there, and `das_release` to the server a
  problem moved away from): behind problem-keyed routing a server holds the trees of its own problems only, and
  drafts exactly as if it had loaded them all.
  A replica that is missing, empty or does not open (or fails while followed) stops nothing: the proposer logs
  one warning, drafts from its own requests and their siblings, and the same thread retries every
  `DAS_HISTORY_RETRY_S`, loading the replica in pieces between steps once it opens
  (`das_proposer_history_missing`, `das_proposer_history_outages_total`).

Nothing a request carries can crash the engine: malformed `extra_args` give one warning and own-context
drafting; an unexpected error in drafting is logged, counted, and that step drafts nothing.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise, repeat
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np

from history_store.automaton.config import DraftConfig
from history_store.automaton.deferred_index import DeferredIndex
from history_store.automaton.kernels import DONE
from history_store.automaton.problem_index import BatchDrafts, ProblemIndex
from history_store.native.bundles import draft_params
from workers.budget.config import BudgetConfig
from workers.budget.policy import BudgetPolicy
from workers.errors import InvalidInput
from workers.generator.history_feed import HistoryFeed, no_gate
from workers.generator.settings import ProposerSettings
from workers.generator.step import DirectCall, StepTables, pack_tables
from workers.generator.step import decode_step as _decode_step_dispatcher
from workers.generator.step import draft_step as _draft_step_dispatcher
from workers.generator.step_book import END, MetricsFlush, StepBook
from workers.generator.step_tables import Reply, StepGroups

# The step's kernels, called past numba's dispatcher while the tables keep their type (`DirectCall`).
decode_step = DirectCall(_decode_step_dispatcher)
draft_step = DirectCall(_draft_step_dispatcher)

logger = logging.getLogger(__name__)

MAX_PROBLEM_ID_LEN = 512
# Frames searched above `propose` for the model runner: vLLM calls it from the runner's draft method, two or
# three frames up depending on the version and wrapper. Why frames: vLLM (0.24 and 0.32) builds a custom_class
# proposer from the config alone and passes `propose` no request ids; a worker extension is appended as the
# worker's last base class, so it cannot wrap a method vLLM calls (the worker's own comes first), and verl's
# servers never call `collective_rpc("das_attach")`. The caller's frame is the one place the runner is named;
# the search runs once per engine.
_RUNNER_SEARCH_DEPTH = 8
# Steps whose cost coefficients are kept between `reset_stats` calls (`step_costs`): a long epoch's worth, a
# few MB at most.
_STEP_COSTS_KEPT = 1 << 18


class LastStep(NamedTuple):
    """The last step's drafts in full, row-aligned with its rows (`DasProposer.last_step`): views of reused
    buffers, valid until the next step."""

    slots: np.ndarray  # the rows' request slots (the budget's per-request state is indexed by them)
    drafts: BatchDrafts  # what the trees drafted, before the budget's cut
    kept: np.ndarray  # tokens kept of each row's draft (sent to vLLM)
    predicted: np.ndarray  # (rows, K) the budget's path acceptance of each token (with the budget on)
    path_p: np.ndarray  # (rows, K) its raw path before the past-match recalibration
    queued: int  # requests the budget counted as queued (tail candidates without a row)


@dataclass
class _Live:
    """A request the proposer has registered in the index."""

    slot: int
    problem_id: str | None
    epoch: int | None
    sample: int | None
    prompt_len: int
    max_tokens: int | None
    stop_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    # A segment verl's fully-async client resumed (its prompt holds an earlier partial output): it is no
    # trajectory, so it neither enters the history nor teaches the budget a length.
    resumed: bool = False


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


def is_resumed(extra_args: Any, prompt_len: int) -> bool:
    """True when `extra_args` name a shorter prompt (`das_prompt_tokens`, set by verl's `das_agent`) than the
    request has: verl's fully-async client resumed it with the partial output appended to the prompt."""
    asked = extra_args.get("das_prompt_tokens") if isinstance(extra_args, dict) else None
    return isinstance(asked, int) and not isinstance(asked, bool) and asked < prompt_len


def _is_output_rank() -> bool:
    """True on the tensor-parallel rank whose drafts vLLM's executor uses (rank 0; also outside a
    distributed setup)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().rank_in_group == 0
    except (ImportError, AssertionError):  # no vLLM, or no process group (a proposer built outside an engine)
        return True


def _natural_end(live: _Live, tokens: np.ndarray) -> int | None:
    """The response length vLLM returned if the request ended by itself: through its first stop token at or
    after min_tokens (accepted drafts may have run past it in the runner), or at max_tokens. None when it ended
    otherwise (aborted, or a stop string). `tokens` is the request's prompt and committed output."""
    fed = tokens.shape[0] - live.prompt_len
    if live.stop_ids:
        response = tokens[live.prompt_len :]
        stops = np.flatnonzero(np.isin(response[live.min_tokens :], list(live.stop_ids)))
        if stops.size:
            end = live.min_tokens + int(stops[0]) + 1
            return end if live.max_tokens is None else min(end, live.max_tokens)
    if live.max_tokens is not None and fed >= live.max_tokens:
        return live.max_tokens
    return None


class DasProposer:
    """vLLM `custom_class` proposer: per-problem history drafts with a length-aware budget."""

    def __init__(
        self,
        vllm_config: Any,
        settings: ProposerSettings | None = None,
        draft_config: DraftConfig | None = None,
        publish: bool = True,
    ) -> None:
        """vLLM builds it from its config alone; the settings then come from `DAS_*` variables. Callers
        outside vLLM (the replay, benchmarks) may pass `settings`, a `draft_config` that replaces the one the
        settings give, and `publish=False` to keep the counts from Prometheus."""
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.settings = settings or ProposerSettings.from_env()
        # With tensor parallelism every rank builds a proposer, but vLLM's executor takes drafts only from the
        # first rank of the last pipeline stage and sends them to every rank with the next schedule; the other
        # ranks neither draft nor load the history (asynchronous scheduling, which would use local drafts, is
        # off for custom_class).
        self.drafting = _is_output_rank()
        # `pause_drafting`: the engine keeps its speculative path but gets no drafts (the cost of that path
        # alone, for benchmarks).
        self.paused = False
        self.draft_config = draft_config or self.settings.drafting(self.k)
        # A server that follows a replica changes its history trees in bounded pieces between steps
        # (`workers.generator.history_feed`); an embedded one as its history is pushed.
        index_class = ProblemIndex if self.settings.history_dir is None else DeferredIndex
        self.index = index_class(
            window_epochs=self.settings.window_epochs,
            config=self.draft_config,
            draft_threads=self.settings.draft_threads,
            # Only a replica can supply a problem's history later; embedded histories are pushed whole.
            lazy=self.settings.history_dir is not None and self.settings.history_load == "lazy",
        )
        self.runner: Any = None
        # Where step times come from: the verifier's step is the interval from one return to the next call.
        # A benchmark outside vLLM sets the clock of the engine it models.
        self.clock: Callable[[], float] = time.perf_counter
        self._live: dict[str, _Live] = {}
        self._slot_of: dict[str, int] = {}
        # The last step's request ids and their slots: vLLM's rows stay the same between most steps.
        self._rows_seen: list[str] | None = None
        self._rows_slots = np.zeros(0, np.int64)
        self._row_base = np.zeros(0, np.int64)
        self._row_width = 0
        self._all_verified = np.zeros(0, np.int64)  # `scheduled` when the caller knows of no cuts: -1s
        self._warned: set[str] = set()
        # The node's replica, followed off the step (None: embedded, or a rank that does not draft), and the
        # step's hold on the index against it.
        self._feed: HistoryFeed | None = None
        self._gate: Any = no_gate()
        self._publish = publish
        # Problems whose history trees were built on demand (those with history), the tokens and seconds that
        # took, and the longest single build (what a first request of a problem may add to its decode step).
        self._loaded_problems = 0
        self._loaded_tokens = 0
        self._load_seconds = 0.0
        self._load_seconds_max = 0.0
        # What the submitter last said it submitted here (`set_submitted`): per problem, requests, and their
        # max_tokens; and how many of them have started since. The rest wait in vLLM's queue: the budget's tail
        # candidates, each held in a slot of its own (`_queue_slots`, started in the policy, not in the index).
        self._submitted: dict[str, int] = {}
        self._submitted_cap: int | None = None
        self._started: Counter[str] = Counter()
        self._queue_slots: dict[str, list[int]] = {}
        self._queued = np.zeros(0, np.int64)
        self._queue_stale = False
        if self.drafting:  # the other tensor-parallel ranks never draft: nothing to compile there
            self._new_step_state(publish=False)
            self._warm_up()
        self._new_step_state(publish=publish)

    def _new_step_state(self, publish: bool) -> None:
        """Fresh budget policy, bookkeeping and counters; `publish`: whether the counts reach Prometheus."""
        # The index hands out the request slots; the policy's and the book's per-slot arrays grow with its.
        self.policy = BudgetPolicy(BudgetConfig(max_tokens=self.k), request_rows=self.index.request_rows)
        self._book = StepBook(self.k, request_rows=self.index.request_rows)
        self._step_tables: StepTables | None = None
        self._tables_key: tuple[int, ...] = ()
        # The kept drafts as the kernel packs them (`_pack_reply`): tokens, and where each row's start.
        self._reply = Reply(tokens=np.zeros(0, np.int32), bounds=np.zeros(0, np.int64))
        # The cost model refits every few steps; its gauges follow at each flush, not at each refit.
        self._metrics = MetricsFlush(self._book, publish=publish, also_publish=self.policy.cost.publish)
        self._step_no = 0
        self._last_rows = 0  # rows of the previous step, and when it returned
        self._last_ended_at: float | None = None
        self._verify_seconds: float | None = None
        self.reset_stats()

    def _warm_up(self) -> None:
        """Compiles the step's native kernels now (numba caches them on disk, but a cold cache costs seconds),
        so that vLLM's first decode step is not the one that waits: two steps of a throwaway request, typed as
        vLLM's runner types its arrays (int32 token counts and matrix); and the history's (a rollout added,
        then evicted, then the arena compacted and its hash table grown beside the step, in pieces of a throwaway
        index: on a cold cache they took about 14 s inside the first step in which a request finished, and a
        first piece compiled its kernels for 0.7 s while it held the step off). The caller then starts afresh."""
        key = "__das_warmup__"
        tokens = np.tile(np.arange(1, 9, dtype=np.int32), (1, 4))  # repeats: the second step has a draft
        request = SimpleNamespace(
            num_prompt_tokens=8, sampling_params=SimpleNamespace(extra_args=None, max_tokens=16)
        )
        # The third step outgrows the segment sized for max_tokens: the mid-step growth's `draft_step`, whose
        # first compile on a cold cache held a measured step 3.8-4.9 s (`das bench ingest`, batch 256).
        for end in (9, 10, 32):
            self.step([key], np.array([end], np.int32), tokens, {key: request})
        self._finish(key)
        scratch = DeferredIndex(window_epochs=1, config=self.draft_config)
        for epoch in (0, 1):  # the second epoch evicts the first: a rebuild, in pieces
            scratch.add_trajectory(key, epoch, 0, tokens[0, :8], tokens[0, 8:])
        scratch.forest.compaction_wanted = True  # and a compaction, in pieces (`tree_work.Mirror`)
        scratch.settle()
        scratch.forest.hashes_wanted = (
            True  # and a growth of its hash table, as a server's history thread does it
        )
        for _ in range(16):  # plan, write, begin, copy, install: a few rounds on a table this small
            scratch.prepare()
            scratch.work(1)
            if not scratch.forest.hashes_wanted:
                break

    @classmethod
    def standalone(
        cls,
        k: int,
        max_model_len: int,
        settings: ProposerSettings | None = None,
        draft_config: DraftConfig | None = None,
        publish: bool = True,
    ) -> DasProposer:
        """A proposer outside vLLM (the replay, benchmarks, tests): the same object the engine builds from its
        config (the other arguments as `__init__`'s)."""
        config = SimpleNamespace(
            speculative_config=SimpleNamespace(num_speculative_tokens=k),
            model_config=SimpleNamespace(max_model_len=max_model_len),
        )
        return cls(config, settings=settings, draft_config=draft_config, publish=publish)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model: drafts come from suffix trees. vLLM's CPU runner calls this unconditionally."""
        if self.settings.history_dir and self.drafting and self._feed is None:
            # Never fails the engine: without a readable replica the server drafts from its requests' own tokens
            # and siblings, and the feed opens the replica when it appears (or after damage, again).
            self._open_replica(Path(self.settings.history_dir))
        if self.drafting:
            from workers.generator.metrics_endpoint import serve_proposer_metrics

            try:
                serve_proposer_metrics()
            except OSError as exc:  # metrics must never stop an engine
                logger.warning("DAS: cannot serve the proposer's /metrics (%s); drafting goes on", exc)

    def pause_drafting(self, paused: bool) -> None:
        """Stops (or resumes) drafting while the engine keeps its speculative path: every step gets no drafts.
        Requests that join or finish meanwhile are registered or reaped at the first step after resuming."""
        self.paused = paused

    # ------------------------------------------------------------------ statistics
    def reset_stats(self) -> None:
        """Zeroes the counters `stats` reports (not the Prometheus metrics, which only grow)."""
        self._base = self._book.snapshot()
        self._errors = 0
        self._malformed = 0
        self._draft_seconds = 0.0
        self._step_costs: list[tuple[float, float, float]] = []
        self._step_trace: list[tuple[int, int, int]] = []

    def step_costs(self) -> list[tuple[float, float, float]]:
        """The cost coefficients (c_base, c_seq, c_tok) each step since `reset_stats` budgeted with, in order:
        what this engine fitted from its own step times. `das traces generate` records them so that a replay of
        its trace prices drafts as this engine did (`das bench fidelity`, `pin_costs`)."""
        return list(self._step_costs)

    def step_trace(self) -> list[tuple[int, int, int]]:
        """Each step since `reset_stats`, as (rows, tokens the rows held, draft tokens returned), in order: where
        a replay of the same trace first parts from this engine (`das bench fidelity`)."""
        return list(self._step_trace)

    def pin_costs(self, coefficients: tuple[float, float, float]) -> None:
        """Budgets with these cost coefficients and fits none from step times until the next call (a replay
        pricing steps as a recorded engine did)."""
        self.policy.cost.pin(coefficients)

    def stats(self) -> dict[str, Any]:
        """Counters since the last reset, the live request count, and the budget policy's state."""
        with self._gate_hold():
            return self._stats()

    def _stats(self) -> dict[str, Any]:
        self._metrics.flush()
        out = self._book.since(self._base)
        out["draft_seconds"] = self._draft_seconds
        out["errors"] = self._errors
        out["malformed_requests"] = self._malformed
        out["live_requests"] = len(self._live)
        out["budget_enabled"] = self.settings.budget
        out["draft_threads"] = self.index.draft_threads
        out["drafting_rank"] = self.drafting
        out["policy"] = self.policy.snapshot()
        out["history_problems"] = len(self.index.problem_ids())
        out["history_available"] = self.history_available
        out["history_outages"] = self._feed.outages if self._feed is not None else 0
        out["history_loads"] = {
            "problems": self._loaded_problems,
            "tokens": self._loaded_tokens,
            "seconds": self._load_seconds,
            "max_seconds": self._load_seconds_max,
        }
        if self._feed is not None:
            out["history_feed"] = self._feed.stats()
        return out

    # ------------------------------------------------------------------ history
    def add_trajectories(self, records: list[dict[str, Any]]) -> int:
        """Adds finished trajectories (TrajectoryRecord fields) to the history; returns how many were new.

        Raises:
            ValueError: a record misses a field or has the wrong types (checked by TrajectoryRecord).
        """
        from pipeline.schemas import TrajectoryRecord

        with self._gate_hold():
            if self.runner is not None:
                self._reap(self.runner.requests)
            return sum(self._add_record(TrajectoryRecord, raw) for raw in records)

    def _add_record(self, model: Any, raw: Any) -> int:
        record = raw if isinstance(raw, model) else model.model_validate(raw)
        return self._add(
            record.problem_id,
            record.epoch,
            record.sample,
            record.prompt_ids,
            record.response_ids,
            record.response_logprobs,
        )

    def _add(
        self,
        problem_id: str,
        epoch: int,
        sample: int,
        prompt_ids: Any,
        response_ids: Any,
        response_logprobs: Any = None,
    ) -> int:
        new = self.index.add_trajectory(
            problem_id, epoch, sample, prompt_ids, response_ids, response_logprobs
        )
        if new:
            self.policy.lengths.observe(problem_id, len(response_ids))
        return int(new)

    def evict(self, problem_id: str, min_epoch: int) -> int:
        """Drops a problem's history epochs below `min_epoch`; returns how many trajectories left."""
        with self._gate_hold():
            evicted = self.index.evict_epochs_before(problem_id, min_epoch)
            if evicted:
                self.policy.lengths.forget(problem_id)
            return len(evicted)

    def _gate_hold(self) -> Any:
        """The index for a caller outside the step (an RPC): after the history thread's current piece."""
        return self._gate if self._feed is None else self._feed.gate.hold()

    def _open_replica(self, path: Path) -> None:
        """Follows the node's replica: loads it now if it is readable, and from then on keeps the trees in step
        with it from a thread of its own (`HistoryFeed`); a missing or damaged one is opened when it can be."""
        from workers.generator.replica_dirs import secondary_dir

        secondary = Path(os.environ.get("DAS_SECONDARY_DIR") or secondary_dir(path))
        assert isinstance(self.index, DeferredIndex)
        self._feed = HistoryFeed(
            path,
            secondary,
            self.index,
            learn=lambda problem_id, length: self.policy.lengths.observe(problem_id, length),
            forget=lambda problem_id: self.policy.lengths.forget(problem_id),
            relearn=self._relearn_lengths,
            catch_up_interval_s=self.settings.catch_up_interval_s,
            retry_s=self.settings.history_retry_s,
            duty=self.settings.history_duty,
            publish=self._publish,
        )
        self._feed.open()
        self._gate = self._feed.gate
        self._feed.start()

    @property
    def history_available(self) -> bool:
        """Whether the proposer follows its replica (False without one configured, or while it is unavailable)."""
        return self._feed is not None and self._feed.available

    def prefetch(self, problem_ids: Sequence[str]) -> int:
        """Builds the history trees of problems whose requests are coming (a lazy load's first request then
        finds them ready); returns the tokens added. Problems without history, or resident already, cost
        nothing; without a replica (or with an eager load) it does nothing."""
        with self._gate_hold():
            return sum(self._make_resident(p) for p in problem_ids)

    def release(self, problem_ids: Sequence[str]) -> int:
        """Drops the history trees of problems that moved to another server (a problem with a live request here
        keeps its tree); a later request builds them again. Returns the tokens dropped."""
        with self._gate_hold():
            return sum(self.index.release(p) for p in problem_ids)

    def _make_resident(self, problem_id: str) -> int:
        if self._feed is None or self.index.is_resident(problem_id):
            return 0
        started = time.perf_counter()
        feed = self._feed

        def fetch(pid: str, epoch: int, sample: int) -> tuple[Any, ...] | None:
            record = feed.fetch(pid, epoch, sample)
            if record is None:
                return None
            return record.prompt_ids, record.response_ids, record.response_logprobs

        tokens = self.index.make_resident(problem_id, fetch)
        seconds = time.perf_counter() - started
        self._loaded_problems += tokens > 0
        self._loaded_tokens += tokens
        self._load_seconds += seconds
        self._load_seconds_max = max(self._load_seconds_max, seconds)
        return tokens

    def _relearn_lengths(self) -> None:
        """The budget's length predictions from what the index holds (after a load from the replica)."""
        for problem_id in self.index.problem_ids():
            self.policy.lengths.forget(problem_id)
            for length in self.index.problem_stats(problem_id)["response_lengths"]:
                self.policy.lengths.observe(problem_id, length)

    def catch_up(self) -> None:
        """Brings the trees in step with the node's replica now, wholly (the feed's thread does it between
        steps by itself; tests and tools call this for a known state). Opens a replica that has appeared."""
        if self._feed is not None:
            self._feed.drain()

    def close(self) -> None:
        """Stops following the replica (its thread and secondary instance); the trees stay as they are."""
        if self._feed is not None:
            self._feed.close()

    # ------------------------------------------------------------------ the decode step
    def _find_runner(self) -> Any:
        # vLLM calls propose from a model runner method; walk up to the first `self` that looks like a runner
        # and drafts with this proposer (directly, or wrapped as `user_proposer`).
        frame = sys._getframe(1)
        for _ in range(_RUNNER_SEARCH_DEPTH):
            frame = frame.f_back
            if frame is None:
                break
            caller = frame.f_locals.get("self")
            if hasattr(caller, "input_batch") and unwrap_proposer(getattr(caller, "drafter", None)) is self:
                self.runner = caller
                break
        return self.runner

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """Draft tokens per batch row (each at most K and within max_model_len), or [] where none."""
        n = len(sampled_token_ids)
        if not self.drafting or self.paused:
            return [[] for _ in range(n)]
        if self.runner is None and self._find_runner() is None:
            self._warn_once("runner", "DasProposer could not find the model runner: drafting disabled")
            return [[] for _ in range(n)]
        batch = self.runner.input_batch
        # The draft tokens vLLM's scheduler sent to the verifier this step, per row (it cuts drafts to fit its
        # token budget): the input batch keeps them until the next schedule (vLLM 0.24 and 0.32; a runner
        # without them counts every draft as verified).
        spec = getattr(batch, "spec_token_ids", None)
        scheduled = None if spec is None else np.fromiter(map(len, spec[:n]), np.int64, n)
        return self.step(
            batch.req_ids[:n], num_tokens_no_spec, token_ids_cpu, self.runner.requests, scheduled
        )

    def step(
        self,
        req_ids: Sequence[str],
        num_tokens: np.ndarray,
        token_ids: np.ndarray,
        requests: Mapping[str, Any],
        scheduled: np.ndarray | None = None,
    ) -> list[list[int]]:
        """One decode step for a batch, without an engine: row i is request req_ids[i], whose prompt and
        output are token_ids[i, :num_tokens[i]] (int32); `requests` maps every unfinished request id to its
        description (num_prompt_tokens, sampling_params with extra_args and max_tokens), as vLLM's runner
        does. Requests missing from it finished. `scheduled[i]` (int64): how many of row i's last draft
        tokens were verified, where the engine's scheduler cut some (None: all of them). Returns each row's
        draft (at most K, within max_model_len).

        Never raises: an unexpected error is logged and counted, and that step drafts nothing.
        """
        n = len(req_ids)
        # Row i's tokens start at i * width in the flattened matrix (a view: vLLM's matrix is contiguous).
        width = token_ids.shape[1]
        if self._row_base.shape[0] < n or self._row_width != width:
            self._row_base = np.arange(max(n, token_ids.shape[0]), dtype=np.int64) * width
            self._row_width = width
        src = token_ids.ravel() if token_ids.dtype == np.int32 else token_ids.astype(np.int32).ravel()
        return self.step_flat(req_ids, num_tokens, src, self._row_base[:n], requests, scheduled)

    def step_flat(
        self,
        req_ids: Sequence[str],
        num_tokens: np.ndarray,
        src: np.ndarray,
        bases: np.ndarray,
        requests: Mapping[str, Any],
        scheduled: np.ndarray | None = None,
    ) -> list[list[int]]:
        """`step` for tokens held in one flat int32 buffer: row i's prompt and output are
        src[bases[i] : bases[i] + num_tokens[i]] (bases int64, one per row). The replay keeps every request's
        tokens so and runs the engine's step on them."""
        started = self.clock()
        n = len(req_ids)
        if scheduled is None:
            if self._all_verified.shape[0] < n:
                self._all_verified = np.full(2 * n, -1, np.int64)
            scheduled = self._all_verified[:n]
        try:
            with self._gate:  # the history thread works between steps, never inside one
                drafts = self._step(req_ids, num_tokens, src, bases, requests, scheduled, started)
        except Exception:
            # The engine must survive whatever a request or the history holds; the error is logged and counted
            # (tests assert none happen) and this step simply drafts nothing.
            self._errors += 1
            logger.exception("DAS drafting failed; this step drafts nothing")
            self._last_rows = 0
            self._last_ended_at = self.clock()
            return [[] for _ in range(n)]
        ended = self.clock()
        self._draft_seconds += ended - started
        self._metrics.step_done(ended - started, self._verify_seconds, ended)
        self._last_ended_at = ended
        return drafts

    def _step(
        self,
        req_ids: Sequence[str],
        num_tokens: np.ndarray,
        src: np.ndarray,
        bases: np.ndarray,
        requests: Mapping[str, Any],
        scheduled: np.ndarray,
        started: float,
    ) -> list[list[int]]:
        self._reap(requests)
        if req_ids == self._rows_seen:  # the last step's rows, and no request started or finished since
            slots, joined = self._rows_slots, False
        else:
            slots, joined = self._slots_of_rows(req_ids, requests, src, bases)
        if (
            type(num_tokens) is not np.ndarray
            or num_tokens.dtype != np.int32
            or not num_tokens.flags.c_contiguous
        ):
            # The step kernel is called past numba's dispatcher (`DirectCall`): its argument types must stay.
            num_tokens = np.ascontiguousarray(num_tokens, np.int32)
        if self._queue_stale:
            self._requeue()
        total = self._native_step(slots, num_tokens, scheduled, joined, started, src, bases)
        self._last_rows = len(req_ids)
        self._step_no += 1
        # A fresh list per row (vLLM's scheduler may extend a draft in place), sliced from the packed tokens.
        packed, bounds = self._reply
        tokens, b = packed[:total].tolist(), bounds.tolist()
        return [tokens[start:end] for start, end in pairwise(b)]

    def _slots_of_rows(
        self, req_ids: Sequence[str], requests: Mapping[str, Any], src: np.ndarray, bases: np.ndarray
    ) -> tuple[np.ndarray, bool]:
        """Each row's slot, registering the requests that joined; and whether any did. Kept for the next
        step with a copy of the rows (vLLM rewrites its list of request ids in place)."""
        n, slot_of = len(req_ids), self._slot_of
        try:
            slots = np.fromiter(map(slot_of.__getitem__, req_ids), np.int64, n)
            joined = False
        except KeyError:  # requests joined the batch (rare next to steps): register them
            slots = np.fromiter(map(slot_of.get, req_ids, repeat(-1, n)), np.int64, n)
            for i in np.flatnonzero(slots < 0).tolist():
                key = req_ids[i]
                slots[i] = self._start(key, requests[key], src, int(bases[i]))
            joined = True
        self._rows_seen, self._rows_slots = list(req_ids), slots
        return slots, joined

    def last_step(self) -> LastStep:
        """What the last step drafted, kept and predicted per row (the replay reads it to verify the drafts)."""
        slots = self._rows_slots
        n = slots.shape[0]
        drafts, _ = self.index.step_buffers(n)
        kept = self._buffers.kept[:n] if self.settings.budget else drafts.lengths
        return LastStep(
            slots,
            drafts,
            kept,
            self._buffers.predicted[:n],
            self.policy.path_p[slots],
            self._queued.shape[0],
        )

    # ------------------------------------------------------------------ the queue
    def set_submitted(self, problems: Mapping[str, int], max_tokens: int | None = None) -> None:
        """Requests the submitter just submitted to this engine, per problem id (`das rollout` when it submits
        an epoch, verl's DAS managers with each step's prefetch), and the max_tokens they carry. Until one
        starts it waits in vLLM's queue, and the budget counts it as a tail candidate
        (`workers.budget.step.plan`), as the replay does; the requests that start from now on are taken off.
        Replaces the last call's counts (an empty mapping: no queue). Send it before the requests, or wait for
        it: a request that started before it arrived would be counted as waiting.

        Raises:
            ValueError: a count is negative, or a problem id is not a non-empty str.
        """
        for problem_id, count in problems.items():
            if not isinstance(problem_id, str) or not problem_id or isinstance(count, bool) or count < 0:
                raise InvalidInput(f"submitted requests need a problem id and a count >= 0: {problem_id!r}")
        self._submitted = {p: int(c) for p, c in problems.items() if c}
        self._submitted_cap = max_tokens
        self._started = Counter()
        self._queue_stale = True

    def _requeue(self) -> None:
        """The queued requests' slots from the submitted counts and the starts since: per problem, one slot per
        request not started yet, in problem order (the budget's sums run in it)."""
        self._queue_stale = False
        cap = self.max_model_len if self._submitted_cap is None else self._submitted_cap
        rows = self.index.request_rows
        for problem_id in self._queue_slots.keys() | self._submitted.keys():
            held = self._queue_slots.setdefault(problem_id, [])
            want = max(self._submitted.get(problem_id, 0) - self._started[problem_id], 0)
            while len(held) > want:
                rows.release(held.pop())
            while len(held) < want:
                held.append(rows.take())
            for slot in held:  # as a request that has not started: no speed, not outlived, the cap
                self.policy.start(slot, problem_id, cap)
            if not held:
                del self._queue_slots[problem_id]
        self._queued = np.fromiter(
            (slot for p in sorted(self._queue_slots) for slot in self._queue_slots[p]), np.int64
        )

    def _tables(self, n: int) -> StepTables:
        """The step kernels' tables for a batch of n rows, packed again only when they are stale: the batch
        size or the queue's length changed, or an array they hold was replaced, which only growth does (of the
        request slots, the problem rows or the arena: each counts its growths). Starting and finishing
        requests, adding and evicting history change the arrays' contents, never the arrays."""
        key = (
            n,
            self._queued.shape[0],
            self.index.request_rows.version,
            self.policy.lengths.problem_rows.version,
            self.index.forest.generation,
        )
        if self._step_tables is None or key != self._tables_key:
            self._step_tables = pack_tables(self._table_sources(n))
            self._tables_key = key
        return self._step_tables

    def _table_sources(self, n: int) -> StepGroups:
        """`pack_tables`' groups for n rows (the per-batch buffers, reused while n stays, included)."""
        policy, index = self.policy, self.index
        _, outputs = index.step_buffers(n)
        budget = policy.tables(n + self._queued.shape[0])
        self._buffers = budget.buffers
        if self._reply.bounds.shape[0] != n + 1:
            self._reply = Reply(tokens=np.zeros(n * self.k, np.int32), bounds=np.zeros(n + 1, np.int64))
        return StepGroups(
            arena=index.forest.tables(),
            slot_table=index.slots,
            outputs=outputs,
            params=draft_params(self.draft_config),
            draft_threads=index.draft_threads,
            book=self._book.kernel_state(n),
            budget=budget,
            reply=self._reply,
            k=self.k,
            max_model_len=self.max_model_len,
        )

    def _native_step(
        self,
        slots: np.ndarray,
        num_tokens: np.ndarray,
        scheduled: np.ndarray,
        joined: bool,
        now: float,
        src: np.ndarray,
        bases: np.ndarray,
    ) -> int:
        """The step's native work, in one call unless the index must grow mid-step: what the verification of
        the previous step's drafts teaches the budget (the tokens each verified row accepted, and the step's
        cost), then budgets, commit, drafts, the pay-off rule and counting. The interval from the previous
        return to this call is the verification step of the previous drafts; it counts only for a clean step
        (no joiner: an idle engine between batches always resumes with joining requests). Returns the number
        of kept draft tokens; they are packed in `self._reply`."""
        n = slots.shape[0]
        policy, budget_on = self.policy, self.settings.budget
        tables = self._tables(n)
        queued = self._queued
        verify_seconds = -1.0 if self._last_ended_at is None else now - self._last_ended_at
        m, clean, status, row, promoted, tokens = decode_step(
            tables,
            slots,
            num_tokens,
            scheduled,
            self._step_no,
            joined,
            verify_seconds,
            self._last_rows,
            budget_on,
            bases,
            src,
            queued,
        )
        self._verify_seconds = verify_seconds if clean else None
        while True:
            if promoted:
                policy.count_promotions(promoted)
            if status == DONE:
                break
            self.index.make_room(status, slots, row, self._book.per_row(n)[END])  # growth: tables repacked
            status, row, promoted, tokens = draft_step(
                self._tables(n), budget_on, True, row, slots, bases, src, self._step_no, queued
            )
        buffers = self._buffers
        policy.drafted(slots, buffers.value[:n], buffers.classes[:n], buffers.predicted[:n])
        if len(self._step_costs) < _STEP_COSTS_KEPT:
            c_base, c_seq, c_tok = policy.cost.coefficients.tolist()
            self._step_costs.append((c_base, c_seq, c_tok))
            self._step_trace.append((n, int(num_tokens[:n].sum()), int(tokens)))
        return tokens

    def _start(self, key: str, request: Any, src: np.ndarray, base: int) -> int:
        sampling = request.sampling_params
        problem_id, epoch, sample, problem = parse_extra_args(getattr(sampling, "extra_args", None))
        if problem is not None:
            self._malformed += 1
            self._warn_once(f"malformed:{key}", f"request {key}: {problem}; drafting from its own context")
        prompt_len = int(request.num_prompt_tokens)
        max_tokens = getattr(sampling, "max_tokens", None)
        # What it may commit: a step that meets a request outgrowing its token segment stops to move it.
        expected = min(prompt_len + int(max_tokens or self.max_model_len), self.max_model_len)
        if problem_id is not None:
            # Its history tree, built from the replica now if no prefetch did (a lazy load's first request).
            self._make_resident(problem_id)
        slot = self.index.start_request(key, problem_id, src[base : base + prompt_len], expected)
        self.policy.start(slot, problem_id, expected - prompt_len)
        self._live[key] = _Live(
            slot,
            problem_id,
            epoch,
            sample,
            prompt_len,
            max_tokens,
            # vLLM keeps EOS among all_stop_token_ids under ignore_eos; such a request stops only on its own.
            frozenset(
                (getattr(sampling, "stop_token_ids", None) or ())
                if getattr(sampling, "ignore_eos", False)
                else (getattr(sampling, "all_stop_token_ids", None) or ())
            ),
            int(getattr(sampling, "min_tokens", 0) or 0),
            is_resumed(getattr(sampling, "extra_args", None), prompt_len),
        )
        self._slot_of[key] = slot
        self._rows_seen = None
        self._book.start(slot, prompt_len)
        if problem_id in self._submitted:
            self._started[problem_id] += 1
            self._queue_stale = True
        return slot

    def _finish(self, key: str) -> None:
        live = self._live.pop(key)
        del self._slot_of[key]
        self._rows_seen = None
        tokens = self.index.request_tokens(key)
        response_len = (
            _natural_end(live, tokens) if live.problem_id is not None and not live.resumed else None
        )
        self.index.finish_request(key)
        # Aborted requests (verl's partial rollouts, a client gone) and stop strings (matched in vLLM's front
        # end, which then aborts the request here) end early for reasons the runner does not show: they must
        # neither feed short lengths to the budget nor enter the history under a real key.
        self.policy.finish(live.slot)
        if response_len is not None and (live.epoch is None or live.sample is None):
            # A sibling that ended by itself tells how long this epoch runs: the budget learns it now (a
            # request naming its epoch and sample teaches it through the history, just below).
            self.policy.lengths.observe(live.problem_id, response_len)
        if response_len is not None and live.epoch is not None and live.sample is not None:
            prompt, response = (
                tokens[: live.prompt_len],
                tokens[live.prompt_len : live.prompt_len + response_len],
            )
            # With a replica, its trees take it in pieces between steps, and the replica's copy of it (published
            # by the rollout) is neither decoded nor inserted again.
            self._add(live.problem_id, live.epoch, live.sample, prompt, response)
            if self._feed is not None:
                self._feed.own((live.problem_id, live.epoch, live.sample))

    def _reap(self, requests: Mapping[str, Any]) -> None:
        """Finishes requests that left the engine (gone from `requests`; preempted ones stay there), in the
        order they started: each adds its trajectory and length, and the length model's state depends on their
        order (a set's order would differ between processes)."""
        for key in [key for key in self._live if key not in requests]:
            self._finish(key)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)


def unwrap_proposer(drafter: Any) -> DasProposer | None:
    """The DasProposer a runner drafts with: its drafter itself, or the user proposer a vLLM
    `CustomClassProposer` wraps; None when it runs something else."""
    for candidate in (drafter, getattr(drafter, "user_proposer", None)):
        if isinstance(candidate, DasProposer):
            return candidate
    return None


class DasWorkerExtension:
    """Methods mixed into vLLM's worker (`worker_extension_cls`), reachable with `collective_rpc(name)`."""

    def _das(self) -> DasProposer:
        proposer = unwrap_proposer(getattr(self.model_runner, "drafter", None))  # type: ignore[attr-defined]
        if proposer is None:
            raise RuntimeError(
                "the engine does not run DasProposer: pass speculative_config="
                '{"method": "custom_class", "model": "workers.proposer.DasProposer", ...}'
            )
        return proposer

    def das_attach(self) -> None:
        """Hands the model runner to the proposer explicitly (it is otherwise found on the first step)."""
        self._das().runner = self.model_runner  # type: ignore[attr-defined]

    def das_add_trajectories(self, records: list[dict[str, Any]]) -> int:
        """Adds finished trajectories to the proposer's history; returns how many were new."""
        return self._das().add_trajectories(records)

    def das_submitted(self, problems: dict[str, int], max_tokens: int | None = None) -> None:
        """Requests just submitted here, per problem (`DasProposer.set_submitted`)."""
        self._das().set_submitted(problems, max_tokens)

    def das_prefetch(self, problem_ids: list[str]) -> int:
        """Builds the history trees of problems about to be requested (`DasProposer.prefetch`)."""
        return self._das().prefetch(problem_ids)

    def das_release(self, problem_ids: list[str]) -> int:
        """Drops the history trees of problems that moved away (`DasProposer.release`)."""
        return self._das().release(problem_ids)

    def das_evict(self, problem_id: str, min_epoch: int) -> int:
        """Evicts a problem's history epochs below `min_epoch`; returns how many trajectories left."""
        return self._das().evict(problem_id, min_epoch)

    def das_stats(self) -> dict[str, Any]:
        """The proposer's counters and budget policy state."""
        return self._das().stats()

    def das_step_costs(self) -> list[tuple[float, float, float]]:
        """`DasProposer.step_costs` on this worker."""
        return self._das().step_costs()

    def das_step_trace(self) -> list[tuple[int, int, int]]:
        """`DasProposer.step_trace` on this worker."""
        return self._das().step_trace()

    def das_pause_drafting(self, paused: bool) -> None:
        """`DasProposer.pause_drafting` on this worker."""
        self._das().pause_drafting(paused)

    def das_reset_stats(self) -> None:
        """Zeroes the proposer's counters (e.g. between benchmark epochs)."""
        self._das().reset_stats()
