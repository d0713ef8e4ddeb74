"""Step records as columns: one fixed-layout row per (rank, step), in numpy.

The doctor and the figures read the same few numbers of every record (times, memory,
fingerprints, loss, LR); as Python objects, 512 ranks x 1,000 steps of them take seconds to
walk. A :class:`StepColumns` holds those numbers as one structured numpy array that grows
as records arrive (amortised doubling), so a check reads a column, or a steps x ranks
matrix of it, in one vectorised pass.

The rows are :data:`dtlab.records.row.ROW` (what a rank sends, :mod:`dtlab.records.packed`):
``nan`` or ``-1`` stand in for None, and fingerprints are unsigned 64-bit (0: not recorded).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from dtlab.records.packed import Frame, Packed, join
from dtlab.records.row import NULLABLE, ROW, TIME_FIELDS, row_of
from dtlab.records.steps import StepRecord


def _grown(array: np.ndarray, used: int, size: int) -> np.ndarray:
    grown = np.zeros(size, dtype=array.dtype)
    _put(grown, 0, array[:used])
    return grown


def _put(array: np.ndarray, at: int, rows: np.ndarray) -> None:
    """``array[at:at + len(rows)] = rows`` as one copy of bytes (overlap allowed): numpy
    copies a structured array field by field, ~8x slower at a million rows."""
    n = array.dtype.itemsize
    array.view(np.uint8)[at * n : (at + len(rows)) * n] = np.ascontiguousarray(rows).view(np.uint8)


def step_seconds(rows: np.ndarray) -> np.ndarray:
    """Each row's whole step time (``StepTimes.total``: every phase, dtlab's own too)."""
    total = np.zeros(rows.shape, dtype=np.float64)
    for name in TIME_FIELDS:
        total += rows[name]
    return total


def _step_rank_keys(rows: np.ndarray, low_step: int, num_ranks: int) -> np.ndarray | None:
    """One int64 per row ordering by step, then rank (None when it would not fit)."""
    top = int(rows["step"].max()) - low_step + 1
    if top * num_ranks >= 1 << 62 or int(rows["rank"].min()) < 0:
        return None
    return (rows["step"] - low_step) * num_ranks + rows["rank"].astype(np.int64)


def _first_of_each(rows: np.ndarray) -> np.ndarray:
    """Rows sorted by step, then rank: a (step, rank) seen twice keeps its first row."""
    if len(rows) < 2:
        return rows
    again = (rows["step"][1:] == rows["step"][:-1]) & (rows["rank"][1:] == rows["rank"][:-1])
    return rows[np.r_[True, ~again]] if again.any() else rows


def _by_step_then_rank(rows: np.ndarray) -> np.ndarray:
    """``rows`` ordered by step, then rank, then arrival, duplicates dropped (a copy)."""
    if not len(rows):
        return rows.copy()
    keys = _step_rank_keys(rows, int(rows["step"].min()), int(rows["rank"].max()) + 1)
    if keys is None:
        order = np.lexsort((np.arange(len(rows)), rows["rank"], rows["step"]))
    else:
        order = np.argsort(keys, kind="stable")
    # a structured array's fancy indexing copies field by field (0.7 s at 512k rows);
    # taking whole rows as bytes is 3-4x faster
    raw = rows.view(np.uint8).reshape(len(rows), rows.dtype.itemsize)
    return _first_of_each(np.take(raw, order, axis=0).reshape(-1).view(rows.dtype))


def _compacted(rows: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``rows``' sample indices alone, one row's after another, and where each row's
    start in them."""
    counts = rows["num_indices"].astype(np.int64)
    at = np.zeros(len(rows), dtype=np.int64)
    if len(rows) > 1:
        np.cumsum(counts[:-1], out=at[1:])
    total = int(counts.sum())
    where = np.repeat(rows["indices_at"] - at, counts) + np.arange(total, dtype=np.int64)
    return indices[where], at


class StepColumns:
    """One row per (rank, step), kept in step then rank order: rows that arrive after the
    last read wait at the end, and are sorted into place on the next read, so a read
    costs the new rows' sort (plus a merge when a late rank's older steps arrive).

    The rows held are ``_rows[_first:_size]`` and their sample indices
    ``_indices[_istart:_iend]`` (each row's ``indices_at`` counts from ``_istart``): a
    window that slides moves ``_first`` and ``_istart`` on, and the arrays are compacted
    in place only when they are full, so a slide copies nothing but the rows it returns."""

    def __init__(self, capacity: int = 1024) -> None:
        self._rows = np.zeros(capacity, dtype=ROW)
        self._first = 0  # rows before it were dropped
        self._size = 0  # rows[first:size] are held
        self._settled = 0  # rows[first:settled] are in order; the rest arrived since
        self._indices = np.zeros(8 * capacity, dtype=np.int64)  # every row's, one after another
        self._istart = 0
        self._iend = 0
        # appended since the last read, as Python tuples and ints: made into array rows in
        # one np.fromiter call when read
        self._waiting: list[tuple] = []
        self._waiting_indices: list[int] = []
        self._frames: list[Frame] = []  # frames of packed rows appended since the last read
        self._aligned: tuple[tuple, tuple] | None = None  # ((first, size, ranks) it is for, it)
        self._ranks: tuple[tuple, np.ndarray] | None = None  # ((first, size), ranks with rows)

    @classmethod
    def from_records(cls, records: Mapping[int, Sequence[StepRecord]]) -> StepColumns:
        columns = cls(max(1, sum(len(recs) for recs in records.values())))
        for rank, recs in records.items():
            columns.extend(rank, recs)
        return columns

    def __len__(self) -> int:
        return len(self.rows())

    def append(self, rank: int, rec: StepRecord) -> None:
        if self._frames:  # rows keep the order they arrived in
            self._take_waiting()
        at = self._iend - self._istart + len(self._waiting_indices)
        self._waiting.append(row_of(rank, rec, at))
        if rec.indices:
            self._waiting_indices.extend(rec.indices)

    def _take_waiting(self) -> None:
        """The rows appended since the last read, into the arrays."""
        if self._frames:
            frames, self._frames = self._frames, []
            batch = join(frames)
            self.append_rows(batch.rows, batch.indices)
        if self._waiting:
            new = np.fromiter(self._waiting, dtype=ROW, count=len(self._waiting))
            self._waiting = []
            self._room_for_rows(len(new))
            _put(self._rows, self._size, new)
            self._size += len(new)
        if self._waiting_indices:
            new_indices = np.fromiter(self._waiting_indices, np.int64, len(self._waiting_indices))
            self._waiting_indices = []
            self._room_for_indices(len(new_indices))
            self._indices[self._iend : self._iend + len(new_indices)] = new_indices
            self._iend += len(new_indices)

    def _room_for_rows(self, n: int) -> None:
        """Room for ``n`` more rows after the last: the rows held moved to the front when
        that leaves a quarter free (a slid window's), else a bigger array."""
        if self._size + n <= len(self._rows):
            return
        live = self._size - self._first
        if self._first and live + n <= len(self._rows) * 3 // 4:
            _put(self._rows, 0, self._rows[self._first : self._size])
        else:
            self._rows = _grown(
                self._rows[self._first :], live, max(live + n, 2 * live, len(self._rows))
            )
        self._settled -= self._first
        self._first, self._size = 0, live
        self._aligned = self._ranks = None

    def _room_for_indices(self, n: int) -> None:
        """Room for ``n`` more sample indices, as :meth:`_room_for_rows` (rows count theirs
        from the start of the indices held, so nothing else moves)."""
        if self._iend + n <= len(self._indices):
            return
        live = self._iend - self._istart
        if self._istart and live + n <= len(self._indices) * 3 // 4:
            self._indices[:live] = self._indices[self._istart : self._iend]
        else:
            self._indices = _grown(
                self._indices[self._istart :], live, max(live + n, 2 * live, len(self._indices))
            )
        self._istart, self._iend = 0, live

    def append_frame(self, frame: Frame) -> None:
        """A rank's checked frame of packed rows, as it came: made into rows with every
        other frame that arrived since the last read, in one pass."""
        if self._waiting:  # rows keep the order they arrived in
            self._take_waiting()
        self._frames.append(frame)

    def append_rows(self, rows: np.ndarray, indices: np.ndarray) -> None:
        """Rows of ROW (``rows["indices_at"]`` counting from the start of ``indices``)."""
        self._take_waiting()
        n = len(indices)
        if n:
            self._room_for_indices(n)
            self._indices[self._iend : self._iend + n] = indices
        at = self._iend - self._istart  # where these rows' indices start
        self._iend += n
        self._room_for_rows(len(rows))
        size = self._size + len(rows)
        _put(self._rows, self._size, rows)
        self._rows["indices_at"][self._size : size] += at
        self._size = size

    def indices(self) -> np.ndarray:
        """Every row's sample indices, one after another (``row["indices_at"]``, and
        ``row["num_indices"]`` of them)."""
        self._take_waiting()
        return self._indices[self._istart : self._iend]

    def extend(self, rank: int, recs: Iterable[StepRecord]) -> None:
        for rec in recs:
            self.append(rank, rec)

    def rows(self) -> np.ndarray:
        """Every row, by step then rank; a (rank, step) that arrived twice keeps its first
        row, as Trace does (a view: valid until the next append)."""
        self._take_waiting()
        if self._settled < self._size:
            self._settle()
        return self._rows[self._first : self._size]

    sorted_rows = rows

    def _settle(self) -> None:
        done = self._rows[self._first : self._settled]
        new = self._rows[self._settled : self._size]
        new = _by_step_then_rank(new)
        last, first = (done[-1] if len(done) else None), (new[0] if len(new) else None)
        if (
            last is None
            or first is None
            or (first["step"], first["rank"])
            > (
                last["step"],
                last["rank"],
            )
        ):
            _put(self._rows, self._settled, new)  # in place, after
            self._size = self._settled + len(new)
        else:  # older steps arrived late: sort the whole
            merged = _by_step_then_rank(self._rows[self._first : self._size])
            _put(self._rows, self._first, merged)
            self._size = self._first + len(merged)
        self._settled = self._size

    def find(self, rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Row ``(rank, step)`` (an array of one, ``indices_at`` 0) and its sample indices;
        KeyError if there is none."""
        rows = self.rows()
        lo, hi = np.searchsorted(rows["step"], [step, step + 1])
        k = int(lo + np.searchsorted(rows["rank"][lo:hi], rank))
        if k >= hi or rows["rank"][k] != rank:
            raise KeyError(f"no record of rank {rank} at step {step} in memory")
        row = rows[k : k + 1].copy()
        at, n = int(row["indices_at"][0]), int(row["num_indices"][0])
        row["indices_at"] = 0
        return row, self.indices()[at : at + n].copy()

    def rank_batch(self, rank: int) -> Packed:
        """Every row of ``rank`` in step order, with its sample indices (no extras)."""
        rows = self.rows()
        mine = rows[rows["rank"] == rank]
        indices, at = _compacted(mine, self.indices())
        mine["indices_at"] = at
        return Packed(mine, indices)

    def drop_through(self, step: int) -> np.ndarray:
        """Forget the rows of steps up to ``step`` (a Trace's bounded window: they are in its
        run folder); returns them (a copy, by step then rank). The rows and indices held
        start later; their arrays are compacted when next full, so memory follows the
        window, not the run."""
        rows = self.rows()
        cut = int(np.searchsorted(rows["step"], step, side="right"))
        if not cut:
            return rows[:0].copy()
        gone = rows[:cut].copy()
        self._first += cut
        kept = self.rows()
        have = kept["num_indices"] > 0
        # the indices of the rows gone: those before the first kept row's (runs interleave
        # their ranks' steps, so a few may stay behind it until the arrays are compacted)
        low = int(kept["indices_at"][have].min()) if have.any() else self._iend - self._istart
        if low:
            kept["indices_at"] -= low
            self._istart += low
        self._aligned = self._ranks = None
        return gone

    def ranks(self) -> np.ndarray:
        """The ranks that have rows, ascending."""
        rows = self.rows()
        if self._ranks is None or self._ranks[0] != (self._first, self._size):
            self._ranks = ((self._first, self._size), np.unique(rows["rank"]))
        return self._ranks[1]

    def by_rank(self) -> dict[int, np.ndarray]:
        """``{rank: its rows in step order}`` (views into the table when every rank has
        every step; copies otherwise)."""
        steps, ranks, table = self.aligned()
        if len(table) * len(ranks) == len(self.rows()):  # every rank has every step
            return {int(r): table[:, j] for j, r in enumerate(ranks)}
        rows = self.rows()
        rows = rows[np.argsort(rows["rank"], kind="stable")]
        starts = np.flatnonzero(np.r_[True, rows["rank"][1:] != rows["rank"][:-1]])
        ends = np.r_[starts[1:], len(rows)]
        return {int(rows["rank"][a]): rows[a:b] for a, b in zip(starts, ends, strict=True)}

    def aligned(
        self, ranks: Sequence[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(steps, ranks, table)`` for the steps every rank recorded (of ``ranks``,
        default: those with rows): ``table`` is a steps x ranks structured array (ROW),
        so ``table["forward"]`` is a matrix (a view of the rows when nothing is missing)."""
        rows = self.rows()
        key = (self._first, self._size, None if ranks is None else tuple(sorted(ranks)))
        if self._aligned is not None and self._aligned[0] == key:
            return self._aligned[1]
        have = self.ranks()
        wanted = have if ranks is None else np.array(sorted(ranks), dtype=np.int64)
        found: tuple[np.ndarray, np.ndarray, np.ndarray]
        if not len(rows) or len(np.setdiff1d(wanted, have)):
            found = (np.zeros(0, np.int64), wanted, np.zeros((0, len(wanted)), dtype=ROW))
        else:
            if len(wanted) != len(have):
                rows = rows[np.isin(rows["rank"], wanted)]
            starts = np.flatnonzero(np.r_[True, rows["step"][1:] != rows["step"][:-1]])
            counts = np.diff(np.r_[starts, len(rows)])
            if not np.all(counts == len(wanted)):  # only the steps every rank recorded
                rows = rows[np.repeat(counts == len(wanted), counts)]
                starts = np.arange(0, len(rows), len(wanted))
            table = rows.reshape(len(starts), len(wanted))
            found = (rows["step"][starts], wanted, table)
        self._aligned = (key, found)
        return found


__all__ = ["NULLABLE", "ROW", "TIME_FIELDS", "StepColumns", "row_of", "step_seconds"]
