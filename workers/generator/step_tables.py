"""What the proposer's step kernels take: the step book's arrays, the reply and every owner's group
(`StepGroups`, the source of `step.StepTables`' fields). Bundles as in `history_store.native.bundles`."""

from __future__ import annotations

from typing import NamedTuple

from history_store.native.bundles import (
    F1,
    I1,
    I2,
    I32_1,
    INT,
    DraftOutputs,
    DraftParams,
    Forest,
    numba_type,
)
from workers.budget.step import BudgetTables


class BookState(NamedTuple):
    """The step book's arrays as its kernels take them (`StepBook.kernel_state`)."""

    drafted_at: I1  # [slots] the step that last drafted for the slot
    length: I1  # [slots] tokens it drafted then
    prompt_len: I1  # [slots]
    rows: I1  # [slots] the verified rows of this step (their slots), filled by `prepare`
    accepted: I1  # [slots] and the tokens each accepted
    accepted_by_position: I1  # [K] running totals
    drafted_by_position: I1  # [K]
    totals: I1  # [len(TOTAL_NAMES)]
    per_row: I2  # [4, >= rows] END, NEW, HEADROOM, OUTPUT of each row (the first n columns are the batch's)
    bounds: F1  # the budget histogram's upper bounds
    by_source: I1  # [len(Source)] drafts by source
    by_bucket: I2  # [len(LENGTH_CLASSES), len(bounds)]
    sum_by_class: I1  # [len(LENGTH_CLASSES)]


class Reply(NamedTuple):
    """The kept draft tokens packed: row i's from bounds[i] to bounds[i + 1]."""

    tokens: I32_1  # [rows x K]
    bounds: I1  # [rows + 1]


class StepGroups(NamedTuple):
    """What the two step kernels read or update, one member per owner: the order and types of `StepTables`'
    fields. The proposer builds it by keyword from its parts (`DasProposer._table_sources`)."""

    arena: numba_type(Forest)  # the index's forest (SuffixForest.tables)
    slot_table: I2  # the index's per-request slots (ProblemIndex.slots)
    outputs: numba_type(DraftOutputs)  # the index's per-batch outputs (ProblemIndex.step_buffers)
    params: numba_type(DraftParams)  # drafting settings (DraftConfig.params)
    draft_threads: INT  # ProblemIndex.draft_threads
    book: numba_type(BookState)  # the step book (StepBook.kernel_state)
    budget: numba_type(BudgetTables)  # the budget's state and per-batch buffers (BudgetPolicy.tables)
    reply: numba_type(Reply)
    k: INT  # the engine's num_speculative_tokens
    max_model_len: INT
