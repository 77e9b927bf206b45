"""Named bundles: how kernels pass groups of arrays to each other.

A bundle is a `typing.NamedTuple` whose annotations are its members' numba types, so one class says what
each member is, its order, and the type the step's packed tables (`workers.generator.step.StepTables`) give
it. Inside nopython code a bundle is a plain struct: its members cost what separate arguments cost, and a
kernel reads `arena.states` instead of the eleventh of twenty-seven positional arguments. Build one by
keyword (`Forest(states=..., ...)`) so no caller restates the order.
"""

from __future__ import annotations

import typing
from typing import Any, NamedTuple, TypeVar

from numba import types

# Array types of bundle members: C-contiguous, as every owner allocates them.
I1, I2 = types.int64[::1], types.int64[:, ::1]
I32_1, I32_2 = types.int32[::1], types.int32[:, ::1]
F1, F2, F3 = types.float64[::1], types.float64[:, ::1], types.float64[:, :, ::1]
F32_1, F32_2 = types.float32[::1], types.float32[:, ::1]
B1 = types.boolean[::1]
U8_1 = types.uint8[::1]
INT, FLOAT, BOOL = types.int64, types.float64, types.boolean


B = TypeVar("B", bound=tuple)


def gather(bundle: type[B], *owners: Any, **given: Any) -> B:
    """A bundle whose members are `given`, or else the first owner's attributes of the same names: how each
    owner builds its bundle without restating the members' order."""
    values = {}
    for name in bundle._fields:
        if name in given:
            values[name] = given[name]
        else:
            owner = next((o for o in owners if hasattr(o, name)), None)
            if owner is None:
                raise AttributeError(f"{bundle.__name__}.{name}: no owner has it")
            values[name] = getattr(owner, name)
    return bundle(**values)


def members(bundle: type) -> tuple[tuple[str, types.Type], ...]:
    """A bundle class's (member name, numba type) pairs, in order."""
    hints = typing.get_type_hints(bundle)
    return tuple((name, hints[name]) for name in bundle._fields)


def numba_type(bundle: type) -> types.Type:
    """The numba type of a bundle class's values."""
    return types.BaseTuple.from_types([t for _, t in members(bundle)], bundle)


class Forest(NamedTuple):
    """The arena and its bookkeeping tables (`SuffixForest.tables`; read again after any growth: growing
    replaces arrays)."""

    states: I32_2  # [n, STATE_FIELDS]
    edges: I32_2  # [n, 3]: TOK, TO, NEXT
    hashes: I32_2  # [2^k, 3]: H_STATE, H_TOKEN, H_EDGE
    meta: I1  # [4 + J]: states, edges and hash entries in use, the journal (`kernels`, `hash_growth`)
    trees: I2  # [T, TREE_FIELDS]
    seqs: I2  # [Q, SEQ_FIELDS]
    pool: I32_1  # every sequence's tokens
    levels: U8_1  # each pooled token's sampling probability (kernels.PROB_LEVELS units; 0: unknown)


class DraftParams(NamedTuple):
    """Drafting settings (`DraftConfig.params`; their meaning is documented there)."""

    max_depth: INT
    spec_factor: FLOAT
    spec_offset: FLOAT
    min_prob: FLOAT
    escape: FLOAT
    all_matches: BOOL
    remembered: BOOL


def draft_params(config: Any) -> DraftParams:
    """A `DraftConfig`'s settings as the step kernels take them."""
    return gather(
        DraftParams,
        config,
        spec_factor=config.max_spec_factor,
        spec_offset=config.max_spec_offset,
        min_prob=config.min_token_prob,
        remembered=config.remembered_probs,
    )


class DraftOutputs(NamedTuple):
    """Each row's best draft (row r of each; the index's reused step buffers)."""

    tok: I32_2  # [rows, K] draft tokens
    prob: F32_2  # [rows, K] their path probabilities
    sup: I32_2  # [rows, K] occurrences behind each
    mem: F32_2  # [rows, K] each one's mean sampling probability in history (-1: unknown)
    info: I32_2  # [rows, kernels.INFO_FIELDS]
    score: F1  # [rows] the draft's score


class StepRows(NamedTuple):
    """A step's rows: row r is the request in slot slots[r]; after the step it holds ends[r] tokens, token j
    being src[bases[r] + j], and budgets[r] caps its draft."""

    slots: I1
    bases: I1
    ends: I1
    budgets: I32_1
    src: I32_1
