"""`das model prepare`: the prepared folder is complete, loadable by transformers, and re-running is a no-op."""

from __future__ import annotations

import pytest

from workers.model import ModelError, default_model_dir, is_prepared, prepare_model, require_model


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


def test_require_model_names_the_prepare_command_when_the_folder_is_empty(tmp_path) -> None:
    assert not is_prepared(tmp_path)
    with pytest.raises(ModelError, match="das model prepare"):
        require_model(tmp_path)


def test_default_model_dir_follows_das_model_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DAS_MODEL_DIR", str(tmp_path / "m"))
    assert default_model_dir() == tmp_path / "m"
