"""The proposer's decode step in one native call (`decode_step`; `draft_step` again only when the index had
to grow mid-step).

`before_draft` works out what the previous step's verification did (`step_book.prepare`) and hands it to the
budget (`workers.budget.step.learn`, and `price` for a clean step's measured time); `draft_step` asks the budget
for each row's budget (`plan`), commits every row's new tokens and drafts (`kernels.step_rows`), applies the
pay-off rule (`cut`) and counts the drafts (`step_book.record`). The budget's four kernels are its public step:
this is the one place they are composed, and the replay runs this step too (`workers.bench.replay` drives the
proposer), so the engine runs exactly the replay's policy.

Both take the step's tables as one `StepTables` value: numba unboxes every argument of every call (about
100 ns an array), so passing the 70 arrays of `StepGroups` cost more than a batch of one's whole drafting.
The proposer packs them once and packs again only after something outside these kernels replaced an array (a
request joined or finished, the history changed, the index grew, the batch size or the queue changed).
`DirectCall` then skips numba's typing of the tables on each call (2.8 µs; 1.6-2.1 µs of an 18-20 µs step at
batch 1, measured), so `pack_tables` checks every array's dtype, rank and layout against `StepGroups` instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, types
from numba.experimental import structref

from history_store.automaton import kernels as K
from history_store.native.bundles import StepRows, members
from workers.budget.state import Drafted
from workers.budget.step import MEDIUM, cut, learn, plan, price
from workers.generator.step_book import END, HEADROOM, OUTPUT, prepare, record
from workers.generator.step_tables import StepGroups


@structref.register
class _StepTablesType(types.StructRef):
    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(t)) for name, t in fields)


class StepTables(structref.StructRefProxy):
    """Every array and setting the two step kernels read or update, as one native value (`pack_tables`): one
    pointer to unbox per call instead of 70 arrays."""


structref.define_boxing(_StepTablesType, StepTables)

_STEP_TABLES = _StepTablesType(members(StepGroups))


def _packer() -> Any:
    """`_pack`: one StepTables from a StepGroups, an assignment per StepGroups field, generated so that the
    fields are named once. Defined in this module (numba's disk cache rebuilds a kernel's globals from its
    module) and compiled against this file's name (which the cache keys by)."""
    lines = ["def _pack(groups):", "    t = structref.new(_STEP_TABLES)"]
    lines += [f"    t.{name} = groups.{name}" for name in StepGroups._fields]
    lines.append("    return t")
    exec(compile("\n".join(lines), __file__, "exec"), globals())
    return globals()["_pack"]


_pack = njit(cache=True)(_packer())


def pack_tables(groups: StepGroups) -> StepTables:
    """One StepTables from a StepGroups (arrays are shared, not copied).

    Raises:
        TypeError: an array's dtype, rank or layout is not the one `StepGroups` declares (the step's calls
            skip numba's checks, so a wrong array would otherwise be undefined behaviour).
    """
    check_arrays(groups, StepGroups.__name__)
    return _pack(groups)


def check_arrays(bundle: tuple, where: str) -> None:
    """Raises TypeError naming the first member array of `bundle` (nested bundles too) whose dtype, rank or
    C-contiguity differs from the numba type its class declares."""
    for (name, expected), value in zip(members(type(bundle)), bundle, strict=True):
        if isinstance(expected, types.Array):
            dtype = np.dtype(str(expected.dtype)) if expected.dtype != types.boolean else np.dtype(bool)
            if (
                not isinstance(value, np.ndarray)
                or value.dtype != dtype
                or value.ndim != expected.ndim
                or (expected.layout == "C" and not value.flags.c_contiguous)
            ):
                got = (
                    f"{value.dtype}[{value.ndim}d, contiguous={value.flags.c_contiguous}]"
                    if isinstance(value, np.ndarray)
                    else type(value).__name__
                )
                raise TypeError(f"{where}.{name} must be a C-contiguous {expected}, got {got}")
        elif isinstance(value, tuple) and hasattr(value, "_fields"):
            check_arrays(value, f"{where}.{name}")


@njit(cache=True, inline="always")
def before_draft(t, slots, num_tokens, scheduled, step_no, joined, verify_seconds, last_rows):
    """Per-row END/NEW/HEADROOM/OUTPUT into per_row, the verified rows' acceptance into the budget (`learn`),
    and the time since the last step returned into its cost model (`price`) when it measured a clean decode
    step: no request joined (no prefill ran in it), every row committed, and the last step had rows. That step
    ran these rows and verified their last drafts as vLLM's scheduler cut them (`scheduled`, see
    `step_book.prepare`): n rows, n + their verified draft tokens. Returns (verified rows, clean)."""
    book = t.book
    have = K.committed(t.arena.seqs, t.slot_table, slots)
    m, every_row_new = prepare(
        slots=slots,
        num_tokens=num_tokens,
        scheduled=scheduled,
        have=have,
        step_no=step_no,
        k=t.k,
        max_model_len=t.max_model_len,
        book=book,
    )
    clean = not joined and every_row_new and last_rows > 0 and verify_seconds > 0.0
    if clean:
        n = slots.shape[0]
        verified = n
        for i in range(m):
            verified += book.length[book.rows[i]]  # the draft tokens each row had verified (`prepare`)
        price(t.budget, n, verified, verify_seconds)
    kept = t.budget.policy.kept
    for i in range(m):  # tokens the scheduler cut were never tried: the budget learns nothing of them
        s = book.rows[i]
        kept[s] = min(kept[s], book.length[s])
    learn(t.budget, book.rows[:m], book.accepted[:m])
    return m, clean


@njit(cache=True, inline="always")
def draft_step(t, budget_on, resume, row, slots, bases, src, step_no, queued):
    """Budgets (unless `resume`), commit and draft from `row` on, the pay-off rule and counting. Returns
    (status, row reached, rows promoted to the tail, draft tokens): a status other than K.DONE means the index
    must make room for that row and the caller packs the tables again and calls with resume=True from it.
    `queued`: slots of requests waiting for the engine (tail candidates, `plan`). The kept draft tokens are
    packed in t.reply."""
    promoted = 0
    n = slots.shape[0]
    per_row, buffers = t.book.per_row[:, :n], t.budget.buffers
    budgets, classes = buffers.budgets, buffers.classes
    if not resume:
        if budget_on:
            promoted = plan(t.budget, slots, per_row[OUTPUT], per_row[HEADROOM], queued)
        else:
            for i in range(n):
                budgets[i] = per_row[HEADROOM, i]
                classes[i] = MEDIUM
    out = t.outputs
    rows = StepRows(slots=slots, bases=bases, ends=per_row[END], budgets=budgets, src=src)
    row, status = K.step_rows(t.arena, t.slot_table, rows, row, True, t.params, out, t.draft_threads)
    if status != K.DONE:
        return status, row, promoted, 0
    info = out.info
    sources = info[:, K.I_SOURCE]
    if budget_on:
        drafted = Drafted(
            tokens=out.tok,
            probs=out.prob,
            support=out.sup,
            remembered=out.mem,
            lengths=info[:, K.I_LEN],
            match_lens=info[:, K.I_MATCH],
            sources=sources,
            agreement=info[:, K.I_AGREE : K.I_AGREE + K.N_CANDIDATES - 1],
        )
        cut(t.budget, drafted, slots)
        lengths = buffers.kept[:n]  # the buffers hold the queued requests' rows too
    else:
        lengths = info[:, K.I_LEN]
    tokens = record(slots, lengths, classes, sources, budgets, step_no, t.book)
    _pack_reply(out.tok, lengths, t.reply)
    return status, row, promoted, tokens


@njit(cache=True, inline="always")
def _pack_reply(drafted, lengths, reply):
    """Row i's first lengths[i] drafted tokens into reply.tokens[reply.bounds[i]:reply.bounds[i + 1]]: vLLM
    takes a list per row,
    and slicing one list of the packed tokens builds them faster than cutting a list of every row's K. Copied
    token by token: slices would cost two views, each two atomic reference counts, per row."""
    packed, bounds = reply.tokens, reply.bounds
    total = 0
    bounds[0] = 0
    for i in range(lengths.shape[0]):
        for j in range(lengths[i]):
            packed[total + j] = drafted[i, j]
        total += lengths[i]
        bounds[i + 1] = total


@njit(cache=True)
def decode_step(
    t,
    slots,
    num_tokens,
    scheduled,
    step_no,
    joined,
    verify_seconds,
    last_rows,
    budget_on,
    bases,
    src,
    queued,
):
    """`before_draft`, then `draft_step` from the first row: the whole step in one call when the index has
    room. Returns before_draft's (verified rows, clean), then draft_step's (status, row reached, rows promoted,
    draft tokens)."""
    m, clean = before_draft(t, slots, num_tokens, scheduled, step_no, joined, verify_seconds, last_rows)
    status, row, promoted, tokens = draft_step(t, budget_on, False, 0, slots, bases, src, step_no, queued)
    return m, clean, status, row, promoted, tokens


class DirectCall:
    """A kernel whose first argument is a `StepTables`, called through the compiled overload's entry point
    instead of the dispatcher while the tables keep the type it last compiled for.

    The dispatcher types every argument on every call to pick its overload; for a StepTables value that
    costs 2.8 µs (numba types its 70 arrays each time), about a tenth of the whole step at batch 1. numba
    interns types, so "the same tables type" is one identity test. The entry point unboxes by its signature
    without checking: `pack_tables` checks the tables' arrays once per packing, and the caller must keep every
    other argument's type (the proposer builds each array it passes with a fixed dtype, rank and layout, and
    normalizes vLLM's token counts on entry; checking them on every call cost as much as it saved). Any other tables type goes through the dispatcher, which types
    it, compiles if needed and becomes the new fast path.
    """

    def __init__(self, dispatcher: Any) -> None:
        self.dispatcher = dispatcher
        self._fast: tuple[Any, Any] | None = None  # (tables type, entry point), replaced as one value

    def __call__(self, tables: Any, *args: Any) -> Any:
        fast = self._fast
        if fast is not None and tables._numba_type_ is fast[0]:
            return fast[1](tables, *args)
        result = self.dispatcher(tables, *args)
        self._learn(tables, args)
        return result

    def _learn(self, tables: Any, args: tuple[Any, ...]) -> None:
        if any(isinstance(a, np.ndarray) and not a.flags.c_contiguous for a in args):
            self._fast = None  # a strided view: leave such calls to the dispatcher
            return
        signature = tuple(self.dispatcher.typeof_pyval(a) for a in (tables, *args))
        overload = self.dispatcher.overloads.get(signature)
        self._fast = None if overload is None else (tables._numba_type_, overload.entry_point)
