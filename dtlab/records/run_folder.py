"""A Trace's run folder on disk: writing it as a run goes, reading it back.

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

:class:`FolderWriter` is what a live Trace writes through; the functions below it read a
folder back (``Trace.load`` puts them together).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from dtlab.records import (
    CheckResult,
    DeepSpeedInfo,
    Finding,
    JobInfo,
    MeshInfo,
    ParamInfo,
    StepRecord,
    step_record_from_dict,
)
from dtlab.records.packed import Frame, Packed, as_tuples, join, unpack
from dtlab.records.step_files import RELISTS, StepFiles

FORMAT = "dtlab-trace/3"
FORMATS = ("dtlab-trace/1", "dtlab-trace/2", FORMAT)  # what Trace.load reads
PART_ROWS = 65536  # records kept in the journal before they become a Parquet part
JOURNAL = "journal.bin"
# a journal whose rows a part being written holds (journal-<ns>.bin): gone once it is written
SEALED = "journal-{:020d}.bin"
SEALED_GLOB = "journal-*.bin"
JSON_JOURNAL = "journal.jsonl"  # format 2's
_LENGTH = struct.Struct("<I")
RUNS_DIR_ENV = "DTLAB_RUNS_DIR"


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


# --- writing ----------------------------------------------------------------------------
class FolderWriter:
    """The records a live Trace puts in its run folder, frame by frame as they came: the
    frames since the last part (``add``) go to the journal at every ``flush`` (the end of
    a run), and once there are ``PART_ROWS`` rows of them, to a Parquet part written on a
    thread of its own."""

    def __init__(self, folder: Path):
        self.files = StepFiles(folder)
        self._pending: list[Frame] = []  # records not yet in a part, frame by frame
        self._pending_rows = 0
        self._journaled = 0  # how many of them the journal holds
        self._part: Future | None = None  # the Parquet part being written, if one is

    def add(self, frame: Frame) -> None:
        self._pending.append(frame)
        self._pending_rows += frame.rows

    @property
    def all_on_disk(self) -> bool:
        """Does the folder hold every frame added (the journal at least)?"""
        return self._journaled == len(self._pending)

    def flush(self) -> None:
        """Append the frames added since the last flush to the journal; once there are
        PART_ROWS rows of them, start writing them as a part."""
        if not self._pending:
            return
        self._journal()
        if self._pending_rows >= PART_ROWS:
            self._write_part()

    def close(self) -> None:
        """Write what is left as a part (no journal stays behind), and wait for it."""
        if self._pending:
            self._journal()
            self._write_part()
        self.sync()

    def sync(self) -> None:
        """Wait until the part being written (if one is) is in the run folder; a failure
        to write it is raised here (its rows stay in its sealed journal, which a later
        load reads)."""
        part, self._part = self._part, None
        if part is not None:
            part.result()

    def _journal(self) -> None:
        """Append the frames not in the journal yet (as they came)."""
        self.files.folder.mkdir(parents=True, exist_ok=True)
        with open(self.files.folder / JOURNAL, "ab") as out:
            for frame in self._pending[self._journaled :]:
                out.write(_LENGTH.pack(len(frame.data)) + frame.data)
        self._journaled = len(self._pending)

    def _write_part(self) -> None:
        """The journal's rows become a Parquet part, written (and merged) on a thread of
        its own, so the run that fills a part does not wait for its compression. The
        journal is sealed first (renamed: its rows stay on disk until the part holds them),
        and one part is written at a time."""
        assert self.all_on_disk
        self.sync()
        sealed = self.files.folder / SEALED.format(time.time_ns())
        os.replace(self.files.folder / JOURNAL, sealed)
        pending, self._pending, self._journaled, self._pending_rows = self._pending, [], 0, 0
        self._part = _writer().submit(_write_sealed, self.files, pending, sealed)


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


def wait_for_parts() -> None:
    """Wait until the parts this process has started writing are in their folders."""
    if _WRITER is not None:
        _WRITER.submit(lambda: None).result()


def write_header(
    folder: Path, jobs: Mapping[int, JobInfo], meta: Mapping, created: float
) -> FolderWriter:
    """Start a run folder: its ``trace.json``; returns the writer of its steps."""
    folder.mkdir(parents=True, exist_ok=True)
    # the parameter lists once each (data-parallel replicas share one); a job names its
    # list by number: 512 ranks x 300 parameters as dataclasses.asdict took seconds
    param_lists: dict[tuple[ParamInfo, ...], int] = {}
    fields_of = {}
    for rank, info in jobs.items():
        params = param_lists.setdefault(info.params, len(param_lists))
        fields = {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
        fields["params"] = params
        if info.deepspeed is not None:
            fields["deepspeed"] = dataclasses.asdict(info.deepspeed)
        if info.mesh is not None:
            fields["mesh"] = dataclasses.asdict(info.mesh)
        fields_of[str(rank)] = fields
    header = {
        "format": FORMAT,
        "created": created,
        "world_size": len(jobs),
        "params": [
            [{"name": p.name, "shape": p.shape, "dtype": p.dtype, "numel": p.numel} for p in ps]
            for ps in param_lists
        ],
        "jobs": fields_of,
        "meta": dict(meta),
    }
    (folder / "trace.json").write_text(json.dumps(header))
    return FolderWriter(folder)


def write_checks(folder: Path, results: list) -> None:
    """``doctor.json``: ``%dt_doctor``'s results, with each one's outcome (passed, found or
    not checked) for whoever reads the file."""
    data = [{**dataclasses.asdict(r), "outcome": r.outcome} for r in results]
    (folder / "doctor.json").write_text(json.dumps(data, indent=1, default=str))


# --- reading ----------------------------------------------------------------------------
def read_header(folder: Path) -> tuple[dict, dict[int, JobInfo]]:
    """A run folder's header and its jobs by rank; a ValueError names what is wrong."""
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
    return header, jobs


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
    if data.get("mesh"):
        fields["mesh"] = MeshInfo(**{k: as_tuples(v) for k, v in data["mesh"].items()})
    fields["unobserved"] = as_tuples(data.get("unobserved", []))
    return JobInfo(**fields)


def batches(folder: Path, steps: range | None = None) -> Iterator[Packed]:
    """Every row of a run folder (format 3) that may hold ``steps``: its parts, then the
    records since the last part (a journal sealed for a part that was being written when
    the notebook stopped, then the journal), batch by batch.

    A second notebook may read a folder while the one running the job writes it: parts
    are merged, journals sealed and turned into parts. No row is left out, and one may come
    twice (``Trace`` drops repeated steps): a part merged away is read from the part it
    went into, and the journals are read before the parts are listed a second time, so a
    journal that became a part meanwhile is read from that part."""
    files = StepFiles(folder)
    read = 0  # the rows of the parts read so far
    for end, batch in files.read_after(0, steps):
        read = end
        yield batch
    held = _journals(folder)
    for _, batch in files.read_after(read, steps):
        yield batch
    yield from held


def _journals(folder: Path) -> list[Packed]:
    """The journals' batches, read at one moment: the journal first (the newest rows: it
    is sealed by a rename, and a new one starts at the next run), then the sealed ones
    (each a part once written), returned oldest first; read again if one went meanwhile."""
    steps = folder / "steps"
    for _ in range(RELISTS):
        try:
            journal = steps / JOURNAL
            newest = list(_batches_in(journal)) if journal.is_file() else []
            sealed = [b for path in sorted(steps.glob(SEALED_GLOB)) for b in _batches_in(path)]
            return sealed + newest
        except FileNotFoundError:
            continue
    raise ValueError(
        f"{steps}: its journals kept changing while they were read ({RELISTS} times); "
        "is a notebook writing it? Read it again."
    )


def _batches_in(journal: Path) -> Iterator[Packed]:
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


def json_records(folder: Path, format: str) -> Iterator[tuple[int, StepRecord]]:
    """Format 1's records (``steps.jsonl``), or format 2's journal
    (``steps/journal.jsonl``): one JSON line per record, as (rank, record)."""
    path = folder / ("steps.jsonl" if format == "dtlab-trace/1" else "steps")
    if path.is_dir():
        path = path / JSON_JOURNAL
    if not path.is_file():
        return
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
        yield rank, rec


def read_checks(folder: Path) -> list[CheckResult]:
    """The ``%dt_doctor`` results kept with the run (none if it has no doctor.json)."""
    path = folder / "doctor.json"
    if not path.is_file():
        return []
    return [_check_from_json(c) for c in json.loads(path.read_text())]


def _check_from_json(data: Mapping) -> CheckResult:
    findings = tuple(Finding(**{**f, "ranks": tuple(f["ranks"])}) for f in data.get("findings", ()))
    fields = {k: v for k, v in data.items() if k != "outcome"}  # derived, written for readers
    return CheckResult(**{**fields, "findings": findings})
