"""A run folder's step records as Parquet files (trace formats ``dtlab-trace/2`` to ``/4``).

``<run>/steps/`` holds parts named ``L<level>-<first>-<count>.parquet``. Each
:meth:`StepFiles.write` (a Trace's journal once it holds ``PART_ROWS`` rows,
:mod:`dtlab.records.run_folder`) adds a level-0 part, written to a temporary name and
renamed, so a run killed mid-write leaves every part it finished and no half file. When
``MERGE_AT`` parts in a row share a level they are merged into one part of the next level
(as a log-structured store does), unless that part would pass ``MAX_PART_ROWS``: each
record is rewritten at most twice (parts of 65k+ rows make ~0.5M-row ones, and those
~4M-row ones while 8 fit under the cap), so 512 ranks x 100k steps leave tens of files,
not thousands.
A merge streams its parts batch by batch, so a long run's big merges need no more memory
than a small one's; the row groups it writes carry step statistics, so reading a range of
steps back (``Trace.read_steps``) skips the rest.

One row per (rank, step): the numbers of a :class:`StepRecord` as typed columns (nulls
where a value is None), sample indices as a list column, and whatever else a record carries
that is not at its default (missing gradients, RNG fingerprints, a non-finite module...)
as a JSON object in ``extra``. Columns are zstd-compressed, and those whose values repeat
are dictionary-encoded, so a fingerprint that every data-parallel replica shares costs a
few bits per row.
pandas reads the folder directly: ``pd.read_parquet(run / "steps")``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dtlab.records.packed import EXTRA_FIELDS, Packed, as_tuples
from dtlab.records.row import COUNTS, MEMORY_FIELDS, NULL_BIT, ROW, ROW_FIELDS, TIME_FIELDS

MERGE_AT = 8  # parts of one level merged into one of the next
# parts are not merged past this many rows (~150 MB on disk at 37 B a row): merging costs
# ~1.2 us a row each time, and the step statistics of a big part's row groups let a
# read of a few steps skip most of it anyway
MAX_PART_ROWS = 1 << 22
MERGE_BATCH = 65_536  # rows read and written at a time in a merge (a row group each)
RELISTS = 100  # times a reader lists the parts again when a merge removed one it listed
FOLDER = "steps"
_PART = re.compile(r"^L(\d+)-(\d+)-(\d+)\.parquet$")

# The columns are derived from the row (dtlab.records.row: ROW, ROW_FIELDS): the record's
# own numbers one typed column each (ints as int64, fingerprints uint64, floats float64,
# None as null), times.* and memory.* (ints), the sample indices as a list column, the rest
# in ``extra``. What is special:
# where a part's column order differs from the row's (parts have always had it there)
_MOVED = {"epoch": "skipped"}  # epoch right after skipped
# columns whose values rarely repeat step to step or across replicas: not
# dictionary-encoded (times, memory and losses; a dictionary there costs more to write,
# about twice the CPU, and makes the file larger, not smaller)
_UNIQUE = {"time", "loss", "grad_norm", "update_rms"}
# float columns a part written before them lacks (read as nulls): nan, "not measured"
_ADDED_LATER = {"update_rms"}


def _arrow_kind(column: str) -> str:
    kind = ROW[column].kind
    return {"f": "float64", "u": "uint64", "b": "bool"}.get(kind, "int64")


def _in_part_order(names: tuple[str, ...]) -> list[str]:
    order = [n for n in names if n not in _MOVED]
    for name, after in _MOVED.items():
        order.insert(order.index(after) + 1, name)
    return order


_SCALARS = {name: _arrow_kind(name) for name in _in_part_order(ROW_FIELDS)}
_TIMES = {name: "float64" for name in TIME_FIELDS}
_MEMORY = {name: "int64" for name in MEMORY_FIELDS}
# dictionary-encoded columns: those whose values repeat (across data-parallel replicas, or
# step after step)
_DICTIONARY = ["rank", *(name for name in _SCALARS if name not in _UNIQUE), "extra"]
_NULL_AS_MINUS_ONE = {n for n in NULL_BIT if n in _SCALARS and ROW[n].kind in "iu"}
# count columns whose items are extras: (column, field); -1 where the field was None
_EXTRA_COUNTS = tuple((c, f) for c, f in COUNTS.items() if f in EXTRA_FIELDS)


def _pa():
    import pyarrow as pa  # imported when a run folder is first written or read
    import pyarrow.parquet as pq

    return pa, pq


def _schema():
    pa, _ = _pa()
    columns = [("rank", pa.int32())]
    columns += [(name, pa.type_for_alias(kind)) for name, kind in _SCALARS.items()]
    columns += [(f"times.{name}", pa.type_for_alias(kind)) for name, kind in _TIMES.items()]
    columns += [(f"memory.{name}", pa.type_for_alias(kind)) for name, kind in _MEMORY.items()]
    columns += [("indices", pa.list_(pa.int64())), ("extra", pa.string())]
    return pa.schema(columns)


def table_of(batch: Packed):
    """A batch of rows (any ranks) as one Arrow table (the schema above)."""
    pa, _ = _pa()
    rows, n = batch.rows, len(batch.rows)
    nulls = rows["nulls"]

    def column(name: str, row_name: str, kind: str):
        values = rows[row_name]
        mask = (nulls & NULL_BIT[name]) != 0 if name in NULL_BIT else None
        if kind == "int64" and values.dtype.kind == "f":  # CUDA bytes: nan where None
            values = np.where(mask, 0, values).astype(np.int64) if mask is not None else values
        if kind == "bool":
            values = values.astype(bool)
        return pa.array(values, type=pa.type_for_alias(kind), mask=mask)

    data = {"rank": pa.array(rows["rank"], pa.int32())}
    data.update({name: column(name, name, kind) for name, kind in _SCALARS.items()})
    data.update({f"times.{n_}": column(n_, n_, kind) for n_, kind in _TIMES.items()})
    data.update({f"memory.{n_}": column(n_, n_, kind) for n_, kind in _MEMORY.items()})
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(rows["num_indices"], out=offsets[1:])
    data["indices"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(batch.indices))
    extra: list[str | None] = [None] * n
    for i, found in batch.extras.items():
        extra[i] = json.dumps(found)
    data["extra"] = pa.array(extra, pa.string())
    return pa.Table.from_pydict(data, schema=_schema())


def packed_of(table) -> Packed:
    """The inverse of :func:`table_of`."""
    pa, _ = _pa()
    n = table.num_rows
    rows = np.zeros(n, dtype=ROW)
    nulls = np.zeros(n, dtype=np.uint16)

    def read(column: str, name: str) -> None:
        values = table.column(column).combine_chunks()
        missing = values.is_null().to_numpy(zero_copy_only=False)
        if missing.any():
            if name not in NULL_BIT and name not in _ADDED_LATER:
                raise ValueError(f"column {column} has nulls")
            if name in NULL_BIT:
                nulls[missing] |= NULL_BIT[name]
        if missing.any():
            values = values.fill_null(False if pa.types.is_boolean(values.type) else 0)
        filled = values.to_numpy(zero_copy_only=False)
        if rows.dtype[name].kind == "f":
            filled = np.where(missing, np.nan, filled)
        elif name in _NULL_AS_MINUS_ONE:
            filled = np.where(missing, -1, filled)
        rows[name] = filled

    rows["rank"] = table.column("rank").to_numpy()
    for name in _SCALARS:
        read(name, name)
    for name in _TIMES:
        read(f"times.{name}", name)
    for name in _MEMORY:
        read(f"memory.{name}", name)
    lists = table.column("indices").combine_chunks()
    offsets = lists.offsets.to_numpy()
    rows["num_indices"] = np.diff(offsets)
    rows["indices_at"] = offsets[:-1] - offsets[0]
    indices = lists.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    extras: dict[int, dict] = {}
    counts = {c: np.full(n, -1 if f in NULL_BIT else 0, ROW[c]) for c, f in _EXTRA_COUNTS}
    for i, text in enumerate(table.column("extra").to_pylist()):
        if not text:
            continue
        found = json.loads(text)
        if not isinstance(found, dict) or set(found) - set(EXTRA_FIELDS):
            raise ValueError(f"row {i}: extra {text[:80]!r} is not a step record's")
        found = {name: as_tuples(v) for name, v in found.items()}
        extras[i] = found
        for column, name in _EXTRA_COUNTS:
            if name not in NULL_BIT:
                counts[column][i] = len(found.get(name, ()))
            elif found.get(name) is not None:  # (None: -1, its bit set below)
                counts[column][i] = len(found[name])
    for column, name in _EXTRA_COUNTS:
        rows[column] = counts[column]
        if name in NULL_BIT:
            nulls[counts[column] < 0] |= NULL_BIT[name]
    rows["nulls"] = nulls
    return Packed(rows, indices, extras)


def _conformed(batch):
    """A batch read from a part as a table of today's schema: a part written before a
    column was added (``_ADDED_LATER``) gets it as nulls."""
    pa, _ = _pa()
    schema = _schema()
    table = pa.Table.from_batches([batch])
    if table.schema.names == schema.names:
        return table
    for name in schema.names:
        if name not in table.schema.names:
            table = table.append_column(name, pa.nulls(len(table), schema.field(name).type))
    return table.select(schema.names).cast(schema)


class StepFiles:
    """The ``steps/`` folder of one run: parts written as a trace flushes, read back whole."""

    def __init__(self, run_folder: str | os.PathLike) -> None:
        self.folder = Path(run_folder) / FOLDER

    def parts(self) -> list[tuple[int, int, int, Path]]:
        """``(level, first, count, path)`` of every finished part, in write order."""
        found = []
        if self.folder.is_dir():
            for path in self.folder.iterdir():
                if m := _PART.match(path.name):
                    found.append((int(m[1]), int(m[2]), int(m[3]), path))
        return sorted(found, key=lambda p: (p[1], -p[0]))

    def write(self, batch: Packed) -> None:
        """Add the rows as a new part, then merge full levels."""
        if not len(batch):
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        parts = self.parts()
        first = max((p[1] + p[2] for p in parts), default=0)
        self._write(table_of(batch), 0, first, len(batch))
        self._merge()

    def _write(self, table, level: int, first: int, count: int) -> Path:
        _, pq = _pa()
        path = self.folder / f"L{level}-{first:012d}-{count}.parquet"
        tmp = path.with_name(path.name + ".tmp")
        pq.write_table(table, tmp, compression="zstd", use_dictionary=_DICTIONARY)
        os.replace(tmp, path)
        return path

    def _merge(self) -> None:
        _, pq = _pa()
        while (group := self._mergeable(self.parts())) is not None:
            level, first, count = group[0][0], group[0][1], sum(p[2] for p in group)
            path = self.folder / f"L{level + 1}-{first:012d}-{count}.parquet"
            tmp = path.with_name(path.name + ".tmp")
            # batch by batch: a merge of millions of rows holds MERGE_BATCH of them at a time
            with pq.ParquetWriter(
                tmp, _schema(), compression="zstd", use_dictionary=_DICTIONARY
            ) as out:
                for part in group:
                    for batch in pq.ParquetFile(part[3]).iter_batches(MERGE_BATCH):
                        out.write_table(_conformed(batch))
            os.replace(tmp, path)
            for part in group:
                part[3].unlink()

    @staticmethod
    def _mergeable(parts: list) -> list | None:
        """The first ``MERGE_AT`` parts in a row (in row order, so the merged part's rows
        are contiguous) that share a level and hold at most ``MAX_PART_ROWS`` rows
        together; lower levels first. A part too big to merge (one flush of millions of
        rows) is passed over, and the parts after it still merge."""
        for level in sorted({p[0] for p in parts}):
            for i in range(len(parts) - MERGE_AT + 1):
                group = parts[i : i + MERGE_AT]
                if all(p[0] == level for p in group) and sum(p[2] for p in group) <= MAX_PART_ROWS:
                    return group
        return None

    def read(self, steps: range | None = None) -> Iterator[Packed]:
        """Every part's rows, in the order written (``steps``: only those); a part that
        cannot be read is a ValueError naming it."""
        for _, batch in self.read_after(0, steps):
            yield batch

    def read_after(self, row: int, steps: range | None = None) -> Iterator[tuple[int, Packed]]:
        """The parts holding rows past the first ``row`` written, in order, as (the row
        each ends at, its rows). Safe while another process writes the folder: a part
        merged away between the listing and its read is read from the part it went into
        (whole: rows before ``row`` come again, and a Trace drops repeats)."""
        _, pq = _pa()
        only = None if steps is None else [("step", ">=", steps.start), ("step", "<", steps.stop)]
        gaps: list[tuple[int, int]] = []
        for _ in range(RELISTS):
            for _, first, count, path in self.parts():
                if first + count <= row:
                    continue
                if first > row:
                    # listing while a merge renamed one part in and unlinked others can
                    # miss the merged part: list again; a gap seen on three listings in a
                    # row is a part that is gone
                    gaps.append((row, first))
                    if gaps[-3:] == [(row, first)] * 3:
                        raise ValueError(
                            f"{self.folder}: the run's rows {row}..{first - 1} are in no "
                            "part file (one was deleted or moved?): put it back; the folder "
                            "cannot be read whole without it"
                        )
                    break
                try:
                    source = _confined(path)
                    if (rows := pq.read_metadata(source).num_rows) != count:
                        raise ValueError(
                            f"{path}: its name says {count} rows, it holds {rows}: "
                            "not the part dtlab wrote"
                        )
                    table = pq.read_table(source, schema=_schema(), filters=only)
                    batch = packed_of(table)
                except FileNotFoundError:
                    break  # merged into a part of the next level meanwhile: list again
                except ValueError as e:
                    said = str(e) if str(path) in str(e) else None
                    raise ValueError(said or f"{path}: not a dtlab step file ({e})") from e
                except (OSError, TypeError, KeyError) as e:
                    raise ValueError(f"{path}: not a dtlab step file ({e})") from e
                row = first + count
                yield row, batch
            else:
                return
        raise ValueError(
            f"{self.folder}: its parts kept being merged away while they were read "
            f"({RELISTS} times); is a notebook writing it? Read it again."
        )

    def num_bytes(self) -> int:
        return sum(p[3].stat().st_size for p in self.parts())


MAX_PART_BYTES = 16 << 30  # a part larger than this is refused, not read


def _confined(path: Path):
    """A part's bytes, for pyarrow: opened without following a link or waiting on a FIFO
    (:func:`dtlab.records.checkpoints.open_confined`; a refusal is a ValueError)."""
    import pyarrow as pa

    from dtlab.records.checkpoints import CheckpointError, open_confined

    try:
        with open_confined(path.parent, path.name, most=MAX_PART_BYTES) as f:
            return pa.BufferReader(f.read())
    except CheckpointError as e:
        raise ValueError(str(e)) from None
