"""Step records as packed binary rows: what a rank sends, and what the notebook keeps.

A :class:`Packed` holds a batch of step records as

- ``rows``: a numpy array of :data:`~dtlab.records.columns.ROW`, one row per record: every
  number of the record (``nulls`` says which were None), ``rank`` included;
- ``indices``: the records' sample indices one after another (row ``i``'s are
  ``indices[rows["indices_at"][i]:][:rows["num_indices"][i]]``);
- ``extras``: ``{row: {field: value}}`` for what a record carries that is neither a number
  of the row nor at its default (epoch starts, missing gradients, RNG fingerprints, a
  non-finite module...).

As bytes (:meth:`Packed.to_bytes`: one zmq frame on the stepping channel, one entry of a run
folder's journal) it is ``MAGIC``, three little-endian uint32 (rows, indices, bytes of
extras), the rows, the indices as int64, and the extras as JSON ``[[row, {field: value}],
...]``. :func:`unpack` checks everything a corrupt or hostile frame could get wrong (sizes,
counts, offsets, the rank, field names) and raises ValueError saying what; nothing in a
frame is executed or unpickled. A frame of the layout before ``update_rms`` (``DTR1``, in
an older run folder's journal) is read as one of today's, its update sizes nan (not
measured).

The notebook takes in a frame without a Python object per record: :func:`read_frame` checks
it (the header, and the rank, step and index count of each row, read in place) and keeps
the bytes as they came (a :class:`Frame`); :func:`join` turns every frame that arrived since
the last read into rows with one numpy pass; a :class:`StepRecord` is made only when code
asks for that record (:meth:`Packed.record`).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import numpy as np

from dtlab.records.row import MEMORY_FIELDS, NULL_BIT, ROW, ROW_FIELDS, TIME_FIELDS, row_of
from dtlab.records.steps import StepMemory, StepRecord, StepTimes

MAGIC = b"DTR2"
OLD_MAGIC = b"DTR1"  # rows without update_rms (ROW_V1): read, never written
_HEADER = struct.Struct("<4sIII")
FIELD_DEFAULTS = {f.name: f.default for f in fields(StepRecord)}
# a record's fields that travel as extras when they are not at their default: all but the
# row's numbers (ROW_FIELDS, times.* and memory.*) and the sample indices
EXTRA_FIELDS = tuple(
    name for name in FIELD_DEFAULTS if name not in {*ROW_FIELDS, "times", "memory", "indices"}
)
_AT = {name: i for i, name in enumerate(ROW.names or ())}
# memory fields the row keeps in float columns (nan: None), ints in the record
INT_MEMORY = {name for name in MEMORY_FIELDS if ROW[name].kind == "f"}
# where Packed._record finds each field in a row's tuple, and its None bit (0: never None)
_ROW_AT = tuple((name, _AT[name], NULL_BIT.get(name, 0)) for name in ROW_FIELDS)
# (StepTimes and StepMemory are made from their fields in order: MEMORY_FIELDS, TIME_FIELDS)
_MEMORY_AT = tuple((_AT[n], NULL_BIT.get(n, 0), n in INT_MEMORY) for n in MEMORY_FIELDS)
_TIMES_AT = tuple(_AT[name] for name in TIME_FIELDS)
# fields whose default is nan ("not measured"): read back as math.nan itself, so that the
# records compare equal (a nan equals only itself)
_NAN_AT = tuple(
    (name, _AT[name])
    for name in ROW_FIELDS
    if isinstance(default := FIELD_DEFAULTS[name], float) and math.isnan(default)
)
_NULLS_AT, _INDICES_AT, _NUM_INDICES_POS = _AT["nulls"], _AT["indices_at"], _AT["num_indices"]
# the row before update_rms was added (frames of OLD_MAGIC)
ROW_V1 = np.dtype([(name, ROW[name]) for name in ROW.names or () if name != "update_rms"])


def extras_of(rec: StepRecord) -> dict:
    """What of ``rec`` is neither a number of its row nor at its default."""
    return {name: v for name in EXTRA_FIELDS if (v := getattr(rec, name)) != FIELD_DEFAULTS[name]}


def as_tuples(value):
    """JSON's lists, nested, as the tuples a record holds."""
    return tuple(as_tuples(v) for v in value) if isinstance(value, list) else value


@dataclass
class Packed:
    """A batch of step records as rows (see the module's description)."""

    rows: np.ndarray
    indices: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    extras: dict[int, dict] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    def record(self, i: int) -> StepRecord:
        """Row ``i`` as the StepRecord it was made from."""
        return self._record(self.rows[i].item(), i)

    def records(self) -> list[StepRecord]:
        """Every row as its StepRecord (one pass: cheaper than row by row)."""
        return [self._record(values, i) for i, values in enumerate(self.rows.tolist())]

    def _record(self, values: tuple, i: int) -> StepRecord:
        nulls = values[_NULLS_AT]
        found: dict[str, Any] = {
            name: None if nulls & bit else values[at] for name, at, bit in _ROW_AT
        }
        for name, at in _NAN_AT:
            if math.isnan(values[at]):
                found[name] = math.nan
        memory = StepMemory(
            *(  # type: ignore[arg-type]  # None only where the field may be None
                None if nulls & bit else (int(values[at]) if whole else values[at])
                for at, bit, whole in _MEMORY_AT
            )
        )
        at, n = values[_INDICES_AT], values[_NUM_INDICES_POS]
        return StepRecord(
            **found,
            times=StepTimes(*(values[at] for at in _TIMES_AT)),
            memory=memory,
            indices=tuple(self.indices[at : at + n].tolist()) if n else (),
            **self.extras.get(i, {}),
        )

    def take(self, keep: np.ndarray) -> Packed:
        """The rows where ``keep`` (a bool per row) holds, with their indices and extras."""
        if keep.all():
            return self
        rows = self.rows[keep]
        indices = self.indices[np.repeat(keep, self.rows["num_indices"])]
        rows["indices_at"] = np.cumsum(rows["num_indices"]) - rows["num_indices"]
        new_at = np.cumsum(keep) - 1
        extras = {int(new_at[i]): v for i, v in self.extras.items() if keep[i]}
        return Packed(rows, indices, extras)

    def to_bytes(self) -> bytes:
        extras = (
            json.dumps(sorted(self.extras.items()), separators=(",", ":")).encode()
            if self.extras
            else b""
        )
        header = _HEADER.pack(MAGIC, len(self.rows), len(self.indices), len(extras))
        return b"".join((header, self.rows.tobytes(), self.indices.astype("<i8").tobytes(), extras))


def pack(rank: int, records: Sequence[StepRecord]) -> Packed:
    """A rank's records as one batch (what its replies carry)."""
    at, tuples, extras = 0, [], {}
    indices: list[int] = []
    for i, rec in enumerate(records):
        tuples.append(row_of(rank, rec, at))
        if rec.indices:
            indices.extend(rec.indices)
            at += len(rec.indices)
        if found := extras_of(rec):
            extras[i] = found
    rows = np.fromiter(tuples, dtype=ROW, count=len(tuples))
    return Packed(rows, np.fromiter(indices, np.int64, len(indices)), extras)


class Part(NamedTuple):
    """A run of consecutive rows of one rank in a :class:`Frame`: rows ``start:stop``."""

    rank: int
    start: int
    stop: int
    first_step: int
    last_step: int
    increasing: bool  # each row's step after the one before


@dataclass(frozen=True, slots=True)
class Frame:
    """One batch of records as it came (checked by :func:`read_frame`): a rank's, or the
    ranks of one host joined by its relay (:func:`concat`), rank after rank."""

    data: bytes
    rows: int
    indices: int
    extras: dict[int, dict]
    parts: tuple[Part, ...]  # its rows rank by rank, in order (one part: one rank's frame)

    def part_extras(self, part: Part) -> dict[int, dict]:
        """The extras of ``part``'s rows, numbered from the part's first row."""
        if not self.extras or len(self.parts) == 1:
            return self.extras
        return {i - part.start: e for i, e in self.extras.items() if part.start <= i < part.stop}


def frame_rows(frame: Frame) -> np.ndarray:
    """The frame's rows, a read-only view into its bytes."""
    return np.frombuffer(frame.data, dtype=ROW, count=frame.rows, offset=_HEADER.size)


_NO_EXTRAS: dict[int, dict] = {}  # shared by every frame without extras (never changed)
_FEW_ROWS = 32  # frames of more rows are checked in numpy (its fixed cost: ~10 us a frame)
_ROW_KEYS = struct.Struct("<iq")  # rank, step: the row's first two fields
_NUM_INDICES = struct.Struct("<i")
_OFFSETS = {name: spec[1] for name, spec in (ROW.fields or {}).items()}
_NUM_INDICES_AT = _OFFSETS["num_indices"]
assert _OFFSETS["rank"] == 0 and _OFFSETS["step"] == 4  # what _ROW_KEYS reads


def read_frame(data: bytes, rank: int | None = None) -> Frame:
    """The batch in ``data`` (from :meth:`Packed.to_bytes` or :func:`concat`), checked;
    ``rank``: every row must be this rank's. Raises ValueError saying what is wrong with a
    frame that is not one. Reads the numbers it checks in place (a frame of many rows as
    numpy views of its bytes): nothing is copied."""
    if len(data) < _HEADER.size:
        raise ValueError(f"a step-record frame of {len(data)} bytes is shorter than its header")
    magic, n, k, e = _HEADER.unpack_from(data)
    if magic == OLD_MAGIC:
        data = _upgraded(data, n, k, e)
        magic = MAGIC
    if magic != MAGIC:
        raise ValueError(f"not a step-record frame (it starts {magic!r}, not {MAGIC!r})")
    size = ROW.itemsize
    rows_end = _HEADER.size + n * size
    if len(data) != rows_end + 8 * k + e:
        raise ValueError(
            f"a step-record frame of {len(data)} bytes, but its header says {n} rows, "
            f"{k} sample indices and {e} bytes of extras ({rows_end + 8 * k + e} bytes)"
        )
    parts = _parts_of(data, n, k, rank) if n > _FEW_ROWS else _few_parts_of(data, n, k, rank)
    extras = _extras(data[rows_end + 8 * k :], n) if e else _NO_EXTRAS
    return Frame(data, n, k, extras, tuple(parts))


def _upgraded(data: bytes, n: int, k: int, e: int) -> bytes:
    """A frame of ``ROW_V1`` rows (``OLD_MAGIC``) as today's: update sizes nan."""
    rows_end = _HEADER.size + n * ROW_V1.itemsize
    if len(data) != rows_end + 8 * k + e:
        raise ValueError(
            f"a step-record frame ({OLD_MAGIC!r}) of {len(data)} bytes, but its header says "
            f"{n} rows, {k} sample indices and {e} bytes of extras"
        )
    old = np.frombuffer(data, dtype=ROW_V1, count=n, offset=_HEADER.size)
    rows = np.zeros(n, dtype=ROW)
    for name in ROW_V1.names or ():
        rows[name] = old[name]
    rows["update_rms"] = math.nan
    return b"".join((_HEADER.pack(MAGIC, n, k, e), rows.tobytes(), data[rows_end:]))


def _parts_of(data: bytes, n: int, k: int, rank: int | None) -> list[Part]:
    """:func:`read_frame`'s checks and parts, in numpy (for frames of many rows)."""
    rows = np.frombuffer(data, dtype=ROW, count=n, offset=_HEADER.size)
    ranks, steps, nums = rows["rank"], rows["step"], rows["num_indices"]
    if rank is not None and (wrong := np.flatnonzero(ranks != rank)).size:
        raise ValueError(f"a record of rank {int(ranks[wrong[0]])} arrived from rank {rank}")
    if (low := np.flatnonzero(steps < 1)).size:
        raise ValueError(f"a step record with step {int(steps[low[0]])} (steps count from 1)")
    if (nums < 0).any() or int(nums.sum()) != k:
        raise ValueError(f"the rows' sample-index counts do not add up to the frame's {k}")
    starts = np.flatnonzero(ranks[1:] != ranks[:-1]) + 1  # a new part at each change of rank
    back = np.zeros(n, dtype=np.int64)  # a row whose step is not after the one before
    back[1:] = steps[1:] <= steps[:-1]
    back[starts] = 0  # (the first row of a part has none before it)
    bounds = np.concatenate(([0], starts))
    stops = np.concatenate((starts, [n]))
    ok = np.add.reduceat(back, bounds) == 0
    return [
        Part(*fields)
        for fields in zip(
            ranks[bounds].tolist(),
            bounds.tolist(),
            stops.tolist(),
            steps[bounds].tolist(),
            steps[stops - 1].tolist(),
            ok.tolist(),
            strict=True,
        )
    ]


def _few_parts_of(data: bytes, n: int, k: int, rank: int | None) -> list[Part]:
    """:func:`read_frame`'s checks and parts, row by row (for frames of a few rows)."""
    rows_end = _HEADER.size + n * ROW.itemsize
    size = ROW.itemsize
    parts: list[Part] = []
    counted, seen, start, first, last, increasing, current = 0, 0, 0, 0, 0, True, None
    for at in range(_HEADER.size, rows_end, size):
        row_rank, step = _ROW_KEYS.unpack_from(data, at)
        if row_rank != current:  # a new part (every row, for a rank it is not)
            if rank is not None and row_rank != rank:
                raise ValueError(f"a record of rank {row_rank} arrived from rank {rank}")
            if current is not None:
                parts.append(Part(current, start, seen, first, last, increasing))
            current, start, first, last, increasing = row_rank, seen, step, 0, True
        if step < 1:
            raise ValueError(f"a step record with step {step} (steps count from 1)")
        (num,) = _NUM_INDICES.unpack_from(data, at + _NUM_INDICES_AT)
        if num < 0:
            break
        counted += num
        increasing = increasing and step > last
        last, seen = step, seen + 1
    if seen != n or counted != k:
        raise ValueError(f"the rows' sample-index counts do not add up to the frame's {k}")
    if current is not None:
        parts.append(Part(current, start, seen, first, last, increasing))
    return parts


def concat(frames: Sequence[Frame]) -> bytes:
    """Checked frames (a host's ranks') as the bytes of one frame, their rows in order: what
    a relay sends up instead of a frame per rank. Copies bytes; makes no array."""
    size = ROW.itemsize
    rows, indices, extras, n = [], [], [], 0
    for f in frames:
        rows_end = _HEADER.size + f.rows * size
        rows.append(f.data[_HEADER.size : rows_end])
        indices.append(f.data[rows_end : rows_end + 8 * f.indices])
        extras += [[n + i, found] for i, found in sorted(f.extras.items())]
        n += f.rows
    text = json.dumps(extras, separators=(",", ":")).encode() if extras else b""
    header = _HEADER.pack(MAGIC, n, sum(f.indices for f in frames), len(text))
    return b"".join([header, *rows, *indices, text])


def _extras(text: bytes, n: int) -> dict[int, dict]:
    extras: dict[int, dict] = {}
    try:
        for i, found in json.loads(text):
            if not (isinstance(i, int) and 0 <= i < n and isinstance(found, dict)):
                raise ValueError(f"extras for row {i!r} of {n}")
            unknown = set(found) - set(EXTRA_FIELDS)
            if unknown:
                raise ValueError(f"unknown fields {sorted(unknown)}")
            extras[i] = {name: as_tuples(value) for name, value in found.items()}
    except (ValueError, TypeError, RecursionError) as err:  # (too deeply nested: recursion)
        raise ValueError(f"a step-record frame's extras are not valid ({err!r})") from err
    return extras


def join(frames: Sequence[Frame]) -> Packed:
    """Checked frames as one batch of rows: one numpy pass for all of them."""
    size = ROW.itemsize
    rows_parts, index_parts, extras = [], [], {}
    first = 0
    for f in frames:
        view = memoryview(f.data)
        rows_end = _HEADER.size + f.rows * size
        rows_parts.append(view[_HEADER.size : rows_end])
        index_parts.append(view[rows_end : rows_end + 8 * f.indices])
        if f.extras:
            extras.update({first + i: found for i, found in f.extras.items()})
        first += f.rows
    rows = np.frombuffer(b"".join(rows_parts), ROW).copy()
    indices = np.frombuffer(b"".join(index_parts), "<i8").astype(np.int64)
    num = rows["num_indices"]
    rows["indices_at"] = np.cumsum(num, dtype=np.int64) - num  # never trust offsets sent
    return Packed(rows, indices, extras)


def unpack(frame: bytes, rank: int | None = None) -> Packed:
    """The batch in ``frame``, checked (:func:`read_frame`) and as rows."""
    return join([read_frame(frame, rank)])


__all__ = [
    "EXTRA_FIELDS",
    "FIELD_DEFAULTS",
    "INT_MEMORY",
    "MAGIC",
    "OLD_MAGIC",
    "ROW_FIELDS",
    "ROW_V1",
    "Frame",
    "Packed",
    "Part",
    "as_tuples",
    "concat",
    "extras_of",
    "join",
    "pack",
    "read_frame",
    "unpack",
]
