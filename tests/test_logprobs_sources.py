"""Where `response_logprobs` come from: the rollout worker's engine (vLLM `logprobs=0` with processed
logprobs) records one per response token, and `das traces annotate` (the model teacher-forced over the trace)
reproduces the engine's values to float rounding, at each epoch's temperature, on a trace the engine sampled
with DAS drafting (accepted draft tokens get their values from vLLM's rejection sampler)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_support import das_json

from workers.bench.replay import load_traces

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parent.parent
TEMPERATURES = "0.7,1.0"
# The engine's float32 forward and transformers' differ in summation order only: at most 3.4e-5 apart on
# SmolLM2-135M (measured); a wrong temperature (0.7 for 0.8: 0.7) or position is off by far more.
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def sampled(tmp_path_factory) -> Path:
    trace = tmp_path_factory.mktemp("logprobs") / "sampled.jsonl"
    # Two epochs at different temperatures; the budget off, so the second drafts from the first's history at
    # every step and accepted draft tokens are among those checked.
    report = das_json(
        "traces", "generate", "--strategy", "das", "--epochs", "2", "--samples", "2", "--num-problems", "2",
        "--max-tokens", "48", "--temperatures", TEMPERATURES, "--max-num-seqs", "4", "--budget", "off",
        "--out", str(trace), timeout=1200,
    )  # fmt: skip
    assert report["settings"]["logprobs"] is True
    assert report["epochs"][1]["accepted_tokens"] > 0
    return trace


def test_the_rollout_worker_records_one_sampling_logprob_per_response_token(sampled: Path) -> None:
    records = load_traces(sampled)
    assert len(records) == 8
    for record in records:
        values = np.asarray(record.response_logprobs)
        assert values.shape == (len(record.response_ids),) and len(values) > 0
        assert np.isfinite(values).all() and (values <= 0).all()
    # Sampling at T >= 0.7 from a 135M model: some tokens were far from certain.
    assert min(min(r.response_logprobs) for r in records) < -1.0


def test_annotate_reproduces_the_engines_logprobs_and_keeps_every_other_field(
    sampled: Path, tmp_path
) -> None:
    lines = [json.loads(line) for line in sampled.read_text().splitlines()]
    stripped = tmp_path / "stripped.jsonl"
    stripped.write_text(
        "".join(
            json.dumps({k: v for k, v in line.items() if k != "response_logprobs"}) + "\n" for line in lines
        )
    )
    out = tmp_path / "annotated.jsonl.gz"
    report = das_json(
        "traces", "annotate", str(stripped), "--temperatures", TEMPERATURES, "-o", str(out), timeout=1200
    )
    assert report["records"] == 8 and report["temperatures"] == {"0": 0.7, "1": 1.0}
    with gzip.open(out, "rt", encoding="utf-8") as handle:
        annotated = [json.loads(line) for line in handle]
    worst = 0.0
    for engine, teacher in zip(lines, annotated, strict=True):
        assert {k: v for k, v in teacher.items() if k != "response_logprobs"} == {
            k: v for k, v in engine.items() if k != "response_logprobs"
        }
        diff = np.abs(np.asarray(teacher["response_logprobs"]) - np.asarray(engine["response_logprobs"]))
        worst = max(worst, float(diff.max()))
    assert worst < TOLERANCE, f"teacher forcing is {worst} from the engine's log probabilities"
    # bfloat16 autocast: faster, and off by a few hundredths of a nat on average.
    fast = tmp_path / "annotated_bf16.jsonl"
    report = das_json(
        "traces",
        "annotate",
        str(stripped),
        "--temperatures",
        TEMPERATURES,
        "-o",
        str(fast),
        "--dtype",
        "bfloat16",
        timeout=1200,
    )
    assert report["dtype"] == "bfloat16 autocast"
    approximate = [json.loads(line) for line in fast.read_text().splitlines()]
    gaps = np.concatenate(
        [
            np.abs(np.asarray(a["response_logprobs"]) - np.asarray(e["response_logprobs"]))
            for a, e in zip(approximate, lines, strict=True)
        ]
    )
    assert (
        gaps.mean() < 0.1 and (np.asarray(sum((a["response_logprobs"] for a in approximate), [])) <= 0).all()
    )


def test_annotate_refuses_temperatures_that_do_not_fit_the_epochs_in_one_line(tmp_path) -> None:
    out = tmp_path / "never.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", "traces", "annotate", str(REPO / "data" / "fidelity_das.jsonl.gz"),
         "--temperatures", "1.0,0.5", "-o", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1 and not out.exists()
    assert result.stderr.strip().splitlines() == [
        "das traces annotate: --temperatures gives 2 values for 3 epochs"
    ]
