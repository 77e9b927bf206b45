"""`das traces import`: a folder of verl's rollout dumps, written by verl 0.9.1's own `_write_generations` (the
default V1 trainer's), becomes a trace: problems are the prompts, epochs are counted per problem as the pass
ledger counts them, ids are what the run's tokenizer gives the text, and `das bench replay` reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from workers.bench.replay import load_traces
from workers.bench.replay import run as replay
from workers.cli import main
from workers.generator.model import require_model
from workers.rollout.worker import chat_prompt_ids

QUESTIONS = {
    "a": "What is 7 times 8? Answer briefly.",
    "b": "Name a prime number above 20.",
    "c": "Explain in one sentence why the sky is blue.",
}
ANSWERS = [
    "7 times 8 is 56.",
    "The product of 7 and 8 is 56, since 7 x 8 = 56.",
    "23 is a prime number above 20.",
    "The sky looks blue because air scatters blue light more than red light.",
]
# Which problems each training step rolls out (verl counts steps from 1); c skips steps 1 and 3.
STEPS = {1: ["a", "b"], 2: ["a", "c"], 3: ["a", "b"], 4: ["c", "b"]}
SAMPLES = 2


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(require_model()))


def _dump(folder: Path, tokenizer) -> dict[str, str]:
    """Writes STEPS as verl would: prompts and responses decoded from ids without special tokens (the chat
    template's markers, the EOS), rows of a prompt consecutive, scores and V1's uid beside them. Returns the
    dumped prompt text of each problem."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    prompts = {
        key: tokenizer.decode(chat_prompt_ids(tokenizer, text), skip_special_tokens=True)
        for key, text in QUESTIONS.items()
    }
    answer = 0
    for step, keys in STEPS.items():
        inputs, outputs = [], []
        for key in keys:
            for _ in range(SAMPLES):
                ids = tokenizer.encode(ANSWERS[answer % len(ANSWERS)], add_special_tokens=False)
                answer += 1
                inputs.append(prompts[key])
                outputs.append(tokenizer.decode([*ids, tokenizer.eos_token_id], skip_special_tokens=True))
        n = len(inputs)
        PPOTrainer._write_generations(
            inputs,
            outputs,
            [None] * n,
            [float(i % 2) for i in range(n)],
            {"uid": [f"{i // SAMPLES}_{i % SAMPLES}_0" for i in range(n)]},
            str(folder),
            step,
        )
    return prompts


def test_import_numbers_verls_dumps_by_prompt_and_pass(tmp_path, tokenizer, capsys) -> None:
    dumps = tmp_path / "rollouts"
    prompts = _dump(dumps, tokenizer)
    assert sorted(p.name for p in dumps.iterdir()) == ["1.jsonl", "2.jsonl", "3.jsonl", "4.jsonl"]
    out = tmp_path / "trace.jsonl.gz"
    code = main(["traces", "import", str(dumps), "--model", str(require_model()), "-o", str(out), "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["records"] == sum(len(keys) for keys in STEPS.values()) * SAMPLES
    assert summary["problems"] == 3
    records = load_traces(out)
    # Each problem is one prompt, its ids the tokenizer's encoding of the dumped prompt text.
    key_of = {tuple(tokenizer.encode(text, add_special_tokens=False)): key for key, text in prompts.items()}
    problems: dict[str, set[str]] = {}
    for record in records:
        problems.setdefault(key_of[tuple(record.prompt_ids)], set()).add(record.problem_id)
    assert all(len(ids) == 1 for ids in problems.values()) and len(problems) == 3
    # Epochs are passes per problem: a is in steps 1-3 (0..2), b in 1, 3, 4 (0..2), c in 2 and 4 (0, 1).
    passes = {key_of[tuple(r.prompt_ids)]: set() for r in records}
    for record in records:
        passes[key_of[tuple(record.prompt_ids)]].add(record.epoch)
    assert passes == {"a": {0, 1, 2}, "b": {0, 1, 2}, "c": {0, 1}}
    for record in records:
        siblings = [r for r in records if r.problem_id == record.problem_id and r.epoch == record.epoch]
        assert sorted(r.sample for r in siblings) == list(range(SAMPLES))
    # Ids are the run's tokenizer's: the answers come back token for token, without the EOS the dump dropped.
    answers = {tuple(tokenizer.encode(a, add_special_tokens=False)) for a in ANSWERS}
    assert {tuple(r.response_ids) for r in records} == answers
    # The replay reads the imported trace and projects das against none.
    result = replay(out, strategies=["none", "das"])
    for cost_model in result["cost_models"].values():
        assert cost_model["strategies"]["none"]["projected_makespan_s"] > 0
        assert cost_model["strategies"]["das"]["projected_makespan_s"] > 0


def test_import_refuses_a_folder_without_dumps_in_one_line(tmp_path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("not a dump\n")
    code = main(
        ["traces", "import", str(tmp_path), "--model", str(require_model()), "-o", str(tmp_path / "t.jsonl")]
    )
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert "holds no verl rollout dump" in err and "\n" not in err


def test_import_names_the_line_that_is_not_a_dump_row(tmp_path, capsys) -> None:
    (tmp_path / "3.jsonl").write_text(
        json.dumps({"input": "q", "output": "a", "step": 3}) + '\n{"input": 1}\n'
    )
    code = main(
        ["traces", "import", str(tmp_path), "--model", str(require_model()), "-o", str(tmp_path / "t.jsonl")]
    )
    assert code == 1
    assert "3.jsonl:2: not a verl rollout dump line" in capsys.readouterr().err


def test_a_null_step_takes_the_files_and_any_other_non_number_is_named_in_one_line(tmp_path, capsys) -> None:
    # verl names each file after its step: a row whose "step" is null belongs to that step.
    (tmp_path / "3.jsonl").write_text(json.dumps({"input": "q", "output": "a", "step": None}) + "\n")
    out = tmp_path / "t.jsonl"
    assert (
        main(["traces", "import", str(tmp_path), "--model", str(require_model()), "-o", str(out), "--json"])
        == 0
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["records"] == 1
    for bad in ("three", 2.5, -1, True):
        (tmp_path / "3.jsonl").write_text(json.dumps({"input": "q", "output": "a", "step": bad}) + "\n")
        assert main(["traces", "import", str(tmp_path), "--model", str(require_model()), "-o", str(out)]) == 1
        err = capsys.readouterr().err.strip()
        assert (
            "3.jsonl:1: not a verl rollout dump line (step must be a whole number" in err and "\n" not in err
        )
