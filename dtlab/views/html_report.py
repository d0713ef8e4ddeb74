"""One self-contained HTML file for a session (``dt.report(path)``): the rank table, the
doctor's findings, checkpoints and restarts, and the figures as interactive plotly with
plotly.js inlined once, so that someone without dtlab, or without a network, can open it.

It holds what the views show and nothing else: the rank table's environment columns are
the compared families only (NCCL_/GLOO_/TORCH_/CUDA_/OMP_), never a rank's whole
environment.
"""

from __future__ import annotations

import html
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from dtlab.records.trace import Trace
from dtlab.views.tables import Table

_STYLE = """body{font-family:system-ui,sans-serif;margin:24px;color:#222}
table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #ddd;padding:3px 8px;
font-size:13px;text-align:left}th{background:#f3f4f6}h2{margin-top:28px}"""


def report_html(
    title: str, lines: Sequence[str], tables: Sequence[Table], figures: Sequence[go.Figure]
) -> str:
    """The page: a heading, summary lines, the tables, then the figures (pure)."""
    parts = [f"<h1>{html.escape(title)}</h1>"]
    parts += [f"<p>{html.escape(line)}</p>" for line in lines]
    for table in tables:
        parts.append(f"<h2>{html.escape(table.title)}</h2>" + table.to_html(caption=False))
    for index, figure in enumerate(figures):  # plotly.js once, with the first figure
        parts.append(figure.to_html(full_html=False, include_plotlyjs=index == 0))
    head = f"<meta charset='utf-8'><title>{html.escape(title)}</title><style>{_STYLE}</style>"
    return f"<!DOCTYPE html><html><head>{head}</head><body>{''.join(parts)}</body></html>"


@dataclass(frozen=True)
class SessionSummary:
    """What a report shows of a session, collected by the caller (a view makes no call
    to the ranks): the findings of a stepped job, the checkpoint catalogue, restarts."""

    world_size: int
    backend: str
    infos: Mapping
    inconsistencies: Sequence
    trace: Any
    findings: Sequence
    checkpoints: Sequence
    restarts: Sequence[Mapping]
    checks: Sequence = ()  # the doctor's CheckResults, each with its outcome
    endings: Sequence[str] = ()  # a job folder's: ranks that failed, died or hung; the verdict


MAX_EARLIER = 8  # earlier timelines of the job a report draws, newest first


def earlier_timelines(trace: Trace) -> tuple[list[Trace], list[str]]:
    """The job's timelines before ``trace``, newest first (up to MAX_EARLIER): each time a
    checkpoint was loaded, the job restarted or its stages moved, a new trace began, its
    meta naming the run folder before (``before``). Also what could not be read, said."""
    found: list[Trace] = []
    problems: list[str] = []
    folder = trace.meta.get("before")
    while isinstance(folder, str) and len(found) < MAX_EARLIER:
        try:
            earlier = Trace.load(folder)
        except (OSError, ValueError) as e:
            problems.append(f"the steps before this timeline ({folder}) could not be read: {e}")
            break
        found.append(earlier)
        folder = earlier.meta.get("before")
    return found, problems


def report_figures(trace: Trace, earlier: Sequence[Trace] = ()) -> list[go.Figure]:
    """The report's figures of a stepped trace: the loss over every step recorded (the
    job's ``earlier`` timelines too), memory, and where the last step's time went."""
    from dtlab.views.figures import loss_figure, memory_figure, time_breakdown_figure

    loss = loss_figure(trace, earlier=earlier)
    return [loss, memory_figure(trace), time_breakdown_figure(trace)]


def _recorded(trace: Trace, earlier: Sequence[Trace]) -> str:
    """Which steps the report holds, and where they are."""
    since = trace.meta.get("step")
    if isinstance(since, int) and since > 0:  # rewound: this timeline began after it
        line = (
            f"steps {since + 1}-{trace.last_step} recorded since the job was rewound to "
            f"step {since}; run folder {trace.folder}"
        )
    else:
        line = f"{trace.last_step} steps recorded; run folder {trace.folder}"
    for before in earlier:
        line += f"; before that, up to step {before.last_step}: {before.folder}"
    return line


def write_report(summary: SessionSummary, path: str | Path) -> Path:
    """Write the report of ``summary`` to ``path`` (.html)."""
    from dtlab.views.reports import checkpoints_table, checks_table, findings_table
    from dtlab.views.tables import rank_table

    trace = summary.trace
    stepped = trace is not None and trace.last_step > 0
    lines = [
        f"{summary.world_size} ranks, {summary.backend}, written "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}"
    ]
    earlier: list[Trace] = []
    if stepped:
        earlier, unread = earlier_timelines(trace)
        lines += [_recorded(trace, earlier), *unread]
    lines += summary.endings
    tables = [rank_table(summary.infos, summary.inconsistencies, title="ranks")]
    if stepped:
        tables.append(findings_table(summary.findings))
        if summary.checks:  # what each check looked at: passed, found, or not checked
            tables.append(checks_table(summary.checks))
    tables.append(checkpoints_table(summary.checkpoints))
    if summary.restarts:
        rows = tuple(
            (time.strftime("%H:%M:%S", time.localtime(e["time"])), str(e["step"]), e["reason"])
            for e in summary.restarts
        )
        tables.append(Table("restarts", ("when", "from step", "why"), rows))
    figures = report_figures(trace, earlier) if stepped else []
    path = Path(path)
    path.write_text(report_html("dtlab session report", lines, tables, figures))
    return path
