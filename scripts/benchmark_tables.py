"""Prints docs/benchmarks.md's replay tables from the JSON in benchmarks/, so every figure there is this
script's output over files that commands made (`python scripts/benchmark_tables.py replay|slots|remembered`).

- replay: per cost model, each trace's projected makespan per strategy (`benchmarks/replay_TRACE.json`);
- slots: the finite-engine table (`benchmarks/replay_slots_TRACE.json`);
- remembered: das with and without remembered probabilities (`benchmarks/remembered_TRACE.json`,
  `benchmarks/replay_remembered_TRACE.json` against `benchmarks/replay_TRACE.json`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# The order the docs list traces in: fixed policies, then the policies that learn.
TRACES = (
    "dev_rollouts",
    "fidelity_das",
    "rl_t1.0",
    "rl_t1.0-0.55",
    "templated_t1.0",
    "templated_t0.7",
    "templated_t0.9-0.75",
    "learn_overlong",
    "learn_format",
)
STRATEGIES = ("none", "ngram", "suffix-global", "suffix-problem", "das-unbudgeted", "das", "oracle")
COST_MODELS = ("default", "memory-bound", "compute-bound")


def _load(name: str) -> dict[str, Any] | None:
    path = BENCHMARKS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def replay_tables() -> str:
    out = []
    for cost in COST_MODELS:
        out += [f"**{cost}**", ""]
        out.append("| trace | " + " | ".join(STRATEGIES) + " | das: gap closed | das vs suffix-problem |")
        out.append("|---" * (len(STRATEGIES) + 3) + "|")
        for trace in TRACES:
            report = _load(f"replay_{trace}")
            if report is None:
                continue
            table = report["cost_models"][cost]
            makespan = {s: r["projected_makespan_s"] for s, r in table["strategies"].items()}
            cells = [f"**{makespan[s]:.2f}**" if s == "das" else f"{makespan[s]:.2f}" for s in STRATEGIES]
            lead = 1.0 - makespan["das"] / makespan["suffix-problem"]
            out.append(
                f"| {trace} | {' | '.join(cells)} | {table['oracle_gap_closed']['das']:.2f} | {lead:.1%} |"
            )
        out.append("")
    return "\n".join(out)


def slots_table() -> str:
    out = [
        "| trace | slots | fcfs to oracle gain (none) | group-oracle captures (none / suffix-problem / das) "
        "| predicted captures (none / suffix-problem / das) | random captures (none / das) | das vs none (fcfs) "
        "| das vs suffix-problem (fcfs) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def captured(table: dict, strategy: str, order: str) -> str:
        value = table.get(strategy, {}).get(order)
        return "-" if value is None else f"{value:+.2f}"

    for trace in TRACES:
        report = _load(f"replay_slots_{trace}")
        if report is None:
            continue
        for label in ("unlimited", "1/4", "1/16"):
            entry = report["max_num_seqs"][label]
            if label == "unlimited":  # every request at once: no queue, no order
                m = entry["makespan_s"]["default"]
                das = f"{m['das'] / m['none'] - 1:+.1%} | {m['das'] / m['suffix-problem'] - 1:+.1%}"
                out.append(f"| {trace} | {label} | - | - | - | - | {das} |")
                continue
            change = entry["das_change"]["default"]["fcfs"]
            das = f"{change['none']:+.1%} | {change['suffix-problem']:+.1%}"
            none = entry["makespan_s"]["default"]["none"]
            gain = 1.0 - none["oracle"] / none["fcfs"]
            captures = entry["oracle_order_gain_captured"]["default"]
            group = " / ".join(
                captured(captures, s, "group-oracle") for s in ("none", "suffix-problem", "das")
            )
            predicted = " / ".join(
                captured(captures, s, "predicted") for s in ("none", "suffix-problem", "das")
            )
            shuffled = " / ".join(captured(captures, s, "random") for s in ("none", "das"))
            out.append(f"| {trace} | {label} | {gain:.1%} | {group} | {predicted} | {shuffled} | {das} |")
    return "\n".join(out)


def remembered_table() -> str:
    out = [
        "| trace | verified draft tokens with a remembered probability | its Brier score by match length "
        "0-3 / 4-15 / 16+ tokens (tokens) | budget's Brier without → with | das makespan without → with, default / "
        "memory-bound / compute-bound | per-epoch change, worst / best |",
        "|---|---|---|---|---|---|",
    ]
    for trace in TRACES:
        report, with_them, without = (
            _load(f"remembered_{trace}"),
            _load(f"replay_remembered_{trace}"),
            _load(f"replay_{trace}"),
        )
        if report is None or with_them is None or without is None:
            continue
        section = report["remembered"]
        bands = " / ".join(
            f"{b['brier_remembered']:.3f} ({b['tokens']:,})" for b in section["by_match_length"]
        )
        makespans, changes = [], []
        for cost in COST_MODELS:
            new = with_them["cost_models"][cost]["strategies"]["das"]
            old = without["cost_models"][cost]["strategies"]["das"]
            ratio = new["projected_makespan_s"] / old["projected_makespan_s"] - 1.0
            makespans.append(
                f"{old['projected_makespan_s']:.2f} → {new['projected_makespan_s']:.2f} ({ratio:+.1%})"
            )
            changes += [
                a["projected_makespan_s"] / b["projected_makespan_s"] - 1.0
                for a, b in zip(new["per_epoch"], old["per_epoch"], strict=True)
            ]
        out.append(
            f"| {trace} | {section['share']:.0%} of {section['tokens']:,} | {bands} | "
            f"{section['brier_policy_without']:.3f} → {section['brier_policy']:.3f} | {' / '.join(makespans)} | "
            f"{max(changes):+.1%} / {min(changes):+.1%} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", choices=["replay", "slots", "remembered"])
    table = parser.parse_args().table
    print({"replay": replay_tables, "slots": slots_table, "remembered": remembered_table}[table]())


if __name__ == "__main__":
    main()
