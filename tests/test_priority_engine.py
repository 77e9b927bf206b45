"""The tail first in a real vLLM (CPU) engine: priority scheduling with the DAS custom_class drafter.

One DAS engine with two slots and `scheduling_policy="priority"` (the worker's default). Greedy float32, so a
problem's length is the same every epoch and an epoch's order changes only when its requests start, never what
they say. Epoch 0 teaches the worker every problem's length; the next epochs submit the problems shortest
first, so vLLM's arrival order (FCFS) starts the longest last, and the predicted-first order starts it first.
Passing priorities to an engine built this way is also the check that vLLM 0.32 accepts priority scheduling
with the custom_class drafter.
"""

from __future__ import annotations

import os

import pytest

from workers.rollout.worker import (
    EngineOptions,
    RolloutWorker,
    build_engine,
    builtin_problems,
    shutdown_engine,
)

pytestmark = pytest.mark.vllm

GREEDY = {"temperature": 0.0, "max_tokens": 192}


@pytest.fixture(scope="module")
def worker():
    # The budget prices drafts by measured step times, which would make step counts vary from run to run;
    # without it a draft depends on history alone. The engine process reads the variable when it starts.
    previous = os.environ.get("DAS_BUDGET")
    os.environ["DAS_BUDGET"] = "off"
    try:
        llm = build_engine(EngineOptions(strategy="das", max_num_seqs=2, max_model_len=1024))
    finally:
        if previous is None:
            del os.environ["DAS_BUDGET"]
        else:
            os.environ["DAS_BUDGET"] = previous
    try:
        yield RolloutWorker(llm, "das")
    finally:
        shutdown_engine(llm)


def _epoch(worker: RolloutWorker, problems, epoch: int) -> tuple[int, dict[str, list[int]]]:
    steps: list[int] = []
    finished = worker.run([(p, epoch, 0) for p in problems], GREEDY, between_steps=steps.append)
    return len(steps), {f.record.problem_id: list(f.record.response_ids) for f in finished}


def test_predicted_first_finishes_the_epoch_in_fewer_steps_with_the_same_greedy_outputs(worker):
    assert worker.llm.llm_engine.vllm_config.scheduler_config.policy == "priority"
    assert worker.llm.llm_engine.vllm_config.speculative_config.method == "custom_class"
    everything = builtin_problems(worker.llm.get_tokenizer())
    _, first = _epoch(worker, everything, 0)
    # The two shortest and the longest, shortest first in submission order: the known tail arrives last.
    everything.sort(key=lambda p: len(first[p.problem_id]))
    problems = [*everything[:2], everything[-1]]
    first = {p.problem_id: first[p.problem_id] for p in problems}
    lengths = [len(first[p.problem_id]) for p in problems]
    assert lengths[-1] >= 2 * lengths[0], f"no long tail among {lengths}"
    # The priorities the worker hands vLLM: the long one first once its length is known.
    assert worker.predictor.priorities([p.problem_id for p in problems]) == [2, 1, 0]
    # Two more epochs fill the history window (3 epochs), so the two compared epochs draft from equally much
    # history: a problem's tree with more copies of a response drafts longer, which would decide the race.
    worker.tail_first = False  # vLLM's arrival order, as with scheduling_policy="fcfs"
    for epoch in (1, 2):
        _epoch(worker, problems, epoch)
    worker.tail_first = True
    predicted_steps, predicted = _epoch(worker, problems, 3)
    worker.tail_first = False
    fcfs_steps, fcfs = _epoch(worker, problems, 4)
    assert predicted == first and fcfs == first
    # FCFS starts the long one when the shortest ends; predicted starts it at once, beside the short ones.
    assert predicted_steps < fcfs_steps, (lengths, predicted_steps, fcfs_steps)
