"""One state per rank decides whether a request may go: a rank in a run, or stuck in a
request that never finished, is refused with what to do; a late reply of an older run
does not free a rank that is in a newer one."""

from __future__ import annotations

from concurrent.futures import Future

from dtlab.control.activity import RankActivity


def test_a_rank_in_a_run_is_stepping_until_that_run_ends():
    activity = RankActivity()
    activity.start_run([0, 1, 2], run_id=1)
    activity.end_run(1, run_id=1)
    assert activity.stepping() == [0, 2]
    activity.start_run([0, 1, 2], run_id=2)
    activity.end_run(0, run_id=1)  # late: run 1 is over, rank 0 is in run 2 now
    assert activity.stepping() == [0, 1, 2]
    assert [activity.state(r, dead=[2]) for r in range(3)] == ["stepping", "stepping", "dead"]


def test_a_request_is_refused_while_a_rank_is_busy_and_says_what_to_do():
    activity = RankActivity()
    assert activity.refusal([0, 1], "pull", run_in_flight=False, world_size=2) is None
    activity.start_run([1], run_id=4)
    said = activity.refusal([0, 1], "pull", run_in_flight=True, world_size=2)
    assert "rank 1" in said and "pause it" in said
    said = activity.refusal([0, 1], "pull", run_in_flight=False, world_size=2)
    assert "still busy" in said and "%dt_launch 2 --restart" in said
    assert activity.refusal([0], "pull", run_in_flight=True, world_size=2) is None


def test_a_stuck_request_holds_its_rank_until_it_finishes():
    activity = RankActivity()
    request = Future()
    activity.mark_stuck({3: request})
    assert activity.state(3) == "stuck"
    assert "rank 3" in activity.refusal([3], "execute", run_in_flight=False, world_size=4)
    request.set_result(None)
    assert activity.state(3) == "idle" and activity.stuck() == []
    activity.start_run([0], run_id=1)
    activity.reset()
    assert activity.stepping() == []
