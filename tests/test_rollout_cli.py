"""`das rollout` and `das traces generate`: end to end on a real engine (from a sharded checkpoint folder), the
embedded bus into a local history replica that the proposer reads, trace files of valid trajectory records;
engine settings per platform; inputs checked before any engine starts."""

from __future__ import annotations

import pytest
from _checkpoints import shard_checkpoint
from cli_support import das_json, run_das

from history_store.durable.store import HistoryStore
from pipeline.schemas import TrajectoryRecord
from workers.generator.model import require_model
from workers.rollout.worker import EngineOptions, engine_kwargs

# Tiny runs: the engine start dominates; greedy, so a repeated epoch is drafted exactly from its history.
SMALL = [
    "--num-problems",
    "2",
    "--samples",
    "2",
    "--max-tokens",
    "24",
    "--temperature",
    "0",
    "--max-num-seqs",
    "4",
]


@pytest.mark.vllm
def test_rollout_publishes_every_trajectory_into_the_embedded_replica(tmp_path) -> None:
    history = tmp_path / "history"
    # A sharded checkpoint folder, as Hugging Face saves every 7B+ model.
    sharded = shard_checkpoint(require_model(), tmp_path / "model")
    out = das_json(
        "rollout", "--epochs", "2", "--history-dir", str(history), "--model-dir", str(sharded), *SMALL
    )
    assert [e["epoch"] for e in out["epochs"]] == [0, 1]
    for epoch in out["epochs"]:
        assert epoch["requests"] == 4 and epoch["output_tokens"] > 0
        assert epoch["proposer_errors"] == 0
        assert epoch["latency_max_s"] >= epoch["latency_p50_s"] > 0
    # Epoch 1 repeats epoch 0's problems greedily: drafts from the replayed history are all accepted.
    assert out["epochs"][1]["mean_accepted_per_step"] > out["epochs"][0]["mean_accepted_per_step"]
    with HistoryStore(history) as store:
        keys = sorted((t.problem_id, t.epoch, t.sample) for t in store.iter_trajectories())
    assert keys == [(f"builtin-{p}", e, s) for p in range(2) for e in range(2) for s in range(2)]


@pytest.mark.vllm
def test_traces_generate_writes_one_valid_record_per_request(tmp_path) -> None:
    trace = tmp_path / "traces" / "run.jsonl"
    out = das_json("traces", "generate", "--out", str(trace), "--epochs", "1", "--strategy", "none", *SMALL)
    assert out["epochs"][0]["requests"] == 4
    records = [TrajectoryRecord.model_validate_json(line) for line in trace.read_text().splitlines()]
    assert sorted((r.problem_id, r.sample) for r in records) == [
        (f"builtin-{p}", s) for p in range(2) for s in range(2)
    ]
    assert all(r.response_ids and r.prompt_ids and r.finish_reason in ("stop", "length") for r in records)


def test_the_cpu_keeps_exact_small_engine_settings() -> None:
    kwargs = engine_kwargs(EngineOptions(), on_cpu=True)
    assert kwargs["dtype"] == "float32" and kwargs["enforce_eager"] is True
    assert kwargs["kv_cache_memory_bytes"] == 512 * 2**20 and kwargs["max_num_seqs"] == 16
    assert "gpu_memory_utilization" not in kwargs


def test_a_gpu_gets_vllms_serving_settings_as_valid_engine_arguments() -> None:
    from vllm.engine.arg_utils import EngineArgs

    kwargs = engine_kwargs(EngineOptions(), on_cpu=False)
    assert kwargs["dtype"] == "auto" and kwargs["enforce_eager"] is False  # CUDA graphs on
    assert kwargs["gpu_memory_utilization"] == 0.9 and "kv_cache_memory_bytes" not in kwargs
    assert kwargs["max_num_seqs"] == 256
    chosen = EngineOptions(
        dtype="bfloat16",
        max_num_seqs=64,
        gpu_memory_utilization=0.8,
        kv_cache_dtype="fp8",
        tensor_parallel_size=2,
        max_model_len=8192,
    )
    kwargs = engine_kwargs(chosen, on_cpu=False)
    # Every key is a vLLM engine argument (a typo would raise here, not on a GPU machine).
    args = EngineArgs(model=str(require_model()), **kwargs)
    assert (args.dtype, args.max_num_seqs, args.gpu_memory_utilization) == ("bfloat16", 64, 0.8)
    assert (args.kv_cache_dtype, args.tensor_parallel_size, args.enforce_eager) == ("fp8", 2, False)
    assert args.speculative_config["method"] == "custom_class"


def test_missing_inputs_fail_in_one_line_before_an_engine_is_built(tmp_path) -> None:
    missing = run_das("rollout", "--problems", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2  # a flag that names nothing: a usage error
    assert missing.stderr.strip().splitlines() == [
        f"das rollout: --problems {tmp_path / 'nope.jsonl'}: no such file (see `das rollout --help`)"
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "no id"}\n')
    malformed = run_das("traces", "generate", "--problems", str(bad), "--out", str(tmp_path / "t.jsonl"))
    assert malformed.returncode == 1 and "not a problem" in malformed.stderr
    no_model = run_das("rollout", "--model-dir", str(tmp_path))
    assert no_model.returncode == 1 and "has no config.json" in no_model.stderr
    # No engine started: vLLM logs its start-up to stderr, and nothing of it is there.
    for result in (missing, malformed, no_model):
        assert "vllm" not in result.stderr.lower(), result.stderr
