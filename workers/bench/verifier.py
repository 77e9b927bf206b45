"""`das bench verifier`: the replay's verifier cost model, measured on a real decoder shape.

The replay prices a verification step as c_base + c_seq x running sequences + c_tok x verified tokens
(`workers.bench.replay.CostModel`). This times what such a step is: a forward of `queries` tokens per
sequence (the last sampled token and its draft) for `batch` sequences that each attend to a KV cache of
`context` tokens, with the logits of every query token (the rejection sampler needs them all). The weights
are random, of a real shape (a transformers config): timing does not depend on their values. Then it fits
the three coefficients by non-negative least squares and writes JSON that `das bench replay --cost-model`
reads (`cost_model`).

The attention implementation is transformers' SDPA, not vLLM's paged kernels, and there is no CUDA graph:
at small batches, where launch overheads dominate, expect c_base above what a vLLM engine pays.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from workers.errors import InvalidInput

# Shapes by name; any other name is a path to a transformers config.json (a model folder's).
SHAPES: dict[str, dict] = {
    # For tests on the CPU: seconds for the whole grid.
    "tiny": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
    },
    # Qwen/Qwen2.5-7B's config.json.
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
    },
}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# 1 + K for drafts of K = 0, 1, 2, 4, 8, 16 tokens.
QUERIES = (1, 2, 3, 5, 9, 17)


def load_config(shape: str):
    """The transformers config of a named shape or of a config.json path."""
    from transformers import AutoConfig

    if shape in SHAPES:
        fields = dict(SHAPES[shape])
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    path = Path(shape)
    if not path.exists():
        raise InvalidInput(f"unknown shape {shape!r}: name one of {', '.join(SHAPES)} or a config.json path")
    return AutoConfig.from_pretrained(path.parent if path.is_file() else path)


def fit(batches: np.ndarray, tokens: np.ndarray, seconds: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative least squares of seconds = c_base + c_seq x batch + c_tok x tokens (every subset of the
    three coefficients, the best non-negative one): the coefficients and R^2."""
    design = np.column_stack([np.ones_like(batches), batches, tokens]).astype(np.float64)
    best, best_err = np.zeros(3), np.inf
    for size in (1, 2, 3):
        for cols in itertools.combinations(range(3), size):
            coef, *_ = np.linalg.lstsq(design[:, cols], seconds, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(3)
            full[list(cols)] = coef
            err = float(((design @ full - seconds) ** 2).sum())
            if err < best_err:
                best, best_err = full, err
    total = float(((seconds - seconds.mean()) ** 2).sum())
    return best, 1.0 - best_err / total if total > 0 else 1.0


def measure(
    shape: str,
    batches: Sequence[int] = BATCHES,
    queries: Sequence[int] = QUERIES,
    context: int = 1024,
    repeats: int = 5,
    device: str | None = None,
    dtype: str | None = None,
    seed: int = 0,
) -> dict:
    """Times the forward at every (batch, queries) pair (the fastest of `repeats` after one warm-up) and fits
    the cost model; the JSON `das bench verifier` writes."""
    import torch
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    torch.manual_seed(seed)
    config = load_config(shape)
    # Built in place, in its dtype, through the default dtype: transformers 4.x and 5.x name the argument
    # differently.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(default_dtype)
    model.eval()
    vocab = config.vocab_size

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    points = []
    with torch.inference_mode():
        for batch in batches:
            prompt = torch.randint(vocab, (batch, context), device=device)
            # The prefill only builds the cache: one position's logits, not the whole context's.
            cache = model(prompt, use_cache=True, logits_to_keep=1).past_key_values
            del prompt
            for q in queries:
                step = torch.randint(vocab, (batch, q), device=device)
                times = []
                for _ in range(repeats + 1):
                    sync()
                    start = time.perf_counter()
                    model(step, past_key_values=cache, use_cache=True)
                    sync()
                    times.append(time.perf_counter() - start)
                    cache.crop(-q)  # the next forward sees the same context
                # The least disturbed forward: on a shared machine noise only adds time.
                points.append({"batch": batch, "queries": q, "seconds": min(times[1:])})
            del cache
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    b = np.array([p["batch"] for p in points], np.float64)
    t = np.array([p["batch"] * p["queries"] for p in points], np.float64)
    s = np.array([p["seconds"] for p in points])
    coef, r2 = fit(b, t, s)
    predicted = coef[0] + coef[1] * b + coef[2] * t
    return {
        "shape": shape,
        # The fields that make a shape (those a named shape sets).
        "config": {k: v for k, v in config.to_dict().items() if k in SHAPES["qwen2.5-7b"]},
        "device": device,
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "context": context,
        "repeats": repeats,
        "torch": torch.__version__,
        "points": points,
        "cost_model": dict(zip(("c_base", "c_seq", "c_tok"), map(float, coef), strict=True)),
        "fit": {"r2": round(r2, 4), "max_relative_error": round(float(np.abs(predicted / s - 1).max()), 4)},
    }
