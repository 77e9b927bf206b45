"""Trace files: JSON Lines of trajectory records (gzip when the name ends in `.gz`), what `das traces ...`
writes and `das bench replay` reads."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from pipeline.schemas import TrajectoryRecord


def open_trace(path: Path, mode: str = "rt", gzipped: bool | None = None) -> IO[str]:
    """`path` as text, through gzip when `gzipped` or, by default, when its name ends in `.gz` (multi-epoch
    traces compress about 4x)."""
    if str(path).endswith(".gz") if gzipped is None else gzipped:
        return gzip.open(path, mode, encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The non-blank lines of a JSON Lines file (gzip if the name ends in `.gz`) with their 1-based line numbers,
    so that whoever parses them can name the line that is wrong."""
    with open_trace(path) as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                yield number, line


def check_writable(path: Path) -> None:
    """Raises OSError at once if `trace_writer(path)` could not write `path` (a read-only or missing folder, a
    folder in its place): commands check their output before minutes or hours of work, not after."""
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; give the file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    probe = path.with_name(f".{path.name}.tmp")
    with open(probe, "ab"):
        pass
    probe.unlink()


@contextmanager
def trace_writer(path: Path) -> Iterator[IO[str]]:
    """A text handle that becomes `path` only when the block ends without an error: a run that stops midway
    never leaves half a trace under the name a replay would read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open_trace(tmp, "wt", gzipped=str(path).endswith(".gz")) as handle:
        yield handle
    tmp.replace(path)


def trace_line(record: TrajectoryRecord) -> str:
    """One record as a trace line (fields left unset are omitted)."""
    return record.model_dump_json(exclude_none=True) + "\n"
