"""`das bench replay`: what each drafting strategy would gain on recorded rollouts, before a GPU is spent.

Epochs run in order; all requests of an epoch run concurrently as one batch and are interleaved token by
token, so in-flight siblings see each other as in a real batch. Each verification step a strategy drafts up
to `max_draft` tokens per request; the longest prefix equal to the recorded continuation is accepted, plus
one bonus token. For a fixed drafter, exact-match acceptance on sampled rollouts equals rejection
sampling's acceptance in expectation. A finished rollout enters history at once (as the indexer would).

Tokens per step hides the long tail, so the replay also projects each epoch's makespan with the verifier
cost model step = c_base + c_seq * active requests + c_tok * tokens verified; requests leave the batch as
they finish. Defaults are the reference figures' constants (8 ms, 0.1 ms, 0.035 ms: a 7B model on one
H100-class GPU at decode batch sizes).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numba import njit
from pydantic import ValidationError

from history_store.problem_index import ProblemIndex
from history_store.suffix_tree import DraftConfig
from pipeline.schemas import TrajectoryRecord
from workers.budget import BudgetConfig, BudgetPolicy

STRATEGIES = ("none", "ngram", "suffix-global", "das-problem", "das-unbudgeted", "das")


@dataclass(frozen=True)
class CostModel:
    """Verifier step cost in seconds: c_base + c_seq * active + c_tok * verified tokens."""

    c_base: float = 8e-3
    c_seq: float = 1e-4
    c_tok: float = 3.5e-5

    def step(self, active: int, verified: int) -> float:
        return self.c_base + self.c_seq * active + self.c_tok * verified


def load_traces(path: str | Path) -> list[TrajectoryRecord]:
    """Reads a JSON Lines trace (gzip if the name ends in .gz). Raises ValueError naming the first malformed
    line; never skips data."""
    records = []
    with (gzip.open if str(path).endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(TrajectoryRecord.model_validate_json(line))
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                raise ValueError(
                    f"{path}:{lineno}: invalid trajectory record ({where}: {first['msg']})"
                ) from None
    if not records:
        raise ValueError(f"{path}: no trajectory records")
    return records


@njit(cache=True)
def ngram_draft(ctx: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """vLLM's prompt lookup: the longest n-gram (min_n..max_n) ending the context that also occurs earlier;
    its earliest occurrence's next k tokens."""
    n_tok = ctx.shape[0]
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        for j in range(0, n_tok - n):
            match = True
            for t in range(n):
                if ctx[j + t] != ctx[n_tok - n + t]:
                    match = False
                    break
            if match:
                start = j + n
                return ctx[start : min(start + k, n_tok)].copy()
    return np.empty(0, ctx.dtype)


class _Request:
    __slots__ = ("key", "record", "response", "pos", "context", "ctx_len")

    def __init__(self, key: str, record: TrajectoryRecord) -> None:
        self.key = key
        self.record = record
        self.response = np.asarray(record.response_ids, np.int32)
        self.pos = 0
        prompt = np.asarray(record.prompt_ids, np.int32)
        self.context = np.empty(prompt.shape[0] + self.response.shape[0], np.int32)
        self.context[: prompt.shape[0]] = prompt
        self.ctx_len = prompt.shape[0]


def _index_for(strategy: str, config: DraftConfig, window: int) -> ProblemIndex | None:
    if strategy in ("none", "ngram"):
        return None
    if strategy == "suffix-global":
        # SuffixDecoding as it is: one global tree of responses (active ones included), the request's own
        # context, and its raw count ratios as probabilities.
        config = dataclasses.replace(config, escape=0.0)
        return ProblemIndex(window_epochs=1_000_000, config=config, use_history=False, live_scope="all")
    if strategy == "das-problem":
        return ProblemIndex(window_epochs=window, config=config, use_global=False)
    if strategy in ("das", "das-unbudgeted"):
        return ProblemIndex(window_epochs=window, config=config)
    raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


def replay(
    records: list[TrajectoryRecord],
    strategy: str,
    config: DraftConfig,
    window: int = 3,
    cost: CostModel | None = None,
    ngram_range: tuple[int, int] = (2, 4),
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Replays the records with one strategy; returns its totals and breakdowns."""
    cost = cost or CostModel()
    if strategy == "das":
        # As in the engine (workers/proposer.py): with the budget on, the calibrated pay-off rule, not the
        # tree's raw probability floor, decides where a draft ends.
        config = dataclasses.replace(config, min_token_prob=0.0)
    index = _index_for(strategy, config, window)
    k = config.max_spec_tokens
    # DAS proper: the same length-aware policy the engine runs, its cost model fed the simulated step times.
    policy = (
        BudgetPolicy(
            BudgetConfig(
                max_tokens=k, prior_c_base=cost.c_base, prior_c_seq=cost.c_seq, prior_c_tok=cost.c_tok
            )
        )
        if strategy == "das"
        else None
    )
    by_epoch: dict[int, list[TrajectoryRecord]] = defaultdict(list)
    for r in records:
        by_epoch[r.epoch].append(r)
    per_epoch = []
    per_request: list[tuple[int, int, int, int]] = []  # (length, steps, drafted, accepted)
    for epoch in sorted(by_epoch):
        reqs = [_Request(f"{r.problem_id}/{r.epoch}/{r.sample}", r) for r in by_epoch[epoch]]
        if index is not None:
            for q in reqs:
                index.start_request(q.key, q.record.problem_id, q.context[: q.ctx_len])
        if policy is not None:
            for q in reqs:
                policy.start(q.key, q.record.problem_id)
        steps = {q.key: [0, 0, 0] for q in reqs}  # steps, drafted, accepted
        active = [q for q in reqs if q.response.shape[0] > 0]
        makespan = 0.0
        n_steps = 0
        while active:
            keys = [q.key for q in active]
            pos = np.array([q.pos for q in active], np.int64)
            # As in the engine, the first token comes from the prefill, before anything was drafted.
            room = np.where(pos > 0, k, 0)
            if policy is not None:
                budgets, classes = policy.budgets(keys, pos, room)
                drafts = index.draft_batch(keys, budgets)
                kept = policy.truncate(drafts.lengths, drafts.probs, classes)
                accepted_now = np.zeros(len(active), np.int32)
            elif index is not None:
                drafts = index.draft_batch(keys, room.astype(np.int32))
                kept = np.minimum(drafts.lengths, room)
            verified = 0
            committed = []
            for row, q in enumerate(active):
                if strategy == "ngram" and q.pos > 0:
                    draft = ngram_draft(q.context[: q.ctx_len], ngram_range[0], ngram_range[1], k)
                elif index is not None:
                    draft = drafts.tokens[row, : kept[row]]
                else:
                    draft = q.response[:0]
                target = q.response[q.pos : q.pos + draft.shape[0]]
                n = min(draft.shape[0], target.shape[0])
                mismatch = np.nonzero(draft[:n] != target[:n])[0]
                accepted = int(mismatch[0]) if mismatch.size else n
                advance = min(accepted + 1, q.response.shape[0] - q.pos)
                verified += draft.shape[0] + 1
                new = q.response[q.pos : q.pos + advance]
                q.context[q.ctx_len : q.ctx_len + advance] = new
                q.ctx_len += advance
                q.pos += advance
                s = steps[q.key]
                s[0] += 1
                s[1] += draft.shape[0]
                s[2] += accepted
                if policy is not None:
                    accepted_now[row] = accepted
                committed.append(new)
            if index is not None:
                index.append_batch(keys, committed)
            step_s = cost.step(len(active), verified)
            makespan += step_s
            if policy is not None:
                policy.observe_acceptance(drafts.probs, kept, classes, accepted_now)
                policy.observe_step(len(active), verified, step_s)
            n_steps += 1
            still = []
            for q in active:
                if q.pos < q.response.shape[0]:
                    still.append(q)
                elif index is not None:
                    index.finish_request(q.key)
                    if policy is not None:
                        policy.finish(q.key, q.response.shape[0])
                    r = q.record
                    index.add_trajectory(r.problem_id, r.epoch, r.sample, r.prompt_ids, r.response_ids)
            active = still
        for q in reqs:
            if index is not None and q.response.shape[0] == 0:
                index.finish_request(q.key)
            per_request.append((q.response.shape[0], *steps[q.key]))
        tokens = sum(q.response.shape[0] for q in reqs)
        e_steps = sum(steps[q.key][0] for q in reqs)
        per_epoch.append(
            {
                "epoch": epoch,
                "requests": len(reqs),
                "tokens": tokens,
                "steps": e_steps,
                "draft_tokens": sum(steps[q.key][1] for q in reqs),
                "accepted_tokens": sum(steps[q.key][2] for q in reqs),
                "batch_steps": n_steps,
                "mean_accepted_per_step": tokens / max(e_steps, 1),
                "projected_makespan_s": makespan,
            }
        )
        if progress:
            progress(f"{strategy}: epoch {epoch} done")
    return _summary(strategy, per_epoch, per_request)


def _summary(strategy: str, per_epoch: list[dict], per_request: list[tuple[int, int, int, int]]) -> dict:
    arr = np.array(per_request, np.int64).reshape(-1, 4)
    tokens, steps, drafted, accepted = (int(x) for x in arr.sum(axis=0))
    quartiles = []
    if arr.shape[0]:
        order = np.argsort(arr[:, 0], kind="stable")
        for i, part in enumerate(np.array_split(order, 4)):
            sub = arr[part]
            quartiles.append(
                {
                    "quartile": i + 1,
                    "response_len_range": [int(sub[:, 0].min()), int(sub[:, 0].max())]
                    if sub.size
                    else [0, 0],
                    "mean_accepted_per_step": float(sub[:, 0].sum() / max(sub[:, 1].sum(), 1)),
                    "acceptance_rate": float(sub[:, 3].sum() / sub[:, 2].sum()) if sub[:, 2].sum() else None,
                }
            )
    return {
        "strategy": strategy,
        "tokens": tokens,
        "steps": steps,
        "mean_accepted_per_step": tokens / max(steps, 1),
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "projected_makespan_s": sum(e["projected_makespan_s"] for e in per_epoch),
        "per_epoch": per_epoch,
        "per_length_quartile": quartiles,
    }


def run(
    path: str | Path,
    strategies: Iterable[str] = STRATEGIES,
    config: DraftConfig | None = None,
    window: int = 3,
    cost: CostModel | None = None,
) -> dict:
    """Replays a trace file with each strategy; the JSON `das bench replay` prints."""
    config = config or DraftConfig()
    cost = cost or CostModel()
    records = load_traces(path)
    results = {s: replay(records, s, config, window, cost) for s in strategies}
    return {
        "trace": str(path),
        "records": len(records),
        "config": {**config.__dict__, "window_epochs": window},
        "cost_model": cost.__dict__,
        "strategies": results,
    }


def main_table(result: dict) -> str:
    lines = [f"{'strategy':15s} {'tok/step':>9s} {'accept':>8s} {'makespan s':>11s}"]
    for name, r in result["strategies"].items():
        acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        lines.append(
            f"{name:15s} {r['mean_accepted_per_step']:9.3f} {acc:>8s} {r['projected_makespan_s']:11.2f}"
        )
    return "\n".join(lines)


def dumps(result: dict) -> str:
    return json.dumps(result, indent=2)
