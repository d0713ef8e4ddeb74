"""One step record as a fixed-layout row (numpy structured dtype ``ROW``).

The same layout is what a rank sends (:mod:`dtlab.records.packed`), what the notebook keeps
(:mod:`dtlab.records.columns`) and what a run folder's Parquet parts hold, column by column
(:mod:`dtlab.records.step_files`).

``ROW`` is the one list of the record's numbers, in the order they travel (the frames'
bytes: never reorder it). Every other list of fields is derived from it and from the
dataclasses' fields (:class:`~dtlab.records.steps.StepRecord`, ``StepTimes``,
``StepMemory``): a column named as a field of the record, of its times or of its memory
holds that number; the few that differ are the tables below it (``COUNTS``, the row's own
``rank``, ``indices_at`` and ``nulls``, and ``NULLABLE``). Whatever of a record is not a
number of its row (sample indices aside) travels as an extra (:mod:`dtlab.records.packed`).

Missing values have fixed stand-ins so that every column has one dtype: ``nan`` for a
float that is None (``lr``, ``scale``, ``grad_norm``, CUDA bytes), ``-1`` for an int that
is None (``synced_micro_batches``, ``comm_calls``, ``comm_bytes``); the ``nulls`` bits say
which were None, so a row turns back into the record it came from. ``update_rms`` is never
None: nan is its own "not measured". Fingerprints are unsigned 64-bit (0: not recorded).
"""

from __future__ import annotations

from dataclasses import fields
from operator import attrgetter

import numpy as np

from dtlab.records.steps import StepMemory, StepRecord, StepTimes

ROW = np.dtype(
    [
        ("rank", np.int32),
        ("step", np.int64),
        ("time", np.float64),
        ("loss", np.float64),
        ("lr", np.float64),
        ("scale", np.float64),
        ("skipped", np.bool_),
        ("data", np.float64),
        ("forward", np.float64),
        ("backward", np.float64),
        ("optimizer", np.float64),
        ("record", np.float64),
        ("rss", np.int64),
        ("param_bytes", np.int64),
        ("grad_bytes", np.int64),
        ("optimizer_bytes", np.int64),
        ("dtlab_bytes", np.int64),
        ("cuda_allocated", np.float64),
        ("cuda_reserved", np.float64),
        ("cuda_peak", np.float64),
        ("grad_norm", np.float64),
        ("update_rms", np.float64),  # nan: not measured (the record's own stand-in)
        ("grad_fingerprint", np.uint64),
        ("param_fingerprint", np.uint64),
        ("buffer_fingerprint", np.uint64),
        ("num_nonfinite", np.int64),
        ("micro_batches", np.int32),
        ("synced_micro_batches", np.int32),
        ("epoch", np.int64),
        ("num_indices", np.int32),
        ("indices_at", np.int64),  # where this row's sample indices start in indices()
        ("epoch_starts", np.int32),  # how many epochs began inside this step
        ("num_missing", np.int32),  # parameters without a gradient after the step
        ("num_unreached", np.int32),  # ... that this rank's own backward did not reach
        ("comm_calls", np.int64),
        ("comm_bytes", np.int64),
        ("nulls", np.uint16),  # bit k set: NULLABLE[k] was None (not a nan or -1 that came)
    ]
)
# --- what is special -----------------------------------------------------------------------
# columns that count the items of a record's tuple (the items travel apart: sample indices
# in the frame's index array, the rest as extras)
COUNTS = {
    "num_indices": "indices",
    "epoch_starts": "epoch_starts",
    "num_missing": "missing_grads",
    "num_unreached": "unreached",  # -1: None (not watched)
}
ROW_OWN = ("rank", "indices_at", "nulls")  # the row's own columns: no field of the record
# the record's fields that may be None, in the order of their bits in ``nulls`` (the
# frames' bytes: append, never reorder)
NULLABLE = (
    "lr",
    "scale",
    "grad_norm",
    "cuda_allocated",
    "cuda_reserved",
    "cuda_peak",
    "synced_micro_batches",
    "comm_calls",
    "comm_bytes",
    "unreached",
)
# --- derived -------------------------------------------------------------------------------
NULL_BIT = {name: 1 << bit for bit, name in enumerate(NULLABLE)}  # a field's bit in ``nulls``
TIME_FIELDS = tuple(f.name for f in fields(StepTimes))
MEMORY_FIELDS = tuple(f.name for f in fields(StepMemory))
_RECORD_FIELDS = {f.name for f in fields(StepRecord)}


def _source(column: str) -> str:
    """The record attribute a column holds (``times.data``), or counts."""
    if column in COUNTS:
        return COUNTS[column]
    if column in TIME_FIELDS:
        return f"times.{column}"
    if column in MEMORY_FIELDS:
        return f"memory.{column}"
    if column in _RECORD_FIELDS:
        return column
    raise AssertionError(f"ROW column {column!r} is no field of StepRecord, its times or memory")


# the record's top-level fields the row holds as numbers, in ROW order
ROW_FIELDS = tuple(
    n for n in ROW.names or () if n not in ROW_OWN and n not in COUNTS and n in _RECORD_FIELDS
)
_MASK64 = (1 << 64) - 1  # fingerprints as unsigned 64-bit, whatever sign they came with
_FILLED = tuple(n for n in ROW.names or () if n not in ROW_OWN)  # what row_of reads
_GET = attrgetter(*(_source(n) for n in _FILLED))
_MAYBE = tuple(  # (position in _FILLED, bit in nulls, stand-in for None)
    (i, NULL_BIT[field], -1 if n in COUNTS or ROW[n].kind != "f" else float("nan"))
    for i, n in enumerate(_FILLED)
    if (field := COUNTS.get(n, n)) in NULL_BIT
)
_UNSIGNED = tuple(i for i, n in enumerate(_FILLED) if ROW[n].kind == "u")
_COUNTED = tuple(i for i, n in enumerate(_FILLED) if n in COUNTS)
_INDICES_AT = (ROW.names or ()).index("indices_at") - 1  # (after rank)
assert ROW.names is not None and ROW.names[0] == "rank" and ROW.names[-1] == "nulls"
assert {COUNTS.get(n, n) for n in _FILLED} >= set(NULLABLE)


def row_of(rank: int, rec: StepRecord, indices_at: int = 0) -> tuple:
    """One record as a ROW tuple (the order of ROW's fields); its sample indices start at
    ``indices_at`` in the columns' index array."""
    values = list(_GET(rec))
    nulls = 0
    for i, bit, stand_in in _MAYBE:
        if values[i] is None:
            values[i] = stand_in
            nulls |= bit
    for i in _UNSIGNED:
        values[i] &= _MASK64
    for i in _COUNTED:
        if values[i].__class__ is not int:  # (-1: a count that was None)
            values[i] = len(values[i])
    values.insert(_INDICES_AT, indices_at)
    return (rank, *values, nulls)


__all__ = [
    "COUNTS",
    "MEMORY_FIELDS",
    "NULLABLE",
    "NULL_BIT",
    "ROW",
    "ROW_FIELDS",
    "ROW_OWN",
    "TIME_FIELDS",
    "row_of",
]
