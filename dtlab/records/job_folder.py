"""A job folder: what ``torchrun ... -m dtlab.run train.py`` leaves, and reading it back.

Each rank of a job started through :mod:`dtlab.run` writes its own records, with no
notebook and no talk between ranks (:mod:`dtlab.agent.rank_folder`), so the folder is one
run folder per rank under one job folder::

    <job>/job.json          {"format": "dtlab-job/1", "created", "world_size", "script",
                             "argv", "record", "hang_timeout_s", ...}: rank 0's, at its start
    <job>/rank-<r>/         a run folder (:mod:`dtlab.records.run_folder`, format 4) of rank
                            r alone: ``trace.json`` (its JobInfo; its RankInfo, initial
                            fingerprints and host cores under ``meta``), ``steps/`` (the
                            journal, appended every second or so, and Parquet parts)
    <job>/rank-<r>/outcome.json   how the rank's script ended (:class:`RankOutcome`): at its
                            end, or at a SIGTERM; none while it runs or after a kill -9
    <job>/rank-<r>/details.jsonl   the whole records (per-parameter norms and fingerprints)
                            of its first steps, one JSON line each, recording on: where
                            ranks first differ there, the doctor names the parameter
    <job>/rank-<r>/hang.json, stacks.txt   no step for ``--hang-timeout`` seconds: when, after
                            which step, the script's stack and each process group's last
                            collectives (torch's Flight Recorder) then (:class:`RankHang`),
                            every thread's Python stack; ``resumed`` once it stepped again
    <job>/rank-<r>/fatal.txt  every thread's stack at a fatal signal (an abort, a segfault),
                            written by faulthandler; empty while none came

``read_job(folder)`` reads it (``Trace.load`` does, for a folder ``is_job_folder`` says is
one): every rank's job and rows, and what the doctor needs beside them (``evidence``).
Nothing here starts a thread or imports torch; a rank that has not made its first step
yet has no ``trace.json`` and is left out of the jobs.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from dtlab.records import (
    Evidence,
    InitialState,
    JobInfo,
    RankInfo,
    RankReport,
    StepRecord,
    step_record_from_dict,
)
from dtlab.records import run_folder as disk
from dtlab.records.packed import Packed, as_tuples

FORMAT = "dtlab-job/1"
JOB_FILE = "job.json"
OUTCOME_FILE = "outcome.json"
HANG_FILE = "hang.json"
STACKS_FILE = "stacks.txt"
FATAL_FILE = "fatal.txt"  # faulthandler's, on a fatal signal (empty: none)
DETAILS_FILE = "details.jsonl"  # whole records (per-parameter) of a rank's first steps
MAX_DETAILS = 64  # lines of it read
RANK_PREFIX = "rank-"
_RANK_FOLDER = re.compile(r"^rank-(\d+)$")
MAX_JSON_BYTES = 16 << 20  # a job's or a rank's small files: never read past this
MAX_STACKS_BYTES = 1 << 20


def rank_folder(job: str | os.PathLike, rank: int) -> Path:
    return Path(job) / f"{RANK_PREFIX}{rank}"


def is_job_folder(folder: str | os.PathLike) -> bool:
    """A folder ``dtlab.run`` writes: its ``job.json``, or (rank 0's not there: another
    host's share of the job) ``rank-<r>/`` folders and no ``trace.json`` of its own."""
    folder = Path(folder)
    if (folder / JOB_FILE).is_file():
        return True
    if not folder.is_dir() or (folder / "trace.json").exists():
        return False
    return any(_RANK_FOLDER.match(p.name) and p.is_dir() for p in folder.iterdir())


def write_json(path: Path, data: Mapping) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed), so that a reader of
    a running job never sees half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    """A small JSON file of the folder; a ValueError names it and what is wrong."""
    if path.is_symlink() or not path.is_file():
        raise ValueError(f"{path}: not a regular file")
    with open(path, "rb") as f:
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise ValueError(f"{path}: larger than {MAX_JSON_BYTES} bytes; not dtlab's")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None


def _signal_name(number: int | None) -> str:
    try:
        return f"{signal.Signals(number or 0).name} ({number})"
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True)
class RankOutcome:
    """How a rank's script ended. ``kind``: "finished" (it returned), "exited"
    (``sys.exit(code)``), "failed" (it raised: ``ename``, ``evalue``, ``traceback``) or
    "killed" (a signal dtlab saw: ``code`` is its number)."""

    rank: int
    kind: str
    step: int  # the last step it made
    code: int | None = None
    ename: str = ""
    evalue: str = ""
    traceback: str = ""
    time: float = 0.0

    def describe(self) -> str:
        at = f"at step {self.step}" if self.step else "before its first step"
        if self.kind == "failed":
            return f"rank {self.rank} failed {at}: {self.ename}: {self.evalue}"
        if self.kind == "killed":
            return f"rank {self.rank} was stopped by {_signal_name(self.code)} {at}"
        if self.kind == "exited":
            return f"rank {self.rank} exited with code {self.code} {at}"
        return f"rank {self.rank} finished {at}"

    @property
    def bad(self) -> bool:
        """Failed, killed, or exited with a non-zero code."""
        return self.kind in ("failed", "killed") or (self.kind == "exited" and bool(self.code))


@dataclass(frozen=True)
class RankHang:
    """A rank that made no step for ``timeout_s`` seconds after ``step`` (from ``since``,
    epoch seconds), its threads' stacks then; ``resumed``: the step it made next, if any
    (then it was slow, not hung)."""

    rank: int
    step: int
    since: float
    timeout_s: float
    stacks: str = ""
    resumed: int | None = None
    report: RankReport | None = None  # the script's stack and last collectives, structured

    def describe(self) -> str:
        said = f"rank {self.rank} made no step for {self.timeout_s:g} s after step {self.step}"
        if self.resumed is not None:
            return f"{said}, then went on (step {self.resumed}): slow, not hung"
        return said


@dataclass
class JobFolder:
    """A job folder as read (``read_job``)."""

    folder: Path
    meta: dict
    created: float
    jobs: dict[int, JobInfo]  # ranks that made their first step
    rank_folders: dict[int, Path]  # every rank folder found
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    initial: dict[int, InitialState] = field(default_factory=dict)
    cores_by_host: dict[str, int] = field(default_factory=dict)
    outcomes: dict[int, RankOutcome] = field(default_factory=dict)
    hangs: dict[int, RankHang] = field(default_factory=dict)
    fatal: dict[int, str] = field(default_factory=dict)  # fatal.txt of ranks that have one
    details: dict[int, list[StepRecord]] = field(default_factory=dict)  # first steps, whole
    formats: dict[int, str] = field(default_factory=dict)  # each rank folder's trace.json's

    @property
    def world_size(self) -> int | None:
        size = self.meta.get("world_size")
        return size if isinstance(size, int) else None

    @property
    def missing(self) -> list[int]:
        """Ranks of the job (``world_size``) whose folder holds no record yet."""
        size = self.world_size or 0
        return [r for r in range(size) if r not in self.jobs]

    def batches(self, *, salvage: bool = False) -> Iterator[Packed]:
        """Every rank's rows, rank by rank (each its own run folder's parts and journal;
        ``salvage``: a corrupt journal read up to the corruption, warned of)."""
        for rank in sorted(self.jobs):
            format = self.formats.get(rank, disk.FORMAT)
            yield from disk.batches(self.rank_folders[rank], format=format, salvage=salvage)

    def evidence(self, trace) -> Evidence:
        """What the doctor's checks read (as ``Training.evidence`` gathers it from live
        ranks): the loaded ``trace`` (``Trace.load(folder)``), each rank's environment and
        first fingerprints as it wrote them. No per-parameter details: a divergence is
        named by step and ranks from the step summaries, and by parameter too where it is
        among the first steps (``details.jsonl``)."""
        return Evidence(
            records=trace.records,
            columns=trace.columns,
            history=trace.history.rows(),
            names=trace.param_names,
            jobs=dict(trace.jobs),
            ranks=dict(self.ranks),
            cores_by_host=dict(self.cores_by_host),
            details={rank: list(self.details.get(rank, ())) for rank in trace.ranks},
            initial=dict(self.initial),
        )


def read_job(folder: str | os.PathLike) -> JobFolder:
    """Read a job folder; a ValueError names the file and what is wrong with it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder")
    meta: dict = {}
    if (folder / JOB_FILE).exists():
        meta = read_json(folder / JOB_FILE)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"{folder / JOB_FILE}: not a dtlab job ({FORMAT!r} expected)")
    job = JobFolder(
        folder=folder,
        meta=meta,
        created=float(meta.get("created") or 0.0),
        jobs={},
        rank_folders={},
    )
    for path in sorted(folder.iterdir()):
        m = _RANK_FOLDER.match(path.name)
        if m is None or not path.is_dir() or path.is_symlink():
            continue
        rank = int(m[1])
        job.rank_folders[rank] = path
        _read_rank(job, rank, path)
    if not job.rank_folders and not meta:
        raise ValueError(f"{folder}: not a dtlab job folder (no {JOB_FILE}, no rank-<r>/)")
    return job


def _read_rank(job: JobFolder, rank: int, path: Path) -> None:
    if (path / "trace.json").exists():
        try:
            header, jobs = disk.read_header(path)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path / 'trace.json'}: not a run folder's header ({e!r})") from None
        if set(jobs) != {rank}:
            raise ValueError(f"{path / 'trace.json'}: holds ranks {sorted(jobs)}, not {rank}")
        job.jobs[rank] = jobs[rank]
        job.formats[rank] = header["format"]
        created = header.get("created")
        if isinstance(created, (int, float)) and not job.meta.get("created"):
            job.created = min(job.created or float(created), float(created))
        meta = header.get("meta") or {}
        try:
            if meta.get("rank_info"):
                job.ranks[rank] = RankInfo(**meta["rank_info"])
            if meta.get("initial"):
                job.initial[rank] = InitialState(**as_tuples(meta["initial"]))
        except TypeError as e:
            raise ValueError(f"{path / 'trace.json'}: meta is not a rank's ({e})") from None
        info = job.ranks.get(rank)
        cores = meta.get("num_cpus")
        if info is not None and isinstance(cores, int):
            job.cores_by_host[info.host] = max(job.cores_by_host.get(info.host, 0), cores)
    if (path / OUTCOME_FILE).exists():
        job.outcomes[rank] = _record(RankOutcome, read_json(path / OUTCOME_FILE), path, rank)
    if (path / DETAILS_FILE).exists():
        job.details[rank] = _details(path / DETAILS_FILE, rank)
    if (path / HANG_FILE).exists():
        data = read_json(path / HANG_FILE)
        hang = _record(RankHang, data, path, rank)
        job.hangs[rank] = replace(
            hang, stacks=_text(path / STACKS_FILE), report=_rank_report(data, path, rank)
        )
    if fatal := _text(path / FATAL_FILE):
        job.fatal[rank] = fatal


def _text(path: Path) -> str:
    """A text file of the folder, its first MAX_STACKS_BYTES ("" when it is not there, or
    not a regular file)."""
    if not path.is_file() or path.is_symlink():
        return ""
    with open(path, "rb") as f:
        return f.read(MAX_STACKS_BYTES).decode("utf-8", "replace")


def _rank_report(data: dict, path: Path, rank: int) -> RankReport | None:
    """hang.json's stack and collectives, as the verdict reads them (None: not there)."""
    if "stack" not in data:
        return None
    try:
        return RankReport.from_dict(rank, data)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path / HANG_FILE}: its stack or collectives are not a rank's ({e!r})"
        ) from None


def _details(path: Path, rank: int) -> list[StepRecord]:
    """The whole records of details.jsonl (a torn last line, left by a kill, skipped)."""
    if path.is_symlink() or not path.is_file():
        raise ValueError(f"{path}: not a regular file")
    with open(path, "rb") as f:
        lines = f.read(MAX_JSON_BYTES).decode("utf-8", "replace").split("\n")
    found = []
    for number, line in enumerate(lines[:MAX_DETAILS], 1):
        if not line.strip():
            continue
        try:
            said, rec = step_record_from_dict(json.loads(line))
        except (ValueError, KeyError, TypeError) as e:
            if number >= len(lines) - 1:  # the last line, cut short
                break
            raise ValueError(f"{path}:{number}: not a step record ({e})") from None
        if said != rank:
            raise ValueError(f"{path}:{number}: a record of rank {said}, not {rank}")
        found.append(rec)
    return found


def _record(kind, data, path: Path, rank: int):
    """A RankOutcome or RankHang from its file's JSON (unknown keys ignored)."""
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {kind.__name__} is not a JSON object")
    names = {f.name for f in fields(kind)}
    try:
        return kind(**{k: v for k, v in data.items() if k in names and k != "rank"}, rank=rank)
    except TypeError as e:
        raise ValueError(f"{path}: not a {kind.__name__} ({e})") from None
