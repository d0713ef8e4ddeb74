"""Stage balance: the schedule simulation against textbook numbers, predicted balance from
block costs, measured balance from hand-built stage reports (pure: no torch, no cluster)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from dtlab.analysis import timing
from dtlab.analysis.balance import (
    Balance,
    StageBalance,
    bubble_fraction,
    compare,
    measured_balance,
    microbatches_in_flight,
    predict_balance,
    simulate_schedule,
)
from dtlab.records import Plan, PlanError
from dtlab.records.stages import BlockCost, ScheduleEvent, StageReport

BLOCKS = ("embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head")
PLAN = Plan(BLOCKS, (0, 2, 4, 5, 7))
COSTS = {
    b: BlockCost(b, n, 4 * n, f, 2 * f, a)
    for b, n, f, a in [
        ("embed", 100, 0.001, 10),
        ("blocks.0", 50, 0.004, 20),
        ("blocks.1", 50, 0.004, 20),
        ("blocks.2", 50, 0.004, 20),
        ("blocks.3", 50, 0.004, 20),
        ("norm", 1, 0.0005, 5),
        ("head", 100, 0.002, 30),
    ]
}


# -- simulation -------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, m, f, b", [(4, 8, 1.0, 2.0), (4, 8, 1.0, 1.0), (3, 2, 0.5, 1.5)])
def test_equal_stages_give_the_textbook_bubble(schedule, stages, m, f, b):
    events = simulate_schedule([f] * stages, [b] * stages, m, schedule)
    assert max(e.end for e in events) == pytest.approx((m + stages - 1) * (f + b))
    assert bubble_fraction(events, stages) == pytest.approx((stages - 1) / (m + stages - 1))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedule_respects_its_dependencies(schedule):
    fwd, bwd = [1.0, 2.0, 1.5, 0.5], [2.0, 3.0, 1.0, 1.0]
    events = simulate_schedule(fwd, bwd, 5, schedule)
    assert len(events) == 2 * 4 * 5
    assert [e.start for e in events] == sorted(e.start for e in events)
    end = {(e.phase, e.stage, e.microbatch): e.end for e in events}
    for e in events:
        assert e.end - e.start == (fwd if e.phase == "F" else bwd)[e.stage]
        if e.phase == "F" and e.stage > 0:
            assert e.start >= end["F", e.stage - 1, e.microbatch]
        if e.phase == "B":
            before = ("B", e.stage + 1, e.microbatch) if e.stage < 3 else ("F", 3, e.microbatch)
            assert e.start >= end[before]
    for stage in range(4):  # one thing at a time on a stage
        mine = [e for e in events if e.stage == stage]
        assert all(a.end <= b.start for a, b in itertools.pairwise(mine))


def test_gpipe_runs_all_forwards_then_backwards_in_order():
    events = simulate_schedule([1.0] * 3, [1.0] * 3, 3)
    assert [(e.phase, e.microbatch) for e in events if e.stage == 1] == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("B", 0),
        ("B", 1),
        ("B", 2),
    ]


def test_1f1b_warms_up_then_alternates():
    events = simulate_schedule([1.0] * 4, [1.0] * 4, 6, "1f1b")
    order = [(e.phase, e.microbatch) for e in events if e.stage == 1]
    assert order == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("B", 0),
        ("F", 3),
        ("B", 1),
        ("F", 4),
        ("B", 2),
        ("F", 5),
        ("B", 3),
        ("B", 4),
        ("B", 5),
    ]
    last = [(e.phase, e.microbatch) for e in events if e.stage == 3]
    assert last[:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


def test_1f1b_holds_fewer_micro_batches():
    assert [microbatches_in_flight(s, 4, 8, "gpipe") for s in range(4)] == [8] * 4
    assert [microbatches_in_flight(s, 4, 8, "1f1b") for s in range(4)] == [4, 3, 2, 1]
    assert microbatches_in_flight(0, 4, 2, "1f1b") == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (([1.0], [1.0], 2, "zb"), "unknown schedule 'zb'.*gpipe, 1f1b"),
        (([1.0, 1.0], [1.0], 2), "2 forward and 1 backward"),
        (([], [], 2), "0 forward"),
        (([1.0], [-1.0], 2), "finite and >= 0"),
        (([1.0], [1.0], 0), "microbatches must be an int >= 1"),
    ],
)
def test_simulation_refuses_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        simulate_schedule(*args)


def test_bubble_needs_events():
    with pytest.raises(ValueError, match="no schedule events"):
        bubble_fraction([], 2)


# -- predicted --------------------------------------------------------------------------


def test_predicted_balance_sums_its_blocks():
    balance = predict_balance(PLAN, COSTS, microbatches=8)
    assert not balance.measured and balance.schedule == "gpipe"
    first, last = balance.stages[0], balance.stages[3]
    assert first.blocks == ("embed", "blocks.0") and first.rank is None
    assert (first.num_params, first.param_bytes, first.grad_bytes) == (150, 600, 600)
    assert first.optimizer_bytes == 1200
    assert first.activation_bytes == 30 * 8
    assert first.memory_bytes == 600 * 4 + 240
    assert first.forward_s == pytest.approx(0.005)
    assert first.backward_s == pytest.approx(0.010)
    assert last.compute_s == pytest.approx(0.0075)
    assert balance.slowest_stage == 1  # blocks.1 + blocks.2: 0.024 s
    assert balance.step_s == pytest.approx(max(e.end for e in balance.events))
    assert 0 < balance.bubble < 1
    assert balance.imbalance == pytest.approx(0.024 / ((0.015 + 0.024 + 0.012 + 0.0075) / 4))


def test_predicted_1f1b_holds_fewer_activations():
    gpipe = predict_balance(PLAN, COSTS, microbatches=8)
    one_f_one_b = predict_balance(PLAN, COSTS, microbatches=8, schedule="1f1b")
    assert [s.activation_bytes for s in gpipe.stages] == [240, 320, 160, 280]
    assert [s.activation_bytes for s in one_f_one_b.stages] == [120, 120, 40, 35]


def test_predicted_balance_without_times_has_no_schedule():
    costs = {b: BlockCost(b, c.num_params, c.param_bytes) for b, c in COSTS.items()}
    balance = predict_balance(PLAN, costs, microbatches=4, optimizer_bytes_per_param_byte=1.0)
    assert balance.step_s is None and balance.bubble is None and balance.events == ()
    assert balance.stages[0].forward_s is None and balance.stages[0].activation_bytes is None
    assert balance.stages[0].optimizer_bytes == 600
    assert balance.imbalance is None and balance.slowest_stage is None


def test_predicted_balance_needs_every_blocks_cost():
    with pytest.raises(PlanError, match="no BlockCost for head.*profile_blocks"):
        predict_balance(PLAN, {b: COSTS[b] for b in BLOCKS[:-1]}, microbatches=2)


# -- measured ---------------------------------------------------------------------------


def reports(plan=PLAN, fwd=(1.0, 2.0, 1.0, 1.0), bwd=(2.0, 4.0, 2.0, 2.0), m=4):
    """One report per rank as the agents would send them: rank r runs stage r."""
    events = simulate_schedule(fwd, bwd, m)
    step_s = max(e.end for e in events)
    return {
        s: StageReport(
            rank=s,
            stage=s,
            blocks=plan.stage_blocks(s),
            num_params=10 * (s + 1),
            param_bytes=40 * (s + 1),
            grad_bytes=40 * (s + 1),
            optimizer_bytes=80 * (s + 1),
            activation_bytes=100,
            microbatches=m,
            schedule="gpipe",
            step=3,
            step_s=step_s - 0.1 * s,
            events=tuple(e for e in events if e.stage == s),
        )
        for s in range(plan.num_stages)
    }


def test_measured_balance_reads_the_reports():
    balance = measured_balance(PLAN, reports())
    assert balance.measured and balance.microbatches == 4 and balance.schedule == "gpipe"
    assert [s.rank for s in balance.stages] == [0, 1, 2, 3]
    assert [s.forward_s for s in balance.stages] == [1.0, 2.0, 1.0, 1.0]
    assert [s.backward_s for s in balance.stages] == [2.0, 4.0, 2.0, 2.0]
    assert balance.stages[2].param_bytes == 120 and balance.stages[2].activation_bytes == 400
    predicted = simulate_schedule([1.0, 2.0, 1.0, 1.0], [2.0, 4.0, 2.0, 2.0], 4)
    assert balance.step_s == max(e.end for e in predicted)  # the slowest rank's step
    assert balance.slowest_stage == 1
    assert balance.events == predicted
    assert balance.bubble == pytest.approx(bubble_fraction(predicted, 4))


def test_measured_times_are_means_of_the_stage_s_own_events():
    ev = ScheduleEvent
    events = (
        ev(0, 0, "F", 0.0, 1.0),
        ev(0, 1, "F", 1.0, 2.2),
        ev(1, 0, "F", 1.0, 9.0),
        ev(0, 0, "B", 5.0, 7.0),
        ev(0, 1, "B", 7.0, 10.0),
    )
    plan = Plan(("a", "b"), (0, 1, 2))
    rep = reports(plan, fwd=(1.0, 1.0), bwd=(1.0, 1.0), m=2)
    stage = measured_balance(plan, {**rep, 0: dataclasses.replace(rep[0], events=events)}).stages[0]
    assert stage.forward_s == pytest.approx(1.1) and stage.backward_s == pytest.approx(2.5)


def test_measured_balance_without_events():
    bare = {r: dataclasses.replace(rep, events=(), step_s=None) for r, rep in reports().items()}
    balance = measured_balance(PLAN, bare)
    assert balance.bubble is None and balance.step_s is None and balance.stages[0].forward_s is None


def test_measured_balance_refuses_reports_that_do_not_match():
    good = reports()
    with pytest.raises(PlanError, match="no report for stage 2"):
        measured_balance(PLAN, {r: good[r] for r in (0, 1, 3)})
    other = reports(Plan(BLOCKS, (0, 1, 4, 5, 7)))
    with pytest.raises(
        PlanError, match=r"rank 0 runs stage 0 with embed, but the plan puts embed, blocks\.0"
    ):
        measured_balance(PLAN, other)
    with pytest.raises(PlanError, match="ranks 1 and 4 both report stage 1"):
        measured_balance(PLAN, {**good, 4: dataclasses.replace(good[1], rank=4)})
    with pytest.raises(PlanError, match=r"stage 4, but the plan has stages 0\.\.3"):
        measured_balance(PLAN, {**good, 4: dataclasses.replace(good[1], rank=4, stage=4)})
    with pytest.raises(ValueError, match=r"reports\[5\] holds rank 1's report"):
        measured_balance(PLAN, {**good, 5: good[1]})
    with pytest.raises(ValueError, match="disagree on micro-batches"):
        measured_balance(PLAN, {**good, 3: dataclasses.replace(good[3], microbatches=8)})


# -- compare ----------------------------------------------------------------------------


def balance(step_s, bubble, times):
    stages = tuple(
        StageBalance(s, s, PLAN.stage_blocks(s), 0, 0, 0, 0, None, t, None if t is None else 0.0)
        for s, t in enumerate(times)
    )
    return Balance(PLAN, stages, 4, "gpipe", True, step_s, bubble, ())


def test_compare_says_what_changed_and_judges_the_step_only_from_several_steps():
    before = balance(0.0412, 0.38, [1.0, 1.0, 2.0, 1.0])
    after = balance(0.0305, 0.22, [1.0, 1.5, 1.0, 1.0])
    assert compare(before, after) == (
        "step 41.2 ms → 30.5 ms (one step each: no verdict); slowest stage 2 → 1; bubble 38% → 22%"
    )
    unknown = balance(None, None, [None] * 4)
    assert compare(unknown, after) == "step ? → 30.5 ms; slowest stage ? → 1; bubble ? → 22%"
    assert compare(balance(2.5, 0.1, [1.0] * 4), after).startswith("step 2.50 s → 30.5 ms")
    line = compare(before, after, timing.change(SLOW, FAST))
    assert line.startswith("step 41.0 ms (IQR 41.0 ms-42.0 ms, 5 samples) → 30.0 ms (IQR")
    assert "1.37x faster, beyond the spread; slowest stage 2 → 1" in line
    assert "1.37x slower, beyond the spread" in compare(after, before, timing.change(FAST, SLOW))


SLOW = [0.041, 0.042, 0.040, 0.043, 0.041]  # seconds per step, apart from FAST's range
FAST = [0.030, 0.031, 0.030, 0.029, 0.031]


def test_a_timing_change_inside_the_spread_is_noise_and_few_samples_are_no_verdict():
    busy = [0.106, 0.150, 0.098, 0.180, 0.120, 0.140]
    later = [0.156, 0.110, 0.190, 0.100, 0.130, 0.170]
    found = timing.change(busy, later)
    assert found.verdict == "within noise"
    said = timing.describe(found, "step", lambda s: f"{s * 1e3:.0f} ms")
    assert said.endswith("within noise (the spreads overlap)") and "x slower" not in said
    few = timing.change([0.106, 0.107, 0.105], [0.156, 0.157, 0.155])
    assert few.verdict == "too few to judge"
    said = timing.describe(few, "step", lambda s: f"{s * 1e3:.0f} ms")
    assert said.endswith("too few samples to judge (2 more per side needed)")
    assert timing.spread([3.0]) == timing.Spread(3.0, 3.0, 3.0, 1)
    with pytest.raises(ValueError, match="no samples"):
        timing.spread([])


def test_alternating_rounds_cancel_a_load_that_rises_between_windows():
    # the plan is 1.3x faster; the machine's load doubles the step time between the
    # before window and the after window (what a busy box did to runbook 03)
    quiet_old = [0.100, 0.102, 0.099, 0.101]
    busy_new = [2 * t / 1.3 for t in quiet_old]
    naive = timing.change(quiet_old * 3, busy_new * 3)
    assert naive.verdict == "slower"  # before-then-after takes the load for the plan
    load = [1.0, 1.5, 2.0]  # rising from round to round, alike for both sides of a round
    rounds = [([t * k for t in quiet_old], [t * k / 1.3 for t in quiet_old]) for k in load]
    found = timing.interleaved_change(rounds)
    assert found.verdict == "faster" and found.rounds == 3
    assert found.ratio == pytest.approx(1.3)
    said = timing.describe(found, "step", lambda s: f"{s * 1e3:.0f} ms")
    assert "12 samples) → " in said and "(alternating, 3 rounds): 1.30x faster" in said


def test_alternating_rounds_that_disagree_are_noise_not_a_verdict():
    same = [0.100, 0.101, 0.099, 0.100]
    # rounds 1 and 2 favour the new plan by 30 %, round 3 favours the old by as much
    rounds = [(same, [t / 1.3 for t in same]), (same, [t / 1.3 for t in same])]
    rounds.append(([t / 1.3 for t in same], same))
    found = timing.interleaved_change(rounds)
    assert found.verdict == "within noise"
    said = timing.describe(found, "step", lambda s: f"{s * 1e3:.0f} ms")
    assert said.endswith("within noise (within each round the spreads overlap, or rounds disagree)")
    # three rounds favour the new plan, the fourth (slightly) the old: beyond the spread
    # taken together, yet no claim while a round says otherwise
    mixed = [(same, [t / 1.3 for t in same])] * 3 + [(same, [t * 1.02 for t in same])]
    assert timing.interleaved_change(mixed).verdict == "within noise"
    few = timing.interleaved_change([([0.1, 0.1], [0.05, 0.05])])
    assert few.verdict == "too few to judge"
    with pytest.raises(ValueError, match="no round"):
        timing.interleaved_change([([], [0.1])])
