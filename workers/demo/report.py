"""The demo's report: a JSON summary, a plain-text table, and PNG plots a person can read.

`write_report(summary, folder)` takes the summary `workers.demo.run.DemoResult.to_json()` produces (epochs with
their figures, identical-output status, the budget timeline, the projection) and writes `summary.json` plus five
plots: rollout time per epoch by strategy, the response-length distribution with its long tail, acceptance by
draft position, the DAS budget by length class over time, and the projected makespans of the demo's rollouts
under the replay's GPU cost models. Matplotlib runs headless (Agg).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

SUMMARY_FILE = "summary.json"
PLOT_FILES = (
    "rollout_time.png",
    "response_lengths.png",
    "acceptance_by_position.png",
    "budget_by_length_class.png",
    "projected_makespan.png",
)
_COLUMNS = (
    ("epoch", "epoch", "{}"),
    ("strategy", "strategy", "{}"),
    ("wall_s", "wall s", "{:.1f}"),
    ("cpu_s", "cpu s", "{:.1f}"),
    ("tokens_per_s", "tok/s", "{:.1f}"),
    ("acceptance_rate", "accept", "{:.1%}"),
    ("mean_accepted_per_step", "acc/step", "{:.2f}"),
    ("latency_p50_s", "p50 s", "{:.1f}"),
    ("latency_p99_s", "p99 s", "{:.1f}"),
    ("latency_max_s", "max s", "{:.1f}"),
)


def format_table(summary: dict[str, Any]) -> str:
    """One line per epoch and strategy, plus each strategy's greedy identical-output status."""
    identical = summary.get("identical_output", {})
    header = [title for _, title, _ in _COLUMNS] + ["identical output"]
    rows = [
        [fmt.format(epoch[key]) for key, _, fmt in _COLUMNS] + [identical.get(epoch["strategy"], "-")]
        for epoch in sorted(summary["epochs"], key=lambda e: (e["epoch"], e["strategy"]))
    ]
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    history = summary.get("history", {})
    if history:
        start = "warm" if history.get("warm") else "cold"
        lines.append(
            f"history: {start} start with {history.get('trajectories_at_start', 0)} trajectories, "
            f"{history.get('trajectories_at_end', 0)} stored at the end ({history.get('path')})"
        )
    return "\n".join(lines)


def write_report(summary: dict[str, Any], folder: Path) -> list[Path]:
    """Writes summary.json and the plots into `folder` (created if needed); returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    summary_path = folder / SUMMARY_FILE
    summary_path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    epochs = summary["epochs"]
    strategies = list(dict.fromkeys(e["strategy"] for e in epochs))
    plotters = (_rollout_time, _response_lengths, _acceptance_by_position, _budget_by_class, _projection)
    written = [summary_path]
    for name, plot in zip(PLOT_FILES, plotters, strict=True):
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        plot(ax, summary, strategies)
        fig.tight_layout()
        path = folder / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _rollout_time(ax: Any, summary: dict[str, Any], strategies: Sequence[str]) -> None:
    epochs = sorted({e["epoch"] for e in summary["epochs"]})
    width = 0.8 / max(len(strategies), 1)
    for i, strategy in enumerate(strategies):
        wall = {e["epoch"]: e["wall_s"] for e in summary["epochs"] if e["strategy"] == strategy}
        x = np.arange(len(epochs)) + (i - (len(strategies) - 1) / 2) * width
        ax.bar(x, [wall.get(epoch, 0.0) for epoch in epochs], width, label=strategy)
    ax.set_xticks(np.arange(len(epochs)), [str(e) for e in epochs])
    ax.set_xlabel("epoch")
    ax.set_ylabel("rollout wall time (s)")
    ax.set_title("Rollout time per epoch (the makespan RL waits for)")
    ax.legend()


def _response_lengths(ax: Any, summary: dict[str, Any], strategies: Sequence[str]) -> None:
    lengths = {
        s: [n for e in summary["epochs"] if e["strategy"] == s for n in e.get("response_lengths", [])]
        for s in strategies
    }
    everything = [n for values in lengths.values() for n in values]
    if not everything:
        _empty(ax, "no responses")
        return
    bins = np.linspace(0, max(everything) + 1, min(30, max(everything) + 2))
    for strategy, values in lengths.items():
        ax.hist(values, bins=bins, histtype="step", linewidth=1.5, label=strategy)
    p50, p99 = np.percentile(everything, [50, 99])
    ax.axvline(p50, color="grey", linestyle="--", linewidth=1, label=f"p50 {p50:.0f}")
    ax.axvline(p99, color="black", linestyle=":", linewidth=1, label=f"p99 {p99:.0f}")
    max_tokens = summary.get("config", {}).get("max_tokens")
    title = "Response lengths (the long tail sets the epoch's makespan)"
    ax.set_title(title if max_tokens is None else f"{title}; cap {max_tokens}")
    ax.set_xlabel("response tokens")
    ax.set_ylabel("requests")
    ax.legend()


def _acceptance_by_position(ax: Any, summary: dict[str, Any], strategies: Sequence[str]) -> None:
    drawn = False
    for strategy in strategies:
        rows = [e for e in summary["epochs"] if e["strategy"] == strategy and e.get("drafts")]
        if not rows:
            continue
        width = max(len(e["acceptance_by_position"]) for e in rows)
        drafts = np.array([e["drafts"] for e in rows], dtype=float)
        rates = np.array(
            [e["acceptance_by_position"] + [0.0] * (width - len(e["acceptance_by_position"])) for e in rows]
        )
        # Weighted by drafts: the rate over all of the strategy's drafts, not a mean of epoch rates.
        overall = (rates * drafts[:, None]).sum(axis=0) / drafts.sum()
        ax.plot(np.arange(1, width + 1), overall, marker="o", label=strategy)
        drawn = True
    if not drawn:
        _empty(ax, "no drafts (only the 'none' strategy ran)")
        return
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance by draft position")
    ax.legend()


def _budget_by_class(ax: Any, summary: dict[str, Any], strategies: Sequence[str]) -> None:
    points = [p for p in summary.get("budget_timeline", []) if p["strategy"] == "das"]
    if not points:
        _empty(ax, "no DAS budget samples (the 'das' strategy did not run or did not decode)")
        return
    for length_class in ("short", "medium", "long"):
        mine = [p for p in points if p["length_class"] == length_class]
        if mine:
            ax.plot(
                [p["t_s"] for p in mine], [p["mean_budget"] for p in mine], marker=".", label=length_class
            )
    for epoch in sorted({p["epoch"] for p in points}):
        first = min(p["t_s"] for p in points if p["epoch"] == epoch)
        ax.axvline(first, color="grey", linewidth=0.5)
        ax.annotate(f"epoch {epoch}", (first, 0), rotation=90, fontsize=7, va="bottom")
    ax.set_xlabel("seconds since the demo started")
    ax.set_ylabel("mean draft budget per step (tokens)")
    ax.set_title("DAS budget by predicted length class")
    ax.legend()


def _projection(ax: Any, summary: dict[str, Any], _strategies: Sequence[str]) -> None:
    from workers.demo.projection import STRATEGIES

    projection = summary.get("projection")
    if not projection:
        _empty(ax, "no projection in this summary")
        return
    models = projection["cost_models"]
    width = 0.8 / len(STRATEGIES)
    for i, strategy in enumerate(STRATEGIES):
        x = np.arange(len(models)) + (i - (len(STRATEGIES) - 1) / 2) * width
        bars = ax.bar(
            x,
            [m["makespan_s"][strategy] for m in models],
            width,
            label=strategy,
            hatch="//" if strategy == "oracle" else None,
            fill=strategy != "oracle",
        )
        if strategy == "das":
            for bar, model in zip(bars, models, strict=True):
                gap = model["das_gap_closed"]
                if gap is not None:
                    ax.annotate(
                        f"{gap:.0%} of gap",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
    ax.set_xticks(np.arange(len(models)), [m["cost_model"] for m in models])
    ax.set_xlabel("verifier cost model (assumed for a GPU, not measured here)")
    ax.set_ylabel("projected makespan (s)")
    ax.set_title(
        f"PROJECTION: this run's {projection['rollouts_of']} rollouts replayed on GPU cost models", fontsize=9
    )
    ax.legend(fontsize=8)
