"""The demo's projection: the rollouts it just made, replayed under the replay's GPU cost models.

On a CPU verifier a verified token costs a large share of a decode step, so the demo's measured wall times show
DAS level with plain decoding. A GPU verifies a token for a small fraction of a step, and there drafts pay.
`project` writes the demo's rollouts as a trace and runs `workers.bench.replay` on it, exactly as
`das bench replay TRACE --strategies none,suffix-problem,das,oracle` does, so every figure can be re-derived
with that command. The figures are projections from assumed cost models, never measurements of this machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.schemas import TrajectoryRecord

TRACE_FILE = "rollouts.jsonl"
# none is the baseline, suffix-problem the strongest published drafter on per-problem history, oracle the
# ceiling that das's share of the gap is measured against.
STRATEGIES = ("none", "suffix-problem", "das", "oracle")


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
        "(step = c_base + c_seq x active + c_tok x verified tokens; default: a 7B model on one H100)",
        _line(header, widths),
        "  ".join("-" * w for w in widths),
        *(_line(row, widths) for row in rows),
        "gap closed: share of the none -> oracle makespan gap (oracle: das's drafts cut to what is accepted)",
        f"re-run: {projection['command']}",
    ]
    return "\n".join(lines)


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    # Names left-aligned, figures right-aligned.
    return "  ".join(
        cell.ljust(w) if i < 2 else cell.rjust(w)
        for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
    )
