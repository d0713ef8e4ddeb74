"""A run folder's step records as Parquet files (trace format ``dtlab-trace/2``).

``<run>/steps/`` holds parts named ``L<level>-<first>-<count>.parquet``. Each
:meth:`StepFiles.write` (a Trace's flush: the end of every run) adds a level-0 part, written
to a temporary name and renamed, so a run killed mid-write leaves every part it finished
and no half file. When ``MERGE_AT`` parts share a level they are merged into one part of
the next level (as a log-structured store does): a run of a thousand ``dt.step(1)`` calls
leaves a handful of files, and each record is rewritten about log_MERGE_AT(parts) times.

One row per (rank, step): the numbers of a :class:`StepRecord` as typed columns (nulls
where a value is None), sample indices as a list column, and whatever else a record carries
that is not at its default (missing gradients, RNG fingerprints, a non-finite module...)
as a JSON object in ``extra``. Columns are zstd-compressed with dictionary encoding, so a
fingerprint that every data-parallel replica shares costs a few bits per row.
pandas reads the folder directly: ``pd.read_parquet(run / "steps")``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import fields
from pathlib import Path

from dtlab.records.steps import StepMemory, StepRecord, StepTimes

MERGE_AT = 8  # parts of one level merged into one of the next
FOLDER = "steps"
_PART = re.compile(r"^L(\d+)-(\d+)-(\d+)\.parquet$")
_UINT64 = (1 << 64) - 1

# the record's own numbers, one typed column each (the rest goes to ``extra``)
_SCALARS = {
    "step": "int64",
    "time": "float64",
    "loss": "float64",
    "lr": "float64",
    "scale": "float64",
    "skipped": "bool",
    "epoch": "int64",
    "grad_norm": "float64",
    "grad_fingerprint": "uint64",
    "param_fingerprint": "uint64",
    "buffer_fingerprint": "uint64",
    "num_nonfinite": "int64",
    "micro_batches": "int64",
    "synced_micro_batches": "int64",
    "comm_calls": "int64",
    "comm_bytes": "int64",
}
_TIMES = {f.name: "float64" for f in fields(StepTimes)}
_MEMORY = {f.name: "int64" for f in fields(StepMemory)}
_DEFAULTS = {f.name: f.default for f in fields(StepRecord) if f.name not in _SCALARS}
_EXTRA = tuple(name for name in _DEFAULTS if name not in ("times", "memory", "indices"))


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


def _extra(rec: StepRecord) -> str | None:
    found = {}
    for name in _EXTRA:
        value = getattr(rec, name)
        if value != _DEFAULTS[name]:
            found[name] = value
    return json.dumps(found) if found else None


def to_table(rows: Iterable[tuple[int, StepRecord]]):
    """``(rank, record)`` pairs as one Arrow table (the schema above)."""
    pa, _ = _pa()
    rows = list(rows)
    data: dict[str, list] = {"rank": [rank for rank, _ in rows]}
    for name in _SCALARS:
        data[name] = [getattr(rec, name) for _, rec in rows]
    for name in ("grad_fingerprint", "param_fingerprint", "buffer_fingerprint"):
        bad = next((v for v in data[name] if not 0 <= v <= _UINT64), None)
        if bad is not None:
            raise ValueError(f"{name} {bad} is not an unsigned 64-bit fingerprint")
    for name in _TIMES:
        data[f"times.{name}"] = [getattr(rec.times, name) for _, rec in rows]
    for name in _MEMORY:
        data[f"memory.{name}"] = [getattr(rec.memory, name) for _, rec in rows]
    data["indices"] = [rec.indices for _, rec in rows]
    data["extra"] = [_extra(rec) for _, rec in rows]
    return pa.Table.from_pydict(data, schema=_schema())


def from_table(table) -> Iterator[tuple[int, StepRecord]]:
    """The inverse of :func:`to_table`."""
    columns = table.to_pydict()
    n = table.num_rows
    for i in range(n):
        extra = columns["extra"][i]
        fields_ = {name: columns[name][i] for name in _SCALARS}
        fields_["times"] = StepTimes(**{k: columns[f"times.{k}"][i] for k in _TIMES})
        fields_["memory"] = StepMemory(**{k: columns[f"memory.{k}"][i] for k in _MEMORY})
        fields_["indices"] = tuple(columns["indices"][i] or ())
        if extra:
            for name, value in json.loads(extra).items():
                if name not in _DEFAULTS:
                    raise ValueError(f"unknown field {name!r} in a step record")
                fields_[name] = _as_tuples(value) if isinstance(value, list) else value
        yield columns["rank"][i], StepRecord(**fields_)


def _as_tuples(value: list) -> tuple:
    return tuple(_as_tuples(v) if isinstance(v, list) else v for v in value)


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

    def write(self, rows: list[tuple[int, StepRecord]]) -> None:
        """Add the records as a new part, then merge full levels."""
        if not rows:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        parts = self.parts()
        first = max((p[1] + p[2] for p in parts), default=0)
        self._write(to_table(rows), 0, first, len(rows))
        self._merge()

    def _write(self, table, level: int, first: int, count: int) -> Path:
        _, pq = _pa()
        path = self.folder / f"L{level}-{first:012d}-{count}.parquet"
        tmp = path.with_name(path.name + ".tmp")
        pq.write_table(table, tmp, compression="zstd", use_dictionary=True)
        os.replace(tmp, path)
        return path

    def _merge(self) -> None:
        pa, pq = _pa()
        while True:
            parts = self.parts()
            levels: dict[int, list] = {}
            for part in parts:
                levels.setdefault(part[0], []).append(part)
            full = next((lv for lv in sorted(levels) if len(levels[lv]) >= MERGE_AT), None)
            if full is None:
                return
            group = levels[full][:MERGE_AT]
            table = pa.concat_tables(pq.read_table(p[3], schema=_schema()) for p in group)
            first, count = group[0][1], sum(p[2] for p in group)
            self._write(table, full + 1, first, count)
            for part in group:
                part[3].unlink()

    def read(self) -> Iterator[tuple[int, StepRecord]]:
        """Every record, in the order written; a part that cannot be read is a ValueError
        naming it."""
        _, pq = _pa()
        for _, _, _, path in self.parts():
            try:
                table = pq.read_table(path, schema=_schema())
                yield from from_table(table)
            except (OSError, ValueError, TypeError, KeyError) as e:
                if isinstance(e, ValueError) and str(e).startswith(str(path)):
                    raise
                raise ValueError(f"{path}: not a dtlab step file ({e})") from e

    def num_bytes(self) -> int:
        return sum(p[3].stat().st_size for p in self.parts())
