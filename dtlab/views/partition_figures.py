"""Figures of pipeline partitions: pure functions of plans, balances and schedules.

Runs in the notebook kernel; nothing here shows anything (the partition editor's widgets
wrap these figures). Stage ``s`` has colour ``stage_colour(s)`` wherever a figure colours
by stage; forward and backward keep the colours of ``time_breakdown_figure``'s phases.

- :func:`balance_figure`: compute per micro-batch and memory per stage, side by side;
- :func:`schedule_figure`: one step's schedule as a timeline, one row per stage;
- :func:`plan_strip_figure`: the model's blocks in order, coloured by stage;
- :func:`balance_comparison_figure`: compute per stage before vs after a new plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from dtlab.analysis.balance import Balance, StageBalance
from dtlab.analysis.clock_align import ClockAlignment
from dtlab.records import Plan
from dtlab.records.stages import BlockCost, ScheduleEvent
from dtlab.views.figures import _PHASE_COLORS, MIB, PHASES, TEMPLATE, _layout
from dtlab.views.partition_tables import balance_facts, microbatches_text

# Not the rank palette: a stage is not a rank, and a figure that shows both should not
# suggest "stage 2 is rank 2" by colour. Safe is colour-blind safe.
_STAGE_COLOURS = qualitative.Safe
PHASE_NAMES = {"F": "forward", "B": "backward"}
_COMPUTE_COLOURS = {name: _PHASE_COLORS[PHASES.index(name)] for name in PHASE_NAMES.values()}
MEMORY_KINDS = {  # trace name -> StageBalance field; optimizer as time_breakdown's phase
    "parameters": ("param_bytes", _PHASE_COLORS[4]),
    "gradients": ("grad_bytes", _PHASE_COLORS[5]),
    "optimizer": ("optimizer_bytes", _PHASE_COLORS[PHASES.index("optimizer")]),
    "activations": ("activation_bytes", _PHASE_COLORS[6]),
}
SLOWEST_COLOUR = "#d62828"
NOT_PROFILED = "not profiled yet"


def stage_colour(stage: int) -> str:
    """The colour of pipeline stage ``stage`` in every partition figure."""
    return _STAGE_COLOURS[stage % len(_STAGE_COLOURS)]


def stage_blocks(plan: Plan) -> list[tuple[str, ...]]:
    """Each stage's blocks, from the plan's DeepSpeed-style bounds."""
    b = plan.bounds
    return [tuple(plan.blocks[b[s] : b[s + 1]]) for s in range(len(b) - 1)]


def _stage_label(sb: StageBalance) -> str:
    return f"stage {sb.stage}" + ("" if sb.rank is None else f" (rank {sb.rank})")


def _stage_tick(sb: StageBalance) -> str:
    # the axis is titled "stage"; a panel a third of a notebook wide fits "3", not
    # "stage 3 (rank 3)" (plotly tilted those into each other); the rank only if it differs
    return str(sb.stage) + ("" if sb.rank in (None, sb.stage) else f"<br>rank {sb.rank}")


def _stage_axis(fig: go.Figure, stages: Sequence[StageBalance], col: int) -> None:
    """Ticks of ``_stage_tick``'s short text at the bars' full labels (hover keeps them)."""
    fig.update_xaxes(
        title_text="stage",
        tickvals=[_stage_label(s) for s in stages],
        ticktext=[_stage_tick(s) for s in stages],
        tickangle=0,
        automargin=True,
        row=1,
        col=col,
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _blocks_text(blocks: Sequence[str], per_line: int = 4) -> str:
    # a stage can hold dozens of blocks: wrap, or the hover box runs off the screen
    lines = [", ".join(blocks[i : i + per_line]) for i in range(0, len(blocks), per_line)]
    return f"{len(blocks)} blocks:<br>" + "<br>".join(lines)


def _summary(balance: Balance) -> tuple[str, str]:
    """The title and its subtitle, e.g. ``Measured balance (1f1b, 8 micro-batches)`` and
    ``step 12.0 ms, bubble 25%, imbalance 1.30x`` (the facts not known yet left out): on
    two lines, so that neither is clipped in a notebook-wide figure."""
    kind = "Measured" if balance.measured else "Predicted"
    facts = balance_facts(balance)
    head = f"{kind} balance ({balance.schedule}, {microbatches_text(balance.microbatches)})"
    return head, ", ".join(facts) or NOT_PROFILED


def _slowest(stages: Sequence[StageBalance]) -> int | None:
    """Position of the slowest stage; None when a time is missing or nothing to compare."""
    times = [s.compute_s for s in stages]
    if len(times) < 2 or any(t is None for t in times):
        return None
    return max(range(len(times)), key=times.__getitem__)


def _add_compute_bars(fig: go.Figure, stages: Sequence[StageBalance]) -> None:
    labels = [_stage_label(s) for s in stages]
    if all(s.forward_s is None and s.backward_s is None for s in stages):
        fig.add_annotation(
            text=f"compute {NOT_PROFILED}",
            x=0.5,
            y=0.5,
            xref="x domain",
            yref="y domain",
            showarrow=False,
            row=1,
            col=1,
        )
        return
    slowest = _slowest(stages)
    # outline both halves of the slowest stack: that stage sets the pipeline's pace
    widths = [3 if i == slowest else 0 for i in range(len(stages))]
    hover = [_blocks_text(s.blocks) for s in stages]
    for phase in ("forward", "backward"):
        fig.add_trace(
            go.Bar(
                x=labels,
                y=[_ms(getattr(s, f"{phase}_s")) for s in stages],
                name=phase,
                marker={
                    "color": _COMPUTE_COLOURS[phase],
                    "line": {"width": widths, "color": SLOWEST_COLOUR},
                },
                hovertext=hover,
                hovertemplate=f"%{{x}}<br>{phase}: %{{y:.2f}} ms<br>%{{hovertext}}<extra></extra>",
            ),
            row=1,
            col=1,
        )
    if slowest is not None:
        fig.add_annotation(
            text="slowest",
            x=labels[slowest],
            y=_ms(stages[slowest].compute_s),
            yanchor="bottom",
            showarrow=False,
            font={"color": SLOWEST_COLOUR},
            row=1,
            col=1,
        )


MEMORY_TITLE = "Memory per stage"


def _add_memory_bars(fig: go.Figure, stages: Sequence[StageBalance]) -> None:
    labels = [_stage_label(s) for s in stages]
    hover = [_blocks_text(s.blocks) for s in stages]
    for name, (field, colour) in MEMORY_KINDS.items():
        values = [getattr(s, field) for s in stages]
        if all(v is None for v in values):  # activations before profiling: say so, or the
            # bars look smaller than a draft's that counts them; a second line of the
            # panel's title (an annotation of its own at the same height overlapped it)
            for title in fig.layout.annotations:
                if title.text.startswith(MEMORY_TITLE):
                    title.text += (
                        "<br><span style='font-size:11px;color:#6b7280'>"
                        f"{name} not measured: %dt_partition --profile</span>"
                    )
            continue
        fig.add_trace(
            go.Bar(
                x=labels,
                y=[None if v is None else v / MIB for v in values],
                name=name,
                legend="legend2",  # its own legend, beside the memory panel
                marker_color=colour,
                hovertext=hover,
                hovertemplate=f"%{{x}}<br>{name}: %{{y:.1f}} MiB<br>%{{hovertext}}<extra></extra>",
            ),
            row=1,
            col=2,
        )


_BELOW = {"orientation": "h", "y": -0.2, "yanchor": "top"}


def balance_figure(balance: Balance) -> go.Figure:
    """Per stage: forward + backward ms per micro-batch (left), memory in MiB (right).

    The slowest stage's compute bars are outlined and labelled "slowest". Before profiling
    (no stage times) the left panel says so and has no traces; activations are left out
    while unknown for every stage.
    """
    fig = make_subplots(
        rows=1,
        cols=2,
        horizontal_spacing=0.12,
        subplot_titles=("Compute per micro-batch", MEMORY_TITLE),
    )
    _add_compute_bars(fig, balance.stages)
    _add_memory_bars(fig, balance.stages)
    fig.update_yaxes(title_text="time (ms)", row=1, col=1)
    fig.update_yaxes(title_text="memory (MiB)", row=1, col=2)
    for col in (1, 2):
        _stage_axis(fig, balance.stages, col)
    head, facts = _summary(balance)
    fig.update_layout(
        title={"text": head, "subtitle": {"text": facts}},
        margin={"t": 100},
        template=TEMPLATE,
        height=440,
        barmode="stack",
        hovermode="closest",
        # compute and memory are different quantities: one legend each, on one row under
        # the axis titles, the memory one held to the right edge (from its panel's left
        # edge its four entries ran out of the figure)
        legend={**_BELOW, "title": {"text": "compute"}, "x": 0.0, "xanchor": "left"},
        legend2={**_BELOW, "title": {"text": "memory"}, "x": 1.0, "xanchor": "right"},
    )
    return fig


def _phase_name(phase: str) -> str:
    if phase not in PHASE_NAMES:
        raise ValueError(f"schedule event phase {phase!r}; valid phases: F, B")
    return PHASE_NAMES[phase]


def _clock_note(clock: ClockAlignment | None, stage: int) -> str:
    """The hover's line on how far this stage's clock may be off stage 0's."""
    if clock is None or stage == 0 or stage >= len(clock.bounds_s):
        return ""
    return f"<br>clock vs stage 0: ±{sum(clock.bounds_s[: stage + 1]) * 1000:.2f} ms"


def schedule_figure(
    events: Sequence[ScheduleEvent],
    *,
    title: str = "Pipeline schedule of one step",
    clock: ClockAlignment | None = None,
) -> go.Figure:
    """One row per stage (stage 0 on top), one bar per event from its start to its end (ms).

    Two traces, ``"forward"`` and ``"backward"``, always (empty before a step has run, with
    a note saying so), so a live view can update them in place. Each bar shows its
    micro-batch; gaps between bars are the stage's idle time. ``clock``: how the ranks'
    clocks were put on stage 0's (``Balance.clock``); the subtitle and the x axis say so.
    Without it the events are taken to share one clock (a simulation's).
    """
    by_phase: dict[str, list[ScheduleEvent]] = {"forward": [], "backward": []}
    for e in events:
        by_phase[_phase_name(e.phase)].append(e)
    fig = go.Figure()
    for phase, evs in by_phase.items():
        fig.add_trace(
            go.Bar(
                name=phase,
                orientation="h",
                marker_color=_COMPUTE_COLOURS[phase],
                y=[f"stage {e.stage}" for e in evs],
                base=[e.start * 1000 for e in evs],
                x=[(e.end - e.start) * 1000 for e in evs],
                text=[str(e.microbatch) for e in evs],
                textposition="inside",
                insidetextanchor="middle",
                textangle=0,
                customdata=[[e.microbatch, e.start * 1000, e.end * 1000] for e in evs],
                hovertext=[_clock_note(clock, e.stage) for e in evs],
                hovertemplate=(
                    f"%{{y}}, micro-batch %{{customdata[0]}}, {phase}<br>"
                    "%{customdata[1]:.2f} to %{customdata[2]:.2f} ms "
                    "(%{x:.2f} ms)%{hovertext}<extra></extra>"
                ),
            )
        )
    stages = sorted({e.stage for e in events})
    # forward and backward share a row: overlay, or plotly would offset them as a group
    # a bar too short for its micro-batch number shows none (hover gives it) rather than
    # a sliver of shrunken, unreadable text
    fig.update_layout(barmode="overlay", bargap=0.3, uniformtext={"minsize": 10, "mode": "hide"})
    fig.update_yaxes(
        categoryorder="array", categoryarray=[f"stage {s}" for s in stages], autorange="reversed"
    )
    if not events:
        fig.add_annotation(
            text="No step has run yet: the schedule appears after the first pipeline step.",
            x=0.5,
            y=0.5,
            xref="paper",
            yref="paper",
            showarrow=False,
        )
    height = min(700, 160 + 50 * max(len(stages), 2))
    if clock is None:
        return _layout(fig, title, "time from step start (ms)", "stage", height, "closest")
    _layout(fig, title, "time from stage 0's step start, on its clock (ms)", "stage", height)
    fig.update_layout(
        title={"text": title, "subtitle": {"text": clock.describe()}},
        margin={"t": 90},
        hovermode="closest",
    )
    return fig


def _strip_values(
    plan: Plan, costs: Mapping[str, BlockCost] | None
) -> tuple[list[float | None], str, str]:
    """Bar heights, their axis title and hover format: measured ms if every block is
    measured, else the parameter count (None for a block without a cost), else (no costs:
    the plan alone knows no sizes) boxes of equal height."""
    if costs is None:
        return [1.0] * len(plan.blocks), "", ""
    found = [costs.get(b) for b in plan.blocks]
    if all(c is not None and c.measured for c in found):
        ms = [(c.forward_s + c.backward_s) * 1000 for c in found]
        return ms, "forward + backward (ms)", ".2f"
    return [None if c is None else c.num_params for c in found], "parameters", ",d"


def plan_strip_figure(
    plan: Plan,
    stage_colours: Sequence[str] | None = None,
    costs: Mapping[str, BlockCost] | None = None,
) -> go.Figure:
    """The plan's blocks in model order, one bar each, coloured by stage; one trace per
    stage (``"stage s"``) and a dotted line at each stage boundary.

    ``stage_colours[s]`` overrides ``stage_colour(s)``. Heights: see ``_strip_values``.
    """
    values, unit, fmt = _strip_values(plan, costs)
    fig = go.Figure()
    for s, blocks in enumerate(stage_blocks(plan)):
        lo = plan.bounds[s]
        colour = stage_colours[s % len(stage_colours)] if stage_colours else stage_colour(s)
        fig.add_trace(
            go.Bar(
                name=f"stage {s}",
                x=list(blocks),
                y=values[lo : lo + len(blocks)],
                marker_color=colour,
                hovertemplate=f"%{{x}}<br>stage {s}"
                + (f"<br>{unit}: %{{y:{fmt}}}" if unit else "")
                + "<extra></extra>",
            )
        )
    for bound in plan.bounds[1:-1]:
        fig.add_vline(x=bound - 0.5, line_dash="dot", line_color="#555")
    # traces never share a block, so "overlay" just keeps each bar centred on its block
    fig.update_layout(barmode="overlay", bargap=0.05)
    fig.update_xaxes(categoryorder="array", categoryarray=list(plan.blocks))
    if not unit:
        fig.update_yaxes(showticklabels=False)
    title = f"Plan: {len(plan.bounds) - 1} stages over {len(plan.blocks)} blocks"
    return _layout(fig, title, "block", unit, 320, hovermode="closest")


def _step_text(balance: Balance) -> str:
    kind = "measured" if balance.measured else "predicted"
    if balance.step_s is None:
        return NOT_PROFILED
    return f"{balance.step_s * 1000:.1f} ms ({kind})"


def balance_comparison_figure(before: Balance, after: Balance) -> go.Figure:
    """Compute per micro-batch (ms) per stage, ``"before"`` and ``"after"`` side by side;
    the title gives the step time before -> after."""
    fig = go.Figure()
    for name, balance, colour in (("before", before, "#8d99ae"), ("after", after, "#2a9d8f")):
        stages = balance.stages
        fig.add_trace(
            go.Bar(
                name=name,
                x=[f"stage {s.stage}" for s in stages],
                y=[_ms(s.compute_s) for s in stages],
                marker_color=colour,
                hovertext=[_blocks_text(s.blocks) for s in stages],
                hovertemplate=f"%{{x}} {name}: %{{y:.2f}} ms<br>%{{hovertext}}<extra></extra>",
            )
        )
    fig.update_layout(barmode="group")
    title = f"Compute per stage: step {_step_text(before)} → {_step_text(after)}"
    return _layout(fig, title, "stage", "forward + backward per micro-batch (ms)", 400, "closest")
