"""The step records of one attached job, by rank, in memory and in a run folder.

A Trace keeps every rank's records as columns (what the doctor reads) and, once a run
folder holds them, only the last ``window`` steps of them in memory, with one summary row
per step it let go (:mod:`dtlab.records.summaries`). What the run folder holds and how it
is read: :mod:`dtlab.records.run_folder`; a live Trace writes it through the sink it is
made with (``Trace(jobs, sink=FolderWriter(folder))``: the notebook's writer,
:mod:`dtlab.control.run_folder_writer`). ``Trace.load(folder)`` reads a folder back, with
no writer, so another notebook can plot or compare it.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

import numpy as np

from dtlab.records import JobInfo, ParamInfo, StepRecord, job_folder
from dtlab.records import run_folder as disk
from dtlab.records.columns import StepColumns
from dtlab.records.dataframe import records_frame
from dtlab.records.packed import Frame, Packed, frame_rows, join, pack, read_frame
from dtlab.records.rank_records import RankRecords
from dtlab.records.run_folder import FORMAT, RUNS_DIR_ENV, FolderSink, new_run_folder
from dtlab.records.step_files import StepFiles
from dtlab.records.summaries import Summaries, summarize

__all__ = [
    "FORMAT",
    "RUNS_DIR_ENV",
    "WINDOW",
    "WINDOW_ENV",
    "FolderSink",
    "Trace",
    "new_run_folder",
]

WINDOW = 2000  # steps of every rank a Trace with a run folder keeps in memory
WINDOW_ENV = "DTLAB_WINDOW"  # sets WINDOW (steps; 0: keep every step in memory)


class Trace:
    """Step records keyed by rank: ``trace.records[rank]`` is a sequence in step order
    (:class:`RankRecords`: each StepRecord is made when first read). ``sink``: what writes
    its run folder (``sink.folder``; its header is written now), for a live trace."""

    def __init__(
        self,
        jobs: Mapping[int, JobInfo],
        *,
        sink: FolderSink | None = None,
        meta: Mapping | None = None,
        created: float | None = None,
        window: int | None = None,
    ):
        self.jobs = dict(sorted(jobs.items()))
        # steps kept in memory once the older ones are in the run folder (0: all of them)
        self.window = _window() if window is None else window
        self.history = Summaries()  # one row per step the window left behind
        self.first_step = 1  # the first step whose records are in memory
        self._format = FORMAT  # how its run folder holds the records (a loaded one's own)
        self._salvage = False  # a loaded one's: read corrupt journals up to the corruption
        self.meta = dict(meta or {})
        self.created = time.time() if created is None else created
        self.columns = StepColumns()  # the records' numbers, as columns (the doctor's)
        self.records: dict[int, RankRecords] = {rank: self._mine(rank) for rank in self.jobs}
        self.checks: list = []  # the last %dt_doctor results (CheckResult), kept with the run
        self.folder = sink.folder if sink is not None else None
        self._sink = sink  # what writes the run folder (a live one's, until it is closed)
        if sink is not None:
            disk.write_header(sink.folder, self.jobs, self.meta, self.created)

    @classmethod
    def empty(cls, ranks) -> Trace:
        """A trace with no job and no steps yet (for views made before the first step)."""
        trace = cls({})
        trace.records = {rank: trace._mine(rank) for rank in ranks}
        return trace

    def _mine(self, rank: int) -> RankRecords:
        return RankRecords(rank=rank, columns=self.columns)

    # --- what it holds ------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.jobs)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self.jobs)

    @property
    def params(self) -> tuple[ParamInfo, ...]:
        return next(iter(self.jobs.values())).params if self.jobs else ()

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def last_step(self) -> int:
        """The last step every rank has recorded (0 before the first)."""
        if not self.records:
            return 0
        return min(recs.last_step for recs in self.records.values())

    def at(self, step: int) -> dict[int, StepRecord]:
        """``{rank: record}`` of one step, for the ranks that recorded it (read back from the
        run folder when the window has moved past it)."""
        if step < self.first_step:
            return {
                rank: recs[0]
                for rank, recs in self.read_steps(range(step, step + 1)).records.items()
                if len(recs)
            }
        found = {}
        for rank, recs in self.records.items():
            for rec in reversed(recs):
                if rec.step == step:
                    found[rank] = rec
                    break
                if rec.step < step:
                    break
        return found

    def __len__(self) -> int:
        return sum(len(recs) for recs in self.records.values())

    def __repr__(self) -> str:
        where = f", {self.folder}" if self.folder else ""
        return f"<dtlab Trace: {self.world_size} ranks, {self.last_step} steps{where}>"

    # --- growing it ---------------------------------------------------------------------
    def add(self, rank: int, records: Iterable[StepRecord]) -> None:
        """Append a rank's new records (older or repeated steps are ignored)."""
        mine = self._records_of(rank)
        added = [rec for rec in records if mine.append(rec)]
        if added:
            self.columns.extend(rank, added)
            if self._sink is not None:
                self._sink.add(read_frame(pack(rank, added).to_bytes()))

    def add_packed(self, rank: int, data: bytes) -> None:
        """Append the records of a rank's reply: a frame of packed rows as it came (one that
        is not one, or holds another rank's records, is a ValueError and adds nothing)."""
        self._add_frame(read_frame(data, rank))

    def add_host(self, data: bytes, ranks: Collection[int]) -> list[int]:
        """Append the records of a relayed host's replies: one frame of packed rows, rank
        after rank, joined by its relay (agent/relay.py). Only the rows of ``ranks`` (whose
        replies the channel took) are kept; returns the other ranks whose rows were left
        out. A frame that is not one is a ValueError and adds nothing."""
        frame = read_frame(data)
        others = sorted({part.rank for part in frame.parts if part.rank not in ranks})
        if not others:
            self._add_frame(frame)
            return []
        batch = join([frame])
        keep = np.isin(batch.rows["rank"], list(ranks))
        if keep.any():
            self._add_frame(read_frame(batch.take(keep).to_bytes()))
        return others

    def _add_frame(self, frame: Frame) -> None:
        """A checked frame's rows: to the columns as they came, and each rank's steps to its
        RankRecords. Older or repeated steps of a rank are dropped (rows taken out first)."""
        if not frame.rows:
            return
        parts = frame.parts
        if len(parts) == 1 and (recs := self._records_of(parts[0].rank)).fresh(parts[0]):
            recs.add_part(parts[0], frame_rows(frame)["step"].copy(), frame.extras)
            self._keep(frame)  # (a rank's frame, as nearly all are: its own path, no lists)
            return
        mine = [self._records_of(part.rank) for part in parts]
        fresh = len({part.rank for part in parts}) == len(parts) and all(
            recs.fresh(part) for recs, part in zip(mine, parts, strict=True)
        )
        if not fresh:  # (rare) the new rows of each part, frame by frame
            batch = join([frame])
            for recs, part in zip(mine, parts, strict=True):
                keep = np.zeros(len(batch), bool)
                keep[part.start : part.stop] = True
                new = recs.new_rows(batch.take(keep))
                if len(new):
                    self._add_frame(read_frame(new.to_bytes(), part.rank))
            return
        steps = frame_rows(frame)["step"].copy()  # not a view: the bytes go
        for recs, part in zip(mine, parts, strict=True):
            recs.add_part(part, steps[part.start : part.stop], frame.part_extras(part))
        self._keep(frame)

    def _keep(self, frame: Frame) -> None:
        """A frame whose rows are all new: to the columns, and to the run folder's queue."""
        self.columns.append_frame(frame)
        if self._sink is not None:
            self._sink.add(frame)

    def _records_of(self, rank: int) -> RankRecords:
        mine = self.records.get(rank)
        if mine is None:
            mine = self.records[rank] = self._mine(rank)
        return mine

    def _add_mixed(self, batch: Packed) -> None:
        """A batch of any ranks' rows (a part read back), rank by rank."""
        ranks = batch.rows["rank"]
        for rank in np.unique(ranks).tolist():
            self.add_packed(rank, batch.take(ranks == rank).to_bytes())

    def flush(self) -> None:
        """Put the records added since the last flush in the run folder: appended to the
        journal, or, once there are PART_ROWS of them, written as a Parquet part (by its
        sink). The columns take in the new rows now (the end of a run), not at the
        doctor's first read."""
        self.columns.rows()
        if self._sink is not None:
            self._sink.flush()
            self._slide()

    def sync(self) -> None:
        """Wait until the part being written (if one is) is in the run folder; a failure
        to write it is raised here (its rows stay in its sealed journal, which a later
        load reads)."""
        if self._sink is not None:
            self._sink.sync()

    def _slide(self) -> None:
        """Forget the steps before the last ``window`` once they are all in the run folder
        (after a flush), leaving their summaries in ``history``. It slides a quarter
        window at a time, so the columns are compacted every window/4 steps, not every step."""
        if not self.window or not self._all_on_disk():
            return
        last = max((recs.last_step for recs in self.records.values()), default=0)
        if last - self.first_step + 1 <= self.window + max(1, self.window // 4):
            return
        through = last - self.window
        self.history.add(self.columns.drop_through(through))
        for recs in self.records.values():
            recs.drop_through(through)
        self.first_step = through + 1

    def _all_on_disk(self) -> bool:
        """Does the run folder hold every record in memory (in a form read_steps reads)?"""
        if self.folder is None or self._format not in disk.PACKED_FORMATS:
            return False
        # loaded, or closed: nothing waits to be written
        return self._sink is None or self._sink.all_on_disk

    @property
    def whole(self) -> bool:
        """Every step recorded is in memory (the window has not moved)."""
        return len(self.history) == 0 and self.first_step == 1

    def summaries(self) -> np.ndarray:
        """One SUMMARY row per step of the whole run (:mod:`dtlab.records.summaries`): the
        steps the window left, then those in memory."""
        window = summarize(self.columns.rows())
        if len(self.history):
            window = window[window["step"] > self.history.last_step]
        return np.concatenate([self.history.rows(), window])

    def read_steps(self, steps: range) -> Trace:
        """The records of ``steps`` as a Trace of their own (no folder): from memory when
        the window holds them, else read back from the run folder."""
        steps = range(max(steps.start, 1), steps.stop)
        part = Trace(self.jobs, meta=self.meta, created=self.created)
        if (
            steps.start >= self.first_step
            or self.folder is None
            or self._format not in disk.PACKED_FORMATS
        ):
            for rank, recs in self.records.items():
                part.add(rank, recs.between(steps.start, steps.stop))
            return part
        self.flush()  # what is in memory, in the folder too
        self.sync()
        for batch in disk.batches(self.folder, steps, format=self._format, salvage=self._salvage):
            part._add_mixed(
                batch.take((batch.rows["step"] >= steps.start) & (batch.rows["step"] < steps.stop))
            )
        return part

    def close(self) -> None:
        """Write what is left as a part (no journal stays behind)."""
        if self._sink is not None:
            self._sink.close()
        self._sink = None

    # --- as data ------------------------------------------------------------------------
    def to_records(self) -> list[dict]:
        """One plain dict per (rank, step), nested records flattened (``times.forward``)."""
        rows = []
        for rank, recs in self.records.items():
            for rec in recs:
                row = {"rank": rank}
                for key, value in dataclasses.asdict(rec).items():
                    if isinstance(value, dict):
                        row.update({f"{key}.{k}": v for k, v in value.items()})
                    else:
                        row[key] = value
                rows.append(row)
        return rows

    def to_dataframe(self, steps: range | None = None):
        """The records as a pandas DataFrame, one row per (rank, step), made from the columns
        without a StepRecord per row (:mod:`dtlab.records.dataframe`); ``steps``: only
        those (e.g. ``range(100, 200)``; read back from the run folder where the window has
        moved past them). Without ``steps``: the steps in memory (``trace.first_step`` on)."""
        if steps is not None:
            return self.read_steps(steps).to_dataframe()
        extras = {
            (rank, step): found
            for rank, recs in self.records.items()
            for step, found in recs.extras().items()
        }
        return records_frame(self.columns.rows(), self.columns.indices(), extras)

    # --- files --------------------------------------------------------------------------
    def keep_checks(self, results: list) -> None:
        """Keep ``%dt_doctor`` results with the run (``doctor.json`` in its folder)."""
        self.checks = list(results)
        if self.folder is not None:
            try:
                disk.write_checks(self.folder, self.checks)
            except OSError as e:  # a full disk: the results are still here, in memory
                warnings.warn(
                    f"dtlab: run folder {self.folder}: doctor.json not written ({e}); "
                    "the results are kept in memory",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def save(self, folder: str | os.PathLike) -> Path:
        """Write the whole trace to ``folder`` (a copy; this trace keeps its own folder)."""
        copy = Trace(
            self.jobs,
            sink=_Copy(Path(folder)),
            meta=self.meta,
            created=self.created,
            window=self.window,
        )
        if not self.whole and self.folder is not None:
            self.flush()
            self.sync()
            everything = range(1, self.last_step + 1)
            for batch in disk.batches(
                self.folder, everything, format=self._format, salvage=self._salvage
            ):
                copy._add_mixed(batch)
                copy.flush()  # part by part: the copy's window bounds its memory too
        for rank, recs in self.records.items():
            copy.add(rank, recs)  # (steps it has are ignored)
        copy.keep_checks(self.checks)
        copy.close()
        return Path(folder)

    @classmethod
    def load(
        cls, folder: str | os.PathLike, *, window: int | None = None, salvage: bool = False
    ) -> Trace:
        """Read a run folder written by dtlab (the last ``window`` steps into memory, as a
        live Trace keeps them), or a job folder of ``python -m dtlab.run`` (every rank's,
        every step: :mod:`dtlab.records.job_folder`); raises ValueError naming what is
        wrong. ``salvage``: a corrupt journal (:class:`dtlab.records.run_folder.
        CorruptJournal`) is read up to the corruption, with a warning saying what is left
        out, instead of raising."""
        folder = Path(folder)
        if job_folder.is_job_folder(folder):  # python -m dtlab.run's: a run folder per rank
            job = job_folder.read_job(folder)
            trace = cls(job.jobs, meta=job.meta, created=job.created, window=window)
            trace.folder, trace._format = folder, job_folder.FORMAT  # (all kept in memory)
            for batch in job.batches(salvage=salvage):
                trace._add_mixed(batch)
            return trace
        header, jobs = disk.read_header(folder)
        trace = cls(jobs, meta=header.get("meta"), created=header.get("created"), window=window)
        trace.folder, trace._format = folder, header["format"]
        trace._salvage = salvage
        if header["format"] != "dtlab-trace/1":
            # parts, then the records since the last part (a repeat is ignored)
            for batch in disk.batches(folder, format=header["format"], salvage=salvage):
                trace._add_mixed(batch)
                trace._slide()  # a long run's parts, one by one, in bounded memory
        for rank, rec in disk.json_records(folder, header["format"]):
            trace.add(rank, [rec])
        trace.checks = disk.read_checks(folder)
        return trace


class _Copy:
    """The sink of a copy :meth:`Trace.save` writes: the same parts a live trace's writer
    would leave once closed, written at once (no journal: the copy is written whole)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files = StepFiles(folder)
        self._pending: list[Frame] = []
        self._pending_rows = 0

    @property
    def all_on_disk(self) -> bool:
        return not self._pending

    def add(self, frame: Frame) -> None:
        self._pending.append(frame)
        self._pending_rows += frame.rows

    def flush(self) -> None:
        if self._pending_rows >= disk.PART_ROWS:
            self.close()

    def sync(self) -> None:
        pass

    def close(self) -> None:
        if self._pending:
            self.files.write(join(self._pending))
        self._pending, self._pending_rows = [], 0


def _window() -> int:
    text = os.environ.get(WINDOW_ENV, "").strip()
    if not text:
        return WINDOW
    try:
        steps = int(text)
    except ValueError:
        raise ValueError(f"${WINDOW_ENV}={text!r}: give a number of steps (0: keep all)") from None
    if steps < 0:
        raise ValueError(f"${WINDOW_ENV}={text!r}: give a number of steps >= 0 (0: keep all)")
    return steps
