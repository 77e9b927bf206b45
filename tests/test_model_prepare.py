"""`das model prepare` and checkpoint folders: the prepared folder is complete and loadable by transformers,
re-running is a no-op, and any Hugging Face checkpoint folder (single file or sharded) is accepted while an
incomplete one is refused with what is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _checkpoints import shard_checkpoint

from workers.generator.model import (
    ModelError,
    check_checkpoint,
    default_model_dir,
    is_prepared,
    prepare_model,
    require_model,
)


def test_prepared_model_folder_is_complete_and_loads_with_transformers() -> None:
    model_dir = require_model()
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(model_dir))
    assert config.model_type == "llama"
    assert "quantization_config" not in config.to_dict()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert tokenizer.decode(tokenizer.encode("The answer is 42.")).endswith("The answer is 42.")


def test_prepare_on_a_prepared_folder_does_not_convert_again() -> None:
    model_dir = require_model()
    weights = model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert prepare_model(model_dir) == model_dir
    assert weights.stat().st_mtime_ns == before


def test_the_default_folder_names_the_prepare_command_when_empty(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DAS_MODEL_DIR", str(tmp_path / "m"))
    assert not is_prepared(tmp_path / "m")
    with pytest.raises(ModelError, match="das model prepare"):
        require_model()


def test_default_model_dir_follows_das_model_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DAS_MODEL_DIR", str(tmp_path / "m"))
    assert default_model_dir() == tmp_path / "m"


def test_a_sharded_checkpoint_is_accepted_and_loads_with_transformers(tmp_path) -> None:
    from safetensors import safe_open

    sharded = shard_checkpoint(require_model(), tmp_path / "sharded")
    checkpoint = check_checkpoint(sharded)
    assert require_model(sharded) == sharded
    assert checkpoint.weight_files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert checkpoint.architectures == ["LlamaForCausalLM"]
    names = set()
    for file in checkpoint.weight_files:
        with safe_open(str(sharded / file), "pt") as handle:
            names |= set(handle.keys())
    with safe_open(str(require_model() / "model.safetensors"), "pt") as handle:
        assert names == set(handle.keys())


@pytest.mark.parametrize(
    ("remove", "message"),
    [
        ("model-00002-of-00002.safetensors", "missing shards"),
        ("config.json", "no config.json"),
        ("tokenizer.json", "no tokenizer"),
    ],
)
def test_an_incomplete_checkpoint_names_what_is_missing(tmp_path, remove, message) -> None:
    sharded = shard_checkpoint(require_model(), tmp_path / "sharded")
    (sharded / remove).unlink()
    with pytest.raises(ModelError, match=message):
        require_model(sharded)


def test_das_model_check_prints_the_summary_and_fails_in_one_line(tmp_path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    ok = subprocess.run(
        [sys.executable, "-m", "workers.cli", "model", "check", str(require_model())],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["weight_files"] == ["model.safetensors"]
    bad = subprocess.run(
        [sys.executable, "-m", "workers.cli", "model", "check", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        f"das model check: {tmp_path} has no config.json: not a Hugging Face checkpoint folder"
    ]
