"""Plain tables with a text and an HTML face (what ``display`` shows in a notebook)."""

from __future__ import annotations

import html
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dtlab.analysis.consistency import Inconsistency
from dtlab.records import RankInfo

_CELL = "text-align:left;vertical-align:top;white-space:normal;max-width:48em"
# Plain text a person reads is wrapped here, between words: a notebook's output area (and
# a terminal) breaks a longer line wherever it runs out of room, inside a word.
TEXT_WIDTH = 88
INDENT = "    "  # a wrapped line's continuation


def wrapped(text: str, width: int = TEXT_WIDTH) -> str:
    """Each line of ``text`` longer than ``width`` wrapped between words, its continuation
    indented by INDENT more than the line; a word longer than the width stays whole."""
    lines = []
    for line in text.splitlines():
        if len(line) <= width:
            lines.append(line)
            continue
        lead = line[: len(line) - len(line.lstrip())]
        lines += textwrap.wrap(
            line,
            width,
            subsequent_indent=lead + INDENT,
            break_long_words=False,
            break_on_hyphens=False,
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Table:
    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...] = field(default_factory=tuple)  # shown under the table
    warnings: tuple[str, ...] = field(default_factory=tuple)  # shown under it, flagged

    def __str__(self) -> str:
        return self.text()

    def text(self, width: int | None = None) -> str:
        """The table as plain text: a row per line, or with ``width`` (e.g. TEXT_WIDTH)
        its widest columns narrowed until a line fits, their cells wrapped between words
        onto more lines (the notes and warnings too)."""
        widths = [
            max([len(h), *(len(row[i]) for row in self.rows)]) for i, h in enumerate(self.headers)
        ]
        if width is not None:
            widths = _narrowed(widths, width - 2 * (len(widths) - 1))

        lines = [self.title] if self.title else []
        for cells in (self.headers, *self.rows):
            lines += _row_lines(cells, widths)
        said = [f"WARNING: {w}" for w in self.warnings] + list(self.notes)
        lines += said if width is None else [wrapped(line, width) for line in said]
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        return self.to_html()

    def to_html(self, caption: bool = True) -> str:
        """The table, its warnings and notes; the title as a bold caption unless the page
        gives it a heading of its own (``caption=False``). A table without rows is not
        drawn: its notes say why it is empty. Cells are left-aligned and wrap (JupyterLab
        right-aligns table cells by default, which makes prose hard to read)."""
        esc = html.escape
        head = "".join(f"<th style='{_CELL}'>{esc(h)}</th>" for h in self.headers)
        body = "".join(
            "<tr>" + "".join(f"<td style='{_CELL}'>{esc(c)}</td>" for c in row) + "</tr>"
            for row in self.rows
        )
        warn = "".join(f'<li style="color:#b45309">&#9888; {esc(w)}</li>' for w in self.warnings)
        notes = "".join(f"<li>{esc(n)}</li>" for n in self.notes)
        listing = f"<ul style='margin:4px 0'>{warn}{notes}</ul>" if warn or notes else ""
        title = f"<b>{esc(self.title)}</b>" if self.title and caption else ""
        table = (
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
            if self.rows
            else ""
        )
        return f'<div class="dtlab-table">{title}{table}{listing}</div>'


def _narrowed(widths: list[int], room: int, least: int = 12) -> list[int]:
    """Column widths that fit ``room`` characters: every column wider than a common cap is
    cut to it (the narrow ones keep theirs); never under ``least`` (then a line is longer)."""
    if sum(widths) <= room:
        return widths
    cap = max(widths)
    while cap > least and sum(min(w, cap) for w in widths) > room:
        cap -= 1
    return [min(w, cap) for w in widths]


def _row_lines(cells: Sequence[str], widths: Sequence[int]) -> list[str]:
    """One row, its cells side by side, on as many lines as its longest cell needs."""
    parts = [_cell_lines(c, w) for c, w in zip(cells, widths, strict=True)]
    return [
        "  ".join(
            (part[i] if i < len(part) else "").ljust(w)
            for part, w in zip(parts, widths, strict=True)
        ).rstrip()
        for i in range(max(len(part) for part in parts))
    ]


def _cell_lines(cell: str, width: int) -> list[str]:
    """A cell's text on lines of at most ``width`` (a longer word stays whole)."""
    if len(cell) <= width:
        return [cell]
    return textwrap.wrap(cell, width, break_long_words=False, break_on_hyphens=False) or [""]


def _v(value) -> str:
    return "-" if value is None else str(value)


def rank_table(
    infos: Mapping[int, RankInfo], inconsistencies: Sequence[Inconsistency], title: str = ""
) -> Table:
    headers = ("rank", "host", "pid", "device", "backend", "threads", "torch", "CUDA", "NCCL")
    rows = tuple(
        (
            str(r),
            i.host,
            str(i.pid),
            i.device,
            i.backend,
            str(i.num_threads),
            i.torch_version,
            _v(i.cuda_version),
            _v(i.nccl_version),
        )
        for r, i in sorted(infos.items())
    )
    warnings = tuple(inc.describe() for inc in inconsistencies)
    notes = (
        ()
        if warnings
        else (
            "all ranks agree on python/torch/CUDA/NCCL versions, threads and "
            "NCCL_*/GLOO_*/TORCH_*/CUDA_*/OMP_* variables",
        )
    )
    return Table(title, headers, rows, notes, warnings)


def status_table(
    states: Mapping[int, str], infos: Mapping[int, RankInfo], title: str = ""
) -> Table:
    headers = ("rank", "state", "host", "pid", "device")
    rows = tuple(
        (
            str(r),
            s,
            infos[r].host if r in infos else "-",
            str(infos[r].pid) if r in infos else "-",
            infos[r].device if r in infos else "-",
        )
        for r, s in sorted(states.items())
    )
    return Table(title, headers, rows)


def launch_summary(session, seconds: float, reused: bool = False) -> str:
    how = f"{session.backend}, {session.config.launcher} launcher"
    if reused:
        how += ", live engines reused"
    return f"{session.world_size} ranks ready ({how}) in {seconds:.1f} s; the session is dt"
