"""`das bench proposer --kernels-against REV`: this checkout's step kernels against another revision's, in one
process, step by step.

`--against` runs each side in its own process, and on a shared machine such runs of the same code spread by
3-10% from one to the next: more than a kernel change worth making. Here two proposers decode the same
workload in one process, one stepping through this checkout's kernels and one through REV's, in turns, and
each steady step (no request started or finished) is compared with its
partner: a burst from another tenant falls on both alike. The drafts of the two sides are compared every
step, so the run also says whether the change left the drafts as they were.

Only the native step differs between the sides. REV's step kernel modules (`KERNEL_MODULES`) are imported as
a temporary package (`das_rev_kernels`, their imports of each other rewritten to it), while the proposer,
index and policy around them, and the bundles the kernels take (`history_store.native.bundles`,
`workers.budget.state`, `workers.generator.step_tables`) and the budget's config, are this checkout's on both
sides. REV must
therefore be a revision of this layout: kernels in these modules taking these bundles (a revision from before
the bundles took positional arrays instead), and the arena's layout unchanged; one that does not fails in
numba's typing, with numba's message.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from history_store.automaton.config import DEFAULT_ENGINE_K
from workers.bench.proposer import decoding
from workers.bench.proposer_ab import REPO, existing_trace, resolve_revision
from workers.bench.replay import load_traces
from workers.errors import InvalidInput
from workers.generator import proposer as proposer_module

PACKAGE = "das_rev_kernels"
# The step's kernel modules; each is imported in the package under its last name.
KERNEL_MODULES = (
    "history_store.automaton.kernels",
    "workers.budget.cost",
    "workers.budget.tail_weights",
    "workers.budget.lengths",
    "workers.budget.acceptance",
    "workers.budget.policy",
    "workers.generator.step_book",
    "workers.generator.step",
)


def _rewritten(source: str) -> str:
    """A kernel module's source with its imports of the other kernel modules pointed into the package
    (`from a.b import c` and `from a.b.c import ...` alike)."""
    for module in KERNEL_MODULES:
        parent, _, name = module.rpartition(".")
        source = re.sub(
            rf"^from {re.escape(module)} import", f"from {PACKAGE}.{name} import", source, flags=re.M
        )
        source = re.sub(
            rf"^from {re.escape(parent)} import {name}\b", f"from {PACKAGE} import {name}", source, flags=re.M
        )
    return source


def _revision_kernels(commit: str, folder: Path) -> ModuleType:
    """REV's step kernel modules as the package `das_rev_kernels` under `folder` (a normal import: numba's
    on-disk cache cannot key a module loaded from a bare file path); returns its `step`."""
    package = folder / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    for module in KERNEL_MODULES:
        path = module.replace(".", "/") + ".py"
        source = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{commit}:{path}"], capture_output=True, text=True, check=True
        ).stdout
        (package / f"{module.rpartition('.')[2]}.py").write_text(_rewritten(source))
    sys.path.insert(0, str(folder))
    return importlib.import_module(f"{PACKAGE}.step")


def _unload(folder: Path) -> None:
    if str(folder) in sys.path:
        sys.path.remove(str(folder))
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]


def _use(kernels: tuple[Any, Any, Any]) -> None:
    proposer_module.decode_step, proposer_module.draft_step, proposer_module.pack_tables = kernels


def _check_errors(sides: dict[str, tuple[Any, Any, Any]]) -> None:
    """Stops the run when a side's step failed (the proposer logs the error and drafts nothing): REV's
    kernels that do not fit this checkout's proposer fail at the first step."""
    if sides["theirs"][0].stats()["errors"]:
        raise InvalidInput(
            "the revision's step kernels fail in this checkout's proposer (the log above says how): "
            "--kernels-against needs a revision whose kernels take the same tables and arguments"
        )
    if sides["ours"][0].stats()["errors"]:
        raise RuntimeError("this checkout's proposer reported errors; see the log")


def _paired_batch(
    records: list[Any], theirs: ModuleType, batch: int, k: int, steps: int, warmup: int
) -> dict[str, Any]:
    """Both sides decode the same rollouts at `batch` rows, alternating per step."""
    mine = (proposer_module.decode_step, proposer_module.draft_step, proposer_module.pack_tables)
    sides = {}
    for side, module in (("ours", None), ("theirs", theirs)):
        proposer, engine = decoding(records, k, batch)
        kernels = mine
        if module is not None:
            direct = proposer_module.DirectCall
            kernels = (direct(module.decode_step), direct(module.draft_step), module.pack_tables)
        sides[side] = (proposer, engine, kernels)
    seconds: dict[str, list[float]] = {"ours": [], "theirs": []}
    differing = []
    try:
        for step in range(warmup + steps):
            drafts = {}
            # Always in this order, so each side's step follows the other's: flipping the order every step
            # ran one side twice in a row, on caches it had just warmed, and split the ratios in two groups
            # (pairs of the same code spread 0.95-1.00 in their median at batch 256).
            for side in ("ours", "theirs"):
                proposer, engine, kernels = sides[side]
                _use(kernels)
                req_ids = engine.req_ids()
                steady = req_ids == proposer._rows_seen  # no request started or finished
                start = time.perf_counter()
                drafts[side] = proposer.step(req_ids, engine.num_tokens, engine.token_ids, engine.requests)
                elapsed = time.perf_counter() - start
                if step >= warmup:
                    seconds[side].append(elapsed if steady else float("nan"))
                engine.verify(drafts[side])
            if drafts["ours"] != drafts["theirs"]:
                differing.append(step)
            if step == 0 or step == warmup + steps - 1:
                _check_errors(sides)
    finally:
        _use(mine)
    ours, theirs_s = np.array(seconds["ours"]), np.array(seconds["theirs"])
    both = ~np.isnan(ours) & ~np.isnan(theirs_s)
    ratios = ours[both] / theirs_s[both]
    per = 1e6 / batch
    return {
        "batch": batch,
        "steps": steps,
        "steady_steps_paired": int(both.sum()),
        "this_checkout_median_us_per_request": round(float(np.median(ours[both])) * per, 3),
        "against_median_us_per_request": round(float(np.median(theirs_s[both])) * per, 3),
        "ratio_median": round(float(np.median(ratios)), 4),
        "ratio_p25": round(float(np.percentile(ratios, 25)), 4),
        "ratio_p75": round(float(np.percentile(ratios, 75)), 4),
        "drafts_identical": not differing,
        "first_differing_step": differing[0] if differing else None,
    }


def run(
    trace: str | Path,
    against: str,
    k: int = DEFAULT_ENGINE_K,
    steps: int = 400,
    warmup: int = 50,
    batches: tuple[int, ...] = (1, 64, 256),
) -> dict[str, Any]:
    """The JSON `das bench proposer --kernels-against REV` prints."""
    trace = existing_trace(trace)
    commit = resolve_revision(against)
    records = load_traces(trace)
    with tempfile.TemporaryDirectory(prefix="das-kernels-against-") as name:
        folder = Path(name)
        try:
            theirs = _revision_kernels(commit, folder)
            rows = [_paired_batch(records, theirs, b, k, steps, warmup) for b in batches]
        finally:
            _unload(folder)
    return {
        "trace": str(trace),
        "kernels_against": {"revision": against, "commit": commit},
        "k": k,
        "batches": rows,
    }
