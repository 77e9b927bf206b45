"""`das bench proposer --against REV`: this checkout's proposer step against another revision's, interleaved.

On a shared machine one run of the same code spreads by a factor of two (other tenants, cache and frequency
state), far more than a change worth making, so two separate runs cannot show a 10% difference. Here both
sides run in turns, one batch size per run, each in its own process (numba compiles the kernels of each
tree on its own), and the order flips every round (A B, B A, ...), so slow drift hits both alike. What is
compared is each round's pair: the ratio of this checkout's median step to the other revision's, whose
median over rounds and spread are reported beside both sides' figures.

The other revision is exported with `git archive` (its tracked files only) into a temporary folder and runs
on this checkout's interpreter and packages; this side runs the working tree as it is, uncommitted changes
included, which is the point: measure a change before committing it.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from statistics import median
from typing import Any

from history_store.automaton.config import DEFAULT_ENGINE_K
from workers.errors import InvalidInput

REPO = Path(__file__).resolve().parents[2]
# The figures compared per batch size: the steady step (the scope of the targets) and the whole step.
FIGURES = ("steady_step_median_us_per_request", "step_median_us_per_request")


def resolve_revision(revision: str) -> str:
    """`revision`'s full commit id. Raises ValueError when this is not a git checkout or git does not know
    the revision."""
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        raise InvalidInput(f"{revision!r}: not a revision of the git checkout at {REPO}") from exc


def export_revision(revision: str, into: Path) -> str:
    """Writes `revision`'s tracked files under `into`; returns its full commit id (ValueError as
    `resolve_revision`)."""
    commit = resolve_revision(revision)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", commit], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return commit


def _run_side(tree: Path, args: list[str]) -> dict[str, Any]:
    """One `das bench proposer --json` run of the code under `tree`; raises ValueError with its stderr's
    tail when it fails (ValueError: e.g. a revision whose bench lacks a flag)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-m", "workers.cli", "bench", "proposer", *args, "--json"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise InvalidInput(f"the bench under {tree} failed (exit {done.returncode}): {tail}")
    return json.loads(done.stdout)


def existing_trace(trace: str | Path) -> Path:
    """The trace's absolute path (the sides may run in other folders). Raises ValueError when it is missing."""
    path = Path(trace).resolve()
    if not path.is_file():
        raise InvalidInput(f"no trace file at {path}")
    return path


def paired(ours: list[float], theirs: list[float]) -> dict[str, Any]:
    """Both sides' per-round figures and the per-round ratio ours / theirs, with its median and range, and the
    ratio of each side's best round (below 1: this checkout is faster)."""
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return {
        "this_checkout": [round(x, 3) for x in ours],
        "against": [round(x, 3) for x in theirs],
        "this_checkout_median": round(median(ours), 3),
        "against_median": round(median(theirs), 3),
        "ratio_per_round": [round(r, 4) for r in ratios],
        "ratio_median": round(median(ratios), 4),
        "ratio_min": round(min(ratios), 4),
        "ratio_max": round(max(ratios), 4),
        # Other tenants only ever add time, so each side's least disturbed round is a second estimate.
        "ratio_of_best": round(min(ours) / min(theirs), 4),
    }


def run(
    trace: str | Path,
    against: str,
    rounds: int = 5,
    k: int = DEFAULT_ENGINE_K,
    steps: int = 400,
    warmup: int = 50,
    batches: tuple[int, ...] = (1, 64, 256),
) -> dict[str, Any]:
    """The JSON `das bench proposer --against REV` prints."""
    trace = existing_trace(trace)
    common = [str(trace), "--k", str(k), "--repeats", "1"]
    timed = [*common, "--steps", str(steps), "--warmup", str(warmup)]
    with tempfile.TemporaryDirectory(prefix="das-against-") as folder:
        theirs_tree = Path(folder)
        commit = export_revision(against, theirs_tree)
        sides = {"ours": REPO, "theirs": theirs_tree}
        # One untimed run per side first: numba compiles (and caches) each tree's kernels on its first run.
        for tree in sides.values():
            _run_side(tree, [*common, "--batches", "1", "--steps", "5", "--warmup", "1"])
        figures: dict[int, dict[str, dict[str, list[float]]]] = {
            b: {f: {"ours": [], "theirs": []} for f in FIGURES} for b in batches
        }
        for i in range(rounds):
            order = ("ours", "theirs") if i % 2 == 0 else ("theirs", "ours")
            for b in batches:
                for side in order:
                    row = _run_side(sides[side], [*timed, "--batches", str(b)])["batches"][0]
                    for f in FIGURES:
                        figures[b][f][side].append(row[f])
    return {
        "trace": str(trace),
        "against": {"revision": against, "commit": commit},
        "rounds": rounds,
        "k": k,
        "steps": steps,
        "batches": [
            {"batch": b, **{f: paired(v["ours"], v["theirs"]) for f, v in figures[b].items()}}
            for b in batches
        ],
    }
