"""One time base for a pipeline step timed on many ranks' clocks.

Pure (runs in the notebook). Each rank times its stage's events on its own clock from its
own step start; ranks on other hosts have other clocks, and even on one host the step
starts differ. Drawn as they come, a stage can appear to start a micro-batch before the
stage feeding it has finished it.

The pipeline's own sends and receives give the offsets, NTP-style, with no extra message:

1. collect (each rank, agent/): the stage's events in its own clock (``StageReport.events``).
2. combine (here): between neighbouring stages ``s-1`` and ``s``, with ``d`` the amount by
   which stage ``s``'s times read ahead of stage ``s-1``'s (``t_s = t_{s-1} + d``):

   - a forward is received before it is computed, and sent only after it was computed on
     ``s-1``: ``F_start[s, m] - d >= F_end[s-1, m]``, so ``d <= F_start[s, m] - F_end[s-1, m]``;
   - a gradient goes the other way: ``B_start[s-1, m] >= B_end[s, m] - d``, so
     ``d >= B_end[s, m] - B_start[s-1, m]``.

   Over all micro-batches this brackets ``d`` in ``[lo, hi]``; the midpoint is within
   ``(hi - lo) / 2`` of the truth (the two one-way transfer times, like NTP's round trip).
   Every schedule whose stages wait for their inputs (GPipe, 1F1B, ...) obeys both rules.
3. present (views/): the events shifted onto stage 0's clock, zero at stage 0's step
   start, and the bound in the figure's caption.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from dtlab.records.stages import ScheduleEvent


@dataclass(frozen=True)
class ClockAlignment:
    """Per stage (index = stage): its clock's lead over stage 0's (``offsets_s``), and how
    far the estimate of its lead over the previous stage may be off (``bounds_s``, 0.0 for
    stage 0; ``inf`` where the events give only one side or none)."""

    offsets_s: tuple[float, ...]
    bounds_s: tuple[float, ...]

    @property
    def bound_s(self) -> float:
        """The largest neighbour-to-neighbour uncertainty (what a causality check needs)."""
        return max(self.bounds_s, default=0.0)

    @property
    def total_bound_s(self) -> float:
        """How far the last stage's clock may be off stage 0's (the bounds add up)."""
        return sum(self.bounds_s)

    def describe(self) -> str:
        if len(self.bounds_s) < 2:
            return "one stage: one clock"
        if math.isinf(self.bound_s):
            return "clocks not aligned: some neighbouring stages share no forward and backward"
        return (
            f"stage clocks aligned from the send/receive order to ±{self.bound_s * 1e3:.2f} ms "
            "between neighbouring stages"
        )


def neighbour_offset(
    before: Sequence[ScheduleEvent], after: Sequence[ScheduleEvent]
) -> tuple[float, float]:
    """How far ``after``'s clock reads ahead of ``before``'s (the next stage's events and
    the previous stage's): the midpoint of the bracket, and its half-width (``inf`` when a
    side is missing; 0.0 ahead and ``inf`` when the stages share no micro-batch)."""
    f_prev, b_prev = _by_microbatch(before, "F"), _by_microbatch(before, "B")
    f_next, b_next = _by_microbatch(after, "F"), _by_microbatch(after, "B")
    highs = [f_next[m].start - f_prev[m].end for m in f_next.keys() & f_prev.keys()]
    lows = [b_next[m].end - b_prev[m].start for m in b_next.keys() & b_prev.keys()]
    if highs and lows:
        hi, lo = min(highs), max(lows)
        # lo > hi only if an event broke causality on the rank itself: say so by the width
        return (hi + lo) / 2, abs(hi - lo) / 2
    if highs or lows:
        return (min(highs) if highs else max(lows)), math.inf
    return 0.0, math.inf


def align(events_by_stage: Mapping[int, Sequence[ScheduleEvent]]) -> ClockAlignment:
    """Each stage's clock offset from stage 0's, chained through neighbours. Stages must be
    numbered 0..n-1 (one entry each)."""
    stages = sorted(events_by_stage)
    if stages != list(range(len(stages))):
        raise ValueError(
            f"stages {stages} are not 0..{len(stages) - 1}: collect one report per pipeline "
            "rank from the same step"
        )
    if not stages:
        return ClockAlignment((), ())
    offsets, bounds = [0.0], [0.0]
    for s in stages[1:]:
        d, bound = neighbour_offset(events_by_stage[s - 1], events_by_stage[s])
        offsets.append(offsets[-1] + d)
        bounds.append(bound)
    return ClockAlignment(tuple(offsets), tuple(bounds))


def aligned_events(
    events_by_stage: Mapping[int, Sequence[ScheduleEvent]],
) -> tuple[tuple[ScheduleEvent, ...], ClockAlignment]:
    """Every stage's events on stage 0's clock (seconds from stage 0's step start)."""
    alignment = align(events_by_stage)
    shifted = tuple(
        replace(e, start=e.start - alignment.offsets_s[s], end=e.end - alignment.offsets_s[s])
        for s, evs in events_by_stage.items()
        for e in evs
    )
    return shifted, alignment


def _by_microbatch(events: Sequence[ScheduleEvent], phase: str) -> dict[int, ScheduleEvent]:
    return {e.microbatch: e for e in events if e.phase == phase}
