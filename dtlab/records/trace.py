"""The step records of one attached job, by rank, in memory and in a run folder.

A run folder (``runs/<timestamp>/`` by default, ``DTLAB_RUNS_DIR`` moves it) holds:

- ``trace.json``: ``{"format": "dtlab-trace/2", "created": <epoch s>, "world_size": N,
  "jobs": {"<rank>": JobInfo}, "meta": {...}}``
- ``steps/``: the step records (summaries: the per-parameter tuples stay on the ranks) as
  zstd Parquet parts of at least ``PART_ROWS`` records, merged as they pile up
  (:mod:`dtlab.records.step_files`), and ``steps/journal.jsonl``: the records since the
  last part, as the ranks sent them (one JSON line each), appended at the end of every
  run, so a notebook that dies loses no step a run finished; ``pd.read_parquet(folder /
  "steps")`` reads the parts;
- ``doctor.json``: the last ``%dt_doctor`` results, a list of CheckResult with Findings.

Format ``dtlab-trace/1`` folders (one JSON line per record in ``steps.jsonl``, ~1 KB per
rank-step against ~50-100 B as Parquet) still load.

Records are the dataclasses of :mod:`dtlab.records` as plain data
(:func:`dtlab.records.step_record_to_dict`);
``Trace.load(folder)`` reads a folder back, so another notebook can plot or compare it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from dtlab.records import (
    DeepSpeedInfo,
    JobInfo,
    ParamInfo,
    StepRecord,
    step_record_from_dict,
    step_record_to_dict,
)
from dtlab.records.columns import StepColumns
from dtlab.records.step_files import StepFiles

FORMAT = "dtlab-trace/2"
FORMATS = ("dtlab-trace/1", FORMAT)  # what Trace.load reads
PART_ROWS = 4096  # records kept in the journal before they become a Parquet part
JOURNAL = "journal.jsonl"
RUNS_DIR_ENV = "DTLAB_RUNS_DIR"


def job_from_json(data: Mapping) -> JobInfo:
    fields = dict(data)
    fields["params"] = tuple(
        ParamInfo(p["name"], tuple(p["shape"]), p["dtype"], p["numel"]) for p in data["params"]
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
    """Step records keyed by rank: ``trace.records[rank]`` is a list in step order."""

    def __init__(
        self,
        jobs: Mapping[int, JobInfo],
        *,
        folder: str | os.PathLike | None = None,
        meta: Mapping | None = None,
        created: float | None = None,
    ):
        self.jobs = dict(sorted(jobs.items()))
        self.meta = dict(meta or {})
        self.created = time.time() if created is None else created
        self.records: dict[int, list[StepRecord]] = {rank: [] for rank in self.jobs}
        self.columns = StepColumns()  # the same records' numbers, as columns (the doctor's)
        self.checks: list = []  # the last %dt_doctor results (CheckResult), kept with the run
        self.folder = Path(folder) if folder is not None else None
        # records not yet in a part: (rank, record, its JSON line as it came, or None)
        self._pending: list[tuple[int, StepRecord, str | None]] = []
        self._journaled = 0  # how many of them the journal holds
        self._files: StepFiles | None = None
        if self.folder is not None:
            self._write_header()

    @classmethod
    def empty(cls, ranks) -> Trace:
        """A trace with no job and no steps yet (for views made before the first step)."""
        trace = cls({})
        trace.records = {rank: [] for rank in ranks}
        return trace

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
        return min((recs[-1].step if recs else 0) for recs in self.records.values())

    def at(self, step: int) -> dict[int, StepRecord]:
        """``{rank: record}`` of one step, for the ranks that recorded it."""
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
        for rec in records:
            self._append(rank, rec)

    def add_lines(self, rank: int, lines: Iterable[str]) -> None:
        """Append records that arrive as JSON lines (the stepping channel's)."""
        for line in lines:
            line_rank, rec = step_record_from_dict(json.loads(line))
            if line_rank != rank:
                raise ValueError(f"a record of rank {line_rank} arrived from rank {rank}")
            self._append(rank, rec, line)

    def _append(self, rank: int, rec: StepRecord, line: str | None = None) -> None:
        mine = self.records.setdefault(rank, [])
        if mine and rec.step <= mine[-1].step:
            return
        mine.append(rec)
        self.columns.append(rank, rec)
        if self._files is not None:
            self._pending.append((rank, rec, line))

    def flush(self) -> None:
        """Put the records added since the last flush in the run folder: appended to the
        journal, or, once there are PART_ROWS of them, written as a Parquet part. The
        columns take in the new rows now (the end of a run), not at the doctor's first read."""
        self.columns.rows()
        if self._files is None or not self._pending:
            return
        journal = self._files.folder / JOURNAL
        if len(self._pending) >= PART_ROWS:
            self._write_part()
            return
        self._files.folder.mkdir(parents=True, exist_ok=True)
        with open(journal, "a") as out:  # the lines as they came (encoded if added here)
            for rank, rec, line in self._pending[self._journaled :]:
                out.write((line or json.dumps(step_record_to_dict(rank, rec))) + "\n")
        self._journaled = len(self._pending)

    def _write_part(self) -> None:
        assert self._files is not None
        pending, self._pending, self._journaled = self._pending, [], 0
        self._files.write([(rank, rec) for rank, rec, _ in pending])
        (self._files.folder / JOURNAL).unlink(missing_ok=True)  # its lines are in the part

    def close(self) -> None:
        """Write what is left as a part (no journal stays behind)."""
        if self._files is not None and self._pending:
            self._write_part()
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
        """The records as a pandas DataFrame, one row per (rank, step); ``steps``: only
        those (e.g. ``range(100, 200)``)."""
        import pandas as pd

        rows = self.to_records()
        if steps is not None:
            rows = [row for row in rows if row["step"] in steps]
        return pd.DataFrame.from_records(rows)

    # --- files --------------------------------------------------------------------------
    def _write_header(self) -> None:
        assert self.folder is not None  # called only for a trace with a folder
        self.folder.mkdir(parents=True, exist_ok=True)
        header = {
            "format": FORMAT,
            "created": self.created,
            "world_size": self.world_size,
            "jobs": {str(r): dataclasses.asdict(j) for r, j in self.jobs.items()},
            "meta": self.meta,
        }
        (self.folder / "trace.json").write_text(json.dumps(header, indent=1))
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
        copy = Trace(self.jobs, folder=folder, meta=self.meta, created=self.created)
        for rank, recs in self.records.items():
            copy.add(rank, recs)
        copy.keep_checks(self.checks)
        copy.close()
        return Path(folder)

    @classmethod
    def load(cls, folder: str | os.PathLike) -> Trace:
        """Read a run folder written by dtlab; raises ValueError naming what is wrong."""
        folder = Path(folder)
        header_path = folder / "trace.json"
        if not header_path.is_file():
            raise ValueError(f"{folder} is not a dtlab run folder: it has no trace.json")
        header = json.loads(header_path.read_text())
        if header.get("format") not in FORMATS:
            raise ValueError(
                f"{header_path}: format {header.get('format')!r}, this dtlab reads "
                + " and ".join(map(repr, FORMATS))
            )
        jobs = {int(r): job_from_json(j) for r, j in header["jobs"].items()}
        trace = cls(jobs, meta=header.get("meta"), created=header.get("created"))
        trace.folder = folder
        if header["format"] != "dtlab-trace/1":
            for rank, rec in StepFiles(folder).read():
                trace.add(rank, [rec])
        # format 1's records, or format 2's since its last part (a repeat is ignored)
        if header["format"] == "dtlab-trace/1":
            steps = folder / "steps.jsonl"
        else:
            steps = folder / "steps" / JOURNAL
        lines = steps.read_text().splitlines() if steps.is_file() else []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rank, rec = step_record_from_dict(json.loads(line))
            except (ValueError, KeyError, TypeError) as e:
                if number == len(lines):  # a run killed mid-write leaves half a last line
                    break
                raise ValueError(f"{steps}:{number}: not a step record ({e})") from e
            trace.add(rank, [rec])
        doctor = folder / "doctor.json"
        if doctor.is_file():
            trace.checks = [_check_from_json(c) for c in json.loads(doctor.read_text())]
        return trace


def _check_from_json(data: Mapping):
    from dtlab.records import CheckResult, Finding

    findings = tuple(Finding(**{**f, "ranks": tuple(f["ranks"])}) for f in data.get("findings", ()))
    fields = {k: v for k, v in data.items() if k != "outcome"}  # derived, written for readers
    return CheckResult(**{**fields, "findings": findings})
