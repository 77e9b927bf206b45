"""Trace replay: what each drafting strategy would gain on recorded rollouts, before a GPU is spent.

Each epoch's requests run concurrently as one batch, interleaved token by token in recorded order. A draft is
verified by exact match against the recorded continuation: for a fixed drafter, exact-match acceptance on
sampled rollouts equals rejection sampling's acceptance in expectation. A finished rollout enters history at
once (as the indexer would), and its length is revealed to the budget policy.

Tokens per step hides the long tail, so the replay projects each epoch's makespan with the verifier cost
model step = c_base + c_seq * active requests + c_tok * tokens verified; requests leave the batch as they
finish. The default constants are a 7B model on one H100-class GPU at decode batch sizes (8 ms, 0.1 ms,
0.035 ms); two more models bracket it: memory-bound (c_tok 0.01 ms) and compute-bound (c_tok 0.1 ms, c_seq
0.3 ms). Only `das` depends on the cost model (its budget fits it online from the simulated step times,
starting from the same prior as in the engine), so every other strategy is simulated once and its steps
costed under each model.

Strategies:
- none, ngram (vLLM's prompt lookup, n 2-4);
- suffix-global: SuffixDecoding as vLLM ships it: one tree of all responses (in-flight ones too) and the
  request's own context, raw count ratios, min_token_prob 0.1, max_spec_factor 1;
- suffix-problem: the same rules on per-problem history trees with the request's own context;
- das-unbudgeted: DAS's composed drafter (problem history, in-flight siblings, global tree) at K;
- das: the same drafter with the budget policy of workers/budget/policy.py, as the engine runs it;
- oracle: perfect foresight on das's own drafts: each draft cut to the tokens that will be accepted.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from numba import njit
from pydantic import ValidationError

from history_store.automaton.config import DEFAULT_WINDOW_EPOCHS, DraftConfig
from history_store.automaton.kernels import Source
from pipeline.schemas import TrajectoryRecord
from pipeline.trace_files import numbered_lines
from workers.bench.cost_model import CostModel, cost_models
from workers.bench.engines import Engines, Fleet
from workers.bench.replay_drafters import (
    TREE_STRATEGIES,
    EngineDrafter,
    EpochRequests,
    IndexDrafter,
    NgramDrafter,
    NoDrafter,
)
from workers.errors import InvalidInput

STRATEGIES = ("none", "ngram", "suffix-global", "suffix-problem", "das-unbudgeted", "das", "oracle")
# Strategies whose steps do not depend on the cost model.
COST_FREE = tuple(s for s in STRATEGIES if s != "das")
CALIBRATION_BINS = 10


def load_traces(path: str | Path) -> list[TrajectoryRecord]:
    """Reads a JSON Lines trace (gzip if the name ends in .gz). Raises ValueError naming the first malformed
    line; never skips data."""
    records = []
    for lineno, line in numbered_lines(Path(path)):
        try:
            records.append(TrajectoryRecord.model_validate_json(line))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InvalidInput(
                f"{path}:{lineno}: invalid trajectory record ({where}: {first['msg']})"
            ) from None
    if not records:
        raise InvalidInput(f"{path}: no trajectory records")
    return records


def trace_max_tokens(records: Iterable[TrajectoryRecord]) -> int | None:
    """The response cap the trace was generated with (vLLM's max_tokens), as the engine knows it for every
    request: the length of the responses that ended on it (finish_reason "length"). None when no response
    did, or when one ran past it (then the trace mixes caps and none is known for all)."""
    capped = [len(r.response_ids) for r in records if r.finish_reason == "length"]
    if not capped:
        return None
    cap = max(capped)
    return cap if all(len(r.response_ids) <= cap for r in records) else None


@njit(cache=True)
def _accepted_prefix(drafts, kept, responses, starts, positions, remaining, out):
    """out[i] = how many of row i's first kept[i] draft tokens match its recorded continuation."""
    for i in range(drafts.shape[0]):
        n = min(kept[i], remaining[i])
        a = 0
        base = starts[i] + positions[i]
        while a < n and drafts[i, a] == responses[base + a]:
            a += 1
        out[i] = a


@dataclass
class _Calibration:
    """Predicted path acceptance probability vs outcome, per probability bin: count, sum p, sum y, sum (p-y)^2."""

    bins: np.ndarray = field(default_factory=lambda: np.zeros((CALIBRATION_BINS, 4)))

    def add(
        self,
        predicted: np.ndarray,
        lengths: np.ndarray,
        accepted: np.ndarray,
        first: np.ndarray | None = None,
    ) -> None:
        """Counts each row's draft tokens before lengths[i] (from first[i] on, where given)."""
        pos = np.arange(predicted.shape[1])[None, :]
        mask = pos < lengths[:, None]
        if first is not None:
            mask &= pos >= first[:, None]
        p = predicted[mask]
        y = (pos < accepted[:, None])[mask].astype(np.float64)
        b = np.minimum((p * CALIBRATION_BINS).astype(np.int64), CALIBRATION_BINS - 1)
        for column, values in enumerate((np.ones_like(p), p, y, (p - y) ** 2)):
            self.bins[:, column] += np.bincount(b, values, minlength=CALIBRATION_BINS)

    def report(self) -> dict | None:
        count = self.bins[:, 0]
        if not count.sum():
            return None
        table = [
            {
                "bin": [i / CALIBRATION_BINS, (i + 1) / CALIBRATION_BINS],
                "tokens": int(count[i]),
                "mean_predicted": round(float(self.bins[i, 1] / count[i]), 4),
                "observed": round(float(self.bins[i, 2] / count[i]), 4),
            }
            for i in range(CALIBRATION_BINS)
            if count[i]
        ]
        return {"brier": round(float(self.bins[:, 3].sum() / count.sum()), 5), "reliability": table}


@dataclass
class _AgreementTable:
    """Conditional acceptance of drafted tokens by how many of the request's other trees draft them too (0, 1
    or 2: `BatchDrafts.agreement`), the evidence the budget's agreement feature stands on. Token j of a draft is
    judged when tokens 0..j-1 were accepted; per group: tokens judged, accepted, and the sum of their trees'
    conditional ratios p_j / p_(j-1), so a reader can see the groups differ beyond the ratio."""

    bins: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))

    def add(
        self, probs: np.ndarray, agreement: np.ndarray, lengths: np.ndarray, accepted: np.ndarray
    ) -> None:
        pos = np.arange(probs.shape[1])[None, :]
        judged = (pos < lengths[:, None]) & (pos <= accepted[:, None])
        agreeing = (agreement[:, :1] > pos).astype(np.int64) + (agreement[:, 1:2] > pos)
        p = probs.astype(np.float64)
        previous = np.concatenate([np.ones((p.shape[0], 1)), p[:, :-1]], axis=1)
        ratio = np.divide(p, previous, out=np.zeros_like(p), where=previous > 0)
        groups = agreeing[judged]
        for column, values in enumerate(
            (np.ones(groups.shape[0]), (pos < accepted[:, None])[judged], ratio[judged])
        ):
            self.bins[:, column] += np.bincount(groups, values, minlength=3)

    def report(self) -> list[dict] | None:
        if not self.bins[:, 0].sum():
            return None
        return [
            {
                "agreeing_trees": a,
                "tokens": int(n),
                "acceptance": round(float(y / n), 4),
                "mean_tree_ratio": round(float(r / n), 4),
            }
            for a, (n, y, r) in enumerate(self.bins)
            if n
        ]


@dataclass
class _SourceTable:
    """Per epoch, what each tree's drafts brought: drafts verified, their tokens and the tokens accepted.
    "history" is the problem's tree (its earlier epochs' rollouts and this epoch's finished ones), "live" the
    request's own context with its in-flight siblings, "global" every problem's: where each epoch's gain
    comes from."""

    rows: dict[int, np.ndarray] = field(default_factory=dict)  # epoch -> (source number, 3 counts)

    def add(self, epoch: int, sources: np.ndarray, kept: np.ndarray, accepted: np.ndarray) -> None:
        size = len(Source)
        table = self.rows.setdefault(epoch, np.zeros((size, 3), np.int64))
        drafted = kept > 0  # a row without a draft has source Source.NONE and keeps nothing
        source = sources[drafted]
        for c, values in enumerate((np.ones(source.shape[0]), kept[drafted], accepted[drafted])):
            table[:, c] += np.bincount(source, values, minlength=size).astype(np.int64)

    def report(self) -> list[dict] | None:
        if not self.rows:
            return None
        return [
            {
                "epoch": epoch,
                **{
                    source.label: {"drafts": int(d), "draft_tokens": int(t), "accepted_tokens": int(a)}
                    for source, (d, t, a) in (
                        (source, table[source]) for source in Source if source != Source.NONE
                    )
                },
            }
            for epoch, table in sorted(self.rows.items())
        ]


@dataclass(frozen=True)
class VerifiedStep:
    """One step's drafts and what verification kept of them, for `simulate`'s `on_verified` (arrays are the
    step's own: valid only during the call)."""

    epoch: int
    keys: list[str]  # the rows' requests, "problem/epoch/sample"
    positions: np.ndarray  # each row's response position of its first draft token
    tokens: np.ndarray  # (rows, K) draft tokens
    kept: np.ndarray  # tokens sent to the verifier
    accepted: np.ndarray  # of those, the accepted prefix
    remaining: np.ndarray  # tokens left in each row's response (a draft past its end is never accepted)
    predicted: np.ndarray | None  # (rows, K) the budget's path acceptance probabilities (das only)
    sources: np.ndarray  # each row's draft source (a kernels.Source)
    remembered: np.ndarray  # (rows, K) each draft token's mean sampling probability in history (-1: unknown)
    match_lens: np.ndarray  # each row's matched context length


@dataclass
class Simulation:
    """What one strategy did: per epoch, the (active requests, verified tokens) of every step."""

    strategy: str
    epochs: list[int]
    steps: list[np.ndarray]  # per epoch, (n_steps, 2) int64: active, verified (and the engine, with engines)
    tokens: list[int]  # per epoch
    requests: list[int]  # per epoch
    per_request: np.ndarray  # (n, 4): length, steps, drafted, accepted
    tree_calibration: _Calibration
    policy_calibration: _Calibration | None
    # The acceptance model's raw path (before `path_recalibration`) for tokens drafted past the match length
    # (only with max_spec_factor above 1): what the path recalibration and its prior correct.
    past_match_calibration: _Calibration | None
    agreement: _AgreementTable
    sources: _SourceTable
    # das: per epoch, the first engine's proposer steps as (rows, held tokens, drafts) (`EngineDrafter.traces`).
    proposer_traces: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)


def _drafter(
    strategy: str,
    config: DraftConfig,
    window: int,
    ngram_range: tuple[int, int],
    records: list,
    engines: Engines | None,
    step_costs: Mapping[int, Sequence[Sequence[float]]] | None,
) -> NoDrafter:
    k = config.max_spec_tokens
    if strategy == "none":
        return NoDrafter(k)
    if strategy == "ngram":
        return NgramDrafter(k, ngram_range)
    if strategy in TREE_STRATEGIES:
        return IndexDrafter(strategy, config, window)
    if strategy == "das":
        longest = max(len(r.prompt_ids) + len(r.response_ids) for r in records)
        fleet = engines.engines if engines is not None else 1
        return EngineDrafter(config, window, fleet, trace_max_tokens(records), longest, step_costs)
    raise InvalidInput(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


def simulate(
    records: list[TrajectoryRecord],
    strategy: str,
    config: DraftConfig,
    window: int = DEFAULT_WINDOW_EPOCHS,
    cost: CostModel | None = None,
    ngram_range: tuple[int, int] = (2, 4),
    progress: Callable[[str], None] | None = None,
    measured_costs: Mapping[int, CostModel] | None = None,
    on_verified: Callable[[VerifiedStep], None] | None = None,
    engines: Engines | None = None,
    measured_steps: Mapping[int, Sequence[Sequence[float]]] | None = None,
    arrivals: Mapping[int, Sequence[int]] | None = None,
) -> Simulation:
    """Replays the records with one strategy. `cost` only matters for `das`, whose budget fits it online from
    step times: those of `cost`, or of `measured_costs[epoch]` where given (what an engine fitted in that
    epoch); or it budgets each step with the cost coefficients a recording engine budgeted the same step with
    (`measured_steps[epoch][j]`, where known: it then prices drafts as that engine did, whatever load its
    machine was under). The projected makespan always uses the cost model. A tree strategy hands every step's verified
    drafts to `on_verified` (`das bench ceiling` scores the budget's predictions with it). `engines`: finite
    engines with queues (`workers.bench.engines`); None runs each epoch as one batch, whose requests all start
    at its first step unless `arrivals[epoch][j]` says how many (in trace order) had started by step j (a
    recording engine's ramp: vLLM admits requests as they reach it, a few per step at first)."""
    cost = cost or CostModel()
    k = config.max_spec_tokens
    drafter = _drafter(strategy, config, window, ngram_range, records, engines, measured_steps)
    trees = strategy not in ("none", "ngram")
    budgeted = strategy == "das"
    fleet = Fleet(engines, trace_max_tokens(records)) if engines is not None else None
    by_epoch: dict[int, list[TrajectoryRecord]] = defaultdict(list)
    for r in records:
        by_epoch[r.epoch].append(r)
    sim = Simulation(
        strategy,
        [],
        [],
        [],
        [],
        np.zeros((0, 4), np.int64),
        _Calibration(),
        _Calibration() if budgeted else None,
        _Calibration() if budgeted else None,
        _AgreementTable(),
        _SourceTable(),
    )
    per_request = []
    for epoch in sorted(by_epoch):
        batch = by_epoch[epoch]
        step_cost = (measured_costs or {}).get(epoch, cost)
        requests = EpochRequests.of(batch)
        drafter.start_epoch(requests)
        lengths, pos, starts = np.diff(requests.starts), requests.pos, requests.starts
        prompt_lens = np.array([p.size for p in requests.prompts], np.int64)
        stats = np.zeros((len(batch), 3), np.int64)  # steps, drafted, accepted
        schedule = fleet.epoch([r.problem_id for r in batch], lengths, prompt_lens, pos) if fleet else None
        ramp = list((arrivals or {}).get(epoch, ())) if not schedule else []
        started = np.arange(len(batch))
        step_no = 0
        engine, active = (
            schedule.next_step()
            if schedule
            else (0, np.nonzero((lengths > 0) & (started < (ramp[0] if ramp else len(batch))))[0])
        )
        step_log = []
        while active.size:
            n = active.size
            remaining = lengths[active] - pos[active]
            # As in the engine, the first token comes from the prefill, before anything was drafted; so does the
            # first after a preemption, which recomputes the prefix (verified below).
            recompute = schedule.prefill(active) if schedule else np.zeros(n, bool)
            room = np.where((pos[active] > 0) & ~recompute, k, 0)
            drafts = drafter.draft(engine, active, room)
            kept = drafts.kept
            accepted = np.zeros(n, np.int64)
            _accepted_prefix(
                drafts.tokens, kept, requests.responses, starts[active], pos[active], remaining, accepted
            )
            if on_verified is not None and trees:
                on_verified(
                    VerifiedStep(
                        epoch,
                        [requests.keys[i] for i in active],
                        pos[active],
                        drafts.tokens,
                        kept,
                        accepted,
                        remaining,
                        drafts.predicted,
                        drafts.sources,
                        drafts.remembered,
                        drafts.match_lens,
                    )
                )
            if strategy == "oracle":
                kept = accepted.copy()
            elif trees:
                sim.tree_calibration.add(drafts.probs.astype(np.float64), kept, accepted)
                sim.agreement.add(drafts.probs, drafts.agreement, kept, accepted)
            if trees:
                sim.sources.add(epoch, drafts.sources, kept, accepted)
            if budgeted:
                sim.policy_calibration.add(drafts.predicted, kept, accepted)
                past = np.where(drafts.match_lens > 0, drafts.match_lens, k)
                sim.past_match_calibration.add(drafts.path_p, kept, accepted, past)
            advance = np.minimum(accepted + 1, remaining)
            verified = int(kept.sum()) + n
            for i in active[recompute]:
                verified += prompt_lens[i] + int(pos[i])
            step_log.append((n, verified, engine) if schedule else (n, verified))
            stats[active, 0] += 1
            stats[active, 1] += kept
            stats[active, 2] += accepted
            pos[active] += advance
            done = active[pos[active] >= lengths[active]]
            queued = schedule.queued(engine) if schedule else np.zeros(0, np.int64)
            drafter.after_step(engine, active, done, step_cost.step(n, verified), queued)
            if schedule:
                schedule.finish(engine, done)
                engine, active = schedule.next_step()
            else:
                step_no += 1
                admitted = ramp[step_no] if step_no < len(ramp) else len(batch)
                active = np.nonzero((pos < lengths) & (started < admitted))[0]
        drafter.end_epoch()
        per_request.append(np.column_stack([lengths, stats]))
        sim.epochs.append(epoch)
        sim.steps.append(np.array(step_log, np.int64).reshape(-1, 3 if schedule else 2))
        sim.tokens.append(int(lengths.sum()))
        sim.requests.append(len(batch))
        if progress:
            progress(f"{strategy}: epoch {epoch} done")
    sim.per_request = np.concatenate(per_request)
    if isinstance(drafter, EngineDrafter):
        sim.proposer_traces = drafter.traces
    return sim


def replay(
    records: list[TrajectoryRecord],
    strategy: str,
    config: DraftConfig,
    window: int = DEFAULT_WINDOW_EPOCHS,
    cost: CostModel | None = None,
    measured_costs: Mapping[int, CostModel] | None = None,
    measured_steps: Mapping[int, Sequence[float]] | None = None,
    engines: Engines | None = None,
    arrivals: Mapping[int, Sequence[int]] | None = None,
) -> dict:
    """One strategy's summary under one cost model (`simulate`, then `summarize`); with das, also each epoch's
    proposer steps (`proposer_traces`)."""
    cost = cost or CostModel()
    sim = simulate(
        records,
        strategy,
        config,
        window,
        cost,
        measured_costs=measured_costs,
        measured_steps=measured_steps,
        engines=engines,
        arrivals=arrivals,
    )
    summary = summarize(sim, cost)
    if sim.proposer_traces:
        summary["proposer_traces"] = sim.proposer_traces
    return summary


def makespan(steps: np.ndarray, cost: CostModel) -> float:
    """Projected seconds of one epoch's steps (active, verified[, engine]) under `cost`: with engines, the
    slowest engine's."""
    if not steps.size:
        return 0.0
    seconds = cost.c_base + cost.c_seq * steps[:, 0] + cost.c_tok * steps[:, 1]
    if steps.shape[1] == 3:
        return float(np.bincount(steps[:, 2], seconds).max())
    return float(seconds.sum())


def summarize(sim: Simulation, cost: CostModel) -> dict:
    """Totals, per-epoch and per-length-quartile rows, wasted tokens and calibration of one simulation."""
    arr = sim.per_request
    tokens, steps, drafted, accepted = (int(x) for x in arr.sum(axis=0))
    bounds = np.cumsum([0, *sim.requests])
    per_epoch = [
        {
            "epoch": epoch,
            "requests": n_req,
            "tokens": n_tok,
            "steps": int(s[:, 0].sum()),
            "draft_tokens": int(arr[bounds[e] : bounds[e + 1], 2].sum()),
            "accepted_tokens": int(arr[bounds[e] : bounds[e + 1], 3].sum()),
            "batch_steps": int(s.shape[0]),
            "mean_accepted_per_step": n_tok / max(int(s[:, 0].sum()), 1),
            "projected_makespan_s": makespan(s, cost),
        }
        for e, (epoch, n_req, n_tok, s) in enumerate(
            zip(sim.epochs, sim.requests, sim.tokens, sim.steps, strict=True)
        )
    ]
    quartiles = []
    order = np.argsort(arr[:, 0], kind="stable")
    for i, part in enumerate(np.array_split(order, 4)):
        sub = arr[part]
        quartiles.append(
            {
                "quartile": i + 1,
                "response_len_range": [int(sub[:, 0].min()), int(sub[:, 0].max())] if sub.size else [0, 0],
                "mean_accepted_per_step": float(sub[:, 0].sum() / max(sub[:, 1].sum(), 1)),
                "acceptance_rate": float(sub[:, 3].sum() / sub[:, 2].sum()) if sub[:, 2].sum() else None,
            }
        )
    out = {
        "strategy": sim.strategy,
        "tokens": tokens,
        "steps": steps,
        "mean_accepted_per_step": tokens / max(steps, 1),
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "wasted_verification_tokens": drafted - accepted,
        "projected_makespan_s": sum(e["projected_makespan_s"] for e in per_epoch),
        "per_epoch": per_epoch,
        "per_length_quartile": quartiles,
    }
    calibration = {"tree_ratio": sim.tree_calibration.report()}
    if sim.policy_calibration is not None:
        calibration["budget_policy"] = sim.policy_calibration.report()
        past_match = sim.past_match_calibration.report()
        if past_match:  # none at max_spec_factor 1: no draft runs past its match
            calibration["past_match_raw_path"] = past_match
    if any(calibration.values()):
        out["calibration"] = calibration
    by_agreement = sim.agreement.report()
    if by_agreement:
        out["acceptance_by_agreement"] = by_agreement
    by_source = sim.sources.report()
    if by_source:
        out["by_source"] = by_source
    return out


def compare(results: dict[str, dict]) -> dict:
    """das against none per epoch, and the share of the none -> oracle gap each strategy closes."""
    out: dict = {}
    none, oracle = results.get("none"), results.get("oracle")
    if none and oracle:
        gap = none["projected_makespan_s"] - oracle["projected_makespan_s"]
        out["oracle_gap_closed"] = {
            name: round((none["projected_makespan_s"] - r["projected_makespan_s"]) / gap, 4)
            if gap > 0
            else None
            for name, r in results.items()
            if name not in ("none", "oracle")
        }
    if none and "das" in results:
        out["das_vs_none_per_epoch"] = [
            {
                "epoch": a["epoch"],
                "none_s": round(a["projected_makespan_s"], 4),
                "das_s": round(b["projected_makespan_s"], 4),
                "change": round(b["projected_makespan_s"] / a["projected_makespan_s"] - 1, 4),
            }
            for a, b in zip(none["per_epoch"], results["das"]["per_epoch"], strict=True)
        ]
    contenders = {n: r["projected_makespan_s"] for n, r in results.items() if n != "oracle"}
    if contenders:
        out["best_non_oracle"] = min(contenders, key=contenders.get)
    return out


def run(
    path: str | Path,
    strategies: Iterable[str] = STRATEGIES,
    config: DraftConfig | None = None,
    window: int = DEFAULT_WINDOW_EPOCHS,
    costs: dict[str, CostModel] | None = None,
    progress: Callable[[str], None] | None = None,
    engines: Engines | None = None,
) -> dict:
    """Replays a trace file with each strategy under each cost model; the JSON `das bench replay` prints.
    `engines`: finite engines (see `simulate`), recorded in the result's "engines"."""
    config = config or DraftConfig()
    costs = costs or cost_models(CostModel())
    strategies = list(strategies)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise InvalidInput(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    records = load_traces(path)
    shared = {
        s: simulate(records, s, config, window, progress=progress, engines=engines)
        for s in strategies
        if s in COST_FREE
    }
    by_cost = {}
    for name, cost in costs.items():
        results = {}
        for s in strategies:
            sim = shared.get(s) or simulate(
                records, s, config, window, cost, progress=progress, engines=engines
            )
            results[s] = summarize(sim, cost)
        by_cost[name] = {"coefficients": dataclasses.asdict(cost), "strategies": results, **compare(results)}
    return {
        "trace": str(path),
        "records": len(records),
        "config": {**dataclasses.asdict(config), "window_epochs": window},
        **({"engines": engines.describe()} if engines is not None else {}),
        "cost_models": by_cost,
    }


def main_table(result: dict) -> str:
    """One table per cost model: tokens per step, acceptance, wasted tokens, makespan, oracle gap closed."""
    lines = []
    for name, block in result["cost_models"].items():
        c = block["coefficients"]
        lines.append(
            f"cost model {name}: c_base {c['c_base'] * 1e3:g} ms, c_seq {c['c_seq'] * 1e3:g} ms, "
            f"c_tok {c['c_tok'] * 1e3:g} ms"
        )
        lines.append(
            f"{'strategy':15s} {'tok/step':>9s} {'accept':>7s} {'wasted':>9s} {'makespan s':>11s} {'gap':>6s}"
        )
        gap = block.get("oracle_gap_closed", {})
        for s, r in block["strategies"].items():
            acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
            share = f"{gap[s]:.2f}" if gap.get(s) is not None else "-"
            lines.append(
                f"{s:15s} {r['mean_accepted_per_step']:9.3f} {acc:>7s} {r['wasted_verification_tokens']:9d} "
                f"{r['projected_makespan_s']:11.2f} {share:>6s}"
            )
        if "das_vs_none_per_epoch" in block:
            per_epoch = ", ".join(f"{e['change']:+.1%}" for e in block["das_vs_none_per_epoch"])
            lines.append(f"das vs none per epoch: {per_epoch}")
        calibration = block["strategies"].get("das", {}).get("calibration", {})
        if calibration.get("budget_policy"):
            lines.append(
                f"das acceptance Brier: policy {calibration['budget_policy']['brier']:.4f}, "
                f"tree ratio {calibration['tree_ratio']['brier']:.4f}"
            )
        lines.append("")
    return "\n".join(lines).rstrip()


def dumps(result: dict) -> str:
    return json.dumps(result, indent=2)
