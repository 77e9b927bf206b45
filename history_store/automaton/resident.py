"""Arena memory made resident before the decode step's hold writes to it.

The arena's arrays are allocated zeroed and lazily (numpy's `zeros` is calloc: the kernel maps a page on its
first write), so the first write to each fresh page is a page fault, paid by whoever writes there first: the
tree work that inserts history while it holds the decode step off (`tree_work`), or the step itself. On the
VMs these tests run on, a fault on memory the guest has not used lately costs about 30 ms (measured: 38 of
1.0 M tokens of insertion took 30-50 ms each, nearly all of it system time on one minor fault; not measured on
bare metal, where a fault is far cheaper, though a transparent huge page's still zeroes 2 MiB). The history
thread therefore asks the kernel to map the
next rows of each growing array ahead of use (`madvise(MADV_POPULATE_WRITE)`, Linux 5.14+), outside the
hold: it maps pages without writing them, so it is safe beside a step that writes the same rows. On a kernel
without it, nothing is done and the faults stay where they were.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import weakref
from collections.abc import Iterable

import numpy as np

MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14)
_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int
_supported = True


def populate(arr: np.ndarray, start_row: int, stop_row: int) -> int:
    """Maps rows [start_row, stop_row) of a C-contiguous array writable, without changing them; returns the
    bytes asked for (0 when the kernel cannot, or the range is empty). Releases the GIL while the kernel
    works (a ctypes call)."""
    global _supported
    stop_row = min(int(stop_row), arr.shape[0])
    if not _supported or stop_row <= start_row or not arr.flags.c_contiguous:
        return 0
    row = arr.strides[0]
    base = arr.ctypes.data
    begin = (base + int(start_row) * row) // mmap.PAGESIZE * mmap.PAGESIZE
    end = base + stop_row * row
    if _madvise(begin, end - begin, MADV_POPULATE_WRITE) != 0:
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
            _supported = False  # an older kernel, or a sandbox that refuses it: never asked again
        return 0  # ENOMEM, EFAULT: the array went away meanwhile (grown): the next call asks again
    return end - begin


class Frontier:
    """How far each growing array of an arena is resident. `ahead` maps, for each array, the rows its next
    uses may write, in chunks: when fewer than half of the wanted rows beyond the used ones are mapped, it
    maps up to `used + want`. An array replaced (grown, compacted) starts again from its used rows."""

    def __init__(self) -> None:
        self._mapped: dict[str, tuple[weakref.ref[np.ndarray], int]] = {}

    def ahead(self, arrays: Iterable[tuple[str, np.ndarray, int, int]]) -> int:
        """`arrays`: (name, array, rows used, rows wanted ahead) each; returns the bytes asked for."""
        asked = 0
        for name, arr, used, want in arrays:
            ref, row = self._mapped.get(name, (None, 0))
            if ref is None or ref() is not arr:
                row = 0
            target = min(int(used) + int(want), arr.shape[0])
            if row - int(used) < int(want) // 2 and target > max(row, int(used)):
                asked += populate(arr, max(row, int(used)), target)
                row = target
            self._mapped[name] = (weakref.ref(arr), row)
        return asked


def arena_rows_ahead(
    states: np.ndarray, edges: np.ndarray, meta: np.ndarray, tokens: int
) -> list[tuple[str, np.ndarray, int, int]]:
    """`Frontier.ahead`'s entries for an arena's states and edges: the rows `tokens` tokens of insertion may
    write (two states and three edges each, the room `SuffixForest.grow_for` makes per token)."""
    return [("states", states, int(meta[0]), 2 * tokens), ("edges", edges, int(meta[1]), 3 * tokens)]
