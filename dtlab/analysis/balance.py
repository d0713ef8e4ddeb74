"""How well a pipeline plan balances its stages: predicted from block costs, or measured.

Pure (runs in the notebook): functions of plans, :class:`~dtlab.records.stages.BlockCost`
and per-rank :class:`~dtlab.records.stages.StageReport` that return :class:`Balance`.

1. collect (each rank, agent/): a ``StageReport`` after a step; ``BlockCost`` from profiling.
2. combine (notebook, here): :func:`predict_balance` simulates the schedule from block
   costs; :func:`measured_balance` reads the reports of one step.
3. present (views/): :func:`compare` for one line, figures from ``Balance.events`` (measured
   events put on one time base by :mod:`dtlab.analysis.clock_align`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dtlab.analysis.clock_align import ClockAlignment, aligned_events
from dtlab.analysis.timing import Change, describe
from dtlab.records import Plan, PlanError
from dtlab.records.stages import BlockCost, ScheduleEvent, StageReport

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class StageBalance:
    """One stage's share of the model and of a step."""

    stage: int
    rank: int | None
    blocks: tuple[str, ...]
    num_params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int | None  # per micro-batch x micro-batches in flight
    forward_s: float | None  # per micro-batch
    backward_s: float | None  # per micro-batch

    @property
    def compute_s(self) -> float | None:
        if self.forward_s is None or self.backward_s is None:
            return None
        return self.forward_s + self.backward_s

    @property
    def memory_bytes(self) -> int:
        """Parameters, gradients, optimizer state and (when known) activations in flight."""
        states = self.param_bytes + self.grad_bytes + self.optimizer_bytes
        return states + (self.activation_bytes or 0)


@dataclass(frozen=True)
class Balance:
    """A plan's balance: ``measured`` (from a live step) or predicted (from block costs)."""

    plan: Plan
    stages: tuple[StageBalance, ...]
    microbatches: int
    schedule: str  # "gpipe" | "1f1b"
    measured: bool
    step_s: float | None  # the schedule's wall time (simulated when predicted)
    bubble: float | None  # idle fraction of the stages over the step, 0..1
    events: tuple[ScheduleEvent, ...] = ()  # one step's schedule, all stages
    # measured: the ranks' clocks put on stage 0's (None: simulated, one clock already)
    clock: ClockAlignment | None = None

    @property
    def imbalance(self) -> float | None:
        """Slowest stage's compute over the mean stage's (1.0: perfectly balanced)."""
        times = [s.compute_s for s in self.stages if s.compute_s is not None]
        if not times or len(times) < len(self.stages) or sum(times) == 0:
            return None
        return max(times) / (sum(times) / len(times))

    @property
    def slowest_stage(self) -> int | None:
        times = [s.compute_s for s in self.stages if s.compute_s is not None]
        if not times or len(times) < len(self.stages):
            return None
        return self.stages[times.index(max(times))].stage


def microbatches_in_flight(stage: int, num_stages: int, microbatches: int, schedule: str) -> int:
    """Micro-batches whose activations a stage holds at its peak."""
    _check_schedule(schedule)
    if schedule == "gpipe":
        return microbatches  # every forward runs before the first backward
    return min(num_stages - stage, microbatches)  # 1F1B: the warm-up forwards


def simulate_schedule(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    microbatches: int,
    schedule: str = "gpipe",
) -> tuple[ScheduleEvent, ...]:
    """One step of ``schedule`` with stage ``s`` taking ``forward_s[s]`` / ``backward_s[s]``
    per micro-batch and free communication; events in start order."""
    _check_schedule(schedule)
    num_stages = len(forward_s)
    times = [*forward_s, *backward_s]
    if num_stages == 0 or len(backward_s) != num_stages:
        raise ValueError(
            f"give one forward and one backward time per stage, got {num_stages} forward and "
            f"{len(backward_s)} backward times"
        )
    if any(not math.isfinite(t) or t < 0 for t in times):
        raise ValueError(f"stage times must be finite and >= 0, got {times}")
    _check_microbatches(microbatches)
    orders = [_stage_order(s, num_stages, microbatches, schedule) for s in range(num_stages)]
    ends: dict[tuple[str, int, int], float] = {}  # (phase, stage, micro-batch) -> end
    free, done = [0.0] * num_stages, [0] * num_stages
    events: list[ScheduleEvent] = []
    while len(events) < 2 * num_stages * microbatches:
        before = len(events)
        for s, order in enumerate(orders):
            while done[s] < len(order):
                phase, i = order[done[s]]
                needs = _needs(phase, s, i, num_stages)
                if needs is not None and needs not in ends:
                    break  # waits for another stage; come back to it
                start = max(free[s], ends[needs]) if needs else free[s]
                free[s] = ends[(phase, s, i)] = start + times[s if phase == "F" else num_stages + s]
                events.append(ScheduleEvent(s, i, phase, start, free[s]))
                done[s] += 1
        assert len(events) > before, "both schedules' orders can always make progress"
    return tuple(sorted(events, key=_event_key))


def bubble_fraction(events: Sequence[ScheduleEvent], num_stages: int) -> float:
    """Idle share of ``num_stages`` stages over the events' span: 1 - busy / (stages x span)."""
    if not events:
        raise ValueError("no schedule events: run (or simulate) a step first")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    span = max(e.end for e in events) - min(e.start for e in events)
    if span <= 0:
        return 0.0
    busy = sum(e.end - e.start for e in events)
    return max(0.0, 1.0 - busy / (num_stages * span))


def predict_balance(
    plan: Plan,
    costs: Mapping[str, BlockCost],
    *,
    microbatches: int,
    schedule: str = "gpipe",
    optimizer_bytes_per_param_byte: float = 2.0,
) -> Balance:
    """The plan's balance from block costs; times and the schedule only once all are timed."""
    _check_schedule(schedule)
    _check_microbatches(microbatches)
    missing = [b for b in plan.blocks if b not in costs]
    if missing:
        raise PlanError(
            f"no BlockCost for {', '.join(missing)}: profile the blocks first "
            "(dt.profile_blocks()) and pass every block's cost"
        )
    stages = tuple(
        _predicted_stage(plan, s, costs, microbatches, schedule, optimizer_bytes_per_param_byte)
        for s in range(plan.num_stages)
    )
    if any(st.compute_s is None for st in stages):
        return Balance(plan, stages, microbatches, schedule, False, None, None)
    # every stage is timed from here on (compute_s is None when either time is)
    forward = [st.forward_s for st in stages if st.forward_s is not None]
    backward = [st.backward_s for st in stages if st.backward_s is not None]
    events = simulate_schedule(forward, backward, microbatches, schedule)
    step_s = max(e.end for e in events) - min(e.start for e in events)
    bubble = bubble_fraction(events, plan.num_stages)
    return Balance(plan, stages, microbatches, schedule, False, step_s, bubble, events)


def measured_balance(plan: Plan, reports: Mapping[int, StageReport]) -> Balance:
    """The plan's balance in one step, from one :class:`StageReport` per pipeline rank."""
    ordered = _reports_by_stage(plan, reports)
    runs = {(r.microbatches, r.schedule) for r in ordered}
    if len(runs) > 1:
        raise ValueError(
            "the reports disagree on micro-batches/schedule: "
            + ", ".join(f"rank {r.rank}: {r.microbatches} {r.schedule}" for r in ordered)
            + "; collect all reports from the same step"
        )
    microbatches, schedule = runs.pop()
    stages = tuple(_measured_stage(r, plan.num_stages) for r in ordered)
    events: tuple[ScheduleEvent, ...] = ()
    clock = None
    if any(r.events for r in ordered):  # each rank timed its stage on its own clock
        shifted, clock = aligned_events({r.stage: r.events for r in ordered})
        events = tuple(sorted(shifted, key=_event_key))
    step_times = [r.step_s for r in ordered if r.step_s is not None]
    step_s = max(step_times) if step_times else None
    bubble = bubble_fraction(events, plan.num_stages) if events else None
    return Balance(plan, stages, microbatches, schedule, True, step_s, bubble, events, clock)


def compare(before: Balance, after: Balance, steps: Change | None = None) -> str:
    """``"step 41.2 ms (IQR ...) → 30.5 ms (IQR ...): 1.35x faster, beyond the spread;
    slowest stage 2 → 1; bubble 38% → 22%"``. The step's change is judged only from
    ``steps`` (several steps timed on each side: :func:`dtlab.analysis.timing.change`);
    the one step a Balance holds per side gets no verdict."""
    if steps is not None:
        step = describe(steps, "step", _duration)
    else:
        step = f"step {_duration(before.step_s)} → {_duration(after.step_s)}"
        if before.step_s and after.step_s:
            step += " (one step each: no verdict)"
    slowest = f"slowest stage {_known(before.slowest_stage)} → {_known(after.slowest_stage)}"
    bubble = f"bubble {_percent(before.bubble)} → {_percent(after.bubble)}"
    return "; ".join([step, slowest, bubble])


# -- helpers ----------------------------------------------------------------------------


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")


def _check_microbatches(microbatches: int) -> None:
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"microbatches must be an int >= 1, got {microbatches!r}")


def _stage_order(stage: int, num_stages: int, m: int, schedule: str) -> list[tuple[str, int]]:
    if schedule == "gpipe":  # torch's ScheduleGPipe: all forwards, then backwards 0..m-1
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    # torch's Schedule1F1B: warm-up forwards, then one backward and one forward in turn,
    # then the cool-down backwards
    warmup = min(num_stages - stage, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("B", i), ("F", warmup + i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def _needs(phase: str, stage: int, i: int, num_stages: int) -> tuple[str, int, int] | None:
    if phase == "F":
        return ("F", stage - 1, i) if stage > 0 else None
    return ("B", stage + 1, i) if stage < num_stages - 1 else ("F", stage, i)


def _event_key(e: ScheduleEvent) -> tuple[float, int, str, int]:
    return (e.start, e.stage, e.phase, e.microbatch)


def _predicted_stage(
    plan: Plan,
    stage: int,
    costs: Mapping[str, BlockCost],
    microbatches: int,
    schedule: str,
    optimizer_ratio: float,
) -> StageBalance:
    blocks = plan.stage_blocks(stage)
    held = [costs[b] for b in blocks]
    param_bytes = sum(c.param_bytes for c in held)
    acts = [c.activation_bytes for c in held if c.activation_bytes is not None]
    in_flight = microbatches_in_flight(stage, plan.num_stages, microbatches, schedule)
    timed = all(c.measured for c in held)
    return StageBalance(
        stage=stage,
        rank=None,
        blocks=blocks,
        num_params=sum(c.num_params for c in held),
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        optimizer_bytes=round(param_bytes * optimizer_ratio),
        activation_bytes=sum(acts) * in_flight if len(acts) == len(held) else None,
        forward_s=sum(c.forward_s for c in held if c.forward_s is not None) if timed else None,
        backward_s=sum(c.backward_s for c in held if c.backward_s is not None) if timed else None,
    )


def _reports_by_stage(plan: Plan, reports: Mapping[int, StageReport]) -> list[StageReport]:
    last = plan.num_stages - 1
    found: dict[int, StageReport] = {}
    for rank, report in sorted(reports.items()):
        if report.rank != rank:
            raise ValueError(f"reports[{rank}] holds rank {report.rank}'s report: key by rank")
        if not 0 <= report.stage <= last:
            raise PlanError(
                f"rank {rank} runs stage {report.stage}, but the plan has stages 0..{last}: "
                "the plan does not match the running job"
            )
        if report.stage in found:
            raise PlanError(
                f"ranks {found[report.stage].rank} and {rank} both report stage {report.stage}: "
                "pass one pipeline's reports, one rank per stage"
            )
        expected = plan.stage_blocks(report.stage)
        if tuple(report.blocks) != expected:
            raise PlanError(
                f"rank {rank} runs stage {report.stage} with {', '.join(report.blocks)}, but "
                f"the plan puts {', '.join(expected)} there: measure the plan that is running "
                "(or repartition the job to this plan first)"
            )
        found[report.stage] = report
    missing = [s for s in range(plan.num_stages) if s not in found]
    if missing:
        raise PlanError(
            f"no report for stage{'s' * (len(missing) > 1)} {', '.join(map(str, missing))}: "
            "collect a StageReport "
            "from every pipeline rank (is one hung, or left out of the call?)"
        )
    return [found[s] for s in range(plan.num_stages)]


def _measured_stage(report: StageReport, num_stages: int) -> StageBalance:
    def mean_duration(phase: str) -> float | None:
        spans = [
            e.end - e.start for e in report.events if e.stage == report.stage and e.phase == phase
        ]
        return sum(spans) / len(spans) if spans else None

    in_flight = microbatches_in_flight(
        report.stage, num_stages, report.microbatches, report.schedule
    )
    acts = report.activation_bytes
    return StageBalance(
        stage=report.stage,
        rank=report.rank,
        blocks=tuple(report.blocks),
        num_params=report.num_params,
        param_bytes=report.param_bytes,
        grad_bytes=report.grad_bytes,
        optimizer_bytes=report.optimizer_bytes,
        activation_bytes=None if acts is None else acts * in_flight,
        forward_s=mean_duration("F"),
        backward_s=mean_duration("B"),
    )


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _percent(fraction: float | None) -> str:
    return "?" if fraction is None else f"{fraction:.0%}"


def _known(value: object) -> str:
    return "?" if value is None else str(value)
