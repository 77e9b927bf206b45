"""What each strategy of the replay drafts (`replay.simulate` verifies it against the recorded continuation).

- `NoDrafter` (none) and `NgramDrafter` (vLLM's prompt lookup) draft from nothing or the request's context.
- `IndexDrafter` (suffix-global, suffix-problem, das-unbudgeted, oracle) drafts from a `ProblemIndex` at the
  start of each step, every row up to K.
- `EngineDrafter` (das) runs the engine's own proposer (`DasProposer`) as vLLM calls it: after each forward
  step, for every row that step ran (finished ones included), with the requests still unfinished, the epoch's
  submitted requests (`set_submitted`, as `das rollout` sends them) and a clock that advanced by the step's
  modelled cost; the next step verifies those drafts. The budget, its cost fit and the history it drafts from are the engine's, so a
  replayed makespan is the one of the code an engine runs.

Every drafter sees an epoch through `EpochRequests` and answers a step with `Drafts`, row-aligned with it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
from numba import njit

from history_store.automaton.config import DraftConfig
from history_store.automaton.problem_index import ProblemIndex
from pipeline.schemas import TrajectoryRecord
from workers.budget.config import BUDGET_MIN_TOKEN_PROB
from workers.generator.proposer import DasProposer
from workers.generator.settings import ProposerSettings

TREE_STRATEGIES = ("suffix-global", "suffix-problem", "das-unbudgeted", "oracle")


class Drafts(NamedTuple):
    """One step's drafts, row-aligned with the step's rows. The tree fields are None for none and ngram;
    `predicted` (the budget's path acceptance of each token) and `path_p` (its raw path before the past-match
    recalibration) only for das."""

    tokens: np.ndarray  # (n, K) int32
    kept: np.ndarray  # (n,) int64: tokens sent to the verifier
    probs: np.ndarray | None = None  # (n, K) the tree's path probabilities
    agreement: np.ndarray | None = None  # (n, 2)
    sources: np.ndarray | None = None  # (n,) a kernels.Source
    match_lens: np.ndarray | None = None  # (n,)
    remembered: np.ndarray | None = None  # (n, K)
    predicted: np.ndarray | None = None  # (n, K)
    path_p: np.ndarray | None = None  # (n, K)


@dataclass
class EpochRequests:
    """An epoch's requests as every drafter reads them: keys "problem/epoch/sample", prompts, the responses
    flattened (request i's at responses[starts[i]:starts[i + 1]]) and how far each has got (`pos`, which the
    replay advances)."""

    records: list[TrajectoryRecord]
    keys: list[str]
    prompts: list[np.ndarray]
    responses: np.ndarray
    starts: np.ndarray
    pos: np.ndarray

    @classmethod
    def of(cls, records: list[TrajectoryRecord]) -> EpochRequests:
        lengths = np.array([len(r.response_ids) for r in records], np.int64)
        starts = np.zeros(len(records) + 1, np.int64)
        np.cumsum(lengths, out=starts[1:])
        responses = np.fromiter((t for r in records for t in r.response_ids), np.int32, int(starts[-1]))
        return cls(
            records=records,
            keys=[f"{r.problem_id}/{r.epoch}/{r.sample}" for r in records],
            prompts=[np.asarray(r.prompt_ids, np.int32) for r in records],
            responses=responses,
            starts=starts,
            pos=np.zeros(len(records), np.int64),
        )

    def context(self, i: int) -> np.ndarray:
        """Request i's prompt and the response tokens it has produced."""
        start = self.starts[i]
        return np.concatenate([self.prompts[i], self.responses[start : start + self.pos[i]]])


class NoDrafter:
    """`none`: plain decoding."""

    def __init__(self, k: int) -> None:
        self.k = k

    def start_epoch(self, requests: EpochRequests) -> None:
        self.requests = requests

    def draft(self, engine: int, rows: np.ndarray, room: np.ndarray) -> Drafts:
        n = rows.shape[0]
        return Drafts(tokens=np.zeros((n, self.k), np.int32), kept=np.zeros(n, np.int64))

    def after_step(
        self, engine: int, rows: np.ndarray, done: np.ndarray, seconds: float, queued: np.ndarray
    ) -> None:
        """Called once the step verified and advanced: `done`, the rows it finished; `seconds`, its modelled
        cost; `queued`, the rows still waiting for the engine."""

    def end_epoch(self) -> None:
        """Called after the epoch's last step."""


class NgramDrafter(NoDrafter):
    """`ngram`: vLLM's prompt lookup over the request's own context."""

    def __init__(self, k: int, ngram_range: tuple[int, int]) -> None:
        super().__init__(k)
        self.ngram_range = ngram_range

    def draft(self, engine: int, rows: np.ndarray, room: np.ndarray) -> Drafts:
        drafts = super().draft(engine, rows, room)
        for row in np.nonzero(room)[0]:
            draft = ngram_draft(self.requests.context(rows[row]), *self.ngram_range, self.k)
            drafts.tokens[row, : draft.shape[0]] = draft
            drafts.kept[row] = draft.shape[0]
        return drafts


@njit(cache=True)
def ngram_draft(ctx: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """vLLM's prompt lookup: the longest n-gram (min_n..max_n) ending the context that also occurs earlier;
    its earliest occurrence's next k tokens."""
    n_tok = ctx.shape[0]
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        for j in range(0, n_tok - n):
            match = True
            for t in range(n):
                if ctx[j + t] != ctx[n_tok - n + t]:
                    match = False
                    break
            if match:
                start = j + n
                return ctx[start : min(start + k, n_tok)].copy()
    return np.empty(0, ctx.dtype)


def _suffix_rules(config: DraftConfig) -> DraftConfig:
    # SuffixDecoding's own rules: raw count ratios, probability floor 0.1, match-length factor 1.
    return dataclasses.replace(
        config,
        escape=0.0,
        min_token_prob=0.1,
        max_spec_factor=1.0,
        max_spec_offset=0.0,
        remembered_probs=False,
    )


def tree_index(strategy: str, config: DraftConfig, window: int) -> ProblemIndex:
    """The index a tree strategy drafts from."""
    if strategy == "suffix-global":
        return ProblemIndex(
            window_epochs=1_000_000, config=_suffix_rules(config), use_history=False, live_scope="all"
        )
    if strategy == "suffix-problem":
        return ProblemIndex(
            window_epochs=1_000_000, config=_suffix_rules(config), use_global=False, live_scope="request"
        )
    if strategy == "das-unbudgeted":
        return ProblemIndex(window_epochs=window, config=config)
    if strategy == "oracle":
        # Foresight decides where a draft ends, not the tree's raw probability floor (as das's budget does).
        return ProblemIndex(
            window_epochs=window, config=dataclasses.replace(config, min_token_prob=BUDGET_MIN_TOKEN_PROB)
        )
    raise ValueError(f"not a tree strategy: {strategy!r}")


class IndexDrafter(NoDrafter):
    """The tree strategies: a `ProblemIndex` drafts for every row at the start of each step, up to K; a
    finished rollout enters history at once (as the indexer would)."""

    def __init__(self, strategy: str, config: DraftConfig, window: int) -> None:
        super().__init__(config.max_spec_tokens)
        self.index = tree_index(strategy, config, window)

    def start_epoch(self, requests: EpochRequests) -> None:
        super().start_epoch(requests)
        for key, r, prompt in zip(requests.keys, requests.records, requests.prompts, strict=True):
            self.index.start_request(key, r.problem_id, prompt)
        self._before = np.zeros(len(requests.keys), np.int64)

    def draft(self, engine: int, rows: np.ndarray, room: np.ndarray) -> Drafts:
        result = self.index.draft_batch([self.requests.keys[i] for i in rows], room)
        self._before[rows] = self.requests.pos[rows]
        return Drafts(
            tokens=result.tokens,
            kept=np.minimum(result.lengths, room).astype(np.int64),
            probs=result.probs,
            agreement=result.agreement,
            sources=result.sources,
            match_lens=result.match_lens,
            remembered=result.remembered,
        )

    def after_step(
        self, engine: int, rows: np.ndarray, done: np.ndarray, seconds: float, queued: np.ndarray
    ) -> None:
        requests = self.requests
        starts, pos = requests.starts, requests.pos
        self.index.append_batch(
            [requests.keys[i] for i in rows],
            [requests.responses[starts[i] + self._before[i] : starts[i] + pos[i]] for i in rows],
        )
        for i in done:
            r = requests.records[i]
            self.index.finish_request(requests.keys[i])
            self.index.add_trajectory(
                r.problem_id, r.epoch, r.sample, r.prompt_ids, r.response_ids, r.response_logprobs
            )

    def end_epoch(self) -> None:
        # Requests that produced nothing never ran.
        for i in np.nonzero(self.requests.starts[1:] == self.requests.starts[:-1])[0]:
            self.index.finish_request(self.requests.keys[i])


class _Clock:
    """An engine's modelled time: advanced by each forward step's modelled cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class EngineDrafter(NoDrafter):
    """das: each engine runs its own `DasProposer`, built as an engine builds it (the budget on, the replay's
    draft settings with the budget's probability floor) and called as vLLM calls it. Every proposer gets every
    finished trajectory, as every node's replica holds all of them; live siblings are per engine, as on a real
    fleet."""

    def __init__(
        self,
        config: DraftConfig,
        window: int,
        engines: int,
        max_tokens: int | None,
        longest: int,
        step_costs: Mapping[int, Sequence[Sequence[float]]] | None = None,
    ) -> None:
        """`longest`: the longest prompt plus response of the trace (sizes max_model_len so that every row may
        draft K, as the replay's other strategies do). `step_costs[epoch][j]`: the cost coefficients a
        recording engine budgeted its j-th step of that epoch with; the j-th step here then budgets with
        them too, and the modelled step times teach the budget nothing (`DasProposer.pin_costs`)."""
        super().__init__(config.max_spec_tokens)
        settings = ProposerSettings(budget=True, window_epochs=window)
        draft_config = dataclasses.replace(config, min_token_prob=BUDGET_MIN_TOKEN_PROB)
        self.max_tokens = max_tokens
        self.proposers = [
            DasProposer.standalone(
                self.k, longest + self.k + 2, settings=settings, draft_config=draft_config, publish=False
            )
            for _ in range(engines)
        ]
        self.clocks = [_Clock() for _ in self.proposers]
        for proposer, clock in zip(self.proposers, self.clocks, strict=True):
            proposer.clock = clock
        self.step_costs = step_costs or {}
        # Per epoch, the first engine's `DasProposer.step_trace` (what `das bench fidelity` diffs).
        self.traces: dict[int, list[tuple[int, int, int]]] = {}

    def start_epoch(self, requests: EpochRequests) -> None:
        super().start_epoch(requests)
        n = len(requests.keys)
        # Every request's prompt and whole response in one buffer: the proposer reads only what it has
        # committed (num_tokens), as from vLLM's token matrix.
        prompt_lens = np.array([p.shape[0] for p in requests.prompts], np.int64)
        self.bases = np.zeros(n + 1, np.int64)
        np.cumsum(prompt_lens + np.diff(requests.starts), out=self.bases[1:])
        self.src = np.concatenate(
            [
                part
                for i in range(n)
                for part in (
                    requests.prompts[i],
                    requests.responses[requests.starts[i] : requests.starts[i + 1]],
                )
            ]
            or [np.zeros(0, np.int32)]
        ).astype(np.int32)
        self.prompt_lens = prompt_lens
        self.described = [
            SimpleNamespace(
                num_prompt_tokens=int(prompt_lens[i]),
                sampling_params=SimpleNamespace(
                    extra_args={"das_problem_id": r.problem_id, "das_epoch": r.epoch, "das_sample": r.sample},
                    max_tokens=self.max_tokens,
                ),
            )
            for i, r in enumerate(requests.records)
        ]
        self.unfinished: list[dict[str, SimpleNamespace]] = [{} for _ in self.proposers]
        self.submitted = [False for _ in self.proposers]
        self.costs = self.step_costs.get(requests.records[0].epoch, ()) if requests.records else ()
        self.epoch = requests.records[0].epoch if requests.records else None
        self.trace_from = len(self.proposers[0].step_trace())
        self.steps = [0 for _ in self.proposers]
        k = self.k
        self.pending = Drafts(
            tokens=np.zeros((n, k), np.int32),
            kept=np.zeros(n, np.int64),
            probs=np.zeros((n, k), np.float32),
            agreement=np.zeros((n, 2), np.int32),
            sources=np.zeros(n, np.int32),
            match_lens=np.zeros(n, np.int32),
            remembered=np.full((n, k), -1.0, np.float32),
            predicted=np.zeros((n, k)),
            path_p=np.zeros((n, k)),
        )

    def draft(self, engine: int, rows: np.ndarray, room: np.ndarray) -> Drafts:
        """What the engine's last propose drafted for these rows (none for rows that did not run then)."""
        drafts = Drafts(*(a[rows] for a in self.pending))
        drafts.kept[room == 0] = 0
        self._verified = drafts.kept  # what this step verifies: vLLM's scheduled draft tokens
        return drafts

    def after_step(
        self, engine: int, rows: np.ndarray, done: np.ndarray, seconds: float, queued: np.ndarray
    ) -> None:
        requests, proposer = self.requests, self.proposers[engine]
        self.clocks[engine].now += seconds
        unfinished = self.unfinished[engine]
        keys = [requests.keys[i] for i in rows]
        for key, i in zip(keys, rows.tolist(), strict=True):
            if key not in unfinished:
                unfinished[key] = self.described[i]
        if not self.submitted[engine]:
            # The epoch's requests routed here were all submitted at its start: the first step ran some (their
            # prefill), the rest wait.
            self.submitted[engine] = True
            submitted = Counter(requests.records[i].problem_id for i in (*rows.tolist(), *queued.tolist()))
            proposer.set_submitted(submitted, self.max_tokens)
        step = self.steps[engine]
        self.steps[engine] += 1
        if step < len(self.costs):
            proposer.pin_costs(tuple(self.costs[step]))
        num_tokens = (self.prompt_lens[rows] + requests.pos[rows]).astype(np.int32)
        proposer.step_flat(keys, num_tokens, self.src, self.bases[rows], unfinished, self._verified)
        self._keep(proposer, rows)
        for i in done.tolist():
            # Finished: gone from vLLM's requests at the next step (which reaps it), and in every node's history.
            del unfinished[requests.keys[i]]
            r = requests.records[i]
            for other in self.proposers:
                other.add_trajectories([r])
        self.pending.kept[done] = 0

    def _keep(self, proposer: DasProposer, rows: np.ndarray) -> None:
        """The proposer's last drafts, held for the rows until the next step verifies them."""
        step = proposer.last_step()
        pending = self.pending
        pending.tokens[rows] = step.drafts.tokens
        pending.kept[rows] = step.kept
        pending.probs[rows] = step.drafts.probs
        pending.agreement[rows] = step.drafts.agreement
        pending.sources[rows] = step.drafts.sources
        pending.match_lens[rows] = step.drafts.match_lens
        pending.remembered[rows] = step.drafts.remembered
        pending.predicted[rows] = step.predicted
        pending.path_p[rows] = step.path_p

    def end_epoch(self) -> None:
        if self.epoch is not None:
            self.traces[self.epoch] = self.proposers[0].step_trace()[self.trace_from :]
        # The engines' last propose of the epoch drafted for rows that finished in it; the next epoch's first
        # step reaps them (its requests are all new).
        self.pending.kept[:] = 0
