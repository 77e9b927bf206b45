"""The replay runs the engine's budget, bit for bit.

The replay's das (`workers.bench.replay_drafters.EngineDrafter`) drives `DasProposer` from its own model of an
engine: tokens from one flat buffer, request descriptions, a modelled clock, the queue as submitted counts,
finished trajectories pushed into history. A real engine drives the same class differently: vLLM calls
`propose` with its token matrix and its runner's requests (`SamplingParams` with stop tokens and max_tokens),
the proposer adds each trajectory itself when the request ends by its stop token or its cap, and `das rollout`
tells the proposer what it submitted (`das_submitted`).

Here the replay runs a recorded trace and notes only which rows each of its steps ran (the schedule: vLLM's
scheduler's business, which the replay models). An engine-side driver then runs those rows through a fresh
proposer as vLLM and `das rollout` would, working out everything else from the trace itself: how far each
request got by verifying the proposer's own drafts against the recorded continuation, when requests finish,
what was submitted, and each step's time under the same cost model. Every draft, budget, cut and learned
feature must be identical, unlimited and with a queue (a quarter of an epoch's requests as slots). A change to
either side alone (what the replay hands the proposer, or how the proposer reads vLLM's inputs) breaks it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
from vllm import SamplingParams

from history_store.automaton.config import DEFAULT_WINDOW_EPOCHS, DraftConfig
from pipeline.schemas import TrajectoryRecord
from workers.bench import replay, replay_drafters
from workers.bench.cost_model import CostModel
from workers.bench.engines import Engines
from workers.budget.config import BUDGET_MIN_TOKEN_PROB
from workers.generator.proposer import DasProposer, DasWorkerExtension
from workers.generator.settings import ProposerSettings

TRACE = Path(__file__).resolve().parent.parent / "data" / "fidelity_das.jsonl.gz"
K = 8


def _state(proposer: DasProposer, drafts: list[list[int]]) -> dict[str, Any]:
    """What the budget decided and learned in the proposer's last step, copied."""
    step, policy = proposer.last_step(), proposer.policy
    n = len(drafts)
    buffers = policy.step_buffers(n)
    return {
        "drafts": drafts,
        "budgets": buffers.budgets[:n].copy(),
        "classes": buffers.classes[:n].copy(),
        "value": buffers.value[:n].copy(),
        "weights": buffers.weights[:n].copy(),
        "kept": np.array(step.kept, copy=True),
        "predicted": step.predicted.copy(),
        "features": policy.features[step.slots].copy(),
        "model_p": policy.model_p[step.slots].copy(),
        "acceptance": policy.acceptance.weights.copy(),
        "recalibration": policy.acceptance.recalibration.copy(),
        "coefficients": policy.cost.coefficients.copy(),
        "problem_outcomes": policy.problem_outcomes.copy(),
        "lengths": policy.lengths.quantiles.copy(),
        "queued": step.queued,
    }


class _RecordingProposer(DasProposer):
    """The replay's proposer, noting each step's rows and what the budget did."""

    made: ClassVar[list[_RecordingProposer]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.steps: list[tuple[list[str], dict[str, Any]]] | None = None  # not the warm-up's
        super().__init__(*args, **kwargs)
        self.steps = []
        _RecordingProposer.made.append(self)

    def step_flat(self, *args: Any) -> list[list[int]]:
        drafts = super().step_flat(*args)
        req_ids = args[0]
        if self.steps is not None:
            self.steps.append((list(req_ids), _state(self, drafts)))
        return drafts


class _EngineSide:
    """A fresh proposer driven as vLLM's runner and `das rollout` drive it, over a given schedule of rows."""

    def __init__(self, records: list[TrajectoryRecord], max_model_len: int, cost: CostModel) -> None:
        config = dataclasses.replace(DraftConfig(max_spec_tokens=K), min_token_prob=BUDGET_MIN_TOKEN_PROB)
        settings = ProposerSettings(budget=True, window_epochs=DEFAULT_WINDOW_EPOCHS)
        self.proposer = DasProposer.standalone(
            K, max_model_len, settings=settings, draft_config=config, publish=False
        )
        self.runner = SimpleNamespace(
            input_batch=SimpleNamespace(req_ids=[]), requests={}, drafter=self.proposer
        )
        self.worker = DasWorkerExtension()
        self.worker.model_runner = self.runner
        self.worker.das_attach()
        self.now = 0.0
        self.proposer.clock = lambda: self.now
        self.cost, self.max_model_len = cost, max_model_len
        self.records = {f"{r.problem_id}/{r.epoch}/{r.sample}": r for r in records}
        self.cap = replay.trace_max_tokens(records)
        # The model's stop token: what every response that ended by itself ends with.
        self.stops = sorted({r.response_ids[-1] for r in records if r.finish_reason == "stop"})
        self.pos: dict[str, int] = {}  # response tokens each request has produced
        self.drafts: dict[str, list[int]] = {}  # each row's draft from the last step
        self.finished: set[str] = set()  # reported finished by vLLM
        self.epoch: int | None = None

    def step(self, keys: list[str]) -> dict[str, Any]:
        """The forward step that ran these rows (verifying their drafts, or the prefill of joiners), then the
        propose after it. Returns the budget's state."""
        epoch = self.records[keys[0]].epoch
        if epoch != self.epoch:  # das rollout submits an epoch's requests at once, and says so first
            self.epoch = epoch
            submitted: dict[str, int] = {}
            for r in self.records.values():
                if r.epoch == epoch:
                    submitted[r.problem_id] = submitted.get(r.problem_id, 0) + 1
            self.worker.das_submitted(submitted, self.cap)
        verified = len(keys)
        scheduled = []  # vLLM's input batch keeps the drafts it verified this step, per row
        for key in keys:
            response = self.records[key].response_ids
            if key not in self.pos:  # a joiner: its prefill produces the first token
                self.pos[key] = 1
                scheduled.append([])
                continue
            draft, at = self.drafts.pop(key, []), self.pos[key]
            scheduled.append(draft)
            verified += len(draft)
            accepted = 0
            while (
                accepted < len(draft)
                and at + accepted < len(response)
                and draft[accepted] == response[at + accepted]
            ):
                accepted += 1
            self.pos[key] = min(at + accepted + 1, len(response))
        self.now += self.cost.step(len(keys), verified)
        self._requests_for(keys)
        self.runner.input_batch.req_ids = list(keys)
        self.runner.input_batch.spec_token_ids = scheduled
        matrix = np.zeros((len(keys) + 3, self.max_model_len), np.int32)  # vLLM's has max_num_reqs rows
        num_tokens = np.zeros(len(keys), np.int32)
        for row, key in enumerate(keys):
            r = self.records[key]
            tokens = [*r.prompt_ids, *r.response_ids[: self.pos[key]]]
            matrix[row, : len(tokens)] = tokens
            num_tokens[row] = len(tokens)
        drafts = self.proposer.propose(
            [[int(matrix[i, n - 1])] for i, n in enumerate(num_tokens)], num_tokens, matrix
        )
        for key, draft in zip(keys, drafts, strict=True):
            if self.pos[key] >= len(self.records[key].response_ids):
                self.finished.add(key)  # vLLM reports it finished after this step
            else:
                self.drafts[key] = draft
        return _state(self.proposer, drafts)

    def _requests_for(self, keys: list[str]) -> None:
        """vLLM's runner holds every request it has scheduled until one step after its last."""
        running = set(keys)
        for key in [key for key in self.runner.requests if key not in running and key in self.finished]:
            del self.runner.requests[key]
        for key in keys:
            if key not in self.runner.requests:
                r = self.records[key]
                extra = {"das_problem_id": r.problem_id, "das_epoch": r.epoch, "das_sample": r.sample}
                params = SamplingParams(max_tokens=self.cap, stop_token_ids=self.stops, extra_args=extra)
                self.runner.requests[key] = SimpleNamespace(
                    num_prompt_tokens=len(r.prompt_ids), sampling_params=params
                )


@pytest.mark.parametrize("slots", [None, 0.25], ids=["unlimited", "quarter-of-an-epoch"])
def test_the_replay_and_an_engine_give_the_same_drafts_budgets_cuts_and_features(monkeypatch, slots) -> None:
    records = replay.load_traces(TRACE)
    _RecordingProposer.made.clear()
    monkeypatch.setattr(replay_drafters, "DasProposer", _RecordingProposer)
    cost = CostModel()
    engines = Engines(slots) if slots else None
    sim = replay.simulate(records, "das", DraftConfig(max_spec_tokens=K), cost=cost, engines=engines)
    (replayed,) = _RecordingProposer.made
    assert sum(int(state["kept"].sum()) for _, state in replayed.steps) > 100, "too few drafts to compare"
    engine = _EngineSide(records, replayed.max_model_len, cost)
    queued = 0
    for number, (keys, state) in enumerate(replayed.steps):
        mine = engine.step(keys)
        queued = max(queued, mine["queued"])
        for name, value in state.items():
            same = np.array_equal(mine[name], value) if isinstance(value, np.ndarray) else mine[name] == value
            assert same, f"step {number}: {name} differs between the replay and the engine"
    assert engine.proposer.stats()["errors"] == 0
    # The step trace `das bench fidelity` diffs an engine's against: the same on both paths, and the replay's
    # per-epoch traces are its proposer's steps, in order.
    assert engine.proposer.step_trace() == replayed.step_trace()
    assert [s for e in sim.epochs for s in sim.proposer_traces[e]] == replayed.step_trace()
    assert (queued > 0) == bool(slots), "the budget saw a queue exactly when there was one"
