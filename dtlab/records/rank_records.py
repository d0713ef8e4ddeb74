"""One rank's step records in step order, made from the Trace's columns when read.

A rank's records arrive as frames of packed rows (:mod:`dtlab.records.packed`); making a
StepRecord of each as it comes would cost the notebook tens of microseconds per rank and
step, most of them for records nobody reads one by one (the doctor and the figures read
the columns). The rows themselves live once, in the Trace's :class:`StepColumns`; a
:class:`RankRecords` keeps only each frame's steps (8 bytes a record) and its rare fields
(extras), and makes the record at a position from its row the first time it is read (then
keeps it).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, overload

import numpy as np

from dtlab.records.packed import Packed, Part, extras_of
from dtlab.records.steps import StepRecord

if TYPE_CHECKING:
    from dtlab.records.columns import StepColumns


class RankRecords(Sequence[StepRecord]):
    """A rank's records, steps strictly increasing: an older or repeated step is dropped.
    Records that came in frames are read from ``columns`` (which holds their rows)."""

    def __init__(
        self,
        records: Iterable[StepRecord] = (),
        *,
        rank: int = 0,
        columns: StepColumns | None = None,
    ) -> None:
        self.rank = rank
        self.columns = columns
        self._made: list[StepRecord | None] = []  # by position; None: not made yet
        self._starts: list[int] = []  # the position of each frame's first row
        self._steps: list[np.ndarray] = []  # each frame's steps
        self._extras: list[dict[int, dict]] = []  # each frame's extras, by row
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

    def fresh(self, part: Part) -> bool:
        """Does every row of ``part`` come after the last step, each after the one before?"""
        return part.increasing and part.first_step > self.last_step

    def add_part(self, part: Part, steps: np.ndarray, extras: dict[int, dict]) -> None:
        """Add a part of a frame whose rows are all :meth:`fresh` (its rows go to the
        columns; this keeps their ``steps``, an array not backed by the frame's bytes, and
        ``extras``, numbered from the part's first row)."""
        if part.stop == part.start:
            return
        if self.columns is None:
            raise ValueError("records that come as frames need the Trace's columns")
        self._starts.append(len(self._made))
        self._steps.append(steps)
        self._extras.append(extras)
        self._made.extend([None] * (part.stop - part.start))
        self.last_step = part.last_step

    def drop_through(self, step: int) -> int:
        """Forget the records of steps up to ``step``; returns how many went. Positions
        count from the first record kept."""
        k = f = 0  # positions and frames to drop
        while k < len(self._made):
            if f < len(self._starts) and self._starts[f] == k:
                steps = self._steps[f]
                if steps[-1] <= step:
                    k, f = k + len(steps), f + 1
                    continue
                gone = int(np.searchsorted(steps, step, side="right"))  # it straddles
                if gone:
                    self._steps[f] = steps[gone:].copy()
                    self._extras[f] = {i - gone: v for i, v in self._extras[f].items() if i >= gone}
                    self._starts[f] += gone
                    k += gone
                break
            rec = self._made[k]
            if rec is None or rec.step > step:
                break
            k += 1
        if k:
            del self._made[:k]
            self._starts = [start - k for start in self._starts[f:]]
            self._steps, self._extras = self._steps[f:], self._extras[f:]
            self.dropped += k
        return k

    def extras(self) -> dict[int, dict]:
        """``{step: extras}`` of the records kept that have any (what a row alone lacks)."""
        found: dict[int, dict] = {}
        k = f = 0
        while k < len(self._made):
            if f < len(self._starts) and self._starts[f] == k:
                steps = self._steps[f]
                found.update({int(steps[j]): e for j, e in self._extras[f].items()})
                k, f = k + len(steps), f + 1
                continue
            rec = self._made[k]
            if rec is not None and (e := extras_of(rec)):
                found[rec.step] = e
            k += 1
        return found

    def new_rows(self, batch: Packed) -> Packed:
        """The rows of ``batch`` whose steps come after the last, each after the one before."""
        steps = batch.rows["step"]
        before = np.maximum.accumulate(np.r_[self.last_step, steps[:-1]]) if len(steps) else steps
        return batch.take(steps > before)

    def between(self, first: int, stop: int) -> list[StepRecord]:
        """The records of steps ``first`` up to (not including) ``stop``; only the frames
        that hold some are read."""
        found: list[StepRecord] = []
        k = f = 0
        while k < len(self._made):
            if f < len(self._starts) and self._starts[f] == k:
                steps = self._steps[f]
                lo, hi = np.searchsorted(steps, [first, stop])
                found.extend(self._make(k + j) for j in range(int(lo), int(hi)))
                k, f = k + len(steps), f + 1
                continue
            rec = self._made[k]
            if rec is not None and first <= rec.step < stop:
                found.append(rec)
            k += 1
        return found

    def _make(self, i: int) -> StepRecord:
        rec = self._made[i]
        if rec is None:
            f = bisect.bisect_right(self._starts, i) - 1
            j = i - self._starts[f]
            assert self.columns is not None  # add_frame checked it
            row, indices = self.columns.find(self.rank, int(self._steps[f][j]))
            extras = {0: self._extras[f][j]} if j in self._extras[f] else {}
            rec = self._made[i] = Packed(row, indices, extras).record(0)
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
        if self._starts and any(rec is None for rec in self._made):
            self._make_all()
        return iter(list(self._made))  # type: ignore[arg-type]  # every one made

    def _make_all(self) -> None:
        """Every record not made yet, from this rank's rows in one pass."""
        assert self.columns is not None
        batch = self.columns.rank_batch(self.rank)
        at = {int(s): n for n, s in enumerate(batch.rows["step"].tolist())}
        for start, steps, extras in zip(self._starts, self._steps, self._extras, strict=True):
            for j, step in enumerate(steps.tolist()):
                if self._made[start + j] is None:
                    n = at[step]
                    batch.extras[n] = extras[j] if j in extras else {}
                    self._made[start + j] = batch.record(n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, like a list

    def __repr__(self) -> str:
        return f"<RankRecords: {len(self)} records, last step {self.last_step}>"
