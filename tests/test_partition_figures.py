"""Partition figures are pure functions of plans, balances and schedules: read fig.data and
fig.layout, no browser, no cluster."""

from dataclasses import replace

import plotly.graph_objects as go
import pytest

from dtlab.analysis.balance import Balance, StageBalance
from dtlab.records import Plan
from dtlab.records.stages import BlockCost, ScheduleEvent
from dtlab.views.partition_figures import (
    SLOWEST_COLOUR,
    balance_comparison_figure,
    balance_figure,
    plan_strip_figure,
    schedule_figure,
    stage_blocks,
    stage_colour,
)
from dtlab.views.partition_tables import balance_table

MIB = 1024 * 1024
PLAN = Plan(blocks=("embed", "blocks.0", "blocks.1", "blocks.2", "head"), bounds=(0, 2, 4, 5))


def stage(s, forward_s=0.010, backward_s=0.020, activation_bytes=4 * MIB, rank="same"):
    return StageBalance(
        stage=s,
        rank=s if rank == "same" else rank,
        blocks=stage_blocks(PLAN)[s],
        num_params=1000 * (s + 1),
        param_bytes=(s + 1) * MIB,
        grad_bytes=(s + 1) * MIB,
        optimizer_bytes=2 * (s + 1) * MIB,
        activation_bytes=activation_bytes,
        forward_s=forward_s,
        backward_s=backward_s,
    )


def balance(stages, *, measured=True, step_s=0.120, bubble=0.25):
    return Balance(
        plan=PLAN,
        stages=tuple(stages),
        microbatches=4,
        schedule="1f1b",
        measured=measured,
        step_s=step_s,
        bubble=bubble,
    )


def profiled():
    """Stage 1 is the slowest: 15 + 30 ms against 10 + 20 ms."""
    return balance([stage(0), stage(1, 0.015, 0.030), stage(2)])


def unprofiled():
    stages = [stage(s, None, None, activation_bytes=None, rank=None) for s in range(3)]
    return balance(stages, measured=False, step_s=None, bubble=None)


def by_name(fig):
    return {t.name: t for t in fig.data}


def annotation_texts(fig):
    return [a.text for a in fig.layout.annotations]


def test_stage_colour_is_stable_distinct_and_wraps():
    assert stage_colour(0) == stage_colour(0)
    assert len({stage_colour(s) for s in range(8)}) == 8
    assert stage_colour(0) == stage_colour(len({stage_colour(s) for s in range(100)}))


def test_stage_blocks_follow_the_bounds():
    assert stage_blocks(PLAN) == [("embed", "blocks.0"), ("blocks.1", "blocks.2"), ("head",)]


def test_balance_figure_stacks_forward_and_backward_ms_per_stage():
    fig = balance_figure(profiled())
    assert isinstance(fig, go.Figure)
    assert fig.layout.barmode == "stack"
    traces = by_name(fig)
    labels = ["stage 0 (rank 0)", "stage 1 (rank 1)", "stage 2 (rank 2)"]
    assert list(traces["forward"].x) == labels
    assert list(traces["forward"].y) == pytest.approx([10, 15, 10])
    assert list(traces["backward"].y) == pytest.approx([20, 30, 20])
    assert traces["forward"].xaxis == "x" and traces["parameters"].xaxis == "x2"
    assert "embed, blocks.0" in traces["forward"].hovertext[0]


def test_balance_figure_marks_the_slowest_stage():
    fig = balance_figure(profiled())
    for phase in ("forward", "backward"):
        line = by_name(fig)[phase].marker.line
        assert list(line.width) == [0, 3, 0]
        assert line.color == SLOWEST_COLOUR
    (slowest,) = [a for a in fig.layout.annotations if a.text == "slowest"]
    assert slowest.x == "stage 1 (rank 1)" and slowest.y == pytest.approx(45)


def test_balance_title_says_measured_step_bubble_and_imbalance():
    title = balance_figure(profiled()).layout.title
    assert title.text == "Measured balance (1f1b, 4 micro-batches)"
    # imbalance: 45 ms against a mean of 35 ms; a line of its own, so it is not clipped
    facts = title.subtitle.text
    assert "step 120.0 ms" in facts and "bubble 25%" in facts and "imbalance 1.29x" in facts


@pytest.mark.parametrize("n, text", [(1, "1 micro-batch"), (4, "4 micro-batches")])
def test_balance_title_and_table_count_micro_batches_in_words(n, text):
    one_or_more = replace(profiled(), microbatches=n)
    assert balance_figure(one_or_more).layout.title.text == f"Measured balance (1f1b, {text})"
    note = balance_table(one_or_more).notes[0]
    assert note.startswith(f"measured: 1f1b, {text};"), note


def test_balance_figure_memory_stacks_in_mib():
    fig = balance_figure(profiled())
    traces = by_name(fig)
    # compute and memory series in two legends, each titled
    assert {t.name: t.legend for t in fig.data if t.legend} == {
        "parameters": "legend2",
        "gradients": "legend2",
        "optimizer": "legend2",
        "activations": "legend2",
    }
    assert fig.layout.legend.title.text == "compute" and fig.layout.legend2.title.text == "memory"
    assert list(traces["parameters"].y) == pytest.approx([1, 2, 3])
    assert list(traces["gradients"].y) == pytest.approx([1, 2, 3])
    assert list(traces["optimizer"].y) == pytest.approx([2, 4, 6])
    assert list(traces["activations"].y) == pytest.approx([4, 4, 4])
    assert "head" in traces["parameters"].hovertext[2]


def test_unprofiled_balance_draws_no_time_bars_and_says_so():
    fig = balance_figure(unprofiled())
    assert [t.name for t in fig.data] == ["parameters", "gradients", "optimizer"]
    assert list(fig.data[0].x) == ["stage 0", "stage 1", "stage 2"]
    assert "compute not profiled yet" in annotation_texts(fig)
    assert "slowest" not in annotation_texts(fig)
    assert fig.layout.title.text.startswith("Predicted balance")
    assert fig.layout.title.subtitle.text == "not profiled yet"
    # the note is the memory panel's second title line (one annotation at the same height
    # drew over the panel's title)
    (memory_title,) = [t for t in annotation_texts(fig) if t.startswith("Memory per stage")]
    assert "activations not measured: %dt_partition --profile" in memory_title


def test_one_stage_has_no_slowest_mark():
    fig = balance_figure(balance([stage(0)]))
    assert "slowest" not in annotation_texts(fig)
    assert list(fig.data[0].marker.line.width) == [0]


EVENTS = (
    ScheduleEvent(0, 0, "F", 0.000, 0.010),
    ScheduleEvent(1, 0, "F", 0.010, 0.020),
    ScheduleEvent(0, 1, "F", 0.010, 0.020),
    ScheduleEvent(1, 0, "B", 0.020, 0.040),
    ScheduleEvent(0, 0, "B", 0.045, 0.065),
)


def test_schedule_figure_one_bar_per_event_from_start_to_end():
    fig = schedule_figure(EVENTS)
    forward, backward = fig.data
    assert (forward.name, backward.name) == ("forward", "backward")
    assert forward.orientation == backward.orientation == "h"
    assert list(forward.y) == ["stage 0", "stage 1", "stage 0"]
    assert list(forward.base) == pytest.approx([0, 10, 10])
    assert list(forward.x) == pytest.approx([10, 10, 10])
    assert list(forward.text) == ["0", "0", "1"]
    assert list(backward.base) == pytest.approx([20, 45])
    assert list(backward.x) == pytest.approx([20, 20])
    assert forward.marker.color != backward.marker.color
    assert list(backward.customdata[1]) == pytest.approx([0, 45, 65])


def test_schedule_figure_rows_stage_0_on_top_bars_not_offset():
    fig = schedule_figure(EVENTS, title="Step 3")
    assert list(fig.layout.yaxis.categoryarray) == ["stage 0", "stage 1"]
    assert fig.layout.yaxis.autorange == "reversed"
    assert fig.layout.barmode == "overlay"
    # a sliver's number is hidden, not shrunk to unreadable: its hover still names it
    assert (fig.layout.uniformtext.mode, fig.layout.uniformtext.minsize) == ("hide", 10)
    assert "micro-batch %{customdata[0]}" in fig.data[0].hovertemplate
    assert fig.layout.title.text == "Step 3"
    assert fig.layout.xaxis.title.text == "time from step start (ms)"


def test_schedule_figure_without_events_says_no_step_yet():
    fig = schedule_figure([])
    assert [t.name for t in fig.data] == ["forward", "backward"]
    assert all(len(t.x) == 0 for t in fig.data)
    assert any("No step has run yet" in t for t in annotation_texts(fig))


def test_schedule_figure_refuses_an_unknown_phase():
    with pytest.raises(ValueError, match="'W'.*F, B"):
        schedule_figure([ScheduleEvent(0, 0, "W", 0.0, 0.1)])


def test_plan_strip_without_costs_is_a_row_of_equal_boxes_by_stage():
    fig = plan_strip_figure(PLAN)
    assert [t.name for t in fig.data] == ["stage 0", "stage 1", "stage 2"]
    assert [list(t.x) for t in fig.data] == [
        ["embed", "blocks.0"],
        ["blocks.1", "blocks.2"],
        ["head"],
    ]
    assert all(set(t.y) == {1.0} for t in fig.data)
    assert [t.marker.color for t in fig.data] == [stage_colour(s) for s in range(3)]
    assert list(fig.layout.xaxis.categoryarray) == list(PLAN.blocks)
    assert [s.x0 for s in fig.layout.shapes] == [1.5, 3.5]  # the stage boundaries
    assert "3 stages over 5 blocks" in fig.layout.title.text


def test_plan_strip_uses_measured_ms_when_every_block_is_profiled():
    costs = {
        b: BlockCost(b, 100 * i, 400 * i, 0.001 * i, 0.002 * i)
        for i, b in enumerate(PLAN.blocks, 1)
    }
    fig = plan_strip_figure(PLAN, costs=costs)
    assert [y for t in fig.data for y in t.y] == pytest.approx([3, 6, 9, 12, 15])
    assert fig.layout.yaxis.title.text == "forward + backward (ms)"


def test_plan_strip_falls_back_to_parameter_counts():
    costs = {b: BlockCost(b, 100 * i, 400 * i) for i, b in enumerate(PLAN.blocks, 1)}
    del costs["head"]
    fig = plan_strip_figure(PLAN, ["red", "blue"], costs=costs)
    assert [y for t in fig.data for y in t.y] == [100, 200, 300, 400, None]
    assert fig.layout.yaxis.title.text == "parameters"
    assert [t.marker.color for t in fig.data] == ["red", "blue", "red"]


def test_balance_comparison_groups_before_and_after_per_stage():
    after = balance([stage(0, 0.012, 0.024), stage(1, 0.012, 0.024)], measured=False, step_s=0.100)
    fig = balance_comparison_figure(profiled(), after)
    before_bars, after_bars = fig.data
    assert (before_bars.name, after_bars.name) == ("before", "after")
    assert list(before_bars.x) == ["stage 0", "stage 1", "stage 2"]
    assert list(before_bars.y) == pytest.approx([30, 45, 30])
    assert list(after_bars.y) == pytest.approx([36, 36])
    assert fig.layout.barmode == "group"
    assert "120.0 ms (measured) → 100.0 ms (predicted)" in fig.layout.title.text


def test_balance_comparison_with_unprofiled_side():
    partial = replace(profiled(), step_s=None)
    fig = balance_comparison_figure(unprofiled(), partial)
    assert list(fig.data[0].y) == [None, None, None]
    assert "step not profiled yet → not profiled yet" in fig.layout.title.text
