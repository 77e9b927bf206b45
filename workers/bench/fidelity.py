"""`das bench fidelity`: does the replay predict what the engine measured on the same rollouts?

Input: a trace the engine recorded itself (`das traces generate --strategy das|ngram --report R.json`) and the
engine's per-epoch figures in R.json. The replay runs that trace with the recording's strategy and settings
(K, depth, window, budget and, for the budget, the cost coefficients the engine budgeted each step with, or else
the costs it fitted in each epoch), and both sides' accepted draft tokens per request step and acceptance are
compared, per epoch and over the whole run.

Why they can agree closely: for a fixed drafter, a draft token accepted by rejection sampling is the token the
trajectory records, and a rejected one never is (the recovered token is drawn with the draft's probability
removed). So on the engine's own trace, exact-match replay accepts exactly what the engine accepted whenever
both draft the same tokens at the same positions. The replay's das runs the engine's own proposer
(`workers.bench.replay_drafters.EngineDrafter`) with the costs the engine budgeted each step with, so both
price drafts alike. What still differs: the engine admits requests over a few steps (the replay starts an
epoch's requests together), so the two step sequences, and the costs matched to them by position, align only
approximately; and the engine counts drafts accepted past `max_tokens` that the output then drops.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from history_store.automaton.config import DraftConfig
from workers.bench import replay
from workers.bench.engines import Engines
from workers.errors import InvalidInput
from workers.generator.settings import ProposerSettings

TOLERANCE = 0.10


def _figures(accepted: float, drafted: float, steps: float) -> dict[str, float]:
    return {
        "accepted_per_step": round(accepted / steps, 4) if steps else 0.0,
        "acceptance": round(accepted / drafted, 4) if drafted else 0.0,
    }


def _engine_epoch(row: dict[str, Any]) -> dict[str, Any]:
    # The engine's report: every request step commits its accepted drafts plus one token.
    steps = row["output_tokens"] - row["accepted_tokens"]
    return {
        "steps": steps,
        "draft_tokens": row["draft_tokens"],
        "accepted_tokens": row["accepted_tokens"],
        **_figures(row["accepted_tokens"], row["draft_tokens"], steps),
    }


def first_parting(engine: list[list[int]], replayed: list[list[int]]) -> dict[str, Any] | None:
    """The first step at which a replay's proposer did not do what the engine's did, each step compared as
    (rows, tokens the rows held, draft tokens returned); None when every step both ran agrees. Rows or held
    tokens that differ mean the two ran different batches by then (scheduling, or acceptance earlier); the same
    batch with other drafts means the budget or the trees differ."""
    for step, (mine, theirs) in enumerate(zip(engine, replayed, strict=False)):
        if list(mine) != list(theirs):
            names = ("rows", "held_tokens", "drafted")
            return {
                "step": step,
                "engine": dict(zip(names, mine, strict=True)),
                "replay": dict(zip(names, theirs, strict=True)),
                "same_batch": list(mine[:2]) == list(theirs[:2]),
                "drafted_before": sum(s[2] for s in engine[:step]),
            }
    if len(engine) != len(replayed):
        return {
            "step": min(len(engine), len(replayed)),
            "engine_steps": len(engine),
            "replay_steps": len(replayed),
        }
    return None


def ramp(trace: list[list[int]], total: int) -> list[int]:
    """How many of an epoch's `total` requests an engine had started by each of its first steps, from its step
    trace's rows: while no row has finished (the rows never fell), the rows are the requests started."""
    admitted: list[int] = []
    for rows, _, _ in trace:
        if admitted and rows < admitted[-1]:
            break
        admitted.append(min(int(rows), total))
        if admitted[-1] >= total:
            break
    return admitted


def _relative(replayed: float, engine: float) -> float | None:
    return round(abs(replayed - engine) / engine, 4) if engine else None


def compare(trace: str | Path, engine_report: dict[str, Any], tolerance: float = TOLERANCE) -> dict[str, Any]:
    """Replays `trace` as the engine ran it and compares; returns the report `das bench fidelity` prints.

    Raises:
        ValueError: the report is not one of `das traces generate --report`, or its strategy has no drafts.
    """
    try:
        strategy, settings, epochs = (
            engine_report["strategy"],
            engine_report["settings"],
            engine_report["epochs"],
        )
    except KeyError as exc:
        raise InvalidInput(
            f"not an engine report of `das traces generate --report` (missing {exc})"
        ) from None
    if strategy not in ("ngram", "das"):
        raise InvalidInput(f"the engine ran {strategy!r}: only ngram and das draft")
    proposer = ProposerSettings(budget=settings["budget"] == "on")
    config = DraftConfig(
        max_depth=proposer.max_depth,
        max_spec_tokens=settings["k"],
        max_spec_factor=proposer.max_spec_factor,
        max_spec_offset=proposer.max_spec_offset,
        min_token_prob=proposer.min_token_prob,
    )
    measured = steps = None
    if strategy == "das" and proposer.budget:
        # The engine's budget priced drafts with costs it fitted from its machine's step times (a fit moves with
        # the machine's load): the replay's budgets each step with the costs the engine had at it, where the
        # report has them, else learns from each epoch's fitted costs.
        measured = {row["epoch"]: replay.CostModel(**row["cost_model"]) for row in epochs}
        steps = {row["epoch"]: row["step_costs"] for row in epochs if "step_costs" in row} or None
        strategy_in_replay = "das"
    else:
        strategy_in_replay = "das-unbudgeted" if strategy == "das" else "ngram"
    records = replay.load_traces(trace)
    engines = _slots(settings, records)
    per_epoch = Counter(r.epoch for r in records)
    # An engine with a slot for every request admits them as they reach it, a few per step at first: the
    # replay starts them as its step trace says (recordings since the step trace; before, all at step 0).
    arrivals = (
        {
            row["epoch"]: ramp(row["step_trace"], per_epoch[row["epoch"]])
            for row in epochs
            if "step_trace" in row
        }
        if engines is None
        else None
    )
    replayed = replay.replay(
        records,
        strategy_in_replay,
        config,
        proposer.window_epochs,
        measured_costs=measured,
        measured_steps=steps,
        engines=engines,
        arrivals=arrivals or None,
    )
    by_epoch = {e["epoch"]: e for e in replayed["per_epoch"]}
    rows = []
    totals = {"engine": [0, 0, 0], "replay": [0, 0, 0]}
    for row in epochs:
        engine = _engine_epoch(row)
        mine = by_epoch[row["epoch"]]
        rep = {
            "steps": mine["steps"],
            "draft_tokens": mine["draft_tokens"],
            "accepted_tokens": mine["accepted_tokens"],
            **_figures(mine["accepted_tokens"], mine["draft_tokens"], mine["steps"]),
        }
        for side, values in (("engine", engine), ("replay", rep)):
            for i, name in enumerate(("steps", "draft_tokens", "accepted_tokens")):
                totals[side][i] += values[name]
        entry = {"epoch": row["epoch"], "engine": engine, "replay": rep}
        trace = replayed.get("proposer_traces", {}).get(row["epoch"])
        if "step_trace" in row and trace is not None:
            # Where the two first part (recordings from `das traces generate` since the step trace).
            entry["first_parting"] = first_parting(row["step_trace"], [list(s) for s in trace])
        rows.append(entry)
    overall = {side: _figures(acc, drafted, steps) for side, (steps, drafted, acc) in totals.items()}
    differences = {
        name: _relative(overall["replay"][name], overall["engine"][name])
        for name in ("accepted_per_step", "acceptance")
    }
    return {
        "trace": str(trace),
        "strategy": strategy,
        "replayed_as": strategy_in_replay,
        "settings": settings,
        # What the replay's budget learned its step times from, per epoch (None: it does not price drafts).
        "engine_cost_models": {e: c.__dict__ for e, c in measured.items()} if measured else None,
        # Whether the replay's budget priced each step with the costs the engine had at it.
        "engine_step_times": steps is not None,
        # The engine's slots and admission order where an epoch queued requests (None: every request ran at once).
        "engines": {"max_num_seqs": engines.max_num_seqs, "order": engines.order} if engines else None,
        # Per epoch, the requests the engine had started by each of its first steps (the replay follows them).
        "arrivals": arrivals or None,
        "per_epoch": rows,
        "overall": overall,
        "relative_difference": differences,
        "tolerance": tolerance,
        "within_tolerance": all(d is not None and d <= tolerance for d in differences.values()),
    }


def _slots(settings: dict[str, Any], records: list) -> Engines | None:
    """The engine's slots when an epoch had more requests than them (its queue is then part of what the budget
    saw), admitted as the engine admitted them: vLLM's priority policy with DAS's length prediction is the
    replay's `predicted` order, fcfs its `fcfs` (reports from before the policy was recorded ran `priority`)."""
    slots = settings.get("max_num_seqs")
    per_epoch = Counter(r.epoch for r in records)
    if slots is None or slots >= max(per_epoch.values(), default=0):
        return None
    policy = settings.get("scheduling_policy", "priority")
    return Engines(int(slots), order="predicted" if policy == "priority" else "fcfs")


def load_report(path: str | Path) -> dict[str, Any]:
    """An engine report written by `das traces generate --report`."""
    return json.loads(Path(path).read_text(encoding="utf-8"))
