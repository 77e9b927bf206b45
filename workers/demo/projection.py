"""The demo's projections: the rollouts it just made, and a recorded multi-epoch trace, replayed under the
replay's GPU cost models.

On a CPU verifier a verified token costs a large share of a decode step, so the demo's measured wall times show
DAS level with plain decoding. A GPU verifies a token for a small fraction of a step, and there drafts pay.
`project` writes the demo's rollouts as a trace and runs `workers.bench.replay` on it, exactly as
`das bench replay TRACE --strategies none,suffix-problem,das,oracle` does, so every figure can be re-derived
with that command. The figures are projections from assumed cost models, never measurements of this machine.

A demo makes a dozen rollouts over two epochs: too few for history to matter, so its projection is noisy and
says so. `project_recorded` ends the demo at a size where history matters: a multi-epoch trace recorded on the
CPU engine and shipped in `data/`, replayed with every request of an epoch at once and with a quarter of an
epoch's requests as slots (requests queue, as in a real RL step), exactly as
`das bench replay TRACE --max-num-seqs unlimited,1/4 ...` does.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.schemas import TrajectoryRecord

TRACE_FILE = "rollouts.jsonl"
# none is the baseline, suffix-problem the strongest published drafter on per-problem history, oracle the
# ceiling that das's share of the gap is measured against.
STRATEGIES = ("none", "suffix-problem", "das", "oracle")
# The recorded trace: 18 problems x 8 samples x 4 epochs of SmolLM2-135M on the CPU engine, the temperature falling
# from 1.0 to 0.55 as a policy sharpens during RL (data/README.md); the held-out trace of the replay's tuning.
RECORDED_TRACE = Path(__file__).resolve().parents[2] / "data" / "rl_t1.0-0.55.jsonl.gz"
RECORDED_STRATEGIES = ("none", "suffix-problem", "das")
# Every request of an epoch at once, and a quarter of them as slots (verl's order), under the default cost model.
RECORDED_SLOTS = ("unlimited", "1/4")


def write_trace(records: Sequence[TrajectoryRecord], folder: Path) -> Path:
    """Writes the rollouts as a JSON Lines trace that `das bench replay` reads; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / TRACE_FILE
    path.write_text("".join(r.model_dump_json() + "\n" for r in records), encoding="utf-8")
    return path


def project(trace: Path, strategy: str) -> dict[str, Any]:
    """Replays `trace` (the rollouts of `strategy`) with none, suffix-problem, das and oracle under each of the
    replay's cost models; returns the summary's `projection` entry."""
    from workers.bench import replay

    result = replay.run(trace, STRATEGIES)
    models = []
    for name, block in result["cost_models"].items():
        makespans = {s: r["projected_makespan_s"] for s, r in block["strategies"].items()}
        models.append(
            {
                "cost_model": name,
                "coefficients_s": block["coefficients"],
                "makespan_s": {s: round(v, 4) for s, v in makespans.items()},
                # None when the oracle is no faster than none: no draft of this trace could pay.
                "das_gap_closed": block.get("oracle_gap_closed", {}).get("das"),
            }
        )
    return {
        "trace": str(trace),
        "rollouts_of": strategy,
        "records": result["records"],
        "command": f"das bench replay {trace} --strategies {','.join(STRATEGIES)}",
        "cost_models": models,
    }


def project_recorded(trace: Path) -> dict[str, Any]:
    """Replays a recorded trace with none, suffix-problem and das under the default cost model, unlimited and
    with a quarter of an epoch's requests as slots (fcfs); returns the summary's `recorded_projection` entry."""
    from history_store.automaton.config import DEFAULT_WINDOW_EPOCHS, DraftConfig
    from workers.bench import engines, replay, replay_slots
    from workers.bench.cost_model import CostModel

    settings = [None if s == "unlimited" else engines.parse_slots(s) for s in RECORDED_SLOTS]
    result = replay_slots.run_slots(
        str(trace),
        settings,
        ["fcfs"],
        engines.Engines(1, 1, "fcfs", "round-robin", 0, None),
        {
            "strategies": list(RECORDED_STRATEGIES),
            "config": DraftConfig(),
            "window": DEFAULT_WINDOW_EPOCHS,
            "costs": {"default": replay.cost_models(CostModel())["default"]},
        },
    )
    rows = []
    for label in RECORDED_SLOTS:
        block = result["max_num_seqs"][label]
        runs = block["runs"]["default"] if label == "unlimited" else block["runs"]["fcfs"]["default"]
        by_strategy = runs["strategies"]
        per_epoch = {s: [e["projected_makespan_s"] for e in by_strategy[s]["per_epoch"]] for s in by_strategy}
        rows.append(
            {
                "slots": label,
                "makespan_s": {s: round(r["projected_makespan_s"], 4) for s, r in by_strategy.items()},
                "das_vs_none_by_epoch": [
                    round(d / n - 1, 4) for d, n in zip(per_epoch["das"], per_epoch["none"], strict=True)
                ],
            }
        )
    shown = _shown_path(trace)
    return {
        "trace": shown,
        "records": result["records"],
        "epochs": len(rows[0]["das_vs_none_by_epoch"]),
        "coefficients_s": runs["coefficients"],
        "command": f"das bench replay {shown} --strategies {','.join(RECORDED_STRATEGIES)} "
        f"--cost-models default --max-num-seqs {','.join(RECORDED_SLOTS)} --order fcfs",
        "rows": rows,
    }


def _shown_path(path: Path) -> str:
    """The path as a user types it here: relative to the working directory when it lies below it."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


def format_recorded(projection: dict[str, Any]) -> str:
    """The table the demo ends with: a recorded multi-epoch trace, unlimited and with queued requests."""
    header = [
        "slots",
        *(f"{s} s" for s in RECORDED_STRATEGIES),
        "das vs none",
        "das vs suffix-problem",
        "das vs none by epoch",
    ]
    rows = []
    for row in projection["rows"]:
        m = row["makespan_s"]
        rows.append(
            [
                row["slots"],
                *(f"{m[s]:.2f}" for s in RECORDED_STRATEGIES),
                f"{m['das'] / m['none'] - 1:+.1%}",
                f"{m['das'] / m['suffix-problem'] - 1:+.1%}",
                " / ".join(f"{v:+.0%}" for v in row["das_vs_none_by_epoch"]),
            ]
        )
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    c = projection["coefficients_s"]
    epochs = projection["epochs"]
    return "\n".join(
        [
            f"PROJECTION of a recorded trace, not a measurement: {projection['trace']}, "
            f"{projection['records']} rollouts over {epochs} epochs",
            "(recorded on the CPU engine, shipped in data/; default cost model "
            f"{c['c_base'] * 1e3:g} / {c['c_seq'] * 1e3:g} / {c['c_tok'] * 1e3:g} ms;",
            " slots 1/4: a quarter of an epoch's requests run at once and the rest queue, as in an RL step)",
            _line(header, widths, names=1),
            "  ".join("-" * w for w in widths),
            *(_line(row, widths, names=1) for row in rows),
            f"re-run: {projection['command']}",
        ]
    )


def format_projection(projection: dict[str, Any]) -> str:
    """The table the demo ends with: projected makespans per cost model and das's share of the oracle gap."""
    header = ["cost model", "c_base / c_seq / c_tok ms", *(f"{s} s" for s in STRATEGIES), "das: gap closed"]
    rows = []
    for model in projection["cost_models"]:
        c = model["coefficients_s"]
        gap = model["das_gap_closed"]
        rows.append(
            [
                model["cost_model"],
                f"{c['c_base'] * 1e3:g} / {c['c_seq'] * 1e3:g} / {c['c_tok'] * 1e3:g}",
                *(f"{model['makespan_s'][s]:.3f}" for s in STRATEGIES),
                "-" if gap is None else f"{gap:.0%}",
            ]
        )
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [
        f"PROJECTION, not a measurement: this run's {projection['records']} {projection['rollouts_of']} "
        "rollouts replayed under GPU verifier cost models",
        "(step = c_base + c_seq x active + c_tok x verified tokens; default: a 7B model on one H100;",
        " a few rollouts over few epochs: history has little to offer, and one response can swing the figures)",
        _line(header, widths),
        "  ".join("-" * w for w in widths),
        *(_line(row, widths) for row in rows),
        "gap closed: share of the none -> oracle makespan gap (oracle: das's drafts cut to what is accepted)",
        f"re-run: {projection['command']}",
    ]
    return "\n".join(lines)


def _line(cells: Sequence[str], widths: Sequence[int], names: int = 2) -> str:
    # The first `names` cells left-aligned, figures right-aligned.
    return "  ".join(
        cell.ljust(w) if i < names else cell.rjust(w)
        for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
    )
