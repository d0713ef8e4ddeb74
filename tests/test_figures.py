"""Figures are pure functions of results: read fig.data / fig.layout, no browser."""

from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import pytest

from dtlab.records import StepMemory, StepTimes
from dtlab.records.trace import Trace
from dtlab.views.figures import (
    DASHBOARD_PANELS,
    dashboard_figure,
    dashboard_series,
    dashboard_trace_index,
    deviation_heatmap,
    grad_norm_spread_figure,
    loss_figure,
    memory_figure,
    rank_color,
    time_breakdown_figure,
)
from tests.fakes import PARAMS, healthy_trace, job_info, step_record

MIB = 1024 * 1024


def trace_of(num_ranks, num_steps, **per_record):
    """A trace whose records get ``per_record[name](rank, step)`` for each named field."""
    trace = Trace({r: job_info(r) for r in range(num_ranks)})
    for rank in range(num_ranks):
        recs = [
            step_record(s, rank, **{k: f(rank, s) for k, f in per_record.items()})
            for s in range(1, num_steps + 1)
        ]
        trace.add(rank, recs)
    return trace


def empty_trace(num_ranks=2):
    return Trace({r: job_info(r) for r in range(num_ranks)})


def by_name(fig):
    return {t.name: t for t in fig.data}


def test_loss_figure_one_line_per_rank_with_its_values():
    trace = trace_of(3, 5, loss=lambda r, s: 10 * r + s)
    fig = loss_figure(trace)
    assert isinstance(fig, go.Figure)
    assert [t.name for t in fig.data] == ["rank 0", "rank 1", "rank 2"]
    assert list(fig.data[2].x) == [1, 2, 3, 4, 5]
    assert list(fig.data[2].y) == [21, 22, 23, 24, 25]
    assert fig.layout.xaxis.title.text == "step"
    assert fig.layout.yaxis.title.text == "loss"
    assert "Loss" in fig.layout.title.text


def test_other_run_is_overlaid_dashed_with_the_same_colours():
    trace = trace_of(2, 4, loss=lambda r, s: 1.0)
    other = trace_of(2, 6, loss=lambda r, s: 2.0)
    other.folder = Path("runs/20240101-000000")
    fig = loss_figure(trace, other)
    names = [t.name for t in fig.data]
    assert names == ["rank 0", "rank 1", "rank 0 (other)", "rank 1 (other)"]
    mine, theirs = by_name(fig)["rank 1"], by_name(fig)["rank 1 (other)"]
    assert theirs.line.dash == "dash" and mine.line.dash is None
    assert theirs.line.color == mine.line.color == rank_color(1)
    assert list(theirs.x) == [1, 2, 3, 4, 5, 6] and set(theirs.y) == {2.0}
    assert "20240101-000000" in fig.layout.title.text and "this run" in fig.layout.title.text


def test_rank_colours_are_the_same_in_every_figure():
    trace = healthy_trace(num_ranks=8, num_steps=3)
    colours = {rank_color(r) for r in range(8)}
    assert len(colours) == 8
    for fig in (loss_figure(trace), memory_figure(trace), dashboard_figure(trace)):
        for t in fig.data:
            rank = int(t.name.split()[1])
            assert t.line.color == rank_color(rank)


def test_downsampling_caps_points_and_keeps_first_and_last_step():
    trace = healthy_trace(num_ranks=2, num_steps=1234)
    fig = loss_figure(trace, max_points=100)
    for t in fig.data:
        assert len(t.x) <= 100
        assert t.x[0] == 1 and t.x[-1] == 1234
        assert list(t.x) == sorted(set(t.x))
    # y stays paired with x after downsampling
    rec = trace.records[0]
    assert list(fig.data[0].y) == [rec[s - 1].loss for s in fig.data[0].x]
    assert len(loss_figure(trace).data[0].x) == 1234  # under the default cap: every point
    with pytest.raises(ValueError, match="max_points"):
        loss_figure(trace, max_points=1)


def test_heatmap_axes_values_and_zero_cells():
    names = [p.name for p in PARAMS]
    matrix = np.zeros((3, 4))
    matrix[1, 2] = 1e-7
    matrix[2, 0] = 0.5
    fig = deviation_heatmap((0, 1, 3), matrix, names, step=42)
    (heat,) = fig.data
    assert heat.type == "heatmap"
    assert list(heat.y) == ["rank 0", "rank 1", "rank 3"]
    assert list(heat.x) == names
    assert np.array_equal(np.asarray(heat.z), matrix)
    assert heat.zmin == 0 and heat.zmax == 0.5
    scale = [tuple(c) for c in heat.colorscale]
    assert scale[0] == (0.0, "white")
    # the first value above zero is already a non-white colour
    assert scale[1][0] < 1e-6 and scale[1][1] != "white"
    assert heat.showscale is not False and heat.colorbar.title.text == "deviation"
    assert "42" in fig.layout.title.text
    assert heat.text[0][0].startswith("0 ")
    assert "1e-07" in heat.text[1][2]
    assert "%{text}" in heat.hovertemplate


def test_heatmap_shows_non_finite_cells_at_the_top_of_the_scale():
    matrix = np.array([[0.0, 0.2], [np.inf, 0.0]])
    heat = deviation_heatmap((0, 1), matrix, ["a", "b"], step=3).data[0]
    assert np.asarray(heat.z)[1, 0] == heat.zmax == 0.2  # not a blank (white-looking) cell
    assert heat.text[1][0].startswith("not finite")
    assert heat.to_plotly_json()["z"][1][0] == 0.2


def test_heatmap_all_equal_and_bad_shape():
    fig = deviation_heatmap((0, 1), np.zeros((2, 3)), ["a", "b", "c"], step=1)
    assert fig.data[0].zmax > 0  # all white, not a degenerate 0..0 scale
    # all white says why, with no colour bar whose first colour is not white
    assert fig.data[0].showscale is False
    assert any("all bitwise equal" in n.text for n in fig.layout.annotations)
    differ = deviation_heatmap((0, 1), [[0, 0, 0], [0, 2.0, 0]], ["a", "b", "c"], step=1)
    assert differ.data[0].showscale is not False and not differ.layout.annotations
    assert differ.data[0].colorbar.ticktext[0] == "0 (equal, white)"
    long_names = [f"encoder.layers.{i}.self_attention.query_key_value.weight" for i in range(3)]
    tall = deviation_heatmap((0, 1), np.zeros((2, 3)), long_names, step=1)
    # the names tilted below get room of their own: the rows are not squashed by them
    assert tall.layout.height >= fig.layout.height + 250
    with pytest.raises(ValueError, match="shape"):
        deviation_heatmap((0, 1), np.zeros((2, 3)), ["a", "b"], step=1)
    empty = deviation_heatmap((), np.zeros((0, 0)), [], step=0)
    assert len(empty.data) == 1


def test_memory_figure_in_mib_and_cuda_none_skipped():
    def memory(rank, step):
        cuda = None if rank == 1 or step == 2 else (rank + 1) * MIB * step
        return StepMemory(
            rss=(100 + rank) * MIB,
            param_bytes=0,
            grad_bytes=0,
            optimizer_bytes=0,
            cuda_allocated=cuda,
        )

    trace = trace_of(3, 3, memory=memory)
    rss = memory_figure(trace)
    assert list(rss.data[2].y) == [102.0, 102.0, 102.0]
    assert rss.layout.yaxis.title.text == "rss (MiB)"
    cuda = memory_figure(trace, field="cuda_allocated")
    assert [t.name for t in cuda.data] == ["rank 0", "rank 2"]  # rank 1 never had CUDA
    assert list(by_name(cuda)["rank 2"].x) == [1, 3]
    assert list(by_name(cuda)["rank 2"].y) == [3.0, 9.0]


def test_memory_figure_bad_field_names_the_valid_ones():
    with pytest.raises(ValueError, match="cuda_reserved") as err:
        memory_figure(healthy_trace(2, 2), field="vram")
    assert "vram" in str(err.value) and "rss" in str(err.value)


def test_time_breakdown_stacks_phases_in_ms():
    def times(rank, step):
        if (rank, step) == (1, 2):  # one odd step: the figure shows the median
            return StepTimes(0.5, 0, 0, 0, 0.25)
        return StepTimes(data=0.001 * (rank + 1), forward=0.01, backward=0.02, optimizer=0.005)

    trace = trace_of(2, 3, times=times)
    fig = time_breakdown_figure(trace)
    assert fig.layout.barmode == "stack"
    assert [t.name for t in fig.data] == ["data", "forward", "backward", "optimizer", "record"]
    assert all(t.type == "bar" for t in fig.data)
    data = by_name(fig)["data"]
    assert list(data.x) == ["rank 0", "rank 1"]
    assert list(data.y) == pytest.approx([1.0, 2.0])
    assert "3" in fig.layout.title.text
    assert fig.layout.yaxis.title.text == "time (ms)"
    at2 = time_breakdown_figure(trace, step=2)
    assert by_name(at2)["data"].y[1] == pytest.approx(500.0)
    assert by_name(at2)["record"].y[1] == pytest.approx(250.0)


def test_grad_norm_spread_figure():
    fig = grad_norm_spread_figure([(3, 0.3), (1, 0.1), (2, 0.0)])
    assert list(fig.data[0].x) == [1, 2, 3]
    assert list(fig.data[0].y) == [0.1, 0.0, 0.3]
    assert fig.layout.xaxis.title.text == "step"
    assert len(grad_norm_spread_figure([]).data) == 1


def test_empty_trace_gives_the_same_structure():
    trace = empty_trace(2)
    assert [t.name for t in loss_figure(trace).data] == ["rank 0", "rank 1"]
    assert all(len(t.x) == 0 for t in loss_figure(trace).data)
    assert len(memory_figure(trace, field="cuda_peak").data) == 2
    bars = time_breakdown_figure(trace)
    assert len(bars.data) == 5 and all(len(t.x) == 0 for t in bars.data)
    dash = dashboard_figure(trace)
    assert len(dash.data) == 3 * 2 and all(len(t.x) == 0 for t in dash.data)
    assert dashboard_series(trace) == [([], [])] * 6


def test_dashboard_order_series_and_index():
    norms = lambda r, s: (3.0 * (r + 1), float("nan"), 4.0 * (r + 1), 0.0)  # noqa: E731
    trace = trace_of(3, 4, loss=lambda r, s: r + s / 10, grad_norms=norms)
    trace.add(2, [step_record(5, 2, grad_norms=())])  # recording off at step 5
    fig = dashboard_figure(trace)
    series = dashboard_series(trace)
    assert DASHBOARD_PANELS == ("loss", "grad_norm", "memory")
    assert len(fig.data) == len(series) == 9
    for t, (x, y) in zip(fig.data, series, strict=True):
        assert list(t.x) == x and list(t.y) == y
    i = dashboard_trace_index("grad_norm", 2, 3)
    assert fig.data[i].name == "rank 2" and fig.data[i].yaxis == "y2"
    assert series[i] == ([1, 2, 3, 4], [15.0] * 4)  # sqrt(9^2 + 12^2), nan ignored
    assert fig.data[dashboard_trace_index("loss", 1, 3)].y[0] == pytest.approx(1.1)
    mem = fig.data[dashboard_trace_index("memory", 0, 3)]
    assert mem.yaxis == "y3" and mem.y[0] == pytest.approx(500_000_000 / MIB)
    assert [t.showlegend for t in fig.data] == [True] * 3 + [False] * 6
    assert fig.layout.xaxis3.title.text == "step"
    assert fig.layout.yaxis3.title.text == "MiB"
    assert fig.layout.xaxis.matches == "x3" or fig.layout.xaxis2.matches == "x3"
    with pytest.raises(ValueError, match="panels"):
        dashboard_trace_index("speed", 0, 3)
    with pytest.raises(ValueError):
        dashboard_trace_index("loss", 3, 3)


def test_dashboard_live_update_in_place_matches_a_fresh_figure():
    trace = healthy_trace(num_ranks=2, num_steps=3)
    fig = dashboard_figure(trace)
    for rank in range(2):
        trace.add(rank, [step_record(s, rank) for s in range(4, 7)])
    with fig.batch_update():
        for t, (x, y) in zip(fig.data, dashboard_series(trace), strict=True):
            t.x, t.y = x, y
    assert fig.to_plotly_json()["data"] == dashboard_figure(trace).to_plotly_json()["data"]


def test_the_dashboard_says_when_every_rank_draws_the_same_line_and_fits_a_window():
    from dtlab.views.figures import DASHBOARD_HEIGHT, dashboard_titles

    trace = healthy_trace(num_ranks=4, num_steps=5)  # DDP: one gradient norm on all ranks
    fig = dashboard_figure(trace)
    titles = [a.text for a in fig.layout.annotations]
    assert titles[1] == "Total gradient norm: identical on every rank"
    assert titles[0] == "Loss: identical on every rank" and titles[2].startswith("Memory")
    differ = trace_of(2, 3, loss=lambda r, s: r + s)
    assert dashboard_titles(dashboard_series(differ), 2)[0] == "Loss"
    assert fig.layout.height == DASHBOARD_HEIGHT <= 640  # + the controls: under 900 px


def test_recording_off_leaves_grad_norm_panel_empty():
    trace = trace_of(2, 3, grad_norms=lambda r, s: ())
    series = dashboard_series(trace)
    assert all(series[dashboard_trace_index("grad_norm", p, 2)] == ([], []) for p in range(2))


def test_every_figure_has_the_white_template_and_a_height():
    trace = healthy_trace(2, 3)
    figs = [
        loss_figure(trace),
        memory_figure(trace),
        time_breakdown_figure(trace),
        grad_norm_spread_figure([(1, 0.0)]),
        dashboard_figure(trace),
        deviation_heatmap((0, 1), np.zeros((2, 4)), [p.name for p in PARAMS], step=3),
    ]
    white = go.Figure(layout={"template": "plotly_white"}).layout.template
    for fig in figs:
        assert fig.layout.template == white
        assert fig.layout.height and fig.layout.height >= 300
        assert fig.layout.title.text


def many_ranks(num_ranks=64, num_steps=30, **odd):
    """A data-parallel trace of many ranks; ``odd``: {rank: {step: changes}}."""
    trace = Trace({r: job_info(r) for r in range(num_ranks)})
    rng = np.random.default_rng(0)
    for rank in range(num_ranks):
        recs = []
        for step in range(1, num_steps + 1):
            changes = odd.get(f"r{rank}", {}).get(step, {})
            loss = 2.0 / step + 0.01 * rng.standard_normal()
            recs.append(step_record(step, rank, **{"loss": loss, **changes}))
        trace.add(rank, recs)
    return trace


def test_many_ranks_are_a_band_a_median_and_the_ranks_that_stand_out():
    leak = {
        s: {"memory": StepMemory(500_000_000 + s * 40 * MIB, 592, 592, 1184)} for s in range(10, 31)
    }
    nan = {s: {"loss": float("nan")} for s in range(20, 31)}
    trace = many_ranks(r17=leak, r40=nan)
    fig = loss_figure(trace)
    names = [t.name for t in fig.data]
    # the band (two edges), the median, and rank 40 whose loss went NaN: not 64 lines
    assert names[1:3] == ["lowest to highest of 64 ranks", "median of 64 ranks"]
    assert names[3:] == ["rank 40 (stands out)"] and "1 rank standing out" in fig.layout.title.text
    assert len(fig.data[2].y) == 30 and min(fig.data[1].y) < fig.data[2].y[5] < max(fig.data[0].y)
    memory = memory_figure(trace)
    assert [t.name for t in memory.data[3:]] == ["rank 17 (stands out)"]
    assert memory.data[3].y[-1] == pytest.approx((500_000_000 + 30 * 40 * MIB) / MIB)
    # every rank alike: no rank is singled out
    calm = memory_figure(many_ranks())
    assert len(calm.data) == 3 and "none standing out" in calm.layout.title.text


def test_the_dashboard_of_many_ranks_is_bands_and_the_ranks_that_stand_out():
    nan = {s: {"loss": float("nan")} for s in range(20, 31)}
    fig = dashboard_figure(many_ranks(r40=nan))
    names = [t.name for t in fig.data]
    assert len(fig.data) <= 3 * (3 + 4) and names.count("rank 40 (stands out)") == 1
    titles = [note.text for note in fig.layout.annotations]
    assert (
        titles[0] == "Loss: 1 rank standing out" and titles[2] == "Memory (RSS): none standing out"
    )
    assert sum(t.showlegend is not False for t in fig.data if "median" in t.name) == 1


# --- what a person sees: no empty plot, whole steps ---------------------------------------


def test_a_spread_of_zero_everywhere_says_identical_on_every_rank_on_a_sane_axis():
    from dtlab.views.plots import figure_for

    trace = healthy_trace(num_ranks=4, num_steps=12)  # DDP: one gradient norm on all ranks
    fig = figure_for(trace, "spread")
    assert fig.layout.title.text == "Gradient norm spread across ranks: identical on every rank"
    (note,) = fig.layout.annotations
    assert "identical on every rank at all 12 steps" in note.text
    assert tuple(fig.layout.yaxis.range) == (0, 1)  # not plotly's -1..1 around a flat 0
    assert fig.layout.yaxis.rangemode == "nonnegative"
    assert list(fig.data[0].y) == [0.0] * 12  # the line is still there, at 0


def test_a_spread_that_varies_is_drawn_plainly_and_one_rank_is_said():
    from dtlab.views.plots import figure_for

    norms = lambda r, s: (1.0 + r, 2.0)  # noqa: E731
    fig = figure_for(trace_of(2, 12, grad_norms=norms), "spread")
    assert fig.layout.title.text == "Gradient norm spread across ranks"
    assert not fig.layout.annotations and fig.layout.yaxis.range is None
    assert fig.layout.yaxis.rangemode == "nonnegative"  # a spread is never below 0
    alone = figure_for(healthy_trace(num_ranks=1, num_steps=5), "spread")
    assert alone.layout.title.text.endswith(": one rank")
    assert "nothing to compare" in alone.layout.annotations[0].text
    off = grad_norm_spread_figure([])
    assert "recording off" in off.layout.annotations[0].text


def test_step_axes_tick_whole_steps():
    few = loss_figure(trace_of(2, 5, loss=lambda r, s: s))  # plotly would tick 1.5, 2, 2.5...
    assert few.layout.xaxis.dtick == 1
    many = loss_figure(trace_of(2, 31, loss=lambda r, s: s))  # plotly's own: 5, 10, 15...
    assert many.layout.xaxis.dtick is None
    for fig in (memory_figure(trace_of(2, 5)), dashboard_figure(trace_of(2, 5))):
        assert all(axis.dtick == 1 for axis in fig.select_xaxes())
    bars = time_breakdown_figure(trace_of(2, 5))  # x is ranks, not steps: left alone
    assert bars.layout.xaxis.dtick is None
