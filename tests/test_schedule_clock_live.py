"""A live pipeline's schedule on one time base: what the ranks report, aligned, obeys
causality, and on one host (where the ranks share CLOCK_MONOTONIC) the estimated offsets
match the true ones within the stated bound."""

from __future__ import annotations

import pytest

from dtlab import demo

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_schedule_obeys_causality_on_one_time_base(live4, ip, schedule):
    dt = live4
    demo.attach_pipeline(dt, plan="uniform", microbatches=4, schedule=schedule)
    dt.step(3)
    reports = dt.stage_reports()
    balance = dt.balance()
    clock = balance.clock
    assert clock is not None and clock.bound_s < 0.05, clock  # gloo on one host: well under
    stage_of = {r.stage: r for r in reports.values()}

    # one host, one clock: stage s's step-relative times lead stage 0's by their starts' gap
    for s in range(1, 4):
        true = stage_of[0].clock_start - stage_of[s].clock_start
        error = abs(clock.offsets_s[s] - true)
        assert error <= sum(clock.bounds_s[: s + 1]) + 1e-6, (s, error, clock)

    forward = {(e.stage, e.microbatch): e for e in balance.events if e.phase == "F"}
    backward = {(e.stage, e.microbatch): e for e in balance.events if e.phase == "B"}
    assert len(forward) == len(backward) == 4 * 4
    for (s, m), e in forward.items():
        if s > 0:  # a stage cannot start a micro-batch its feeder has not finished
            assert e.start >= forward[(s - 1, m)].end - clock.bounds_s[s], (s, m, clock)
    for (s, m), e in backward.items():
        if s < 3:  # nor a gradient the next stage has not computed
            assert e.start >= backward[(s + 1, m)].end - clock.bounds_s[s + 1], (s, m, clock)

    ip.user_ns["dt"] = dt
    figure = ip.run_line_magic("dt_partition", "--schedule")
    assert "stage 0's step start" in figure.layout.xaxis.title.text
    assert f"±{clock.bound_s * 1e3:.2f} ms" in figure.layout.title.subtitle.text
