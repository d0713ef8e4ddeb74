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


def test_a_relay_that_fails_ends_the_run_naming_it_and_the_next_run_has_a_new_one(dt):
    dt.step(1)
    dt.execute(
        "from dtlab.agent.state import RANK\n"
        "def broken():\n    raise RuntimeError('planted')\n"
        "RANK.relay._from_ranks = broken",
        ranks=[0],
    )
    with pytest.raises(RankError) as failed:
        dt.step(2)
    assert "RelayError" in str(failed.value) and "planted" in str(failed.value)
    before = dt.trace.last_step
    dt.step(2)  # the ranks connected again, through a new relay
    assert dt.trace.last_step >= before + 2
    assert dt.stepper.channel.routes.get(3) == b"relay:0"
