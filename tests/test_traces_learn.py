"""`das traces learn`: the rewards and advantages of the learning loop, and the loop itself end to end on the real
CPU engine: rewards vary within groups, the policy version advances, the trained layers change and the frozen
ones do not, the engine's sampled log probabilities are finite, <= 0, one per token, and the next epoch is
sampled from the updated weights (its log probabilities are the updated model's, not the base model's)."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.schemas import TrajectoryRecord
from workers.generator.model import require_model
from workers.rollout.learn import format_reward, group_advantages, overlong_reward

REPO = Path(__file__).resolve().parent.parent


def test_overlong_reward_is_dapos_soft_punishment() -> None:
    assert overlong_reward(100, max_tokens=256, buffer=128) == 0.0
    assert overlong_reward(128, max_tokens=256, buffer=128) == 0.0
    assert overlong_reward(192, max_tokens=256, buffer=128) == -0.5
    assert overlong_reward(256, max_tokens=256, buffer=128) == -1.0


def test_format_reward_wants_numbered_steps() -> None:
    assert format_reward("Let us see.\n1. Add 3 and 4.\n2. Double it: 14.") == 1.0
    assert format_reward("Step 1: add.\nStep 2: double.") == 1.0
    assert format_reward("**1.** First\n**2.** Second") == 1.0
    assert format_reward("1. Only one step, then prose about 2. things.") == 0.0
    assert format_reward("The answer is 14.") == 0.0


def test_group_advantages_normalise_within_each_group_and_zero_a_flat_group() -> None:
    advantages = group_advantages([1.0, 0.0, 0.0, 0.5, 0.5], ["a", "a", "a", "b", "b"])
    a = advantages[:3]
    assert a[0] > 0 > a[1] == a[2]
    assert abs(a.mean()) < 1e-12 and abs(a.std() - 1.0) < 1e-12
    assert np.array_equal(advantages[3:], [0.0, 0.0])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, dict, Path]:
    """Two short-answer problems x 3 samples x 2 epochs, 16 tokens, a length reward (buffer = cap: every token
    costs), a large learning rate so one step moves the policy visibly."""
    folder = tmp_path_factory.mktemp("learn")
    problems = folder / "problems.jsonl"
    problems.write_text(
        "".join(
            json.dumps({"problem_id": f"q{i}", "prompt": text}) + "\n"
            for i, text in enumerate(
                ["Is the sun hot? Answer yes or no.", "What is 2 + 2? Reply with the number only."]
            )
        )
    )
    out = folder / "learn.jsonl.gz"
    args = ["--reward", "overlong", "--problems", str(problems), "--samples", "3", "--epochs", "2"]
    args += ["--max-tokens", "16", "--overlong-buffer", "16", "--lr", "1e-3", "--train-layers", "2"]
    args += ["--max-num-seqs", "8", "--work-dir", str(folder / "work"), "--out", str(out), "--json"]
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", "traces", "learn", *args],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return out, json.loads(result.stdout.strip().splitlines()[-1]), folder / "work" / "policy"


@pytest.mark.vllm
def test_learn_writes_a_trace_whose_policy_moves_between_epochs(tiny_run) -> None:
    out, report, _ = tiny_run
    with gzip.open(out, "rt") as handle:
        records = [TrajectoryRecord.model_validate_json(line) for line in handle]
    assert sorted((r.problem_id, r.epoch, r.sample) for r in records) == [
        (f"q{p}", e, s) for p in range(2) for e in range(2) for s in range(3)
    ]
    assert all(r.policy_version == r.epoch for r in records)
    for record in records:
        assert len(record.response_logprobs) == len(record.response_ids) > 0
        assert all(math.isfinite(x) and x <= 0 for x in record.response_logprobs)
    first, last = report["epochs"]
    assert [first["policy_version"], last["policy_version"]] == [0, 1]
    assert first["groups_with_signal"] >= 1  # lengths, so rewards, differ within a group
    update = first["update"]
    assert update["kl"] > 0 and update["update_norm"] > 0
    # The trainer and the engine run the same float32 weights: their log probabilities agree.
    assert update["engine_logprob_gap"] < 1e-3
    assert "update" not in last  # no step after the last epoch
    saved = json.loads((out.parent / "learn.policy.json").read_text())
    assert saved["epochs"] == report["epochs"]


@pytest.mark.vllm
def test_learn_samples_the_next_epoch_from_the_updated_weights(tiny_run) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, _, policy = tiny_run
    base = AutoModelForCausalLM.from_pretrained(str(require_model()), dtype=torch.float32).eval()
    updated = AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32).eval()
    weights = load_file(str(policy / "model.safetensors"))
    top, frozen = "model.layers.29.mlp.down_proj.weight", "model.layers.27.mlp.down_proj.weight"
    base_weights = base.state_dict()
    assert not torch.equal(weights[top], base_weights[top])
    assert torch.equal(weights[frozen], base_weights[frozen])
    with gzip.open(out, "rt") as handle:
        later = [r for r in map(TrajectoryRecord.model_validate_json, handle) if r.epoch == 1]
    gaps = {"base": 0.0, "updated": 0.0}
    for record in later:
        ids = torch.tensor([record.prompt_ids + record.response_ids])
        prompt = len(record.prompt_ids)
        engine = torch.tensor(record.response_logprobs)
        for name, model in (("base", base), ("updated", updated)):
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, prompt - 1 : -1]
            mine = torch.log_softmax(logits, -1).gather(-1, ids[0, prompt:, None]).squeeze(-1)
            gaps[name] += float((mine - engine).abs().mean())
    assert gaps["updated"] < 1e-3 * len(later) < gaps["base"]
