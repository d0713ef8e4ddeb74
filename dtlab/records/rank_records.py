"""One rank's step records in step order, kept as the frames they arrived in.

A rank's records arrive as frames of packed rows (:mod:`dtlab.records.packed`); making a
StepRecord of each as it comes would cost the notebook tens of microseconds per rank and
step, most of them for records nobody reads one by one (the doctor and the figures read
the columns). :class:`RankRecords` is a sequence of StepRecord that keeps the frames as
they came and makes the record at a position the first time it is read (then keeps it).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import numpy as np

from dtlab.records.packed import Frame, Packed, join, read_frame
from dtlab.records.steps import StepRecord


class RankRecords(Sequence[StepRecord]):
    """A rank's records, steps strictly increasing: an older or repeated step is dropped."""

    def __init__(self, records: Iterable[StepRecord] = ()) -> None:
        self._made: list[StepRecord | None] = []  # by position; None: not made yet
        self._starts: list[int] = []  # the position of each frame's first row
        self._frames: list[Frame] = []
        self._rows: dict[int, Packed] = {}  # frames being read, as rows
        self.last_step = 0
        self.dropped = 0  # records before the first kept (a Trace's window moved past them)
        for rec in records:
            self.append(rec)

    def __len__(self) -> int:
        return len(self._made)

    def append(self, rec: StepRecord) -> bool:
        """Add one record; False if its step is not after the last (dropped)."""
        if rec.step <= self.last_step:
            return False
        self._made.append(rec)
        self.last_step = rec.step
        return True

    def fresh(self, frame: Frame) -> bool:
        """Does every row of ``frame`` come after the last step, each after the one before?"""
        return frame.increasing and frame.first_step > self.last_step

    def add_frame(self, frame: Frame) -> None:
        """Add a frame whose rows are all :meth:`fresh`."""
        if frame.rows:
            self._starts.append(len(self._made))
            self._frames.append(frame)
            self._made.extend([None] * frame.rows)
            self.last_step = frame.last_step

    def drop_through(self, step: int) -> int:
        """Forget the records of steps up to ``step``; returns how many went. Positions
        count from the first record kept."""
        k = f = 0  # positions and frames to drop
        while k < len(self._made):
            if f < len(self._frames) and self._starts[f] == k:
                frame = self._frames[f]
                if frame.last_step <= step:
                    k, f = k + frame.rows, f + 1
                    continue
                if frame.first_step <= step:  # it straddles: a frame of its later rows
                    rows = join([frame])
                    later = rows.rows["step"] > step  # steps increase within a frame
                    gone = int(frame.rows - later.sum())
                    self._frames[f] = read_frame(rows.take(later).to_bytes())
                    self._rows.pop(f, None)
                    self._starts[f] += gone
                    k += gone
                break
            rec = self._made[k]
            if rec is None or rec.step > step:
                break
            k += 1
        if k:
            del self._made[:k]
            self._frames = self._frames[f:]
            self._starts = [start - k for start in self._starts[f:]]
            self._rows = {i - f: rows for i, rows in self._rows.items() if i >= f}
            self.dropped += k
        return k

    def between(self, first: int, stop: int) -> list[StepRecord]:
        """The records of steps ``first`` up to (not including) ``stop``; only the frames
        that hold some are read."""
        found: list[StepRecord] = []
        k = f = 0
        while k < len(self._made):
            if f < len(self._frames) and self._starts[f] == k:
                frame = self._frames[f]
                if frame.last_step >= first and frame.first_step < stop:
                    made = (self._make(j) for j in range(k, k + frame.rows))
                    found.extend(rec for rec in made if first <= rec.step < stop)
                k, f = k + frame.rows, f + 1
                continue
            rec = self._made[k]
            if rec is not None and first <= rec.step < stop:
                found.append(rec)
            k += 1
        return found

    def new_rows(self, batch: Packed) -> Packed:
        """The rows of ``batch`` whose steps come after the last, each after the one before."""
        steps = batch.rows["step"]
        before = np.maximum.accumulate(np.r_[self.last_step, steps[:-1]]) if len(steps) else steps
        return batch.take(steps > before)

    def _make(self, i: int) -> StepRecord:
        rec = self._made[i]
        if rec is None:
            f = bisect.bisect_right(self._starts, i) - 1
            rows = self._rows.get(f)
            if rows is None:
                rows = self._rows[f] = join([self._frames[f]])
                if len(self._rows) > 64:  # frames read long ago: made again if asked
                    del self._rows[next(iter(self._rows))]
            rec = self._made[i] = rows.record(i - self._starts[f])
        return rec

    @overload
    def __getitem__(self, i: int) -> StepRecord: ...
    @overload
    def __getitem__(self, i: slice) -> list[StepRecord]: ...
    def __getitem__(self, i: int | slice) -> StepRecord | list[StepRecord]:
        if isinstance(i, slice):
            return [self._make(j) for j in range(*i.indices(len(self._made)))]
        if i < 0:
            i += len(self._made)
        if not 0 <= i < len(self._made):
            raise IndexError(f"record {i} of {len(self._made)}")
        return self._make(i)

    def __iter__(self) -> Iterator[StepRecord]:
        if self._frames:
            self._make_all()
        return iter(list(self._made))  # type: ignore[arg-type]  # every one made

    def _make_all(self) -> None:
        """Every record not made yet, in one pass over every frame; the frames go."""
        made, k = join(self._frames).records(), 0
        for start, frame in zip(self._starts, self._frames, strict=True):
            for j in range(frame.rows):
                if self._made[start + j] is None:
                    self._made[start + j] = made[k + j]
            k += frame.rows
        self._frames, self._starts, self._rows = [], [], {}

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, like a list

    def __repr__(self) -> str:
        return f"<RankRecords: {len(self)} records, last step {self.last_step}>"
