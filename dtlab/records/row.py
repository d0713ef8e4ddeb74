"""One step record as a fixed-layout row (numpy structured dtype ``ROW``).

The same layout is what a rank sends (:mod:`dtlab.records.packed`), what the notebook keeps
(:mod:`dtlab.records.columns`) and what a run folder's Parquet parts hold, column by column
(:mod:`dtlab.records.step_files`).

Missing values have fixed stand-ins so that every column has one dtype: ``nan`` for a
float that is None (``lr``, ``scale``, ``grad_norm``, CUDA bytes), ``-1`` for an int that
is None (``synced_micro_batches``, ``comm_calls``, ``comm_bytes``); the ``nulls`` bits say
which were None, so a row turns back into the record it came from. ``update_rms`` is never
None: nan is its own "not measured". Fingerprints are
unsigned 64-bit (0: not recorded).
"""

from __future__ import annotations

import math

import numpy as np

from dtlab.records.steps import StepRecord

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
# the record's fields that may be None, in the order of their bits in ``nulls``
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
NULL_BIT = {name: 1 << bit for bit, name in enumerate(NULLABLE)}  # a field's bit in ``nulls``
TIME_FIELDS = ("data", "forward", "backward", "optimizer", "record")


_MASK64 = (1 << 64) - 1  # fingerprints as unsigned 64-bit, whatever sign they came with


def _or_nan(value) -> float:
    return math.nan if value is None else value


def _or_minus_one(value) -> int:
    return -1 if value is None else value


def row_of(rank: int, rec: StepRecord, indices_at: int = 0) -> tuple:
    """One record as a ROW tuple (the order of ROW's fields); its sample indices start at
    ``indices_at`` in the columns' index array."""
    t, m = rec.times, rec.memory
    maybe = (
        rec.lr,
        rec.scale,
        rec.grad_norm,
        m.cuda_allocated,
        m.cuda_reserved,
        m.cuda_peak,
        rec.synced_micro_batches,
        rec.comm_calls,
        rec.comm_bytes,
        rec.unreached,
    )
    nulls = 0
    for bit, value in enumerate(maybe):
        if value is None:
            nulls |= 1 << bit
    return (
        rank,
        rec.step,
        rec.time,
        rec.loss,
        _or_nan(rec.lr),
        _or_nan(rec.scale),
        rec.skipped,
        t.data,
        t.forward,
        t.backward,
        t.optimizer,
        t.record,
        m.rss,
        m.param_bytes,
        m.grad_bytes,
        m.optimizer_bytes,
        m.dtlab_bytes,
        _or_nan(m.cuda_allocated),
        _or_nan(m.cuda_reserved),
        _or_nan(m.cuda_peak),
        _or_nan(rec.grad_norm),
        rec.update_rms,
        rec.grad_fingerprint & _MASK64,
        rec.param_fingerprint & _MASK64,
        rec.buffer_fingerprint & _MASK64,
        rec.num_nonfinite,
        rec.micro_batches,
        _or_minus_one(rec.synced_micro_batches),
        rec.epoch,
        len(rec.indices),
        indices_at,
        len(rec.epoch_starts),
        len(rec.missing_grads),
        -1 if rec.unreached is None else len(rec.unreached),
        _or_minus_one(rec.comm_calls),
        _or_minus_one(rec.comm_bytes),
        nulls,
    )


__all__ = ["NULLABLE", "NULL_BIT", "ROW", "TIME_FIELDS", "row_of"]
