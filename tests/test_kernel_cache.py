"""The kernel cache guard: numba's cache of a kernel that inlines another file's kernels goes stale when only
that other file changes; the guard drops the caches whenever any kernel source changed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from history_store.native import kernel_cache

ROOT = Path(__file__).resolve().parent.parent

CALLER = """
from numba import njit
import callee

@njit(cache=True)
def outer():
    return callee.inner() * 10
"""


def _callee(value: int) -> str:
    return f"\nfrom numba import njit\n\n@njit(cache=True)\ndef inner():\n    return {value}\n"


def _run(folder: Path, guard: bool) -> int:
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(folder)!r})
        from history_store.native.kernel_cache import drop_stale_caches
        folder = Path({str(folder)!r})
        if {guard!r}:
            drop_stale_caches([folder / "callee.py", folder / "caller.py"], folder / "__pycache__")
        import caller
        print(caller.outer())
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    return int(out.stdout.split()[-1])


def _bump(path: Path, text: str) -> None:
    path.write_text(text)
    st = path.stat()
    os.utime(path, (st.st_atime + 5, st.st_mtime + 5))  # a new mtime even on a coarse clock


def test_a_cached_kernel_runs_the_new_code_of_a_kernel_it_calls_from_another_file(tmp_path: Path) -> None:
    (tmp_path / "caller.py").write_text(CALLER)
    (tmp_path / "callee.py").write_text(_callee(1))
    assert _run(tmp_path, guard=True) == 10
    _bump(tmp_path / "callee.py", _callee(2))
    # What numba alone does: the caller's cache still holds the old callee (the hazard the guard exists for).
    assert _run(tmp_path, guard=False) == 10
    assert _run(tmp_path, guard=True) == 20
    assert _run(tmp_path, guard=True) == 20  # unchanged sources: the fresh caches stay


def test_only_the_caches_of_the_listed_sources_go_and_only_when_a_source_changed(tmp_path: Path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 1\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    ours = ["a.f-3.py311.nbi", "a.f-3.py311.1.nbc", "b.g-7.py311.nbi"]
    others = ["c.h-1.py311.nbi", "a.cpython-311.pyc"]

    def populate() -> None:
        for name in ours + others:
            (cache / name).write_bytes(b"")

    populate()
    assert kernel_cache.drop_stale_caches([a, b], cache)  # no stamp yet: nothing vouches for the caches
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".sha256")) == sorted(others)
    populate()
    assert not kernel_cache.drop_stale_caches([a, b], cache)
    assert all((cache / name).exists() for name in ours + others)
    b.write_text("y = 2\n")
    assert kernel_cache.drop_stale_caches([a, b], cache)
    assert not any((cache / name).exists() for name in ours)
    assert all((cache / name).exists() for name in others)


def test_every_module_with_cached_kernels_is_guarded() -> None:
    cached = {
        path
        for folder in ("history_store", "workers", "pipeline", "monitoring")
        for path in (ROOT / folder).rglob("*.py")
        if "@njit(cache=True" in path.read_text() and path.name != "kernel_cache.py"
    }
    found = set(kernel_cache.kernel_sources(ROOT))
    assert cached <= found
    assert {ROOT / "history_store/automaton/kernels.py", ROOT / "workers/generator/step.py"} <= found
