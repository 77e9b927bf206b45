"""`das bench verifier` on the tiny shape, end to end on the CPU, and the replay priced with what it wrote."""

from __future__ import annotations

import json

import numpy as np

from history_store.automaton.config import DraftConfig
from pipeline.schemas import TrajectoryRecord
from workers.bench import replay
from workers.bench.verifier import fit, load_config
from workers.cli import main


def test_the_fit_recovers_a_linear_cost_and_never_goes_negative():
    batches = np.repeat([1.0, 4.0, 16.0, 64.0], 3)
    tokens = batches * np.tile([1.0, 5.0, 17.0], 4)
    exact = 8e-3 + 1e-4 * batches + 3.5e-5 * tokens
    coef, r2 = fit(batches, tokens, exact)
    assert np.allclose(coef, [8e-3, 1e-4, 3.5e-5]) and r2 > 0.999999
    # A per-sequence cost that falls with the batch has no non-negative linear fit in c_seq: it drops to 0.
    coef, _ = fit(batches, tokens, 8e-3 - 2e-5 * batches + 3.5e-5 * tokens)
    assert (coef >= 0).all() and coef[1] == 0


def test_named_shapes_and_config_files_load(tmp_path):
    tiny = load_config("tiny")
    assert tiny.model_type == "llama" and tiny.hidden_size == 64
    tiny.save_pretrained(tmp_path)
    assert load_config(str(tmp_path / "config.json")).num_hidden_layers == 2
    qwen = load_config("qwen2.5-7b")
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.num_key_value_heads) == (3584, 28, 4)


def test_tiny_shape_end_to_end_then_the_replay_prices_steps_with_its_fit(tmp_path, capsys):
    out = tmp_path / "verifier.json"
    args = ["--shape", "tiny", "--batches", "1,4", "--queries", "1,5", "--context", "8", "--repeats", "2"]
    assert main(["bench", "verifier", *args, "--out", str(out)]) == 0
    measured = json.loads(out.read_text())
    assert [(p["batch"], p["queries"]) for p in measured["points"]] == [(1, 1), (1, 5), (4, 1), (4, 5)]
    assert all(p["seconds"] > 0 for p in measured["points"])
    assert measured["device"] == "cpu" and measured["dtype"] == "float32"
    cost = replay.CostModel(**measured["cost_model"])
    assert min(cost.c_base, cost.c_seq, cost.c_tok) >= 0 and cost.c_base + cost.c_seq + cost.c_tok > 0
    capsys.readouterr()

    trace = tmp_path / "t.jsonl"
    records = [
        TrajectoryRecord(
            problem_id=f"p{i % 2}", epoch=e, sample=i, prompt_ids=[1, 2], response_ids=[3] * (5 + i)
        )
        for e in range(2)
        for i in range(4)
    ]
    trace.write_text("".join(r.model_dump_json() + "\n" for r in records))
    replay_args = [
        "bench",
        "replay",
        str(trace),
        "--strategies",
        "none",
        "--cost-models",
        "default",
        "--json",
    ]
    assert main([*replay_args, "--cost-model", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)["cost_models"]["default"]
    assert result["coefficients"] == measured["cost_model"]
    steps = replay.simulate(records, "none", DraftConfig()).steps
    expected = sum(replay.makespan(s, cost) for s in steps)
    assert np.isclose(result["strategies"]["none"]["projected_makespan_s"], expected)

    bad = tmp_path / "bad.json"
    bad.write_text('{"c_base": 1}')
    assert main([*replay_args, "--cost-model", str(bad)]) == 2
    assert "expected JSON with cost_model" in capsys.readouterr().err
