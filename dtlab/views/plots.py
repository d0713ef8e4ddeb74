"""A figure of a trace by name: what ``%dt_plot KIND`` shows (analysis, then a figure)."""

from __future__ import annotations

from collections.abc import Mapping

import plotly.graph_objects as go

from dtlab.analysis.divergence import deviation_matrix
from dtlab.analysis.trends import grad_norm_spread
from dtlab.control.errors import OptionError
from dtlab.records import StepRecord
from dtlab.records.trace import Trace
from dtlab.views import figures

KINDS = ("loss", "memory", "times", "deviation", "spread")


def figure_for(
    trace: Trace,
    kind: str,
    *,
    step: int | None = None,
    field: str = "rss",
    other: Trace | None = None,
    details: Mapping[int, StepRecord] | None = None,
) -> go.Figure:
    """``kind`` is one of KINDS; ``step`` picks the step of "times" (default the last),
    ``field`` the memory counter, ``other`` a second run to overlay on "loss"; "deviation"
    needs ``details``, the per-parameter records of one step (``dt.step_details(step)``)."""
    if kind not in KINDS:
        raise OptionError(f"no plot {kind!r}; choose one of {', '.join(KINDS)}")
    if kind == "loss":
        return figures.loss_figure(trace, other)
    if kind == "memory":
        return figures.memory_figure(trace, field=field)
    if kind == "spread":
        spread = grad_norm_spread(trace.records)
        return figures.grad_norm_spread_figure(spread, num_ranks=len(trace.ranks))
    step = trace.last_step if step is None else step
    if kind == "times":
        return figures.time_breakdown_figure(trace, step=step)
    if not details:
        raise ValueError("a deviation plot needs the per-parameter records of one step")
    ranks, matrix = deviation_matrix(details)
    shown = next(iter(details.values())).step
    return figures.deviation_heatmap(ranks, matrix, trace.param_names, step=shown)
