"""A Trace's run folder on disk: its format, and reading it back.

A run folder (``runs/<timestamp>/`` by default, ``DTLAB_RUNS_DIR`` moves it) holds:

- ``trace.json``: ``{"format": "dtlab-trace/4", "created": <epoch s>, "world_size": N,
  "params": [[ParamInfo, ...], ...], "jobs": {"<rank>": JobInfo}, "meta": {...}}``, each
  job's ``params`` the number of its list in ``params`` (replicas share one);
- ``steps/``: the step records (summaries: the per-parameter tuples stay on the ranks) as
  zstd Parquet parts of at least ``PART_ROWS`` records, merged as they pile up
  (:mod:`dtlab.records.step_files`), and ``steps/journal.bin``: the records since the
  last part, as the ranks sent them (packed rows, :mod:`dtlab.records.packed`), appended
  at the end of every run, so a notebook that dies loses no step a run finished; the
  journal whose rows become a part is sealed first as ``steps/journal-<ns>.bin``, removed
  once the part holds its rows; ``pd.read_parquet(folder / "steps")`` reads the parts;
- ``doctor.json``: the last ``%dt_doctor`` results, a list of CheckResult with Findings.

A journal entry (:func:`journal_entry`, the one encoder; :func:`journal_entries`, the one
reader) is a 12-byte header, three little-endian uint32: the batch's length, the CRC-32
(``zlib.crc32``) of the batch, the CRC-32 of those 8 bytes; then the batch. So the
reader tells the two ways a journal goes wrong apart:

- a *torn tail*: the last entry is cut short (its header, or its batch running past the
  end of the file), or the file ends in zeros from an entry on (written, never on disk):
  what a run killed mid-append leaves. The entries before it are read, with a warning
  naming the file and the byte;
- *corruption*: a header whose checksum fails (a garbage length, at the head or in the
  middle), or a batch whose checksum fails or that is not a batch of records: a
  :class:`CorruptJournal` (a ValueError) names the file, the byte, what is wrong and how
  many entries before it are intact. ``Trace.load(folder, salvage=True)`` (``dtlab doctor
  --salvage``) reads those, and the other journals and parts, and warns of what it left
  out: no record is ever dropped without a word.

Older folders still load: ``dtlab-trace/3`` (the same, but an entry's header is only its
length: a garbage length there cannot be told from a torn tail, and is warned about as
one), ``dtlab-trace/2`` (the same parts, a journal of JSON lines in
``steps/journal.jsonl``) and ``dtlab-trace/1`` (one JSON line per record in
``steps.jsonl``, ~1 KB per rank-step against ~50-100 B as Parquet).

A live Trace writes its steps through a :class:`FolderSink`: in the notebook,
:class:`dtlab.control.run_folder_writer.FolderWriter` (the journal, and parts written while
the next run goes on). The functions here write the header and ``doctor.json`` and read a
folder back (``Trace.load`` puts them together); reading needs no writer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import time
import warnings
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Protocol

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
from dtlab.records.checkpoints import CheckpointError, open_confined
from dtlab.records.packed import Frame, Packed, as_tuples, unpack
from dtlab.records.step_files import RELISTS, StepFiles

FORMAT = "dtlab-trace/4"
FORMAT_3 = "dtlab-trace/3"  # journal entries without checksums: read, never written
FORMATS = ("dtlab-trace/1", "dtlab-trace/2", FORMAT_3, FORMAT)  # what Trace.load reads
PACKED_FORMATS = (FORMAT_3, FORMAT)  # a journal of packed rows (older ones: JSON lines)
PART_ROWS = 65536  # records kept in the journal before they become a Parquet part
JOURNAL = "journal.bin"
# a journal whose rows a part being written holds (journal-<ns>.bin): gone once it is written
SEALED = "journal-{:020d}.bin"
SEALED_GLOB = "journal-*.bin"
JSON_JOURNAL = "journal.jsonl"  # format 2's
_LENGTH = struct.Struct("<I")  # format 3's entry header: the batch's length
# format 4's: the batch's length and CRC-32, then the CRC-32 of those 8 bytes
_HEAD = struct.Struct("<II")
_HEAD_CRC = struct.Struct("<I")
ENTRY_HEADER = _HEAD.size + _HEAD_CRC.size  # bytes an entry holds besides its batch
RUNS_DIR_ENV = "DTLAB_RUNS_DIR"
# the most bytes a file of a run folder may hold to be read (larger: refused, never read)
MAX_HEADER_BYTES = 256 << 20  # trace.json, doctor.json
MAX_RANKS = 65536  # a trace.json listing more jobs than this is refused
MAX_JOURNAL_BYTES = 4 << 30  # a journal: PART_ROWS rows and one run's, far below this


def read_confined(folder: Path, name: str, most: int) -> bytes:
    """The bytes of ``folder/name``, opened as checkpoint files are
    (:func:`dtlab.records.checkpoints.open_confined`: no link followed, a FIFO or device
    refused, never waited on, at most ``most`` bytes); a refusal is a ValueError naming the
    file and what it is. FileNotFoundError when it is not there."""
    try:
        with open_confined(folder, name, most=most) as f:
            return f.read()
    except CheckpointError as e:
        raise ValueError(
            str(e).replace("not a checkpoint dtlab wrote", "not a run folder's")
        ) from None


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
class FolderSink(Protocol):
    """What a live Trace needs of whatever writes its run folder's steps (the notebook's
    :class:`dtlab.control.run_folder_writer.FolderWriter`). The Trace writes the header
    (:func:`write_header`) and hands it every new frame once (``add``)."""

    @property
    def folder(self) -> Path:
        """The run folder."""
        ...

    @property
    def all_on_disk(self) -> bool:
        """Does the folder hold every frame added (so that it reads them back)?"""
        ...

    def add(self, frame: Frame) -> None:
        """A frame of new rows, as it came; on disk at the next ``flush`` at the latest."""
        ...

    def flush(self) -> None:
        """Put the frames added since the last flush in the folder (the end of a run)."""
        ...

    def sync(self) -> None:
        """Wait until what ``flush`` started is in the folder; raise its failure if any."""
        ...

    def close(self) -> None:
        """Write what is left as a part (no journal stays behind), and wait for it."""
        ...


def journal_entry(data: bytes) -> bytes:
    """One batch of packed rows as ``steps/journal.bin`` holds it: its header (length,
    CRC-32 of the batch, CRC-32 of those), then it. Every writer's one encoder."""
    head = _HEAD.pack(len(data), zlib.crc32(data))
    return head + _HEAD_CRC.pack(zlib.crc32(head)) + data


def write_header(folder: Path, jobs: Mapping[int, JobInfo], meta: Mapping, created: float) -> None:
    """Start a run folder: its ``trace.json``."""
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
    write_atomic(folder / "trace.json", json.dumps(header).encode())


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` whole or is as it was: written under a temporary name in the
    same folder, then renamed over it (a failed write removes the temporary file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_checks(folder: Path, results: list) -> None:
    """``doctor.json``: ``%dt_doctor``'s results, with each one's outcome (passed, found or
    not checked) for whoever reads the file."""
    data = [{**dataclasses.asdict(r), "outcome": r.outcome} for r in results]
    write_atomic(folder / "doctor.json", json.dumps(data, indent=1, default=str).encode())


# --- reading ----------------------------------------------------------------------------
def read_header(folder: Path) -> tuple[dict, dict[int, JobInfo]]:
    """A run folder's header and its jobs by rank; a ValueError names what is wrong."""
    header_path = folder / "trace.json"
    try:
        data = read_confined(folder, "trace.json", MAX_HEADER_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        raise ValueError(f"{folder} is not a dtlab run folder: it has no trace.json") from None
    try:
        header = json.loads(data.decode())
    except (UnicodeDecodeError, RecursionError, ValueError) as e:
        raise ValueError(f"{header_path}: not a dtlab trace header ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{header_path}: a {type(header).__name__}, not a trace header")
    if header.get("format") not in FORMATS:
        raise ValueError(
            f"{header_path}: format {header.get('format')!r}, this dtlab reads "
            + " and ".join(map(repr, FORMATS))
        )
    lists = header.get("params") or []
    found = header.get("jobs")
    if not isinstance(found, dict):
        raise ValueError(f"{header_path}: field 'jobs' is missing or not a mapping of rank to job")
    if not isinstance(lists, list):
        raise ValueError(f"{header_path}: field 'params' is not a list of parameter lists")
    if len(found) > MAX_RANKS:
        raise ValueError(
            f"{header_path}: field 'jobs' lists {len(found)} ranks, more than the {MAX_RANKS} "
            "a dtlab run holds: refused"
        )
    jobs = {}
    for r, j in found.items():
        try:
            if not isinstance(j, dict):
                raise TypeError(f"a {type(j).__name__}, not a job")
            jobs[int(r)] = job_from_json(j, lists)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            raise ValueError(
                f"{header_path}: field 'jobs.{str(r)[:40]}': not a job "
                f"({type(e).__name__}: {str(e)[:200]})"
            ) from None
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


class CorruptJournal(ValueError):
    """A journal entry that is not what a writer wrote, and not a torn tail: ``journal``,
    the byte ``at`` which the entry starts, ``what`` is wrong, and how many entries before
    it are ``intact`` (``Trace.load(folder, salvage=True)`` reads them)."""

    def __init__(self, journal: Path, at: int, what: str, intact: int):
        self.journal, self.at, self.what, self.intact = journal, at, what, intact
        super().__init__(
            f"{journal}: byte {at}: {what}. The journal is corrupt there (this is not a "
            f"torn last entry, which a kill leaves); {_entries(intact)} before byte {at} "
            f"{'are' if intact > 1 else 'is'} intact: Trace.load(folder, salvage=True) "
            "(dtlab doctor|report --salvage) reads them and the rest of the run folder, "
            "and says what it leaves out"
        )


def batches(
    folder: Path, steps: range | None = None, *, format: str = FORMAT, salvage: bool = False
) -> Iterator[Packed]:
    """Every row of a run folder (format 3 or 4: ``format``, its header's) that may hold
    ``steps``: its parts, then the records since the last part (a journal sealed for a part
    that was being written when the notebook stopped, then the journal), batch by batch.
    A corrupt journal raises :class:`CorruptJournal`; ``salvage``: its entries before the
    corruption are read instead, with a warning.

    A second notebook may read a folder while the one running the job writes it: parts
    are merged, journals sealed and turned into parts. No row is left out, and one may come
    twice (``Trace`` drops repeated steps): a part merged away is read from the part it
    went into, and the journals are read before the parts are listed a second time, so a
    journal that became a part meanwhile is read from that part."""
    if (folder / "steps").is_symlink():
        raise ValueError(f"{folder / 'steps'} is a link, not the run's steps folder: refused")
    files = StepFiles(folder)
    read = 0  # the rows of the parts read so far
    for end, batch in files.read_after(0, steps):
        read = end
        yield batch
    held = _journals(folder, format, salvage) if format in PACKED_FORMATS else []
    for _, batch in files.read_after(read, steps):
        yield batch
    yield from held


def _journals(folder: Path, format: str, salvage: bool) -> list[Packed]:
    """The journals' batches, read at one moment: the journal first (the newest rows: it
    is sealed by a rename, and a new one starts at the next run), then the sealed ones
    (each a part once written), returned oldest first; read again if one went meanwhile."""
    steps = folder / "steps"
    for _ in range(RELISTS):
        try:
            try:
                newest = _batches_in(steps / JOURNAL, format, salvage)
            except FileNotFoundError:
                newest = []
            sealed = [
                b
                for path in sorted(steps.glob(SEALED_GLOB))
                for b in _batches_in(path, format, salvage)
            ]
            return sealed + newest
        except FileNotFoundError:
            continue
    raise ValueError(
        f"{steps}: its journals kept changing while they were read ({RELISTS} times); "
        "is a notebook writing it? Read it again."
    )


def _batches_in(journal: Path, format: str, salvage: bool) -> list[Packed]:
    found = []
    for number, (at, data) in enumerate(journal_entries(journal, format, salvage=salvage)):
        try:
            found.append(unpack(data))
        except ValueError as e:
            what = f"not a batch of step records ({e})"
            _corrupt(journal, at, what, number, salvage, e)
            break
    return found


def journal_entries(
    journal: Path, format: str = FORMAT, *, salvage: bool = False
) -> list[tuple[int, bytes]]:
    """The batches a journal holds, each with the byte its entry starts at: the one reader
    of the entries :func:`journal_entry` writes (``format``: the run folder's; format 3's
    entries are only a length). Every whole entry up to a torn tail, which is warned of;
    a corrupt entry raises :class:`CorruptJournal`, or with ``salvage`` ends the list
    there, warned of."""
    data = read_confined(journal.parent, journal.name, MAX_JOURNAL_BYTES)
    found: list[tuple[int, bytes]] = []
    at, end = 0, len(data)
    old = format == FORMAT_3
    head = _LENGTH.size if old else ENTRY_HEADER
    while at < end:
        if at + head > end:
            _torn(journal, at, end, "its header cut short", len(found), old)
            break
        if old:
            (size,) = _LENGTH.unpack_from(data, at)
        else:
            size, crc = _HEAD.unpack_from(data, at)
            (said,) = _HEAD_CRC.unpack_from(data, at + _HEAD.size)
            if said != zlib.crc32(data[at : at + _HEAD.size]):
                if not any(data[at:]):
                    _torn(journal, at, end, "zeros: appended, never on disk", len(found), old)
                else:
                    what = (
                        f"an entry header whose checksum fails (a corrupt length: it says "
                        f"{size} bytes follow, {end - at - head} do)"
                    )
                    _corrupt(journal, at, what, len(found), salvage)
                break
        if at + head + size > end:
            cut = f"its batch of {size} bytes cut short at {end - at - head}"
            _torn(journal, at, end, cut, len(found), old)
            break
        batch = data[at + head : at + head + size]
        if not old and zlib.crc32(batch) != crc:
            what = f"its {size}-byte batch's checksum fails (bytes inside the entry changed)"
            _corrupt(journal, at, what, len(found), salvage)
            break
        found.append((at, batch))
        at += head + size
    return found


def _torn(journal: Path, at: int, end: int, how: str, intact: int, old: bool) -> None:
    """A run killed mid-append leaves half a last entry: left out, with a word."""
    caveat = (
        " (format 3 journals carry no checksum: a corrupt length there looks the same)"
        if old
        else ""
    )
    warnings.warn(
        f"{journal}: byte {at}: a torn last entry ({end - at} bytes, {how}) of the run "
        f"folder {journal.parent.parent} left out; {_entries(intact)} before it "
        f"read{caveat}",
        RuntimeWarning,
        stacklevel=4,
    )


def _corrupt(
    journal: Path,
    at: int,
    what: str,
    intact: int,
    salvage: bool,
    cause: BaseException | None = None,
) -> None:
    """A corrupt entry: raised, or (``salvage``) the journal read up to it, said loudly."""
    error = CorruptJournal(journal, at, what, intact)
    if not salvage:
        raise error from cause
    warnings.warn(
        f"dtlab: SALVAGED {journal}: byte {at}: {what}. Only {_entries(intact)} before "
        f"byte {at} read; every record from there to its end "
        f"({_size(journal) - at} bytes) is LEFT OUT of the loaded trace",
        RuntimeWarning,
        stacklevel=4,
    )


def _entries(count: int) -> str:
    return {0: "no entry", 1: "the 1 entry"}.get(count, f"the {count} entries")


def _size(path: Path) -> int:
    try:
        return path.lstat().st_size
    except OSError:
        return 0


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
    try:
        checks = json.loads(read_confined(folder, "doctor.json", MAX_HEADER_BYTES).decode())
        return [_check_from_json(c) for c in checks]
    except FileNotFoundError:
        return []
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        warnings.warn(
            f"{path}: not the doctor's results ({type(e).__name__}: {str(e)[:200]}); "
            "the trace loads without them",
            RuntimeWarning,
            stacklevel=2,
        )
        return []


def _check_from_json(data: Mapping) -> CheckResult:
    findings = tuple(Finding(**{**f, "ranks": tuple(f["ranks"])}) for f in data.get("findings", ()))
    fields = {k: v for k, v in data.items() if k != "outcome"}  # derived, written for readers
    return CheckResult(**{**fields, "findings": findings})
