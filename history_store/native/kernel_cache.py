"""Drops numba's on-disk caches of DAS's kernels when any kernel source changed.

numba keys a cached function by its own source file's mtime and size only. A cached kernel that calls kernels
of another file keeps their old machine code, inlined, after that other file changes: a `git pull` or
`git checkout` that touches `history_store/automaton/kernels.py` but not `workers/generator/step.py` leaves the proposer's
cached `decode_step` running the old automaton layout on the new arrays, which can loop forever inside the
engine's step (seen while developing). An installed wheel rewrites every file, so only checkouts (editable
installs, a mounted source tree) meet this; they are exactly where the sources change.

So the first import of either package hashes every kernel source together (`kernel_sources` finds them) and, when the hash differs from
the one stored beside the caches, deletes the cached kernels of those files before any of them is loaded
(numba reads a cache at a kernel's first call, not at import). numba then compiles and caches them afresh.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_STAMP = "das_kernel_sources.sha256"
_checked = False


def kernel_sources(root: Path) -> list[Path]:
    """Every module of the checkout's packages (the folders under `root` with an `__init__.py`) whose source
    asks numba to cache a kernel: found, not listed, so a package that adds kernels is guarded without
    this module naming its files."""
    return sorted(
        path
        for package in root.iterdir()
        if (package / "__init__.py").is_file()
        for path in package.rglob("*.py")
        if path.name != "kernel_cache.py" and "cache=True" in path.read_text(encoding="utf-8")
    )


def sources_digest(sources: Iterable[Path]) -> str:
    """One hash over the sources' names and contents."""
    h = hashlib.sha256()
    for path in sources:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def drop_stale_caches(sources: list[Path], stamp_dir: Path) -> bool:
    """Deletes numba's cache files (`*.nbi`, `*.nbc`) of `sources` in their `__pycache__` folders unless the
    digest stored in `stamp_dir` matches the sources; stores the new digest. Returns whether it dropped any.
    Best effort: a read-only tree keeps its caches (numba then caches elsewhere or not at all)."""
    digest = sources_digest(sources)
    stamp = stamp_dir / _STAMP
    try:
        if stamp.read_text() == digest:
            return False
    except OSError:
        pass
    dropped = False
    for source in sources:
        cache = source.parent / "__pycache__"
        for path in cache.glob(f"{source.stem}.*.nb[ic]"):
            try:
                path.unlink()
                dropped = True
            except OSError:
                pass  # another process dropped it first, or the tree is read-only
    try:
        stamp_dir.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(digest)
        tmp.replace(stamp)  # atomic: concurrent importers read one digest or the other, never half
    except OSError:
        pass
    return dropped


def guard() -> None:
    """Runs `drop_stale_caches` over DAS's kernels once per process (when numba caches in the source tree)."""
    global _checked
    if _checked:
        return
    _checked = True
    if os.environ.get("NUMBA_CACHE_DIR"):
        return  # caches live elsewhere, keyed by the user's own scheme
    drop_stale_caches(kernel_sources(_ROOT), _ROOT / "history_store" / "__pycache__")
