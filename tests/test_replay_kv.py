"""The replay's KV budget (`Engines(kv_tokens=...)`) against a brute-force engine written the way vLLM 0.32's
scheduler loop is: per step, allocate each running request's next token in running order, preempting the
lowest-priority request (priority policy) or the last admitted (FCFS) when the cache is full; admit from the
queue only in a step that preempted nothing, stopping at the first request whose prefix does not fit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from replay_support import random_records

from history_store.automaton.config import DraftConfig
from pipeline.schemas import TrajectoryRecord
from workers.bench import replay
from workers.bench.engines import Engines
from workers.cli import main


def brute_force(
    prompts: list[int], lengths: list[int], order: list[int], slots: int, kv: int, priority: bool
) -> list[tuple[int, int]]:
    """(running requests, verified tokens) of every step of one epoch without drafting. `order`: the rows in
    admission order (arrival order under FCFS, priority under the priority policy)."""
    rank = {row: j for j, row in enumerate(order)}
    waiting = [r for r in order if lengths[r] > 0]
    running: list[int] = []
    generated = dict.fromkeys(range(len(lengths)), 0)
    allocated = dict.fromkeys(range(len(lengths)), 0)  # KV tokens each request holds
    recompute: set[int] = set()
    log = []
    while waiting or running:
        # Every running request holds its prefix; this step each needs room for one more token.
        for r in running:
            allocated[r] = prompts[r] + generated[r]
        scheduled: list[int] = []
        preempted = False
        j = 0
        while j < len(running):
            request = running[j]
            stop = False
            while sum(allocated.values()) + 1 > kv:
                victim = max(running, key=rank.__getitem__) if priority else running[-1]
                running.remove(victim)
                allocated[victim] = 0
                recompute.add(victim)
                preempted = True
                if victim in scheduled:
                    scheduled.remove(victim)
                if priority:
                    waiting.append(victim)
                    waiting.sort(key=rank.__getitem__)
                else:
                    waiting.insert(0, victim)
                if victim == request:
                    stop = True
                    break
            if stop:
                break
            allocated[request] += 1
            scheduled.append(request)
            j = running.index(request) + 1
        if not preempted:
            while waiting and len(running) < slots:
                r = waiting[0]
                need = prompts[r] + generated[r] + 1
                if sum(allocated.values()) + need > kv:
                    break
                waiting.pop(0)
                allocated[r] = need
                running.append(r)
                scheduled.append(r)
        if not scheduled:
            continue
        verified = len(scheduled) + sum(prompts[r] + generated[r] for r in scheduled if r in recompute)
        log.append((len(scheduled), verified))
        for r in scheduled:
            recompute.discard(r)
            generated[r] += 1
            allocated[r] = prompts[r] + generated[r]
        for r in [r for r in running if generated[r] >= lengths[r]]:
            running.remove(r)
            allocated[r] = 0
    return log


def records_of(prompts: list[int], lengths: list[int], groups: int) -> list[TrajectoryRecord]:
    return [
        TrajectoryRecord(
            problem_id=f"p{i % groups}",
            epoch=0,
            sample=i,
            prompt_ids=[1] * p,
            response_ids=[5] * n,
        )
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]


def layout(records: list[TrajectoryRecord]) -> list[int]:
    first: dict[str, int] = {}
    for r in records:
        first.setdefault(r.problem_id, len(first))
    return sorted(range(len(records)), key=lambda i: first[records[i].problem_id])


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 12)), min_size=1, max_size=9),
    groups=st.integers(1, 3),
    slots=st.integers(1, 6),
    spare=st.integers(0, 40),
    order=st.sampled_from(["fcfs", "predicted", "oracle"]),
)
def test_kv_budget_replays_what_the_brute_force_engine_does(data, groups, slots, spare, order):
    prompts = [p for p, _ in data]
    lengths = [n for _, n in data]
    # Never smaller than the longest request (the engine refuses that), often small enough to preempt.
    kv = max(p + n for p, n in data) + 1 + spare
    records = records_of(prompts, lengths, groups)
    rows = layout(records)
    if order == "oracle":
        rows.sort(key=lambda i: -lengths[i])
    # One epoch, nothing known: predicted keeps the layout, under the priority policy.
    expected = brute_force(prompts, lengths, rows, slots, kv, priority=order != "fcfs")
    sim = replay.simulate(records, "none", DraftConfig(), engines=Engines(slots, order=order, kv_tokens=kv))
    (steps,) = sim.steps
    assert [tuple(s) for s in steps[:, :2].tolist()] == expected
    assert int(sim.per_request[:, 0].sum()) == sum(lengths)


def test_a_kv_budget_holding_everything_changes_nothing_and_a_tight_one_preempts():
    records = random_records(1, [1, 2, 3])
    for strategy in ("none", "das"):
        free = replay.simulate(records, strategy, DraftConfig(), engines=Engines(4))
        roomy = replay.simulate(records, strategy, DraftConfig(), engines=Engines(4, kv_tokens=10_000))
        for a, b in zip(free.steps, roomy.steps, strict=True):
            assert np.array_equal(a, b)
    # Four slots of up to 63 tokens each, 100 tokens of KV: requests are preempted and recompute their
    # prefix, so the epoch verifies more tokens than it generates and takes more steps.
    tight = replay.simulate(records, "none", DraftConfig(), engines=Engines(4, kv_tokens=100))
    free = replay.simulate(records, "none", DraftConfig(), engines=Engines(4))
    assert sum(s[:, 1].sum() for s in tight.steps) > sum(s[:, 1].sum() for s in free.steps)
    assert sum(len(s) for s in tight.steps) > sum(len(s) for s in free.steps)
    with pytest.raises(ValueError, match="cannot hold a request"):
        replay.simulate(records, "none", DraftConfig(), engines=Engines(4, kv_tokens=20))


def test_replay_command_takes_a_kv_budget_and_needs_slots(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    records = records_of([3] * 6, [20, 5, 30, 8, 12, 25], groups=3)
    trace.write_text("".join(r.model_dump_json() + "\n" for r in records))
    args = ["bench", "replay", str(trace), "--strategies", "none", "--cost-models", "default"]
    assert main([*args, "--max-num-seqs", "unlimited,2", "--kv-tokens", "60", "--order", "fcfs,oracle"]) == 0
    out = capsys.readouterr().out
    assert "KV cache 60 tokens per engine" in out and "max-num-seqs unlimited" in out
    # With a KV budget, unlimited slots still queue for KV, so orders differ there too.
    assert "oracle-order gain captured, none" in out.split("max-num-seqs 2")[0]
    assert main([*args, "--kv-tokens", "60"]) != 0
    assert "--kv-tokens needs --max-num-seqs" in capsys.readouterr().err
