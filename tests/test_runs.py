"""A run's bookkeeping (dtlab.control.runs.Run) against a scripted host: what it concludes
when a rank could not be sent the run. The live case (an engine killed by SIGKILL before
the controller heard of it) only happens on a busy machine; these drive the same Run the
stepper drives, with the host's answers in a chosen order."""

from __future__ import annotations

import time

import pytest

from dtlab.control import runs
from dtlab.control.errors import RankError, RankTimeoutError
from dtlab.records import HangReport, HangVerdict
from dtlab.records.wire import DoneGroup, RankReply, done_groups, plain_done


class ScriptedHost:
    """Ranks 0 and 1 pause when asked; rank 2's engine is reported dead after ``dies_after``
    seconds (None: never)."""

    trace = None
    interrupted = False

    def __init__(self, dies_after: float | None):
        self.ranks = [0, 1, 2]
        self.dies_at = None if dies_after is None else time.monotonic() + dies_after
        self.run: runs.Run | None = None
        self.paused = False
        self.replied = False

    def current_step(self) -> int:
        return 4

    def receive(self, timeout: float) -> None:
        time.sleep(min(timeout, 0.01))
        if self.paused and not self.replied and self.run is not None:
            self.replied = True
            for rank in (0, 1):
                self.run.handle(RankReply("done", self.run.id, rank, step=5, stopped="pause"))

    def ingest(self, reply: RankReply) -> None:
        pass

    def ranks_finished(self, ranks) -> None:
        pass

    def send_pause(self) -> None:
        self.paused = True

    def dead_ranks(self, ranks) -> dict[int, str]:
        dead = self.dies_at is not None and time.monotonic() >= self.dies_at
        return {2: "killed by SIGKILL"} if dead and 2 in ranks else {}

    def stall_limit(self) -> float:
        return 600.0

    def hang_report(self) -> HangReport:
        return HangReport(HangVerdict("no rank waits in a collective"), {})

    def interrupt_and_wait(self, ranks, poll) -> list[int]:
        return list(ranks)


def drive(host: ScriptedHost, limit_s: float = 60) -> runs.Run:
    run = runs.Run(host, 1, steps=3, until=None, timeout=None)
    host.run = run
    run.could_not_send([2])
    deadline = time.monotonic() + limit_s
    while not run.over():
        assert time.monotonic() < deadline, "the run never ended"
        host.receive(runs.POLL_S)
        run.check()
    return run


def test_a_rank_whose_death_is_reported_late_is_said_to_have_died():
    run = drive(ScriptedHost(dies_after=1.5))  # later than a first look, within the wait
    with pytest.raises(RankError) as e:
        run.result()
    assert not isinstance(e.value, RankTimeoutError)
    assert e.value.dead_ranks == (2,) and "rank 2 died" in str(e.value)


def test_a_rank_that_stays_registered_is_said_to_be_unreachable(monkeypatch):
    monkeypatch.setattr(runs, "UNSENT_WAIT_S", 1.0)
    run = drive(ScriptedHost(dies_after=None))
    with pytest.raises(RankTimeoutError) as e:
        run.result()
    assert "rank 2 could not be sent the run" in e.value.reason


def test_an_unreachable_reply_from_a_relay_is_a_send_failure(monkeypatch):
    """A host's relay that could not forward the run to rank 2 says so in a reply; the run
    then waits for rank 2 as for a rank the notebook could not send to."""
    monkeypatch.setattr(runs, "UNSENT_WAIT_S", 1.0)
    host = ScriptedHost(dies_after=None)
    run = runs.Run(host, 1, steps=3, until=None, timeout=None)
    host.run = run
    run.handle(RankReply("unreachable", 1, 2))
    deadline = time.monotonic() + 60
    while not run.over():
        assert time.monotonic() < deadline, "the run never ended"
        host.receive(runs.POLL_S)
        run.check()
    with pytest.raises(RankTimeoutError) as e:
        run.result()
    assert "rank 2 could not be sent the run" in e.value.reason


class GroupHost(ScriptedHost):
    """Every rank finishes; the attach counts it was told, kept."""

    def __init__(self):
        super().__init__(dies_after=None)
        self.attached: list[tuple[list[int], int | None]] = []
        self.finished: list[int] = []

    def note_attach(self, ranks, attach) -> None:
        self.attached.append((list(ranks), attach))

    def ranks_finished(self, ranks) -> None:
        self.finished.extend(ranks)


def test_a_hosts_done_group_ends_a_run_as_its_replies_would():
    """A relay's DoneGroup and the same done replies one by one give the same result."""
    group = DoneGroup(1, "until", 3, (2, 0), (7, 7))
    results = []
    for as_group in (True, False):
        host = GroupHost()
        run = runs.Run(host, 1, steps=3, until=None, timeout=None)
        run.handle(RankReply("done", 1, 1, step=7, attach=3, stopped="until", hit=True))
        if as_group:
            run.handle_done(group)
            run.handle_done(group)  # (a repeat: those ranks are no longer pending)
        else:
            for reply in group.replies():
                run.handle(reply)
        assert run.over() and run.pending == set()
        assert sorted(host.finished) == [0, 1, 2]
        results.append(run.result())
    assert results[0].last_step == results[1].last_step == 7
    assert results[0].stopped == results[1].stopped == "until"
    assert results[0].hit_ranks == results[1].hit_ranks == (1,)


def test_a_done_group_from_the_wire_is_checked_not_trusted():
    good = {"id": 4, "stopped": "steps", "attach": 1, "ranks": [8, 9], "steps": [3, 3]}
    assert DoneGroup.from_dict(good) == DoneGroup(4, "steps", 1, (8, 9), (3, 3))
    for bad in (
        {**good, "ranks": [8]},  # a step count each
        {**good, "ranks": [8, 8]},  # a rank once
        {**good, "ranks": [8, True]},  # a bool is not a rank
        {**good, "ranks": [8, "9"]},
        {**good, "steps": [3, 3.5]},
        {**good, "stopped": "rm -rf"},
        {**good, "id": None},
        {**good, "attach": "1"},
        [good],
    ):
        assert DoneGroup.from_dict(bad) is None, bad


def test_only_plain_done_replies_become_groups():
    done = RankReply("done", 4, 8, step=3, attach=1, stopped="steps").to_dict()
    assert plain_done({"key": "k", **done})
    for odd in ({"hit": True}, {"output": "printed"}, {"kind": "progress"}, {"extra": 1}):
        assert not plain_done({**done, **odd}), odd
    groups = done_groups([done, {**done, "rank": 9, "step": 4}, {**done, "rank": 10, "id": 5}])
    assert groups == [
        DoneGroup(4, "steps", 1, (8, 9), (3, 4)),
        DoneGroup(5, "steps", 1, (10,), (3,)),
    ]


def test_the_stepper_reads_the_last_steps_time_again_only_after_new_rows():
    from dataclasses import replace

    from dtlab.control.stepper import Stepper
    from dtlab.records.steps import StepTimes
    from dtlab.records.trace import Trace
    from tests.fakes import job_info, step_record

    stepper = Stepper(world=None, hangs=None)
    assert stepper.step_s() is None  # no trace yet
    stepper.trace = Trace({r: job_info(r) for r in (0, 1)})
    assert stepper.step_s() is None  # no step yet
    slow = StepTimes(data=0.5, forward=0.25, backward=0.25, optimizer=0.0)
    for step in range(1, 4):
        stepper.trace.add(0, [replace(step_record(step, 0), times=slow)])
        stepper.trace.add(1, [replace(step_record(step, 1), times=slow)])
    assert stepper.step_s() == pytest.approx(1.0)
    assert stepper.step_s() == pytest.approx(1.0)  # (kept: nothing new)
    fast = StepTimes(data=0.0, forward=0.01, backward=0.01, optimizer=0.0)
    for step in range(4, 14):  # ten fast steps: the last ten are all fast
        for rank in (0, 1):
            stepper.trace.add(rank, [replace(step_record(step, rank), times=fast)])
    assert stepper.step_s() == pytest.approx(0.02)
