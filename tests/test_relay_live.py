"""Host relays on 4 live ranks ($DTLAB_RELAY_AT=2 engages them at any size): the ranks
reach the notebook through rank 0's relay, steps and records arrive as without one, and a
killed relay rank is an error naming it, not a hang. .ci/run also runs the stepping tests
with relays on."""

import time

import pytest

from dtlab import demo
from dtlab.control.errors import RankError

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture
def dt(live4, monkeypatch):
    monkeypatch.setenv("DTLAB_RELAY_AT", "2")
    demo.attach(live4)
    yield live4
    live4.auto_restart(0)


def test_steps_go_through_the_hosts_relay_and_records_arrive_whole(dt):
    dt.step(3)
    channel = dt.stepper.channel
    assert {r: channel.routes.get(r) for r in range(4)} == {r: b"relay:0" for r in range(4)}
    first = dt.trace.last_step
    result = dt.step(4)
    assert (result.first_step, result.last_step) == (first, first + 4)
    assert sorted(dt.trace.at(first + 4)) == [0, 1, 2, 3]
    losses = {rec.loss for rec in dt.trace.at(first + 4).values()}
    assert len(losses) == 4  # each rank's own record, not one copied


def test_the_relay_rank_killed_mid_run_is_named_and_nothing_hangs(dt):
    dt.step(1)
    assert dt.stepper.channel.routes.get(3) == b"relay:0"
    dt.execute(f"dtlab.inject.kill_at(step={dt.trace.last_step + 2})", ranks=[0])
    t0 = time.monotonic()
    with pytest.raises(RankError) as failed:
        dt.step(5)
    assert time.monotonic() - t0 < 60
    assert failed.value.dead_ranks == (0,), str(failed.value)
    assert "rank 0 died" in str(failed.value)
    dt.restart(None)
    dt.step(2)  # new ranks, a new relay
    assert dt.stepper.channel.routes.get(3) == b"relay:0"
