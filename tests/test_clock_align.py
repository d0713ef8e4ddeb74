"""Putting a pipeline step's per-rank clocks on one time base, on synthetic schedules whose
true times and clock offsets are known."""

from __future__ import annotations

import math
import random

import pytest

from dtlab.analysis.balance import measured_balance
from dtlab.analysis.clock_align import align, aligned_events, neighbour_offset
from dtlab.records import Plan
from dtlab.records.stages import ScheduleEvent, StageReport
from dtlab.views.partition_figures import schedule_figure


def _order(stage: int, num_stages: int, m: int, schedule: str) -> list[tuple[str, int]]:
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(num_stages - stage, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("B", i), ("F", warmup + i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def simulate(costs, m, schedule, rng, latency=0.002):
    """True times of a schedule whose messages take 0..latency seconds each way."""
    n = len(costs)
    done: dict[tuple[str, int, int], ScheduleEvent] = {}
    orders = [_order(s, n, m, schedule) for s in range(n)]
    free, pos = [0.0] * n, [0] * n
    while len(done) < 2 * n * m:
        for s in range(n):
            if pos[s] == len(orders[s]):
                continue
            phase, i = orders[s][pos[s]]
            if phase == "F":
                need = ("F", s - 1, i) if s > 0 else None
            else:
                need = ("B", s + 1, i) if s < n - 1 else ("F", s, i)
            if need is not None and need not in done:
                continue
            ready = 0.0 if need is None else done[need].end
            if need is not None and need[1] != s:
                ready += rng.uniform(0, latency)
            start = max(free[s], ready)
            free[s] = start + costs[s][0 if phase == "F" else 1]
            done[(phase, s, i)] = ScheduleEvent(s, i, phase, start, free[s])
            pos[s] += 1
    return done


def on_own_clocks(truth, leads):
    """Each stage's events as its rank reports them: its clock reads ``leads[s]`` ahead."""
    by_stage: dict[int, list[ScheduleEvent]] = {s: [] for s in range(len(leads))}
    for e in truth.values():
        by_stage[e.stage].append(
            ScheduleEvent(
                e.stage, e.microbatch, e.phase, e.start + leads[e.stage], e.end + leads[e.stage]
            )
        )
    return by_stage


def forward_breaks_causality(events, slack=0.0) -> list[tuple[int, int]]:
    f = {(e.stage, e.microbatch): e for e in events if e.phase == "F"}
    return [(s, m) for (s, m), e in f.items() if s > 0 and e.start < f[(s - 1, m)].end - slack]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("seed", range(5))
def test_offsets_are_recovered_within_the_stated_bound(schedule, seed):
    rng = random.Random(seed)
    n, m = 8, rng.choice([2, 4, 6])
    costs = [(rng.uniform(0.002, 0.01), rng.uniform(0.004, 0.02)) for _ in range(n)]
    truth = simulate(costs, m, schedule, rng)
    leads = [rng.uniform(-5.0, 5.0) for _ in range(n)]  # other hosts, other step starts
    reported = on_own_clocks(truth, leads)
    assert forward_breaks_causality([e for evs in reported.values() for e in evs])

    clock = align(reported)
    for s in range(n):
        error = abs(clock.offsets_s[s] - (leads[s] - leads[0]))
        assert error <= sum(clock.bounds_s[: s + 1]) + 1e-9, (s, error, clock.bounds_s)
    assert clock.bound_s <= 0.002  # half of the two one-way trips, at most one latency
    events, _ = aligned_events(reported)
    assert forward_breaks_causality(events, slack=clock.bound_s + 1e-9) == []
    for e in events:  # on stage 0's clock: the truth as stage 0 reads it
        true = truth[(e.phase, e.stage, e.microbatch)]
        assert abs(e.start - (true.start + leads[0])) <= sum(clock.bounds_s[: e.stage + 1]) + 1e-9


def test_free_communication_pins_the_offsets_exactly():
    rng = random.Random(7)
    truth = simulate([(0.01, 0.02)] * 4, 2, "gpipe", rng, latency=0.0)
    clock = align(on_own_clocks(truth, [0.0, 1.0, -2.0, 3.5]))
    assert clock.offsets_s == pytest.approx((0.0, 1.0, -2.0, 3.5), abs=1e-9)
    assert clock.bound_s == pytest.approx(0.0, abs=1e-9)
    assert "±0.00 ms" in clock.describe()


def test_events_that_contradict_each_other_widen_the_bound():
    # stage 1 claims to start micro-batch 0 before stage 0 ended it *and* to end its
    # backward after stage 0 started its own: no offset satisfies both by 3 ms
    before = [ScheduleEvent(0, 0, "F", 0.0, 0.010), ScheduleEvent(0, 0, "B", 0.030, 0.040)]
    after = [ScheduleEvent(1, 0, "F", 0.010, 0.020), ScheduleEvent(1, 0, "B", 0.020, 0.033)]
    d, bound = neighbour_offset(before, after)
    assert d == pytest.approx(0.0015) and bound == pytest.approx(0.0015)


def test_one_sided_or_missing_events_give_no_bound():
    forward_only = [ScheduleEvent(0, 0, "F", 0.0, 0.01)], [ScheduleEvent(1, 0, "F", 0.5, 0.6)]
    d, bound = neighbour_offset(*forward_only)
    assert d == pytest.approx(0.49) and math.isinf(bound)
    assert neighbour_offset([], []) == (0.0, math.inf)
    clock = align(dict(enumerate(forward_only)))
    assert "not aligned" in clock.describe()
    with pytest.raises(ValueError, match="not 0..1"):
        align({0: [], 2: []})


def _report(stage: int, events) -> StageReport:
    blocks = (("a",), ("b",))[stage]
    return StageReport(stage, stage, blocks, 1, 4, 4, 8, None, 2, "gpipe", 1, 0.1, tuple(events))


def test_measured_balance_and_its_figure_use_one_time_base():
    rng = random.Random(3)
    truth = simulate([(0.01, 0.02), (0.01, 0.02)], 2, "gpipe", rng)
    reported = on_own_clocks(truth, [0.0, 0.25])
    balance = measured_balance(
        Plan(("a", "b"), (0, 1, 2)), {s: _report(s, reported[s]) for s in (0, 1)}
    )
    assert balance.clock is not None and balance.clock.offsets_s[1] == pytest.approx(0.25, abs=2e-3)
    assert forward_breaks_causality(balance.events, slack=balance.clock.bound_s + 1e-9) == []
    assert balance.step_s == 0.1
    fig = schedule_figure(balance.events, clock=balance.clock)
    assert "stage 0's step start" in fig.layout.xaxis.title.text
    assert "aligned" in fig.layout.title.subtitle.text and "±" in fig.layout.title.subtitle.text
    hovers = [note for bar in fig.data for note in bar.hovertext]
    assert "" in hovers and "clock vs stage 0: ±" in " ".join(hovers)
    plain = schedule_figure(balance.events)
    assert plain.layout.xaxis.title.text == "time from step start (ms)"
