"""Step records as columns: one fixed-layout row per (rank, step), in numpy.

The doctor and the figures read the same few numbers of every record (times, memory,
fingerprints, loss, LR); as Python objects, 512 ranks x 1,000 steps of them take seconds to
walk. A :class:`StepColumns` holds those numbers as one structured numpy array that grows
as records arrive (amortised doubling), so a check reads a column, or a steps x ranks
matrix of it, in one vectorised pass.

Missing values have fixed stand-ins so that every column has one dtype: ``nan`` for a
float that is None (``lr``, ``scale``, ``grad_norm``, CUDA bytes), ``-1`` for an int that
is None (``synced_micro_batches``, ``comm_calls``, ``comm_bytes``). Fingerprints are
unsigned 64-bit (0: not recorded).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

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
    ]
)
TIME_FIELDS = ("data", "forward", "backward", "optimizer", "record")


_MASK64 = (1 << 64) - 1  # fingerprints as unsigned 64-bit, whatever sign they came with


def _or_nan(value) -> float:
    return math.nan if value is None else value


def _or_minus_one(value) -> int:
    return -1 if value is None else value


def row_of(rank: int, rec: StepRecord) -> tuple:
    """One record as a ROW tuple (the order of ROW's fields)."""
    t, m = rec.times, rec.memory
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
        rec.grad_fingerprint & _MASK64,
        rec.param_fingerprint & _MASK64,
        rec.buffer_fingerprint & _MASK64,
        rec.num_nonfinite,
        rec.micro_batches,
        _or_minus_one(rec.synced_micro_batches),
        rec.epoch,
        len(rec.indices),
        0,  # indices_at: set by StepColumns
        len(rec.epoch_starts),
        len(rec.missing_grads),
        -1 if rec.unreached is None else len(rec.unreached),
        _or_minus_one(rec.comm_calls),
        _or_minus_one(rec.comm_bytes),
    )


def _grown(array: np.ndarray, used: int, size: int) -> np.ndarray:
    grown = np.zeros(size, dtype=array.dtype)
    grown[:used] = array[:used]
    return grown


def step_seconds(rows: np.ndarray) -> np.ndarray:
    """Each row's whole step time (``StepTimes.total``: every phase, dtlab's own too)."""
    total = np.zeros(rows.shape, dtype=np.float64)
    for name in TIME_FIELDS:
        total += rows[name]
    return total


class StepColumns:
    """Rows in arrival order; :meth:`rows` is a view of the filled part."""

    def __init__(self, capacity: int = 1024) -> None:
        self._rows = np.zeros(capacity, dtype=ROW)
        self._size = 0
        self._indices = np.zeros(8 * capacity, dtype=np.int64)  # every row's, one after another
        self._indices_size = 0
        self._aligned: tuple[tuple, tuple] | None = None  # ((size, ranks) it was built for, it)
        self._sorted: tuple[int, np.ndarray] | None = None  # (size it was sorted at, rows)

    @classmethod
    def from_records(cls, records: Mapping[int, Sequence[StepRecord]]) -> StepColumns:
        columns = cls(max(1, sum(len(recs) for recs in records.values())))
        for rank, recs in records.items():
            columns.extend(rank, recs)
        return columns

    def __len__(self) -> int:
        return self._size

    def append(self, rank: int, rec: StepRecord) -> None:
        if self._size == len(self._rows):
            self._rows = _grown(self._rows, self._size, 2 * len(self._rows))
        self._rows[self._size] = row_of(rank, rec)
        if rec.indices:
            n, at = len(rec.indices), self._indices_size
            if at + n > len(self._indices):
                self._indices = _grown(self._indices, at, 2 * (at + n))
            self._indices[at : at + n] = rec.indices
            self._rows["indices_at"][self._size] = at
            self._indices_size = at + n
        self._size += 1

    def indices(self) -> np.ndarray:
        """Every row's sample indices, one after another (``row["indices_at"]``, and
        ``row["num_indices"]`` of them)."""
        return self._indices[: self._indices_size]

    def extend(self, rank: int, recs: Iterable[StepRecord]) -> None:
        for rec in recs:
            self.append(rank, rec)

    def rows(self) -> np.ndarray:
        return self._rows[: self._size]

    def sorted_rows(self) -> np.ndarray:
        """The rows by rank, then step; a (rank, step) seen twice keeps its first row, as
        Trace does (made once per size)."""
        if self._sorted is not None and self._sorted[0] == self._size:
            return self._sorted[1]
        rows = self.rows()
        if not len(rows):
            return rows
        order = np.lexsort((np.arange(len(rows)), rows["step"], rows["rank"]))
        rows = rows[order]
        first = np.r_[True, rows["rank"][1:] != rows["rank"][:-1]]
        first |= np.r_[True, rows["step"][1:] != rows["step"][:-1]]
        self._sorted = (self._size, rows[first])
        return self._sorted[1]

    def by_rank(self) -> dict[int, np.ndarray]:
        """``{rank: its rows in step order}``."""
        rows = self.sorted_rows()
        if not len(rows):
            return {}
        starts = np.flatnonzero(np.r_[True, rows["rank"][1:] != rows["rank"][:-1]])
        ends = np.r_[starts[1:], len(rows)]
        return {int(rows["rank"][a]): rows[a:b] for a, b in zip(starts, ends, strict=True)}

    def aligned(
        self, ranks: Sequence[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(steps, ranks, table)`` for the steps every rank recorded (of ``ranks``,
        default: those with rows): ``table`` is a steps x ranks structured array (ROW),
        so ``table["forward"]`` is a matrix."""
        key = (self._size, None if ranks is None else tuple(sorted(ranks)))
        if self._aligned is not None and self._aligned[0] == key:
            return self._aligned[1]
        rows = self.sorted_rows()
        have = np.unique(rows["rank"])
        wanted = have if ranks is None else np.array(sorted(ranks), dtype=np.int64)
        rows = rows[np.isin(rows["rank"], wanted)]
        found: tuple[np.ndarray, np.ndarray, np.ndarray]
        if not len(rows) or len(np.setdiff1d(wanted, have)):
            found = (np.zeros(0, np.int64), wanted, np.zeros((0, len(wanted)), dtype=ROW))
        else:
            steps, counts = np.unique(rows["step"], return_counts=True)
            common = steps[counts == len(wanted)]
            rows = rows[np.isin(rows["step"], common)]  # sorted by rank, then step
            found = (common, wanted, rows.reshape(len(wanted), len(common)).T)
        self._aligned = (key, found)
        return found


__all__ = ["ROW", "TIME_FIELDS", "StepColumns", "row_of", "step_seconds"]
