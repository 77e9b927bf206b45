"""Threads for drafting a batch: numba's TBB threading layer, or none.

Drafting a large batch is a chain of dependent cache misses per row over an arena far larger than the caches,
and rows are independent once their tokens are committed: several threads overlap their misses (at batch 256
on this 2-vCPU machine, two threads cut the drafting pass by about a third). Only TBB is used:
- numba's GNU OpenMP layer aborts a forked child that launches parallel work after its parent did, and vLLM
  forks its engine processes (`VLLM_WORKER_MULTIPROC_METHOD=fork` is its default where CUDA is not yet up);
- the workqueue layer wakes its threads through the kernel on every launch, which here cost more than the
  threads saved (measured: batch 256, drafting pass 3.6 -> 3.9 us per request with two threads).
TBB is thread- and fork-safe and keeps its workers spinning briefly between launches. Drafting stays on one
thread unless asked (`DAS_DRAFT_THREADS`): threads were measured to help on an idle 2-vCPU machine, and to
hurt beside the busy OpenMP threads of vLLM's CPU engine (`usable_draft_threads`); a GPU node is unmeasured.
pip's `tbb` wheel puts libtbb in the environment's lib folder, where numba's TBB pool does not look: it is
loaded here first, by path, so the pool finds it already in the process.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os

import numba
import numpy as np
from numba import njit, prange

logger = logging.getLogger(__name__)

_LAYER_ENV = "NUMBA_THREADING_LAYER"
_tbb_runs: bool | None = None  # whether TBB runs this process's parallel work; None: not probed yet


def start_threading_layer() -> None:
    """Makes numba pick a fork-safe threading layer (TBB when installed, else workqueue, never GNU OpenMP)
    unless the user chose one, and starts it. Must run before any parallel kernel compiles: lowering one
    launches the layer.

    Starting it here, not when numba first needs it, lets a kernel compiled in this process call a cached
    kernel whose code calls the threaded pass: numba registers the layer's scheduler symbols when it launches
    the layer, which it does when it compiles a parallel kernel or loads one from the cache directly, but not
    when the cached kernel comes in as a callee. The proposer's step, compiled against a `step_rows` that an
    earlier process had cached, aborted with "LLVM ERROR: Symbol not found: allocate_sched" or segfaulted.
    Starting the layer takes about 5 ms (numba's import, which every kernel user pays, takes 250-400) and adds
    one idle thread; drafting threads start only when a step first drafts on more than one."""
    _preload_tbb()
    if _LAYER_ENV not in os.environ:
        numba.config.THREADING_LAYER = "forksafe"
    numba.get_num_threads()  # launches the layer


def _preload_tbb() -> None:
    try:
        files = importlib.metadata.distribution("tbb").files or []
    except importlib.metadata.PackageNotFoundError:
        return
    for file in files:
        if file.name == "libtbb.so.12":
            try:
                ctypes.CDLL(str(file.locate()), mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                logger.warning("could not load %s (%s): drafting stays on one thread", file.locate(), exc)
            return


@njit(parallel=True, cache=True)
def _probe(values: np.ndarray) -> float:
    total = 0.0
    for i in prange(values.shape[0]):
        total += values[i]
    return total


def usable_draft_threads(requested: int) -> int:
    """How many threads drafting may use: `requested`, capped at the CPUs this process may run on and numba's
    pool, when numba's layer is TBB; else 1. Says in one line why it grants fewer than requested.

    The cap comes first, and the probe (parallel work, which starts TBB's workers) runs only for a grant above
    one: more threads than CPUs is far worse than one (a waiting thread spins on the CPU the one it waits for
    needs: two threads in vLLM's CPU engine, which binds its worker to one CPU, took 150 ms a step instead of
    0.6), and even workers a probe had started there and then left idle (two on that one CPU) made a later
    single-threaded epoch spend 19 s drafting instead of 0.03. The layer itself is started when the kernels
    are imported (`start_threading_layer`), whatever the grant; that starts no workers."""
    global _tbb_runs
    if requested <= 1:
        return 1
    cpus = _cpus()
    granted = min(requested, numba.config.NUMBA_NUM_THREADS, cpus)
    if granted < requested:
        logger.warning(
            "drafting on %d thread(s), not %d: this process may run on %d CPU(s) and numba's pool has %d",
            granted,
            requested,
            cpus,
            numba.config.NUMBA_NUM_THREADS,
        )
    if granted <= 1:
        return 1
    if _tbb_runs is None:
        try:
            _probe(np.ones(8))
            layer = numba.threading_layer()
        except Exception as exc:  # numba raises ValueError when no layer loads; report whatever it was
            layer = f"none ({exc})"
        _tbb_runs = layer == "tbb"
        if not _tbb_runs:
            logger.warning(
                "drafting on one thread, not %d: numba's threading layer is %s, and only TBB is both fast "
                "and fork-safe here (pip install tbb)",
                granted,
                layer,
            )
    return granted if _tbb_runs else 1


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
