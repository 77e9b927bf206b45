"""DAS request identity on verl's own data path: problem ids from rows shaped like verl's GSM8K and MATH
preprocessing output (read through verl's RLHFDataset and collate_fn), and epochs as each problem's pass count,
numbered by our managers on batches built the way verl's V1 and legacy trainers build them."""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from history_store.durable.store import HistoryStore
from pipeline.schemas import TrajectoryRecord
from workers.verl.identity import (
    LEDGER_FILE,
    BatchAnnotator,
    PassLedger,
    RequestIdentity,
    history_epochs,
    ledger_from_config,
    problem_id,
)

GSM8K = "openai/gsm8k"
MATH = "DigitalLearningGmbH/MATH-lighteval"


def _gsm8k_row(split: str, idx: int) -> dict[str, Any]:
    """A row as verl's examples/data_preprocess/gsm8k.py writes it."""
    question = f"Natalia sold {idx + 2} clips. How many clips did she sell?"
    return {
        "data_source": GSM8K,
        "prompt": [
            {
                "role": "user",
                "content": question + ' Let\'s think step by step and output the final answer after "####".',
            }
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(idx + 2)},
        "extra_info": {"split": split, "index": idx, "answer": f"#### {idx + 2}", "question": question},
    }


def _math_row(split: str, idx: int, source: str = MATH) -> dict[str, Any]:
    """A row as verl's examples/data_preprocess/math_dataset.py writes it."""
    return {
        "data_source": source,
        "prompt": [
            {
                "role": "user",
                "content": f"What is {idx} squared? Let's think step by step and output the final answer within \\boxed{{}}.",
            }
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(idx * idx)},
        "extra_info": {"split": split, "index": idx, "dataset": source},
    }


def _parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def _dataset_rows(tmp_path: Path, files: list[Path]) -> list[dict[str, Any]]:
    """Every row as verl's RLHFDataset returns it (what the trainer's dataloader batches)."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from workers.generator.model import require_model

    tokenizer = AutoTokenizer.from_pretrained(str(require_model()))
    config = OmegaConf.create({"cache_dir": str(tmp_path / "cache"), "max_prompt_length": 512})
    dataset = RLHFDataset([str(f) for f in files], tokenizer, config)
    return [dataset[i] for i in range(len(dataset))]


def _collated(rows: list[dict[str, Any]]) -> dict[str, Any]:
    from verl.utils.dataset.rl_dataset import collate_fn

    return collate_fn(rows)


def test_gsm8k_and_math_rows_with_the_same_index_get_different_ids_through_verls_dataset(tmp_path) -> None:
    gsm = _parquet(tmp_path / "gsm8k_train.parquet", [_gsm8k_row("train", i) for i in range(3)])
    gsm_test = _parquet(tmp_path / "gsm8k_test.parquet", [_gsm8k_row("test", i) for i in range(3)])
    math = _parquet(tmp_path / "math_train.parquet", [_math_row("train", i) for i in range(3)])
    rows = _dataset_rows(tmp_path, [gsm, gsm_test, math])
    # verl's own index collides: every split of every data set numbers from 0.
    assert [int(r["index"]) for r in rows] == [0, 1, 2] * 3
    ids = [problem_id(r) for r in rows]
    assert ids[:3] == [f"{GSM8K}/train/{i}" for i in range(3)]
    assert ids[3:6] == [f"{GSM8K}/test/{i}" for i in range(3)]
    assert ids[6:] == [f"{MATH}/train/{i}" for i in range(3)]
    assert len(set(ids)) == 9


def test_math_test_sets_concatenated_by_verls_script_stay_apart(tmp_path) -> None:
    # math_dataset.py concatenates MATH-500, AIME 2024 and AIME 2025 test sets, each numbered from 0.
    rows = [_math_row("test", 0, source) for source in ("HuggingFaceH4/MATH-500", "aime2024", "aime2025")]
    loaded = _dataset_rows(tmp_path, [_parquet(tmp_path / "math_test.parquet", rows)])
    assert len({problem_id(r) for r in loaded}) == 3


def test_rows_without_an_index_are_identified_by_their_prompt(tmp_path) -> None:
    plain = [{k: v for k, v in _gsm8k_row("train", i).items() if k != "extra_info"} for i in (0, 1, 0)]
    rows = _dataset_rows(tmp_path, [_parquet(tmp_path / "plain.parquet", plain)])
    assert [int(r["index"]) for r in rows] == [0, 0, 0]  # verl's fallback: one id for everything
    ids = [problem_id(r) for r in rows]
    assert ids[0] == ids[2] != ids[1]
    assert ids[0].startswith(f"{GSM8K}/prompt-")
    # Stable across processes and runs: a hash of the prompt, not of Python's randomized str hash.
    assert ids[0] == problem_id({"data_source": GSM8K, "raw_prompt": list(rows[0]["raw_prompt"])})


def test_repeated_ids_for_different_prompts_warn_once_with_counts(tmp_path, caplog) -> None:
    broken = [_gsm8k_row("train", 0), _gsm8k_row("train", 1), _gsm8k_row("train", 2)]
    for row in broken:
        row["extra_info"]["index"] = 7  # a user's data that numbers every row the same
    rows = _dataset_rows(tmp_path, [_parquet(tmp_path / "broken.parquet", broken)])
    annotator = BatchAnnotator(PassLedger(None))
    with caplog.at_level(logging.WARNING, logger="workers.verl.identity"):
        annotator.annotate(rows, step=1, validate=False, samples_per_row=[1, 1, 1])
        annotator.annotate(rows, step=2, validate=False, samples_per_row=[1, 1, 1])
    warnings = [r.getMessage() for r in caplog.records if "different prompts" in r.getMessage()]
    assert len(warnings) == 1
    assert "1 problem ids name 3 different prompts" in warnings[0] and f"{GSM8K}/train/7" in warnings[0]
    # The n repeats of one prompt are not a collision.
    assert not annotator.collisions.check(["a", "a"], [rows[0]["raw_prompt"]] * 2)


def _v1_batch(rows: list[dict[str, Any]], step: int, validate: bool = False) -> Any:
    """A prompt batch as verl's V1 trainer dispatches it (`_fetch_one_gen_batch`, `_next_train_batch`)."""
    from verl.utils import tensordict_utils as tu

    batch_dict = _collated(rows)
    batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in rows], dtype=object)
    batch = tu.get_tensordict(batch_dict)
    tu.assign_non_tensor_data(batch, "global_steps", step)
    if validate:
        tu.assign_non_tensor_data(batch, "validate", True)
    return batch


def _v1_kwargs(batch: Any, n: int) -> list[dict[str, Any]]:
    """Each session's agent loop keyword arguments, as AgentLoopWorkerTQ.generate_sequences and _run_prompt
    build them."""
    import torch
    from tensordict import NonTensorData, NonTensorStack

    out = []
    for i in range(len(batch)):
        prompt = {}
        for key, value in batch.items():
            if key in ("validate", "agent_name"):
                continue
            if isinstance(value, torch.Tensor):
                prompt[key] = value[i]
            elif isinstance(value, NonTensorStack):
                prompt[key] = value[i].data
            elif isinstance(value, NonTensorData):
                prompt[key] = value.data
        out += [{**prompt, "session_id": s} for s in range(n)]
    return out


def _keys(kwargs: list[dict[str, Any]]) -> list[tuple[str, int, int]]:
    ids = [RequestIdentity.from_kwargs(kw) for kw in kwargs]
    return [(i.problem_id, i.epoch, i.sample) for i in ids]


def test_v1_epochs_count_each_problems_passes_and_survive_a_resume(tmp_path) -> None:
    from workers.verl.manager_v1 import annotate_tq

    data = _parquet(tmp_path / "train.parquet", [_gsm8k_row("train", i) for i in range(3)])
    rows = _dataset_rows(tmp_path, [data])
    state = tmp_path / "ckpt"
    annotator = BatchAnnotator(PassLedger(state))
    a, b, c = (f"{GSM8K}/train/{i}" for i in range(3))
    # Step 1 rolls out problems 0 and 1; step 2 problems 1 and 2: problem 1 is on its second pass, 2 on its first.
    first = _v1_batch(rows[:2], step=1)
    annotate_tq(first, annotator, n=2)
    assert _keys(_v1_kwargs(first, 2)) == [(a, 0, 0), (a, 0, 1), (b, 0, 0), (b, 0, 1)]
    second = _v1_batch(rows[1:], step=2)
    annotate_tq(second, annotator, n=2)
    assert _keys(_v1_kwargs(second, 2)) == [(b, 1, 0), (b, 1, 1), (c, 0, 0), (c, 0, 1)]
    # A resumed run (a new manager over verl's checkpoint folder) continues the numbering.
    resumed = BatchAnnotator(ledger_from_config({"trainer": {"default_local_dir": str(state)}, "das": {}}))
    third = _v1_batch(rows[:1], step=3)
    annotate_tq(third, resumed, n=2)
    assert _keys(_v1_kwargs(third, 2)) == [(a, 1, 0), (a, 1, 1)]
    assert (state / LEDGER_FILE).exists()


def test_v1_refills_and_single_prompt_batches_of_one_step_share_a_pass_with_distinct_samples(
    tmp_path,
) -> None:
    from workers.verl.manager_v1 import annotate_tq

    rows = _dataset_rows(tmp_path, [_parquet(tmp_path / "t.parquet", [_gsm8k_row("train", 0)])])
    pid = f"{GSM8K}/train/0"
    annotator = BatchAnnotator(PassLedger(tmp_path))
    keys = []
    # gen_batch_size=1: the step's prompts arrive one batch at a time; DAPO refills send a prompt again within
    # the step; a batch may even hold a prompt twice (V1 sessions would then both be 0..n-1).
    for batch_rows in ([rows[0]], [rows[0]], [rows[0], rows[0]]):
        batch = _v1_batch(batch_rows, step=4)
        annotate_tq(batch, annotator, n=2)
        keys += _keys(_v1_kwargs(batch, 2))
    assert keys == [(pid, 0, s) for s in range(8)]
    nxt = _v1_batch([rows[0]], step=5)
    annotate_tq(nxt, annotator, n=2)
    assert _keys(_v1_kwargs(nxt, 2)) == [(pid, 1, 0), (pid, 1, 1)]


def test_v1_validation_rows_draft_by_problem_but_stay_out_of_the_history(tmp_path) -> None:
    from workers.verl.manager_v1 import annotate_tq

    rows = _dataset_rows(tmp_path, [_parquet(tmp_path / "v.parquet", [_gsm8k_row("test", 0)])])
    batch = _v1_batch(rows, step=3, validate=True)
    annotate_tq(batch, BatchAnnotator(PassLedger(None)), n=1)
    (identity,) = [RequestIdentity.from_kwargs(kw) for kw in _v1_kwargs(batch, 1)]
    assert identity.extra_args() == {"das_problem_id": f"{GSM8K}/test/0"} and not identity.in_history


def test_legacy_manager_numbers_the_repeated_rows_of_each_problem(tmp_path) -> None:
    from verl.protocol import DataProto

    from workers.verl.manager import annotate

    rows = _dataset_rows(
        tmp_path, [_parquet(tmp_path / "l.parquet", [_gsm8k_row("train", i) for i in range(2)])]
    )
    annotator = BatchAnnotator(PassLedger(None))
    keys = []
    for step in (1, 2):
        # As RayPPOTrainer.fit builds a generation batch: from the collated dict, repeated n times.
        batch = DataProto.from_single_dict(_collated(rows))
        batch.meta_info["global_steps"] = step
        batch = batch.repeat(repeat_times=3, interleave=True)
        annotate(batch, annotator)
        keys += [_keys([{k: v[i] for k, v in batch.non_tensor_batch.items()}])[0] for i in range(len(batch))]
    a, b = f"{GSM8K}/train/0", f"{GSM8K}/train/1"
    assert keys == [(p, e, s) for e in (0, 1) for p in (a, b) for s in range(3)]


def test_a_fresh_run_over_an_old_history_continues_after_its_epochs(tmp_path, monkeypatch, caplog) -> None:
    history = tmp_path / "history"
    with HistoryStore(history) as store:
        store.apply(
            [
                TrajectoryRecord(problem_id="p", epoch=e, sample=0, prompt_ids=[1, 2], response_ids=[3])
                for e in (5, 6, 7)
            ],
            {},
        )
    assert history_epochs(history) == {"p": 7}
    monkeypatch.setenv("DAS_HISTORY_DIR", str(history))
    with caplog.at_level(logging.INFO, logger="workers.verl.identity"):
        ledger = ledger_from_config({"trainer": {"default_local_dir": str(tmp_path / "new-run")}})
    assert any("continue after their stored history epochs" in r.getMessage() for r in caplog.records)
    epochs, samples = ledger.assign(["p", "q"], [2, 2], step=1)
    assert epochs.tolist() == [8, 0] and samples.tolist() == [0, 0]


def test_the_ledger_survives_a_torn_last_line_and_compacts(tmp_path) -> None:
    ledger = PassLedger(tmp_path)
    for step in range(1, 6):
        ledger.assign(["p"], [4], step=step)
    with open(tmp_path / LEDGER_FILE, "a") as handle:
        handle.write('["p", 99, ')  # a crash mid-append
    reloaded = PassLedger(tmp_path)
    assert reloaded.epoch_of("p") == 4
    epochs, samples = reloaded.assign(["p"], [1], step=6)
    assert (epochs.tolist(), samples.tolist()) == ([5], [0])
    lines = (tmp_path / LEDGER_FILE).read_text().splitlines()
    assert json.loads(lines[-1]) == ["p", 5, 6, 1]


@pytest.mark.parametrize("kwargs", [{"das_problem_id": "x", "das_epoch": -1, "das_sample": 0}, {}])
def test_rows_without_a_history_key_do_not_enter_the_history(kwargs) -> None:
    assert not RequestIdentity.from_kwargs(kwargs).in_history
