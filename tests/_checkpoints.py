"""Sharded copies of the prepared test model, laid out as Hugging Face saves 7B+ checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def shard_checkpoint(source: Path, target: Path, shards: int = 2) -> Path:
    """`target`: `source`'s weights split over `shards` safetensors files with `model.safetensors.index.json`,
    plus its config and tokenizer files."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source / "model.safetensors"))
    names = sorted(tensors)
    target.mkdir(parents=True)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(target / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, target / f.name)
    return target
