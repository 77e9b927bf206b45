"""The replay on finite engines: slots, queues, admission orders, routers, and the tail-first predictor."""

from __future__ import annotations

import json

import numpy as np
import pytest
from replay_support import random_records

from history_store.automaton.config import DraftConfig
from pipeline.schemas import TrajectoryRecord
from workers.bench import replay
from workers.bench.engines import Engines, Fleet, parse_slots
from workers.bench.replay_slots import slots_label
from workers.budget.config import BudgetConfig
from workers.budget.policy import BudgetPolicy
from workers.cli import main
from workers.rollout.priority import LengthPredictor

COST = replay.CostModel(c_base=1.0, c_seq=0.0, c_tok=0.0)  # makespan = steps of the slowest engine


def rec(pid: str, epoch: int, sample: int, length: int, token: int = 7) -> TrajectoryRecord:
    return TrajectoryRecord(
        problem_id=pid, epoch=epoch, sample=sample, prompt_ids=[1, 2, 3], response_ids=[token] * length
    )


def tail_last(epochs: int = 2) -> list[TrajectoryRecord]:
    """Short problems first in verl's layout, the long one last: the tail FCFS admits too late."""
    out = []
    for e in range(epochs):
        for p in range(3):
            out += [rec(f"short{p}", e, s, 10) for s in range(2)]
        out += [rec("long", e, s, 100 + s) for s in range(2)]
    return out


def epoch_makespans(records, strategy: str, engines: Engines | None) -> list[float]:
    sim = replay.simulate(records, strategy, DraftConfig(), engines=engines)
    return [replay.makespan(s, COST) for s in sim.steps]


@pytest.mark.parametrize("strategy", ["none", "suffix-problem", "das"])
def test_slots_for_every_request_replay_exactly_the_unlimited_epoch(strategy):
    records = random_records(0, [1, 2])
    unlimited = replay.simulate(records, strategy, DraftConfig())
    finite = replay.simulate(records, strategy, DraftConfig(), engines=Engines(10_000))
    for a, b in zip(unlimited.steps, finite.steps, strict=True):
        assert np.array_equal(a, b[:, :2]) and not b[:, 2].any()
    assert np.array_equal(unlimited.per_request, finite.per_request)


def test_requests_queue_for_slots_and_every_token_is_replayed():
    records = tail_last()
    sim = replay.simulate(records, "none", DraftConfig(), engines=Engines(3))
    assert max(int(s[:, 0].max()) for s in sim.steps) == 3  # never more running than slots
    assert sim.per_request[:, 0].sum() == sum(len(r.response_ids) for r in records)
    assert epoch_makespans(records, "none", None)[0] == 101  # every request at once


def test_longest_first_starts_the_tail_early_and_prediction_learns_it_from_the_last_epoch():
    records = tail_last()
    fcfs, oracle, predicted, group = (
        epoch_makespans(records, "none", Engines(3, order=o))
        for o in ("fcfs", "oracle", "predicted", "group-oracle")
    )
    # FCFS: the six short ones two after another on each of 3 slots, then the long pair from step 20.
    assert fcfs == [121, 121]
    # Longest first: the long pair from the start, the short ones one after another on the third slot.
    assert oracle == [101, 101]
    # Epoch 0 has no history: the predictor ties every request and keeps FCFS. Epoch 1 knows "long".
    assert predicted == [121, 101]
    # Each group's true mean, known from the start: the long group first in both epochs.
    assert group == [101, 101]


def test_random_order_is_a_seeded_permutation():
    records = tail_last()
    a = epoch_makespans(records, "none", Engines(2, order="random", seed=3))
    b = epoch_makespans(records, "none", Engines(2, order="random", seed=3))
    assert a == b


def test_engines_share_the_epoch_and_its_makespan_is_the_slowest_engines():
    records = tail_last(1)
    sim = replay.simulate(records, "none", DraftConfig(), engines=Engines(8, engines=2))
    steps = sim.steps[0]
    per_engine = np.bincount(steps[:, 2], minlength=2)
    # Round-robin in verl's layout puts one sample of every problem on each engine: the long problem's
    # sample 1 (one token longer) sets engine 1's steps.
    assert per_engine.tolist() == [100, 101]
    assert replay.makespan(steps, COST) == 101


def test_problem_routing_keeps_a_group_together_within_the_load_bound():
    fleet = Fleet(Engines(4, engines=2, router="problem"), None)
    for p in ("a", "b", "c", "d"):
        for _ in range(4):
            fleet.predictor.observe(p, 100 if p == "a" else 10)
    problems = [p for p in ("a", "b", "c", "d") for _ in range(2)]
    schedule = fleet.epoch(problems, np.full(8, 5), np.full(8, 3), np.zeros(8, np.int64))
    engine_of = {i: e for e, q in enumerate(schedule.queues) for i in q}
    for p in ("a", "b", "c", "d"):
        rows = [i for i, q in enumerate(problems) if q == p]
        assert len({engine_of[i] for i in rows}) == 1  # a problem's group on one engine
    # "a" (predicted 10x longer) alone on one engine, the three short groups on the other.
    assert engine_of[0] != engine_of[2] == engine_of[4] == engine_of[6]
    again = fleet.epoch(problems, np.full(8, 5), np.full(8, 3), np.zeros(8, np.int64))
    assert {i: e for e, q in enumerate(again.queues) for i in q} == engine_of  # sticky across epochs


def test_queued_requests_are_tail_candidates_in_the_budget_weights():
    policy = BudgetPolicy(BudgetConfig(max_tokens=4))
    for length in (50, 52, 55, 60):
        policy.lengths.observe("p", length)
    for slot in range(4):
        policy.start(slot, "p", None)
    rows = np.array([0, 1])
    outputs = np.array([40, 40])
    headroom = np.array([4, 4])
    policy.budgets(rows, outputs, headroom)
    alone = policy._buffers.views(2).weights.copy()
    budgets, classes = policy.budgets(rows, outputs, headroom, queued=np.array([2, 3]))
    # Two requests not yet started will outlast both running ones: the running ones are rarely the tail.
    assert budgets.shape == (2,) and classes.shape == (2,) and policy._slots.tolist() == [0, 1]
    assert (policy._buffers.views(4).weights[:2] < alone).all()
    # But with a queue every freed slot admits the next request: a token accepted by either running row brings
    # the last admission half a step closer, so each is worth at least half the step's fixed cost.
    c_base, c_seq, c_tok = policy.cost.coefficients
    assert np.allclose(policy._value, c_base / 2 + c_seq + c_tok)
    assert (budgets == 4).all()


def test_the_predictor_expects_lengths_under_the_cap_from_history_and_the_pool():
    predictor = LengthPredictor(max_tokens=100)
    assert predictor.priorities(["a", "b", None]) == [0, 1, 2]  # nothing known: submission order
    for length in (20, 30):
        predictor.observe("a", length)
    for length in (500, 10):
        predictor.observe("b", length)  # capped at 100: mean 55
    # Problems without history get every problem's lengths (the pool), capped too: (20 + 30 + 100 + 10) / 4.
    assert predictor.predict(["a", "b", "new"]).tolist() == [25.0, 55.0, 40.0]


def test_the_order_separates_only_problems_the_evidence_separates_and_keeps_fcfs_within_ties():
    greedy = LengthPredictor()
    for problem, length in (("short", 40), ("mid", 60), ("long", 190)):
        greedy.observe(problem, length)
    # One length each and no spread known (greedy decoding): every difference separates, longest first.
    assert greedy.priorities(["short", "mid", "long"]) == [2, 1, 0]
    sampled = LengthPredictor()
    rng = np.random.default_rng(0)
    # Within a problem samples spread (sd 60) far more than these means differ (100, 110, 120), except "tail".
    for problem, mean in (("a", 100), ("b", 110), ("c", 120), ("tail", 300)):
        for length in rng.normal(mean, 60, 24).round():
            sampled.observe(problem, int(max(length, 1)))
    assert sampled.blocks(["a", "b", "c", "tail"]).tolist() == [1, 1, 1, 0]
    # The separated long problem first; the three that tie keep their submission order, whatever their means;
    # a problem without history ties with them (its mean is the pool's).
    assert sampled.priorities(["c", "a", "new", "tail", "b"]) == [1, 2, 3, 0, 4]
    assert sampled.priorities(["a", "b", "c"]) == [0, 1, 2]
    # Many problems of one length distribution: sorted, neighbours always differ a little; the family-wise
    # test keeps them one block, so the order stays FCFS.
    alike = LengthPredictor()
    for p in range(24):
        for length in rng.normal(200, 60, 24).round():
            alike.observe(f"q{p}", int(max(length, 1)))
    assert alike.blocks([f"q{p}" for p in range(24)]).tolist() == [0] * 24


def test_slot_settings_parse_and_name_themselves():
    assert parse_slots("32") == 32 and parse_slots("1/4") == 0.25
    assert [slots_label(v) for v in (None, 32, 0.25, 0.0625)] == ["unlimited", "32", "1/4", "1/16"]
    assert Engines(0.25, engines=2).slots(96) == 12
    for bad in ("0", "1/0", "x", "2/1"):
        with pytest.raises(ValueError, match="max-num-seqs"):
            parse_slots(bad)
    with pytest.raises(ValueError, match="unknown order"):
        Engines(4, order="sjf")


def test_replay_command_reports_every_order_and_strategy_with_the_oracle_share(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(r.model_dump_json() + "\n" for r in tail_last()))
    code = main(
        [
            "bench",
            "replay",
            str(trace),
            "--json",
            "--strategies",
            "none,das",
            "--cost-models",
            "default",
            "--max-num-seqs",
            "unlimited,3",
            "--order",
            "fcfs,predicted,oracle",
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["max_num_seqs"]) == {"unlimited", "3"}
    block = result["max_num_seqs"]["3"]
    table = block["makespan_s"]["default"]
    assert set(table) == {"none", "das"} and set(table["none"]) == {"fcfs", "predicted", "oracle"}
    assert table["none"]["oracle"] < table["none"]["fcfs"]
    share = block["oracle_order_gain_captured"]["default"]["none"]["predicted"]
    expected = (table["none"]["fcfs"] - table["none"]["predicted"]) / (
        table["none"]["fcfs"] - table["none"]["oracle"]
    )
    assert share == pytest.approx(expected, abs=1e-4)
    assert set(block["das_change"]["default"]["fcfs"]) == {"none"}
    assert result["fleet"] == {"engines": 1, "router": "round-robin", "seed": 0, "kv_tokens": None}


def test_a_bad_slot_setting_is_one_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(r.model_dump_json() + "\n" for r in tail_last(1)))
    assert main(["bench", "replay", str(trace), "--max-num-seqs", "1/0"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max-num-seqs" in err[0]
