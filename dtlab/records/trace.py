"""The step records of one attached job, by rank, in memory and in a run folder.

A run folder (``runs/<timestamp>/`` by default, ``DTLAB_RUNS_DIR`` moves it) holds:

- ``trace.json``: ``{"format": "dtlab-trace/3", "created": <epoch s>, "world_size": N,
  "params": [[ParamInfo, ...], ...], "jobs": {"<rank>": JobInfo}, "meta": {...}}``, each
  job's ``params`` the number of its list in ``params`` (replicas share one);
- ``steps/``: the step records (summaries: the per-parameter tuples stay on the ranks) as
  zstd Parquet parts of at least ``PART_ROWS`` records, merged as they pile up
  (:mod:`dtlab.records.step_files`), and ``steps/journal.bin``: the records since the
  last part, as the ranks sent them (packed rows, :mod:`dtlab.records.packed`, each batch
  after its length as a little-endian uint32), appended at the end of every run, so a
  notebook that dies loses no step a run finished; a part is written on a thread of its
  own from the journal sealed as ``steps/journal-<ns>.bin``, removed once the part holds
  its rows; ``pd.read_parquet(folder / "steps")`` reads the parts;
- ``doctor.json``: the last ``%dt_doctor`` results, a list of CheckResult with Findings.

Older folders still load: ``dtlab-trace/2`` (the same parts, a journal of JSON lines in
``steps/journal.jsonl``) and ``dtlab-trace/1`` (one JSON line per record in
``steps.jsonl``, ~1 KB per rank-step against ~50-100 B as Parquet).
``Trace.load(folder)`` reads a folder back, so another notebook can plot or compare it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dtlab.records import (
    DeepSpeedInfo,
    JobInfo,
    ParamInfo,
    StepRecord,
    step_record_from_dict,
)
from dtlab.records.columns import StepColumns
from dtlab.records.dataframe import records_frame
from dtlab.records.packed import Frame, Packed, frame_rows, join, pack, read_frame, unpack
from dtlab.records.rank_records import RankRecords
from dtlab.records.step_files import StepFiles
from dtlab.records.summaries import Summaries, summarize

FORMAT = "dtlab-trace/3"
FORMATS = ("dtlab-trace/1", "dtlab-trace/2", FORMAT)  # what Trace.load reads
PART_ROWS = 4096  # records kept in the journal before they become a Parquet part
WINDOW = 2000  # steps of every rank a Trace with a run folder keeps in memory
WINDOW_ENV = "DTLAB_WINDOW"  # sets WINDOW (steps; 0: keep every step in memory)
JOURNAL = "journal.bin"
# a journal whose rows a part being written holds (journal-<ns>.bin): gone once it is written
SEALED = "journal-{:020d}.bin"
SEALED_GLOB = "journal-*.bin"
JSON_JOURNAL = "journal.jsonl"  # format 2's
_LENGTH = struct.Struct("<I")
RUNS_DIR_ENV = "DTLAB_RUNS_DIR"


def job_from_json(data: Mapping, param_lists: list | None = None) -> JobInfo:
    """A job from trace.json; its ``params``: a list, or (format 3) a number in
    ``param_lists``, the header's parameter lists."""
    fields = dict(data)
    params = data["params"]
    if isinstance(params, int):
        if not param_lists or not 0 <= params < len(param_lists):
            raise ValueError(f"a job names parameter list {params}; the trace has none such")
        params = param_lists[params]
    fields["params"] = tuple(
        ParamInfo(p["name"], tuple(p["shape"]), p["dtype"], p["numel"]) for p in params
    )
    fields["buffers"] = tuple(data.get("buffers", ()))
    if data.get("deepspeed"):
        fields["deepspeed"] = DeepSpeedInfo(**data["deepspeed"])
    return JobInfo(**fields)


def new_run_folder(root: str | os.PathLike | None = None) -> Path:
    """``<root>/<YYYYmmdd-HHMMSS>[-k]/``, created; root defaults to $DTLAB_RUNS_DIR or runs."""
    base = Path(root or os.environ.get(RUNS_DIR_ENV) or "runs")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for k in range(1000):
        folder = base / (stamp if k == 0 else f"{stamp}-{k}")
        try:
            folder.mkdir(parents=True)
            return folder
        except FileExistsError:
            continue
    raise FileExistsError(f"no free run folder name under {base}")


class Trace:
    """Step records keyed by rank: ``trace.records[rank]`` is a sequence in step order
    (:class:`RankRecords`: each StepRecord is made when first read)."""

    def __init__(
        self,
        jobs: Mapping[int, JobInfo],
        *,
        folder: str | os.PathLike | None = None,
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
        self.meta = dict(meta or {})
        self.created = time.time() if created is None else created
        self.columns = StepColumns()  # the records' numbers, as columns (the doctor's)
        self.records: dict[int, RankRecords] = {rank: self._mine(rank) for rank in self.jobs}
        self.checks: list = []  # the last %dt_doctor results (CheckResult), kept with the run
        self.folder = Path(folder) if folder is not None else None
        self._pending: list[Frame] = []  # records not yet in a part, frame by frame
        self._pending_rows = 0
        self._journaled = 0  # how many of them the journal holds
        self._files: StepFiles | None = None
        self._part: Future | None = None  # the Parquet part being written, if one is
        if self.folder is not None:
            self._write_header()

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
            if self._files is not None:
                frame = read_frame(pack(rank, added).to_bytes())
                self._pending.append(frame)
                self._pending_rows += frame.rows

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
        if self._files is not None:
            self._pending.append(frame)
            self._pending_rows += frame.rows

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
        journal, or, once there are PART_ROWS of them, written as a Parquet part. The
        columns take in the new rows now (the end of a run), not at the doctor's first read."""
        self.columns.rows()
        if self._files is None or not self._pending:
            return
        self._journal()
        if self._pending_rows >= PART_ROWS:
            self._write_part()
        self._slide()

    def _journal(self) -> None:
        """Append the frames not in the journal yet (as they came)."""
        assert self._files is not None
        self._files.folder.mkdir(parents=True, exist_ok=True)
        with open(self._files.folder / JOURNAL, "ab") as out:
            for frame in self._pending[self._journaled :]:
                out.write(_LENGTH.pack(len(frame.data)) + frame.data)
        self._journaled = len(self._pending)

    def _write_part(self) -> None:
        """The journal's rows become a Parquet part, written (and merged) on a thread of
        its own, so the run that fills a part does not wait for its compression. The
        journal is sealed first (renamed: its rows stay on disk until the part holds them),
        and one part is written at a time."""
        assert self._files is not None and self._journaled == len(self._pending)
        self.sync()
        sealed = self._files.folder / SEALED.format(time.time_ns())
        os.replace(self._files.folder / JOURNAL, sealed)
        pending, self._pending, self._journaled, self._pending_rows = self._pending, [], 0, 0
        self._part = _writer().submit(_write_sealed, self._files, pending, sealed)

    def sync(self) -> None:
        """Wait until the part being written (if one is) is in the run folder; a failure
        to write it is raised here (its rows stay in its sealed journal, which a later
        load reads)."""
        part, self._part = self._part, None
        if part is not None:
            part.result()

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
        if self.folder is None or self._format != FORMAT:
            return False
        if self._files is None:  # loaded, or closed: nothing waits to be written
            return not self._pending
        return self._journaled == len(self._pending)

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
        if steps.start >= self.first_step or self.folder is None or self._format != FORMAT:
            for rank, recs in self.records.items():
                part.add(rank, recs.between(steps.start, steps.stop))
            return part
        self.flush()  # what is in memory, in the folder too
        self.sync()
        for batch in _batches(self.folder, steps):
            part._add_mixed(
                batch.take((batch.rows["step"] >= steps.start) & (batch.rows["step"] < steps.stop))
            )
        return part

    def close(self) -> None:
        """Write what is left as a part (no journal stays behind)."""
        if self._files is not None and self._pending:
            self._journal()
            self._write_part()
        self.sync()
        self._files = None

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
    def _write_header(self) -> None:
        assert self.folder is not None  # called only for a trace with a folder
        self.folder.mkdir(parents=True, exist_ok=True)
        # the parameter lists once each (data-parallel replicas share one); a job names its
        # list by number: 512 ranks x 300 parameters as dataclasses.asdict took seconds
        param_lists: dict[tuple[ParamInfo, ...], int] = {}
        jobs = {}
        for rank, info in self.jobs.items():
            params = param_lists.setdefault(info.params, len(param_lists))
            fields = {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
            fields["params"] = params
            if info.deepspeed is not None:
                fields["deepspeed"] = dataclasses.asdict(info.deepspeed)
            jobs[str(rank)] = fields
        header = {
            "format": FORMAT,
            "created": self.created,
            "world_size": self.world_size,
            "params": [
                [{"name": p.name, "shape": p.shape, "dtype": p.dtype, "numel": p.numel} for p in ps]
                for ps in param_lists
            ],
            "jobs": jobs,
            "meta": self.meta,
        }
        (self.folder / "trace.json").write_text(json.dumps(header))
        self._files = StepFiles(self.folder)

    def keep_checks(self, results: list) -> None:
        """Keep ``%dt_doctor`` results with the run (``doctor.json`` in its folder)."""
        self.checks = list(results)
        if self.folder is not None:
            # the outcome too: passed, found or not checked, for whoever reads the file
            data = [{**dataclasses.asdict(r), "outcome": r.outcome} for r in self.checks]
            (self.folder / "doctor.json").write_text(json.dumps(data, indent=1, default=str))

    def save(self, folder: str | os.PathLike) -> Path:
        """Write the whole trace to ``folder`` (a copy; this trace keeps its own folder)."""
        copy = Trace(
            self.jobs, folder=folder, meta=self.meta, created=self.created, window=self.window
        )
        if not self.whole and self.folder is not None:
            self.flush()
            self.sync()
            for batch in _batches(self.folder, range(1, self.last_step + 1)):
                copy._add_mixed(batch)
                copy.flush()  # part by part: the copy's window bounds its memory too
        for rank, recs in self.records.items():
            copy.add(rank, recs)  # (steps it has are ignored)
        copy.keep_checks(self.checks)
        copy.close()
        return Path(folder)

    @classmethod
    def load(cls, folder: str | os.PathLike, *, window: int | None = None) -> Trace:
        """Read a run folder written by dtlab (the last ``window`` steps into memory, as a
        live Trace keeps them); raises ValueError naming what is wrong."""
        folder = Path(folder)
        if _WRITER is not None:  # parts this process is writing: in the folder first
            _WRITER.submit(lambda: None).result()
        header_path = folder / "trace.json"
        if not header_path.is_file():
            raise ValueError(f"{folder} is not a dtlab run folder: it has no trace.json")
        header = json.loads(header_path.read_text())
        if header.get("format") not in FORMATS:
            raise ValueError(
                f"{header_path}: format {header.get('format')!r}, this dtlab reads "
                + " and ".join(map(repr, FORMATS))
            )
        lists = header.get("params") or []
        jobs = {int(r): job_from_json(j, lists) for r, j in header["jobs"].items()}
        trace = cls(jobs, meta=header.get("meta"), created=header.get("created"), window=window)
        trace.folder, trace._format = folder, header["format"]
        if header["format"] != "dtlab-trace/1":
            for part in StepFiles(folder).read():
                trace._add_mixed(part)
                trace._slide()  # a long run's parts, one by one, in bounded memory
        # the records since the last part (a repeat is ignored): a journal sealed for a part
        # that was being written when the notebook stopped, then the journal
        for journal in _journals(folder):
            _read_journal(trace, journal)
        json_lines = folder / ("steps.jsonl" if header["format"] == "dtlab-trace/1" else "steps")
        if json_lines.is_dir():
            json_lines = json_lines / JSON_JOURNAL
        if json_lines.is_file():
            _read_json_lines(trace, json_lines)
        doctor = folder / "doctor.json"
        if doctor.is_file():
            trace.checks = [_check_from_json(c) for c in json.loads(doctor.read_text())]
        return trace


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


def _batches(folder: Path, steps: range) -> Iterator[Packed]:
    """The rows of a run folder (format 3) that may hold ``steps``, part by part, then the
    journal's batches."""
    yield from StepFiles(folder).read(steps)
    for journal in _journals(folder):
        yield from _journal_batches(journal)


def _journals(folder: Path) -> list[Path]:
    """The run folder's journals, oldest first: sealed ones (a part was being written
    when its notebook stopped), then the journal."""
    steps = folder / "steps"
    journal = steps / JOURNAL
    return sorted(steps.glob(SEALED_GLOB)) + ([journal] if journal.is_file() else [])


_WRITER: ThreadPoolExecutor | None = None


def _writer() -> ThreadPoolExecutor:
    """The thread that writes Parquet parts (one for every trace: parts are written one at
    a time; Python waits for it at exit, so a part handed to it is finished)."""
    global _WRITER
    if _WRITER is None:
        _WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtlab-parts")
    return _WRITER


def _write_sealed(files: StepFiles, frames: list[Frame], sealed: Path) -> None:
    files.write(join(frames))
    sealed.unlink(missing_ok=True)  # its rows are in the part


def _journal_batches(journal: Path) -> Iterator[Packed]:
    data = journal.read_bytes()
    at = 0
    while at < len(data):
        if at + _LENGTH.size > len(data):
            break  # a run killed mid-write leaves half a last entry
        (size,) = _LENGTH.unpack_from(data, at)
        if at + _LENGTH.size + size > len(data):
            break
        try:
            batch = unpack(data[at + _LENGTH.size : at + _LENGTH.size + size])
        except ValueError as e:
            raise ValueError(f"{journal}: byte {at}: not a batch of step records ({e})") from e
        yield batch
        at += _LENGTH.size + size


def _read_journal(trace: Trace, journal: Path) -> None:
    for batch in _journal_batches(journal):
        trace._add_mixed(batch)


def _read_json_lines(trace: Trace, path: Path) -> None:
    """Format 1's records, or format 2's journal: one JSON line per record."""
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rank, rec = step_record_from_dict(json.loads(line))
        except (ValueError, KeyError, TypeError) as e:
            if number == len(lines):  # a run killed mid-write leaves half a last line
                break
            raise ValueError(f"{path}:{number}: not a step record ({e})") from e
        trace.add(rank, [rec])


def _check_from_json(data: Mapping):
    from dtlab.records import CheckResult, Finding

    findings = tuple(Finding(**{**f, "ranks": tuple(f["ranks"])}) for f in data.get("findings", ()))
    fields = {k: v for k, v in data.items() if k != "outcome"}  # derived, written for readers
    return CheckResult(**{**fields, "findings": findings})
