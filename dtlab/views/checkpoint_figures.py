"""Figures of checkpoints and replays: pure functions of traces and catalogue entries.

- :func:`checkpoint_loss_figure`: the loss per rank with a marker per checkpoint (trace
  ``"checkpoints"``; each marker's ``customdata`` is its folder, for the browser widget);
- :func:`replay_figure`: original (solid) and replayed (dashed) loss per rank, the first
  step where they differ marked.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from dtlab.records.checkpoints import CheckpointInfo
from dtlab.records.trace import Trace
from dtlab.views.figures import _layout, _line, _loss, _ranks, _series, step_ticks

MARKERS = {
    "complete": ("diamond", "#2a9d8f"),
    "partial": ("x", "#8d99ae"),
    "corrupt": ("x", "#d62828"),
}


def _mean_loss(trace: Trace, step: int) -> float | None:
    losses = [r.loss for r in trace.at(step).values()]
    return sum(losses) / len(losses) if losses else None


def checkpoint_loss_figure(
    trace: Trace, checkpoints: Sequence[CheckpointInfo], *, max_points: int = 2000
) -> go.Figure:
    """Loss per rank, one marker per checkpoint at its step (on the mean loss there, or
    the loss its manifest recorded); partial and corrupt ones drawn as crosses."""
    fig = go.Figure()
    for rank in _ranks(trace):
        fig.add_trace(_line(*_series(trace.records[rank], _loss, max_points), rank))
    ys = []
    for c in checkpoints:
        y = _mean_loss(trace, c.step)
        ys.append(y if y is not None else c.loss)
    fig.add_trace(
        go.Scatter(
            name="checkpoints",
            x=[c.step for c in checkpoints],
            y=ys,
            mode="markers",
            marker={
                "symbol": [MARKERS[c.status][0] for c in checkpoints],
                "size": 13,
                "color": [MARKERS[c.status][1] for c in checkpoints],
            },
            customdata=[str(c.path) for c in checkpoints],
            hovertext=[
                f"step {c.step}: {c.status}" + (f" ({c.problem})" if c.problem else "")
                for c in checkpoints
            ],
            hoverinfo="text",
        )
    )
    # "closest": a click then lands on the marker, not on every trace at that step
    title = "Loss per rank and checkpoints (click one to select it)"
    return step_ticks(_layout(fig, title, "step", "loss", 420, hovermode="closest"))


def replay_figure(
    original: Trace, replayed: Trace, *, first_difference: int | None = None, max_points: int = 2000
) -> go.Figure:
    """Original loss per rank (solid) and the replay's (dashed) over the replayed steps;
    a vertical line at the first step where they differ."""
    steps = [r.step for recs in replayed.records.values() for r in recs]
    first, last = (min(steps), max(steps)) if steps else (0, 0)
    fig = go.Figure()
    for rank in _ranks(original):
        kept = [r for r in original.records[rank] if first <= r.step <= last]
        fig.add_trace(_line(*_series(kept, _loss, max_points), rank, suffix=" (original)"))
    for rank in _ranks(replayed):
        x, y = _series(replayed.records[rank], _loss, max_points)
        fig.add_trace(_line(x, y, rank, suffix=" (replay)", dash="dash"))
    if first_difference is not None:
        fig.add_vline(
            x=first_difference,
            line_dash="dot",
            line_color="#d62828",
            annotation_text=f"first difference: step {first_difference}",
        )
        title = f"Original (solid) vs replay (dashed): they part at step {first_difference}"
    else:
        title = "Original (solid) vs replay (dashed): identical"
    return step_ticks(_layout(fig, title, "step", "loss", 420))
