"""Finite engines for the replay: slots, a queue, an admission order and a router.

A real RL step is larger than an engine's concurrency: requests wait in a queue and are admitted as slots
free (vLLM's `max_num_seqs`), and which ones are admitted last sets the epoch's tail. `Engines` describes the
fleet; `EpochSchedule` runs one epoch of it for `replay.simulate`, which asks it for the next engine step's
running rows (`next_step`) and tells it which finished (`finish`).

- Orders: `fcfs` is verl's layout (problem-major, a problem's samples consecutive), `random` a seeded
  shuffle of it, `predicted` DAS's length prediction (`workers.rollout.priority.LengthPredictor`: history and the
  cap; problems whose expected lengths the evidence separates run longest first, fcfs within ties; fixed when
  the epoch is submitted, as vLLM fixes a request's priority), `group-oracle` each problem's true mean length in
  the epoch, longest first, a group's samples together (the bound a predictor of problems, not samples, can
  reach), `oracle` the true length (longest first: the bound an order can reach).
- Routers (with `engines` > 1): `round-robin` is verl's (its least-loaded router sees all of a step's requests
  at once, so they alternate), `problem` DAS's problem-keyed routing (`workers.verl.router`): a problem's
  whole group goes to one engine, the one it used last epoch while that engine's predicted load stays within
  LOAD_SLACK of the mean, else the least-loaded.
- KV cache (`kv_tokens`, per engine, optional): a running request holds its prompt and generated tokens of
  KV, and each step needs one more token of room per running request. When they do not fit, the engine
  preempts as vLLM 0.32's scheduler does (`vllm/v1/core/sched/scheduler.py`): under the priority policy (the
  `predicted`, `group-oracle` and `oracle` orders, whose ranks are vLLM priorities) the running request with the largest
  (priority, arrival), under FCFS (`fcfs`, `random`: the order is the arrival order) the one admitted last,
  until the rest fit. A preempted request goes back to the front of the queue (by priority under the priority
  policy), keeps the tokens it generated and recomputes its prefix (prompt and generated tokens) when it is
  admitted again: that step drafts nothing and verifies the prefix. No request is admitted in a step that
  preempted, and admission stops at the first queued request whose prefix does not fit. Slots never preempt.
  A drafted token's KV is transient and not counted.
- Engines step in lockstep (one step each in turn), so a finished trajectory reaches history at about the
  time it would on a real fleet whatever the cost model; an epoch's makespan is its slowest engine's.
- das runs one engine proposer per engine (`replay_drafters.EngineDrafter`): history as every node's replica
  holds it, live siblings per engine. The tree strategies share one index: history, and live siblings wherever
  they run, so for them the router changes load balance, not what siblings can draft from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from workers.errors import InvalidInput
from workers.rollout.priority import LengthPredictor

ORDERS = ("fcfs", "random", "predicted", "group-oracle", "oracle")
# Orders whose ranks vLLM would take as priorities (the others are arrival orders, FCFS).
PRIORITY_ORDERS = ("predicted", "group-oracle", "oracle")
ROUTERS = ("round-robin", "problem")
# How far above the mean predicted load a problem's engine may be and still keep the problem (bounded-load
# consistent hashing's usual factor).
LOAD_SLACK = 1.25


def parse_slots(text: str) -> int | float:
    """`--max-num-seqs`: slots per engine ("32") or a share of an epoch's requests over all engines ("1/4")."""
    try:
        if "/" in text:
            num, den = (int(part) for part in text.split("/"))
            if num < 1 or den < num:
                raise InvalidInput
            return num / den
        value = int(text)
        if value < 1:
            raise InvalidInput
        return value
    except ValueError:
        raise InvalidInput(
            f"max-num-seqs must be a positive integer or a share like 1/4, got {text!r}"
        ) from None


@dataclass(frozen=True)
class Engines:
    """A fleet of engines with finite slots.

    max_num_seqs: slots per engine (int), or a share of each epoch's requests spread over the engines (float
    in (0, 1]: 0.25 gives each of E engines ceil(requests / 4 / E) slots).
    kv_tokens: KV cache per engine in tokens, or None for no limit but the slots.
    """

    max_num_seqs: int | float
    engines: int = 1
    order: str = "fcfs"
    router: str = "round-robin"
    seed: int = 0
    kv_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise InvalidInput(f"unknown order {self.order!r}; choose from {', '.join(ORDERS)}")
        if self.router not in ROUTERS:
            raise InvalidInput(f"unknown router {self.router!r}; choose from {', '.join(ROUTERS)}")
        if self.engines < 1:
            raise InvalidInput(f"engines must be >= 1, got {self.engines}")
        share = isinstance(self.max_num_seqs, float)
        if (share and not 0 < self.max_num_seqs <= 1) or (not share and self.max_num_seqs < 1):
            raise InvalidInput(f"max_num_seqs must be >= 1 or a share in (0, 1], got {self.max_num_seqs}")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise InvalidInput(f"kv_tokens must be >= 1, got {self.kv_tokens}")

    def slots(self, requests: int) -> int:
        """Slots per engine for an epoch of `requests`."""
        if isinstance(self.max_num_seqs, float):
            return max(1, math.ceil(requests * self.max_num_seqs / self.engines))
        return self.max_num_seqs

    def describe(self) -> dict:
        return {
            "max_num_seqs": self.max_num_seqs,
            "engines": self.engines,
            "order": self.order,
            "router": self.router,
            "seed": self.seed,
            "kv_tokens": self.kv_tokens,
        }


class Fleet:
    """What outlives an epoch: the length predictor (fed every finished response) and each problem's engine."""

    def __init__(self, spec: Engines, max_tokens: int | None) -> None:
        self.spec = spec
        self.predictor = LengthPredictor(max_tokens)
        self.placement: dict[str, int] = {}
        self.rng = np.random.default_rng(spec.seed)

    def epoch(
        self, problems: Sequence[str], lengths: np.ndarray, prompts: np.ndarray, pos: np.ndarray
    ) -> EpochSchedule:
        """The schedule of one epoch's requests (rows in trace order): their response and prompt lengths, and
        `pos`, the caller's array of tokens each has generated so far (read, never written)."""
        return EpochSchedule(self, list(problems), lengths, prompts, pos)


class EpochSchedule:
    """One epoch on the fleet: per engine a queue (rows in admission order) and the running rows."""

    def __init__(
        self, fleet: Fleet, problems: list[str], lengths: np.ndarray, prompts: np.ndarray, pos: np.ndarray
    ) -> None:
        spec = fleet.spec
        self.fleet = fleet
        self.problems = problems
        self.lengths = lengths
        self.prompts = prompts
        self.pos = pos
        self.slots = spec.slots(len(problems))
        if spec.kv_tokens is not None and len(problems):
            # vLLM refuses an engine whose KV cache cannot hold one request of max_model_len.
            longest = int((prompts + lengths).max()) + 1
            if longest > spec.kv_tokens:
                raise InvalidInput(f"kv_tokens {spec.kv_tokens} cannot hold a request of {longest} tokens")
        # Rows preempted and not yet recomputed: their next step is a prefill of their prefix.
        self._recompute = np.zeros(len(problems), bool)
        self._prefill = np.zeros(len(problems), bool)
        # verl's layout: problems in order of first appearance, each problem's samples consecutive.
        first: dict[str, int] = {}
        for p in problems:
            first.setdefault(p, len(first))
        layout = sorted(range(len(problems)), key=lambda i: first[problems[i]])
        predicted = fleet.predictor.predict(problems)
        engine_of = self._route(layout, predicted)
        if spec.order == "random":
            layout = [layout[i] for i in fleet.rng.permutation(len(layout))]
        elif spec.order == "predicted":
            # Fixed at submission, as vLLM takes a request's priority: blocks of separated problems longest
            # first, the layout within a block.
            blocks = fleet.predictor.blocks([problems[i] for i in layout])
            layout = [layout[j] for j in np.argsort(blocks, kind="stable")]
        elif spec.order == "group-oracle":
            means = {p: lengths[[j for j in layout if problems[j] == p]].mean() for p in first}
            layout.sort(key=lambda i: -means[problems[i]])
        elif spec.order == "oracle":
            layout.sort(key=lambda i: -lengths[i])
        # Rows that produce nothing never occupy a slot (as in the unlimited replay).
        self.queues = [
            [i for i in layout if engine_of[i] == e and lengths[i] > 0] for e in range(spec.engines)
        ]
        self.running = [np.zeros(0, np.int64) for _ in range(spec.engines)]
        # Admission rank (the vLLM priority under the priority policy; the arrival order under FCFS).
        self.rank = np.zeros(len(problems), np.int64)
        for queue in self.queues:
            self.rank[queue] = np.arange(len(queue))
        self._turn = -1

    def _route(self, layout: list[int], predicted: np.ndarray) -> np.ndarray:
        spec, n = self.fleet.spec, len(self.problems)
        engine_of = np.zeros(n, np.int64)
        if spec.engines == 1:
            return engine_of
        if spec.router == "round-robin":
            engine_of[layout] = np.arange(n) % spec.engines
            return engine_of
        groups: dict[str, list[int]] = {}
        for i in layout:
            groups.setdefault(self.problems[i], []).append(i)
        # Work of a group: its predicted tokens (its requests when nothing is known yet).
        work = {p: float(predicted[rows].sum()) or float(len(rows)) for p, rows in groups.items()}
        bound = LOAD_SLACK * sum(work.values()) / spec.engines
        load = np.zeros(spec.engines)
        # Largest groups first onto the least-loaded engine: greedy LPT keeps the loads even.
        for p in sorted(groups, key=lambda p: -work[p]):
            engine = self.fleet.placement.get(p)
            if engine is None or load[engine] + work[p] > bound:
                engine = int(np.argmin(load))
            self.fleet.placement[p] = engine
            load[engine] += work[p]
            engine_of[groups[p]] = engine
        return engine_of

    def _admit(self, engine: int) -> None:
        queue = self.queues[engine]
        free = self.slots - self.running[engine].shape[0]
        if free <= 0 or not queue:
            return
        take = free
        kv = self.fleet.spec.kv_tokens
        if kv is not None:
            # The running requests' prefixes and each one's token of this step.
            room = kv - self._held(self.running[engine]) - self.running[engine].size
            take = 0
            for i in queue[:free]:
                # Its prefix and the token this step computes.
                room -= int(self.prompts[i] + self.pos[i]) + 1
                if room < 0:
                    break
                take += 1
        admitted, self.queues[engine] = queue[:take], queue[take:]
        self.running[engine] = np.concatenate([self.running[engine], np.array(admitted, np.int64)])

    def _held(self, rows: np.ndarray) -> int:
        """KV tokens the rows hold: prompt and generated tokens."""
        return int((self.prompts[rows] + self.pos[rows]).sum())

    def _preempt(self, engine: int) -> bool:
        """Preempts running rows until every one has room for this step's token; True if any was."""
        kv = self.fleet.spec.kv_tokens
        running = self.running[engine]
        if kv is None or self._held(running) + running.size <= kv:
            return False
        priority = self.fleet.spec.order in PRIORITY_ORDERS
        queue = self.queues[engine]
        while self._held(running) + running.size > kv:
            # Priority: the largest (priority, arrival); FCFS: the one admitted last.
            victim = int(np.argmax(self.rank[running])) if priority else running.size - 1
            row = int(running[victim])
            running = np.delete(running, victim)
            self._recompute[row] = True
            if priority:
                at = next((j for j, i in enumerate(queue) if self.rank[i] > self.rank[row]), len(queue))
                queue.insert(at, row)
            else:
                queue.insert(0, row)
        self.running[engine] = running
        return True

    def next_step(self) -> tuple[int, np.ndarray]:
        """The next engine to step (in turn) after admitting into its free slots, and its running rows; an
        empty array when the epoch is over."""
        engines = self.fleet.spec.engines
        for _ in range(engines):
            self._turn = (self._turn + 1) % engines
            if not self._preempt(self._turn):
                self._admit(self._turn)
            running = self.running[self._turn]
            if running.size:
                # Rows back from a preemption recompute their prefix in this step.
                self._prefill[:] = False
                self._prefill[running] = self._recompute[running]
                self._recompute[running] = False
                return self._turn, running
        return -1, np.zeros(0, np.int64)

    def prefill(self, rows: np.ndarray) -> np.ndarray:
        """Which of this step's rows recompute their prefix (prompt and generated tokens) after a preemption."""
        return self._prefill[rows]

    def queued(self, engine: int) -> np.ndarray:
        """Rows waiting for one of the engine's slots: tail candidates that have not started."""
        return np.array(self.queues[engine], np.int64)

    def finish(self, engine: int, done: np.ndarray) -> None:
        """Rows of `engine` that finished this step: they free their slots and reveal their lengths."""
        if not done.size:
            return
        self.running[engine] = self.running[engine][~np.isin(self.running[engine], done)]
        for i in done:
            self.fleet.predictor.observe(self.problems[i], int(self.lengths[i]))
