"""All_reduce sweeps as nccl-tests prints them, and bus bandwidth per message size."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from dtlab.analysis.bandwidth import Sweep
from dtlab.views.figures import _layout
from dtlab.views.tables import Table

MAX_SIZE_TICKS = 8  # "256 KiB" is ~50 px: eight fit a notebook-wide figure


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def bandwidth_table(sweep: Sweep) -> Table:
    """Size, time (us), algbw and busbw (GB/s) per message size, as all_reduce_perf does."""
    rows = tuple(
        (_size(p.size), f"{p.time_s * 1e6:.1f}", f"{p.algbw / 1e9:.3f}", f"{p.busbw / 1e9:.3f}")
        for p in sweep.points
    )
    notes = (
        f"{sweep.label}: all_reduce of {sweep.dtype} on {sweep.world_size} ranks "
        f"({sweep.backend}); slowest rank's mean time; busbw = algbw x 2(n-1)/n; "
        f"peak busbw {sweep.peak_busbw / 1e9:.3f} GB/s",
    )
    return Table(sweep.label, ("size", "time (us)", "algbw (GB/s)", "busbw (GB/s)"), rows, notes)


def bandwidth_figure(sweeps: Sequence[Sweep]) -> go.Figure:
    """Bus bandwidth against message size, one line per sweep (an A/B of settings)."""
    fig = go.Figure()
    for sweep in sweeps:
        fig.add_trace(
            go.Scatter(
                x=[p.size for p in sweep.points],
                y=[p.busbw / 1e9 for p in sweep.points],
                mode="lines+markers",
                name=sweep.label,
                customdata=[p.time_s * 1e6 for p in sweep.points],
                hovertemplate="%{x} B: %{y:.3f} GB/s (%{customdata:.1f} us)<extra>%{fullData.name}"
                "</extra>",
            )
        )
    world = sweeps[0].world_size if sweeps else 0
    _layout(
        fig,
        f"all_reduce bus bandwidth, {world} ranks",
        "message size (bytes per rank)",
        "busbw (GB/s)",
        380,
        hovermode="closest",
    )
    # ticks at swept sizes, in bytes as the table writes them: plotly's own log ticks
    # labelled 2..9 between decades, and "9" ran into "1000"
    sizes = sorted({p.size for sweep in sweeps for p in sweep.points})
    ticks = sizes[:: -(-len(sizes) // MAX_SIZE_TICKS)] if sizes else []
    fig.update_xaxes(type="log", tickvals=ticks, ticktext=[_size(n) for n in ticks])
    return fig
