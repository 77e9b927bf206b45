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

Growing an array used to mean a copy into a fresh one twice as large, inside whatever call ran out of room:
for a server following its replica, a piece of history work holding the decode step off (1.1-1.2 s for an
arena of 4 M states on these VMs, nearly all of it faults on the fresh copy). A large array is therefore
allocated at the start of a reservation of address space (`zeros`: an anonymous `MAP_NORESERVE` mapping,
which costs no memory until a page is written), and `grown` extends it in place: a longer view of the same
memory, nothing copied, nothing written. The rows beyond an array's end are mapped ahead like any others
(`populate` reaches as far as the reservation). Where the kernel refuses the reservation (strict overcommit,
an address-space limit), the array is a plain one and grows by a copy, as before.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import threading
import weakref
from collections.abc import Iterable

import numpy as np

MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14)
_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int
_supported = True

MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # linux/mman.h; Python 3.11's mmap lacks the name
# Arrays smaller than this are plain numpy arrays: copying them to grow is cheap.
RESERVE_MIN_BYTES = 1 << 20
# The address space reserved behind a large array (at least 4 times its bytes): 16 GiB holds the states of
# 250 M history tokens; a reservation costs no memory, and 128 TiB of addresses hold 8,000 of them.
RESERVE_BYTES = 1 << 34
# What one call outside the hold writes of a table's empty slots (`Filled`): 8 MiB took 100-200 ms of fresh
# memory on these VMs (not measured where a fault is cheap).
FILL_BYTES = 8 << 20


def _reservation(arr: np.ndarray) -> np.ndarray | None:
    """The flat array over the reservation `arr` starts at, or None for a plain array."""
    base = arr.base
    if (
        isinstance(base, np.ndarray)
        and isinstance(base.base, memoryview)
        and isinstance(base.base.obj, mmap.mmap)
        and arr.flags.c_contiguous
        and arr.ctypes.data == base.ctypes.data
    ):
        return base
    return None


def zeros(shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
    """`np.zeros(shape, dtype)`; from `RESERVE_MIN_BYTES` on, at the start of a reservation that `grown` can
    extend it into without a copy."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < RESERVE_MIN_BYTES:
        return np.zeros(shape, dtype)
    size = -(-max(RESERVE_BYTES, 4 * nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
    try:
        mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    except OSError:  # no room for the addresses (strict overcommit, ulimit -v): a plain array
        return np.zeros(shape, dtype)
    flat = np.frombuffer(mem, dtype)
    return flat[: nbytes // dtype.itemsize].reshape(shape)


def capacity(arr: np.ndarray) -> int:
    """Rows the memory behind `arr` has room for: its reservation's, or its own."""
    flat = _reservation(arr)
    return int(arr.shape[0]) if flat is None else flat.nbytes // arr.strides[0]


def grown(arr: np.ndarray, rows: int) -> np.ndarray:
    """`arr` with `rows` rows (no fewer than it has), the new ones zero: a longer view of the same memory when
    its reservation has room (nothing copied or written), otherwise a copy into a new `zeros`."""
    rows = max(int(rows), int(arr.shape[0]))
    flat = _reservation(arr)
    if flat is not None and rows <= capacity(arr):
        width = int(np.prod(arr.shape[1:], dtype=np.int64))
        return flat[: rows * width].reshape((rows, *arr.shape[1:]))
    out = zeros((rows, *arr.shape[1:]), arr.dtype)
    out[: arr.shape[0]] = arr
    return out


def populate(arr: np.ndarray, start_row: int, stop_row: int) -> int:
    """Maps rows [start_row, stop_row) of a C-contiguous array writable, without changing them (rows past its
    end as far as its reservation goes: those `grown` gives it next); returns the bytes asked for (0 when the
    kernel cannot, or the range is empty). Releases the GIL while the kernel works (a ctypes call)."""
    global _supported
    stop_row = min(int(stop_row), capacity(arr))
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


class Filled:
    """An array whose rows are set to `value` a chunk at a time (`fill`), outside the decode step's hold: a hash
    table's empty slots, written before a piece needs the table (writing them inside it was a fault per page).
    Whoever needs it before it is ready writes the rest (`finish`); a lock keeps the two writers apart."""

    def __init__(self, shape: tuple[int, ...], dtype: type | np.dtype, value: int) -> None:
        self.array = np.empty(shape, dtype)
        self.value = value
        self.rows = 0  # rows [0, rows) hold the value
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self.rows >= self.array.shape[0]

    def fill(self, nbytes: int) -> int:
        """Sets the next `nbytes` worth of rows; returns the bytes written."""
        with self._lock:
            stop = min(self.array.shape[0], self.rows + max(1, nbytes // self.array.strides[0]))
            self.array[self.rows : stop] = self.value
            written = (stop - self.rows) * self.array.strides[0]
            self.rows = stop
        return written

    def finish(self) -> np.ndarray:
        """The array, every row set (the rest written now)."""
        self.fill(self.array.nbytes)
        return self.array


class Frontier:
    """How far each growing array of an arena is resident. `ahead` maps, for each array, the rows its next
    uses may write, in chunks: when fewer than half of the wanted rows beyond the used ones are mapped, it
    maps up to `used + want`. An array replaced (grown by a copy, compacted) starts again from its used rows;
    one grown in place (`grown`) keeps its mapped rows."""

    def __init__(self) -> None:
        self._mapped: dict[str, tuple[weakref.ref[np.ndarray], int]] = {}

    def ahead(self, arrays: Iterable[tuple[str, np.ndarray, int, int]]) -> int:
        """`arrays`: (name, array, rows used, rows wanted ahead) each; returns the bytes asked for."""
        asked = 0
        for name, arr, used, want in arrays:
            ref, row = self._mapped.get(name, (None, 0))
            memory = _reservation(arr)  # an array grown in place keeps its reservation, and what is mapped
            if memory is None:
                memory = arr
            if ref is None or ref() is not memory:
                row = 0
            target = min(int(used) + int(want), capacity(arr))
            if row - int(used) < int(want) // 2 and target > max(row, int(used)):
                asked += populate(arr, max(row, int(used)), target)
                row = target
            self._mapped[name] = (weakref.ref(memory), row)
        return asked


def arena_rows_ahead(
    states: np.ndarray, edges: np.ndarray, meta: np.ndarray, tokens: int
) -> list[tuple[str, np.ndarray, int, int]]:
    """`Frontier.ahead`'s entries for an arena's states and edges: the rows `tokens` tokens of insertion may
    write (two states and three edges each, the room `SuffixForest.grow_for` makes per token)."""
    return [("states", states, int(meta[0]), 2 * tokens), ("edges", edges, int(meta[1]), 3 * tokens)]
