"""The trace replay: faithful baselines, exact accounting, and clear errors on bad traces."""

from __future__ import annotations

import json

import numpy as np
import pytest

from history_store.automaton.config import DraftConfig
from history_store.automaton.kernels import Source
from pipeline.schemas import TrajectoryRecord
from workers.bench import replay, replay_drafters
from workers.cli import main


def write_trace(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def record(pid, epoch, sample, response, prompt=(1, 2, 3)):
    return {
        "problem_id": pid,
        "epoch": epoch,
        "sample": sample,
        "prompt_ids": list(prompt),
        "response_ids": response,
    }


def test_ngram_baseline_matches_vllms_prompt_lookup():
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens as vllm_ngram,
    )

    rng = np.random.default_rng(0)
    for _ in range(300):
        ctx = rng.integers(0, 4, rng.integers(1, 40)).astype(np.int32)
        ours = replay_drafters.ngram_draft(ctx, 2, 4, 8)
        theirs = vllm_ngram(ctx, 2, 4, 10_000, 8)
        assert ours.tolist() == theirs.tolist()


def test_no_drafting_takes_one_step_per_token_and_the_cost_model_sums_per_step(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [record("a", 0, 0, [5] * 3), record("a", 0, 1, [6] * 5)])
    cost = replay.CostModel(c_base=1.0, c_seq=0.1, c_tok=0.01)
    result = replay.summarize(replay.simulate(replay.load_traces(trace), "none", DraftConfig()), cost)
    assert (result["tokens"], result["steps"], result["draft_tokens"]) == (8, 8, 0)
    # 3 steps with both requests (2 verified tokens), then 2 with one.
    assert result["projected_makespan_s"] == pytest.approx(3 * (1 + 0.2 + 0.02) + 2 * (1 + 0.1 + 0.01))


@pytest.mark.parametrize("strategy", ["suffix-global", "suffix-problem", "das-unbudgeted", "das", "oracle"])
def test_history_strategies_accept_a_repeated_epoch_and_never_a_wrong_token(tmp_path, strategy):
    rng = np.random.default_rng(1)
    responses = [rng.integers(10, 60, 120).tolist() for _ in range(3)]
    records = [record(f"p{i}", e, 0, r) for e in range(2) for i, r in enumerate(responses)]
    records = replay.load_traces(write_trace(tmp_path / "t.jsonl", records))
    result = replay.summarize(replay.simulate(records, strategy, DraftConfig()), replay.CostModel())
    assert result["tokens"] == 2 * 3 * 120  # every recorded token replayed, none invented
    second = result["per_epoch"][1]
    assert second["mean_accepted_per_step"] > 3.0, "epoch 1 repeats epoch 0: history must draft it"
    assert result["accepted_tokens"] <= result["draft_tokens"]


def test_a_malformed_line_is_named_and_nothing_is_skipped(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(record("a", 0, 0, [1])) + "\n" + '{"problem_id": "a", "epoch": -1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        replay.load_traces(path)
    assert main(["bench", "replay", str(path)]) == 1


def test_replay_command_prints_one_json_object_with_every_strategy(tmp_path, capsys):
    records = [record("p", e, s, [7, 8, 9, 7, 8, 9, 7]) for e in range(2) for s in range(2)]
    trace = write_trace(tmp_path / "t.jsonl", records)
    assert main(["bench", "replay", str(trace), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["cost_models"]) == {"default", "memory-bound", "compute-bound"}
    for block in out["cost_models"].values():
        assert set(block["strategies"]) == set(replay.STRATEGIES)
        for result in block["strategies"].values():
            assert result["tokens"] == 4 * 7
            assert len(result["per_length_quartile"]) == 4
        assert len(block["das_vs_none_per_epoch"]) == 2
        assert set(block["oracle_gap_closed"]) == set(replay.STRATEGIES) - {"none", "oracle"}


def _repeating_trace(tmp_path, epochs=3, problems=4, samples=4):
    rng = np.random.default_rng(2)
    base = {p: rng.integers(10, 400, 200) for p in range(problems)}
    records = []
    for e in range(epochs):
        for p in range(problems):
            for s in range(samples):
                # Each sample follows its problem's text with a few random substitutions and its own length.
                response = base[p][: rng.integers(60, 200)].copy()
                flips = rng.random(response.shape[0]) < 0.15
                response[flips] = rng.integers(10, 400, int(flips.sum()))
                records.append(record(f"p{p}", e, s, response.tolist()))
    return replay.load_traces(write_trace(tmp_path / "t.jsonl", records))


def test_oracle_wastes_nothing_and_bounds_das_from_below(tmp_path):
    records = _repeating_trace(tmp_path)
    cost = replay.CostModel()
    oracle = replay.summarize(replay.simulate(records, "oracle", DraftConfig()), cost)
    das = replay.summarize(replay.simulate(records, "das", DraftConfig(), cost=cost), cost)
    none = replay.summarize(replay.simulate(records, "none", DraftConfig()), cost)
    assert oracle["wasted_verification_tokens"] == 0 and oracle["accepted_tokens"] > 0
    assert oracle["projected_makespan_s"] <= das["projected_makespan_s"] <= none["projected_makespan_s"]
    # Epoch 0 has only useless sibling drafts here (siblings run in lockstep, so none is ahead): the budget
    # pays a little to learn that, at the tail where a token that lands would save a whole step.
    first, *later = zip(none["per_epoch"], das["per_epoch"], strict=True)
    assert first[1]["projected_makespan_s"] <= 1.01 * first[0]["projected_makespan_s"]
    for a, b in later:
        assert b["projected_makespan_s"] <= a["projected_makespan_s"]


def test_calibration_reports_brier_score_and_a_reliability_table_that_add_up(tmp_path):
    records = _repeating_trace(tmp_path)
    das = replay.summarize(replay.simulate(records, "das", DraftConfig()), replay.CostModel())
    for name in ("budget_policy", "tree_ratio"):
        report = das["calibration"][name]
        assert 0.0 <= report["brier"] <= 1.0
        assert all(0.0 <= row["observed"] <= 1.0 for row in report["reliability"])
    # Every kept draft token is one prediction of the policy.
    assert (
        sum(row["tokens"] for row in das["calibration"]["budget_policy"]["reliability"])
        == das["draft_tokens"]
    )


def test_raw_paths_past_the_match_are_calibrated_only_where_drafts_run_past_it(tmp_path):
    records = _repeating_trace(tmp_path)
    cost = replay.CostModel()
    default = replay.summarize(replay.simulate(records, "das", DraftConfig()), cost)
    assert "past_match_raw_path" not in default["calibration"]
    freer = replay.summarize(replay.simulate(records, "das", DraftConfig(max_spec_factor=4.0)), cost)
    report = freer["calibration"]["past_match_raw_path"]
    past = sum(row["tokens"] for row in report["reliability"])
    assert 0 < past < freer["draft_tokens"]
    assert all(0.0 <= row["observed"] <= 1.0 for row in report["reliability"])


def test_acceptance_by_agreement_counts_every_judged_draft_token_once(tmp_path):
    """Token j of a draft is judged when tokens 0..j-1 were accepted: every accepted token is judged (and
    accepted), and so are some rejected ones, never more than were kept."""
    records = _repeating_trace(tmp_path)
    sim = replay.simulate(records, "das", DraftConfig())
    judged, accepted, _ = sim.agreement.bins.sum(axis=0)
    _, _, drafted, accepted_tokens = sim.per_request.sum(axis=0)
    assert accepted == accepted_tokens > 0
    assert accepted < judged <= drafted
    report = replay.summarize(sim, replay.CostModel())["acceptance_by_agreement"]
    assert sum(row["tokens"] for row in report) == judged
    assert all(0.0 <= row["acceptance"] <= 1.0 and row["agreeing_trees"] in (0, 1, 2) for row in report)


def test_by_source_splits_every_epochs_drafts_and_accepted_tokens_between_the_trees(tmp_path):
    records = _repeating_trace(tmp_path)
    for strategy in ("das-unbudgeted", "das"):
        result = replay.summarize(replay.simulate(records, strategy, DraftConfig()), replay.CostModel())
        by_source = result["by_source"]
        assert [row["epoch"] for row in by_source] == [e["epoch"] for e in result["per_epoch"]]
        for row, epoch in zip(by_source, result["per_epoch"], strict=True):
            trees = [row[source.label] for source in Source if source != Source.NONE]
            assert sum(t["draft_tokens"] for t in trees) == epoch["draft_tokens"]
            assert sum(t["accepted_tokens"] for t in trees) == epoch["accepted_tokens"]
            assert all(
                t["accepted_tokens"] <= t["draft_tokens"] and t["drafts"] <= t["draft_tokens"] for t in trees
            )
        assert by_source[-1]["history"]["accepted_tokens"] > 0  # a repeated epoch drafts from its history


def test_source_table_counts_only_kept_drafts_by_their_tree():
    table = replay._SourceTable()
    # Rows: a history draft of 3 (1 accepted), a live draft cut to nothing, a global draft of 2 (2 accepted),
    # and a row with no draft.
    table.add(0, np.array([1, 2, 3, 0]), np.array([3, 0, 2, 0]), np.array([1, 0, 2, 0]))
    (row,) = table.report()
    assert row == {
        "epoch": 0,
        "history": {"drafts": 1, "draft_tokens": 3, "accepted_tokens": 1},
        "live": {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0},
        "global": {"drafts": 1, "draft_tokens": 2, "accepted_tokens": 2},
    }


def test_agreement_table_groups_each_judged_token_by_the_trees_that_drafted_it_too():
    table = replay._AgreementTable()
    probs = np.array([[0.8, 0.4, 0.2, 0.1], [0.5, 0.25, 0.0, 0.0]], np.float32)
    # Row 0: 3 kept, 1 accepted (tokens 0 and 1 judged); both other trees repeat its first two tokens, one
    # its third. Row 1: 2 kept, both accepted (both judged); no other tree agrees.
    agreement = np.array([[2, 3], [0, 0]], np.int32)
    table.add(probs, agreement, np.array([3, 2]), np.array([1, 2]))
    np.testing.assert_allclose(
        table.bins,
        [[2, 2, 0.5 + 0.5], [0, 0, 0], [2, 1, 0.8 + 0.5]],
    )
    assert [row["agreeing_trees"] for row in table.report()] == [0, 2]


def test_suffix_problem_drafts_from_its_own_problem_only(tmp_path):
    # Two problems with disjoint vocabularies: per-problem trees never draft the other problem's text.
    records = [record("a", e, 0, list(range(10, 60))) for e in range(2)]
    records += [record("b", e, 0, list(range(100, 150))) for e in range(2)]
    records = replay.load_traces(write_trace(tmp_path / "t.jsonl", records))
    result = replay.summarize(replay.simulate(records, "suffix-problem", DraftConfig()), replay.CostModel())
    assert result["per_epoch"][0]["mean_accepted_per_step"] == 1.0
    assert result["per_epoch"][1]["mean_accepted_per_step"] > 3.0
    assert result["acceptance_rate"] == 1.0


def test_measured_costs_set_the_step_times_the_budget_learns_from_per_epoch(tmp_path):
    # A replay of an engine's trace prices drafts with what the engine measured in each epoch. Where a verified
    # token cost far more than the rest of a step, no draft pays (an accepted token saves one verified token,
    # never more): the budget stops drafting there, and epochs before it are untouched.
    records = _repeating_trace(tmp_path)
    cost = replay.CostModel()
    dear = replay.CostModel(c_base=cost.c_base, c_seq=cost.c_seq, c_tok=100 * cost.c_base)
    plain = replay.replay(records, "das", DraftConfig(), cost=cost)
    priced = replay.replay(records, "das", DraftConfig(), cost=cost, measured_costs={1: dear, 2: dear})
    drafted = [[e["draft_tokens"] for e in r["per_epoch"]] for r in (plain, priced)]
    assert drafted[1][0] == drafted[0][0] > 0
    assert drafted[1][2] < 0.2 * drafted[0][2]


def test_the_replay_knows_the_traces_response_cap_as_the_engine_did() -> None:
    def record(sample: int, length: int, finish: str) -> TrajectoryRecord:
        return TrajectoryRecord(
            problem_id="p",
            epoch=0,
            sample=sample,
            prompt_ids=[1],
            response_ids=[5] * length,
            finish_reason=finish,
        )

    stopped = [record(0, 40, "stop"), record(1, 90, "stop")]
    assert replay.trace_max_tokens(stopped) is None  # nothing ran into it: unknown
    assert replay.trace_max_tokens([*stopped, record(2, 64, "length")]) is None  # one ran past it: mixed caps
    assert replay.trace_max_tokens([*stopped, record(2, 128, "length")]) == 128


def test_load_traces_keeps_response_logprobs(tmp_path) -> None:
    trace = tmp_path / "annotated.jsonl"
    with_values = {"problem_id": "p", "epoch": 0, "sample": 0, "prompt_ids": [1], "response_ids": [2, 3]}
    trace.write_text(
        json.dumps({**with_values, "response_logprobs": [-0.25, -1.5]})
        + "\n"
        + json.dumps({**with_values, "sample": 1})
        + "\n"
    )
    first, second = replay.load_traces(trace)
    assert first.response_logprobs == [-0.25, -1.5] and second.response_logprobs is None
