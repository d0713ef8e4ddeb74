"""Figures: pure functions of a Trace (or of analysis results) -> ``plotly`` Figure.

Runs in the notebook kernel. Nothing here shows, writes or reads anything: ``widgets.py``
wraps these figures in FigureWidgets and updates them, tests read ``fig.data`` and
``fig.layout``.

Conventions shared by every figure:

- rank ``r`` has colour ``rank_color(r)`` everywhere and its legend entry is ``"rank r"``;
- x is the step; each line is evenly downsampled to at most ``max_points`` points, first and
  last step kept, so 8 ranks x many steps stays light in the browser; a step axis ticks
  whole steps (``step_ticks``: plotly's own would tick 27.5 on a few steps);
- an empty trace gives a figure of the same structure with empty traces, never an error.

The dashboard is one figure with three panels (one figure, not three: each FigureWidget
carries the plotly.js bundle). Its traces are in a fixed order, ``DASHBOARD_PANELS`` outer,
ranks in rank order inner, so a live updater can assign ``fig.data[i].x/.y`` in place from
``dashboard_series`` (see ``dashboard_trace_index``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative, sequential
from plotly.subplots import make_subplots

from dtlab.analysis.rank_groups import GROUP_ABOVE, rank_bands
from dtlab.control.errors import OptionError
from dtlab.records import StepMemory, StepRecord, StepTimes
from dtlab.records.row import NULL_BIT
from dtlab.records.trace import Trace

TEMPLATE = "plotly_white"
MIB = 1024 * 1024
_RANK_COLORS = qualitative.Plotly + qualitative.Dark24  # 34 distinct before wrapping
_PHASE_COLORS = qualitative.Set2
MEMORY_FIELDS = tuple(f.name for f in dataclasses.fields(StepMemory))
PHASES = tuple(f.name for f in dataclasses.fields(StepTimes))  # data, forward, ..., record
DASHBOARD_PANELS = ("loss", "grad_norm", "memory")
# each panel's ROW column and the unit it is divided by
_DASHBOARD_COLUMNS = {
    "loss": ("loss", 1.0),
    "grad_norm": ("grad_norm", 1.0),
    "memory": ("rss", MIB),
}
DASHBOARD_HEIGHT = 600
_PANEL_TITLES = ("Loss", "Total gradient norm", "Memory (RSS)")
_PANEL_UNITS = ("loss", "L2 norm", "MiB")


def rank_color(rank: int) -> str:
    """The colour of ``rank`` in every dtlab figure."""
    return _RANK_COLORS[rank % len(_RANK_COLORS)]


def downsample(xs: Sequence, ys: Sequence, max_points: int) -> tuple[list, list]:
    """At most ``max_points`` evenly spaced points, the first and the last always kept."""
    if max_points < 2:
        raise ValueError(f"max_points must be at least 2, got {max_points}")
    if len(xs) <= max_points:
        return list(xs), list(ys)
    keep = np.unique(np.linspace(0, len(xs) - 1, max_points).round().astype(int))
    return [xs[i] for i in keep], [ys[i] for i in keep]


def _ranks(trace: Trace) -> list[int]:
    return sorted(trace.records)


def _series(records: Iterable[StepRecord], value, max_points: int) -> tuple[list, list]:
    """(steps, values) of ``value(record)``; records where it gives None are left out."""
    points = [(rec.step, value(rec)) for rec in records]
    points = [(step, v) for step, v in points if v is not None]
    return downsample([s for s, _ in points], [v for _, v in points], max_points)


def _rows_series(
    rows: np.ndarray | None, column: str, scale: float, max_points: int
) -> tuple[list, list]:
    """(steps, values / ``scale``) of one ROW column of a rank's rows in step order (from
    the trace's columns: no record object is made); rows where it was None left out."""
    if rows is None:
        return [], []
    steps, values = rows["step"], rows[column]
    if column in NULL_BIT:
        keep = (rows["nulls"] & NULL_BIT[column]) == 0
        if not keep.all():
            steps, values = steps[keep], values[keep]
    if scale != 1.0:
        values = values / scale
    return downsample(steps.tolist(), values.tolist(), max_points)


def _line(x, y, rank: int, *, suffix: str = "", dash: str | None = None, **kw) -> go.Scatter:
    # SVG Scatter, not Scattergl: downsampled lines are light enough, and WebGL may be missing
    # in a headless browser (--disable-gpu) and is capped at a few contexts per page.
    return go.Scatter(
        x=x,
        y=y,
        mode="lines",
        name=f"rank {rank}{suffix}",
        line={"color": rank_color(rank), "dash": dash},
        **kw,
    )


def _layout(
    fig: go.Figure, title: str, xaxis: str, yaxis: str, height: int, hovermode: str = "x unified"
) -> go.Figure:
    fig.update_layout(
        title=title,
        template=TEMPLATE,
        height=height,
        xaxis_title=xaxis,
        yaxis_title=yaxis,
        hovermode=hovermode,
    )
    return fig


STEP_TICKS_BELOW = 10  # steps an axis spans up to which it ticks every step
# px between a step axis and its labels: the first step sits on the y axis, and without
# it its label ran into the lowest y label at the corner ("27" over "310" in a report)
STEP_LABELS_BELOW_PX = 8


def step_ticks(fig: go.Figure) -> go.Figure:
    """Tick the step axes (every x axis of ``fig``) at whole steps. Plotly aims at ~10
    ticks, so an axis of a few steps gets fractional ones (27.5); one of up to
    STEP_TICKS_BELOW steps ticks every step, a longer one keeps plotly's (whole: 1, 2, 5,
    10...). Called again after the data changed (the live dashboard)."""
    steps = [x for t in fig.data if t.x is not None for x in t.x if x is not None]
    few = not steps or max(steps) - min(steps) <= STEP_TICKS_BELOW
    fig.update_xaxes(dtick=1 if few else None, ticklabelstandoff=STEP_LABELS_BELOW_PX)
    return fig


def _run_label(trace: Trace, default: str) -> str:
    return trace.folder.name if trace.folder is not None else default


def _grouped(
    fig: go.Figure,
    trace: Trace,
    column: str,
    scale: float,
    max_points: int,
    row: int | None = None,
) -> str:
    """Past GROUP_ABOVE ranks: ``column`` (of records.columns.ROW, divided by ``scale``) as
    the min-max band of every rank, its median, and the ranks that stand out
    (analysis/rank_groups.py), in subplot ``row`` if given (then the band and median
    are in the legend once, from row 1). Returns what the title should say about it."""
    steps, ranks, table = trace.columns.aligned(trace.ranks)
    bands = rank_bands(steps, ranks, table[column] / scale)
    keep = downsample(list(range(len(steps))), list(range(len(steps))), max_points)[0]
    x = steps[keep].tolist()
    grey = "rgba(120, 120, 120, 0.25)"
    where = {} if row is None else {"row": row, "col": 1}
    legend = row is None or row == 1
    edge = {"width": 0, "color": grey}
    n = bands.num_ranks
    parts = (  # the high edge, then the low one filled up to it, then the median
        (bands.high, {"line": edge, "name": "highest rank", "showlegend": False}),
        (
            bands.low,
            {"line": edge, "fill": "tonexty", "fillcolor": grey, "legendgroup": "band"}
            | {"name": f"lowest to highest of {n} ranks", "showlegend": legend},
        ),
        (
            bands.median,
            {"line": {"color": "rgb(60, 60, 60)"}, "legendgroup": "median"}
            | {"name": f"median of {n} ranks", "showlegend": legend},
        ),
    )
    for values, style in parts:
        fig.add_trace(go.Scatter(x=x, y=values[keep].tolist(), mode="lines", **style), **where)
    for rank, series in bands.outliers.items():
        line = _line(x, series[keep].tolist(), rank, suffix=" (stands out)")
        fig.add_trace(line.update(legendgroup=f"rank {rank}"), **where)
    standing = len(bands.outliers)
    return f"{bands.num_ranks} ranks as a band and their median" + (
        f", {standing} rank{'s' if standing != 1 else ''} standing out"
        if standing
        else ", none standing out"
    )


def loss_figure(
    trace: Trace,
    other: Trace | None = None,
    *,
    earlier: Sequence[Trace] = (),
    max_points: int = 2000,
) -> go.Figure:
    """Loss per rank; ``other`` (a second run) is overlaid dashed as ``"rank r (other)"``;
    ``earlier``, the same job's timelines before this one (a checkpoint loaded, a restart,
    stages moved: ``dtlab.views.html_report.earlier_timelines``), dotted under it, so that
    every step recorded is drawn. Past GROUP_ABOVE ranks: a band, the median and the ranks
    that stand out (this timeline only)."""
    fig = go.Figure()
    if len(_ranks(trace)) > GROUP_ABOVE and other is None:
        said = _grouped(fig, trace, "loss", 1.0, max_points)
        return step_ticks(_layout(fig, f"Loss: {said}", "step", "loss", 420))
    for before in reversed(earlier):  # oldest first, under this timeline's lines
        steps = f"steps {_first_step(before)}-{before.last_step}"
        theirs = before.columns.by_rank()
        for rank in _ranks(before):
            x, y = _rows_series(theirs.get(rank), "loss", 1.0, max_points)
            line = _line(x, y, rank, suffix=f" ({steps}, before)", dash="dot", opacity=0.6)
            fig.add_trace(line.update(legendgroup=f"rank {rank}"))
    mine = trace.columns.by_rank()
    for rank in _ranks(trace):
        x, y = _rows_series(mine.get(rank), "loss", 1.0, max_points)
        fig.add_trace(_line(x, y, rank, legendgroup=f"rank {rank}"))
    title = "Loss per rank"
    if earlier:
        title = "Loss per rank: this timeline (solid) and the job's earlier ones (dotted)"
    if other is not None:
        theirs = other.columns.by_rank()
        for rank in _ranks(other):
            x, y = _rows_series(theirs.get(rank), "loss", 1.0, max_points)
            fig.add_trace(_line(x, y, rank, suffix=" (other)", dash="dash"))
        this, that = _run_label(trace, "this run"), _run_label(other, "other run")
        title = f"Loss per rank: {this} (solid) vs {that} (dashed)"
    return step_ticks(_layout(fig, title, "step", "loss", 420))


def _first_step(trace: Trace) -> int:
    """The first step a trace recorded (one after the checkpoint it was rewound to)."""
    older = trace.history.rows()["step"]  # the steps its window let go, if any
    steps = older if len(older) else trace.columns.rows()["step"]
    return int(steps[0]) if len(steps) else trace.first_step


def _loss(rec: StepRecord) -> float:
    return rec.loss


def deviation_heatmap(
    ranks: Sequence[int], matrix, names: Sequence[str], *, step: int
) -> go.Figure:
    """Rank x parameter gradient deviation from the rank majority at ``step``.

    ``matrix[i][j]`` is rank ``ranks[i]``'s deviation on parameter ``names[j]``; 0 means
    bitwise equal to the majority and is drawn white, anything above 0 visibly coloured.
    """
    z = np.asarray(matrix, dtype=float)
    if z.size == 0 and len(ranks) * len(names) == 0:
        z = np.zeros((len(ranks), len(names)))
    if z.shape != (len(ranks), len(names)):
        raise ValueError(
            f"matrix has shape {z.shape}, expected (ranks, params) = ({len(ranks)}, {len(names)})"
        )
    finite = z[np.isfinite(z)]
    zmax = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    # White only at exactly 0: the first non-zero value already starts on a visible colour,
    # so a tiny deviation (one rank off by an ulp) does not hide among the equal cells.
    reds = sequential.OrRd[2:]
    colorscale = [[0.0, "white"], [1e-9, reds[0]]]
    colorscale += [[(i + 1) / (len(reds) - 1), c] for i, c in enumerate(reds[1:])]
    text = [[_deviation_text(v) for v in row] for row in z]
    # JSON has no inf/nan: such cells would be blank, like the equal ones; draw them at the
    # top of the scale instead (their hover text says what they are)
    shown = np.where(np.isfinite(z), z, zmax)
    fig = go.Figure(
        go.Heatmap(
            z=shown,
            x=list(names),
            y=[f"rank {r}" for r in ranks],
            text=text,
            zmin=0,
            zmax=zmax,
            colorscale=colorscale,
            xgap=1,
            ygap=1,
            # white is 0 (bitwise equal); the scale's first tick says so
            colorbar={
                "title": {"text": "deviation"},
                "tickvals": [0, zmax / 2, zmax],
                "ticktext": ["0 (equal, white)", f"{zmax / 2:.2g}", f"{zmax:.2g}"],
            },
            hovertemplate="%{y}<br>%{x}<br>%{text}<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")  # rank 0 on top, as in a table
    if z.size and not np.any(shown):  # nothing to colour: say it, with no bar of colours
        fig.update_traces(showscale=False)
        fig.add_annotation(
            text="all bitwise equal: every rank's gradients are the majority's",
            x=0.5,
            y=1.0,
            xref="paper",
            yref="paper",
            yanchor="bottom",
            showarrow=False,
        )
    # rows keep their height: long parameter names (tilted below) get room of their own
    names_px = min(320, 6 * max((len(n) for n in names), default=0))
    height = min(1400, 180 + 30 * max(len(ranks), 2) + names_px)
    title = f"Gradient deviation from the rank majority at step {step}"
    # plotly tilts the names as far as they need to stay apart (upright past ~30 of them:
    # at a fixed -45 degrees neighbours ran into each other)
    fig.update_xaxes(automargin=True)
    return _layout(fig, title, "parameter", "rank", height, hovermode="closest")


def _deviation_text(value: float) -> str:
    if math.isnan(value):
        return "no gradient"
    if math.isinf(value):
        return "not finite (inf/nan gradient, or a gradient missing on this rank)"
    return "0 (bitwise equal to majority)" if value == 0 else f"deviation {value:.3g}"


def memory_figure(trace: Trace, *, field: str = "rss", max_points: int = 2000) -> go.Figure:
    """One ``StepMemory`` field per rank over steps, in MiB.

    Steps where the field is None (CUDA fields without CUDA) are left out, and so is a rank
    that recorded steps but never the field.
    """
    if field not in MEMORY_FIELDS:
        raise OptionError(f"no memory field {field!r}; valid fields: {', '.join(MEMORY_FIELDS)}")
    fig = go.Figure()
    if len(_ranks(trace)) > GROUP_ABOVE:
        said = _grouped(fig, trace, field, MIB, max_points)
        return step_ticks(_layout(fig, f"Memory: {field}, {said}", "step", f"{field} (MiB)", 420))
    mine = trace.columns.by_rank()
    for rank in _ranks(trace):
        x, y = _rows_series(mine.get(rank), field, MIB, max_points)
        if x or rank not in mine:
            fig.add_trace(_line(x, y, rank))
    return step_ticks(_layout(fig, f"Memory per rank: {field}", "step", f"{field} (MiB)", 420))


def time_breakdown_figure(trace: Trace, *, step: int | None = None) -> go.Figure:
    """Stacked bars, one per rank, of where one step's time went (ms); one trace per phase.

    ``step`` defaults to the last step every rank has recorded.
    """
    step = trace.last_step if step is None else step
    found = trace.at(step)
    ranks = sorted(found)
    fig = go.Figure()
    for i, phase in enumerate(PHASES):
        fig.add_trace(
            go.Bar(
                x=[f"rank {r}" for r in ranks],
                y=[getattr(found[r].times, phase) * 1000 for r in ranks],
                name=phase,
                marker_color=_PHASE_COLORS[i % len(_PHASE_COLORS)],
                hovertemplate=f"%{{x}}<br>{phase}: %{{y:.3f}} ms<extra></extra>",
            )
        )
    fig.update_layout(barmode="stack")
    title = f"Time per phase at step {step}"
    if not ranks:
        title = f"Time per phase: no rank holds step {step}"
    return _layout(fig, title, "rank", "time (ms)", 420, hovermode="closest")


def grad_norm_spread_figure(
    spread: Iterable[tuple[int, float]], *, num_ranks: int | None = None, max_points: int = 2000
) -> go.Figure:
    """Spread of the total gradient norm across ranks, from ``(step, spread)`` pairs
    (``num_ranks``: how many were compared). A spread of 0 at every step (DDP: the ranks
    hold one gradient) is said, as the dashboard says it, instead of drawn alone as a
    flat line on an axis from -1 to 1; a spread is never below 0."""
    pairs = sorted(spread)
    x, y = downsample([s for s, _ in pairs], [v for _, v in pairs], max_points)
    fig = go.Figure(go.Scatter(x=x, y=y, mode="lines", name="spread"))
    title = "Gradient norm spread across ranks"
    note = ""
    if num_ranks == 1:
        title, note = f"{title}: one rank", "one rank: nothing to compare its gradient norm with"
    elif not pairs:
        note = "no step where every rank recorded its gradient norm (recording off?)"
    elif all(v == 0 for _, v in pairs):
        title += ": identical on every rank"
        note = f"the total gradient norm is identical on every rank at all {len(pairs)} steps"
    fig.update_yaxes(rangemode="nonnegative")
    if note:
        fig.update_yaxes(range=[0, 1])  # (plotly's for a flat 0: -1 to 1)
        fig.add_annotation(text=note, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False)
    return step_ticks(_layout(fig, title, "step", "spread (L2 norm)", 380))


def dashboard_series(trace: Trace, max_points: int = 2000) -> list[tuple[list, list]]:
    """The (x, y) of every dashboard trace, in ``dashboard_figure``'s trace order."""
    mine = trace.columns.by_rank()
    return [
        _rows_series(mine.get(rank), *_DASHBOARD_COLUMNS[panel], max_points)
        for panel in DASHBOARD_PANELS
        for rank in _ranks(trace)
    ]


def dashboard_titles(series: Sequence[tuple[list, list]], num_ranks: int) -> list[str]:
    """Each panel's title; "identical on every rank" when the ranks' lines coincide (the
    total gradient norm of a healthy DDP job: one visible line under a legend of many)."""
    titles = []
    for index, title in enumerate(_PANEL_TITLES):
        lines = series[index * num_ranks : (index + 1) * num_ranks]
        same = num_ranks > 1 and lines[0][1] and all(line == lines[0] for line in lines[1:])
        titles.append(f"{title}: identical on every rank" if same else title)
    return titles


def dashboard_trace_index(panel: str, rank_position: int, num_ranks: int) -> int:
    """Index in ``fig.data`` of the dashboard trace of ``panel`` for the rank at
    ``rank_position`` (its position in the sorted ranks)."""
    if panel not in DASHBOARD_PANELS:
        raise ValueError(f"no dashboard panel {panel!r}; panels: {', '.join(DASHBOARD_PANELS)}")
    if not 0 <= rank_position < num_ranks:
        raise ValueError(f"rank_position {rank_position} out of range for {num_ranks} ranks")
    return DASHBOARD_PANELS.index(panel) * num_ranks + rank_position


def dashboard_figure(trace: Trace, *, max_points: int = 2000) -> go.Figure:
    """Loss, total gradient norm and RSS per rank: three rows sharing the step axis.

    Traces: for each panel of ``DASHBOARD_PANELS`` in order, one per rank in rank order.
    A rank's three traces share a legend group, so one click hides it in every panel.
    """
    ranks = _ranks(trace)
    if len(ranks) > GROUP_ABOVE:
        return _grouped_dashboard(trace, max_points)
    every = dashboard_series(trace, max_points)
    fig = make_subplots(
        rows=len(DASHBOARD_PANELS),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.07,
        subplot_titles=dashboard_titles(every, len(ranks)),
    )
    series = iter(every)
    for row, _panel in enumerate(DASHBOARD_PANELS, 1):
        for rank in ranks:
            x, y = next(series)
            fig.add_trace(
                _line(x, y, rank, legendgroup=f"rank {rank}", showlegend=row == 1), row=row, col=1
            )
    return step_ticks(_dashboard_layout(fig, "Training per rank"))


def _grouped_dashboard(trace: Trace, max_points: int) -> go.Figure:
    """The dashboard past GROUP_ABOVE ranks: each panel a band, a median and the ranks
    that stand out (which may change from one refresh to the next: redrawn whole)."""
    fig = make_subplots(
        rows=len(DASHBOARD_PANELS),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.07,
        subplot_titles=_PANEL_TITLES,
    )
    for row, panel in enumerate(DASHBOARD_PANELS, 1):
        said = _grouped(fig, trace, *_DASHBOARD_COLUMNS[panel], max_points, row=row)
        note = fig.layout.annotations[row - 1]
        note.text = f"{note.text}: {said.rpartition(', ')[2]}"  # "none standing out"
    title = f"Training: {len(_ranks(trace))} ranks as a band and a median"
    return step_ticks(_dashboard_layout(fig, title))


def _dashboard_layout(fig: go.Figure, title: str) -> go.Figure:
    for row, unit in enumerate(_PANEL_UNITS, 1):
        fig.update_yaxes(title_text=unit, row=row, col=1)
    fig.update_xaxes(title_text="step", row=len(DASHBOARD_PANELS), col=1)
    # with the controls above it, the dashboard fits a 900 px high window
    fig.update_layout(
        title=title,
        template=TEMPLATE,
        height=DASHBOARD_HEIGHT,
        margin={"t": 60, "b": 40},
        hovermode="x",
    )
    return fig
