"""The notebook's bookkeeping for one run command: who answered, who failed, when to stop
waiting, and the RunResult or the error it ends in.

Waiting is always bounded. A failure is reported FAILURE_GRACE_S after it arrives (peers
stop at the step boundary meanwhile); a dead engine is noticed within CHECK_EVERY_S; a
timeout or Ctrl-C first asks every rank to pause after the step it is in and waits
PAUSE_WAIT_S for that; only then, or on a second Ctrl-C, are ranks sent SIGINT.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

from dtlab.analysis.ranks import label_ranks
from dtlab.control.errors import DtlabError, RankError, RankTimeoutError
from dtlab.records import Condition, HangReport, RemoteFailure, RunResult
from dtlab.records.trace import Trace
from dtlab.records.wire import DoneGroup, RankReply, ReplyKind, Stop

FAILURE_GRACE_S = 1.0  # after one rank fails, how long the others get to finish
PAUSE_WAIT_S = 10.0  # after a pause request, how long ranks get to reach the boundary
CHECK_EVERY_S = 0.25  # how often a waiting run asks whether engines and controller live
POLL_S = 0.1
STALLED_S = 2.0  # no reply from any rank for this long: the run is stalled, not slow
STALL_CONFIRM_S = 2.0  # a deadlock is seen twice, this far apart, before a run is given up
UNSENT_WAIT_S = 30.0  # a rank the run could not be sent to: how long to wait for its death


class Finished(NamedTuple):
    """How a rank's run ended, from its done reply."""

    step: int  # the job's step count then
    stopped: str | None  # one of wire.STOPS
    hit: bool  # the run's condition held at its last step


class RunHost(Protocol):
    """All a Run asks of the notebook side (:class:`dtlab.control.stepper.Stepper` is it)."""

    trace: Trace | None
    interrupted: bool  # set when a run leaves ranks that SIGINT may not have freed

    @property
    def ranks(self) -> list[int]: ...
    def current_step(self) -> int: ...  # where the job stands (after a rewind: its step)
    def receive(self, timeout: float) -> None: ...  # read replies; each reaches its run
    def ingest(self, reply: RankReply) -> None: ...  # its records and output: to the trace
    def note_attach(self, ranks: Iterable[int], attach: int | None) -> None: ...
    def ranks_finished(self, ranks: Iterable[int]) -> None: ...
    def send_pause(self) -> None: ...
    def dead_ranks(self, ranks: Iterable[int]) -> dict[int, str]: ...  # rank -> cause
    def stall_limit(self) -> float: ...
    def hang_report(self) -> HangReport: ...
    def interrupt_and_wait(self, ranks: list[int], poll: Callable[[], list[int]]) -> list[int]: ...


class Run:
    """One run command in flight (made by :class:`dtlab.control.stepper.Stepper`)."""

    def __init__(
        self,
        host: RunHost,
        run_id: int,
        steps: int,
        until: Condition | None,
        timeout: float | None,
        failure_grace: float = FAILURE_GRACE_S,
    ):
        self.host = host
        self.id = run_id
        self.steps = steps
        self.until = until
        self.timeout = timeout
        self.failure_grace = failure_grace
        self.pending = set(host.ranks)
        self.done: dict[int, Finished] = {}  # how each finished rank's run ended
        self.failures: dict[int, RemoteFailure] = {}
        self.first_step = host.current_step()  # after a rewind: where it resumed
        # after a failure on one rank, ranks may start a run at different steps
        self.start_steps = (
            {recs.last_step for recs in host.trace.records.values()}
            if host.trace is not None and host.trace.records
            else {0}
        )
        self.started = self.last_check = self.last_reply = self.next_look = time.monotonic()
        self.hang: HangReport | None = None  # the HangReport taken when the run stopped progressing
        self.first_failure: float | None = None
        self.pause_reason: str | None = None
        self.pause_deadline: float | None = None
        self.give_up_reason: str | None = None
        self.step_by_rank: dict[int, int] = {}
        self.unsent: set[int] = set()  # ranks whose stepping socket was gone at the start
        self._stall: float | None = host.stall_limit()  # the stall limit, as last read
        self._stall_read = self.started

    def could_not_send(self, ranks: Iterable[int]) -> None:
        """The run did not reach ``ranks``: a killed engine closes its socket before the
        controller hears of its death (seconds on a busy machine). The others are asked to
        pause; the run waits up to UNSENT_WAIT_S for the controller to report these ranks
        dead (then the error says they died, and why) before it gives up on them."""
        self.unsent |= set(ranks)
        self.ask_pause(f"{label_ranks(self.unsent)} could not be sent the run")
        assert self.pause_deadline is not None  # (set just now, or by an earlier pause)
        self.pause_deadline = max(self.pause_deadline, self.started + UNSENT_WAIT_S)
        self.last_check = 0.0  # look for their death at the first check

    # --- replies -----------------------------------------------------------------------
    def handle(self, reply: RankReply) -> None:
        rank = reply.rank
        if rank not in self.pending:
            return
        if reply.kind == "unreachable":  # its host's relay could not forward the run
            self.could_not_send([rank])
            return
        self.host.ingest(reply)
        self.last_reply = time.monotonic()
        self.step_by_rank[rank] = reply.step
        if reply.kind == ReplyKind.DONE:
            self.done[rank] = Finished(reply.step, reply.stopped, reply.hit)
        elif reply.kind == ReplyKind.ERROR:
            self.failures[rank] = reply.error or RemoteFailure("Error", "")
        if reply.kind in (ReplyKind.DONE, ReplyKind.ERROR):
            self._finish(rank)

    def handle_done(self, group: DoneGroup) -> None:
        """A relayed host's plain done replies at once (as :meth:`handle` would each)."""
        pending = self.pending
        group = group.only(pending)
        ranks, steps = group.ranks, group.steps
        if not ranks:
            return
        self.host.note_attach(ranks, group.attach)
        self.last_reply = time.monotonic()
        self.step_by_rank.update(zip(ranks, steps, strict=True))
        finished = {step: Finished(step, group.stopped, False) for step in set(steps)}
        self.done.update((r, finished[s]) for r, s in zip(ranks, steps, strict=True))
        pending.difference_update(ranks)
        self.host.ranks_finished(ranks)

    def _finish(self, rank: int) -> None:
        self.pending.discard(rank)
        self.host.ranks_finished((rank,))
        if rank in self.failures and self.first_failure is None:
            self.first_failure = time.monotonic()

    def check(self, interrupts: int = 0) -> None:
        """Engines alive? Timed out? Ctrl-C pressed (once: pause; twice: give up)?"""
        now = time.monotonic()
        if now - self.last_check >= CHECK_EVERY_S:
            self.last_check = now
            for rank, cause in self.host.dead_ranks(self.pending).items():
                self.failures[rank] = RemoteFailure("EngineError", cause)
                self._finish(rank)
            alive = self.unsent & self.pending
            if alive and now - self.started > UNSENT_WAIT_S:
                self.give_up_reason = (
                    f"{label_ranks(alive)} could not be sent the run (its engine is "
                    f"registered but its stepping socket is gone)"
                )
        quiet = now - self.last_reply
        if self.timeout is not None and now - self.started > self.timeout:
            self._timed_out(f"timed out after {self.timeout:g} s", quiet > STALLED_S)
        elif self.timeout is None and quiet > self._stall_limit(now) and now > self.next_look:
            self.next_look = now + self._stall_limit(now)  # slow, not hung: look later
            self._timed_out(f"no step finished for {quiet:.0f} s", True, pause=False)
        if interrupts >= 1:
            self.ask_pause("interrupted")
        if interrupts >= 2:
            self.give_up_reason = "interrupted twice"

    def _stall_limit(self, now: float) -> float:
        """The host's stall limit, read again at most every CHECK_EVERY_S: it reads the last
        steps' times, and a run checks after every reply (8 a step at 8 ranks)."""
        if self._stall is None or now - self._stall_read >= CHECK_EVERY_S:
            self._stall, self._stall_read = self.host.stall_limit(), now
        return self._stall

    def _timed_out(self, reason: str, stalled: bool, pause: bool = True) -> None:
        """Ranks still stepping are asked to pause. Stalled ones are asked (out of band)
        what they are doing: if, twice STALL_CONFIRM_S apart and with no step finished in
        between, some wait in a collective that others never entered (or called
        differently), no step boundary will come: give up at once, with that report.
        Without a timeout of its own (``pause=False``) a run that is merely slow goes on."""
        if stalled and self.hang is None and self.pause_reason is None:
            hang = self._confirmed_hang()
            if hang is not None:
                self.hang, self.pause_reason = hang, reason
                self.give_up_reason = f"{reason}; hung"
                return
        if pause:
            self.ask_pause(reason)

    def _confirmed_hang(self):
        first = self.host.hang_report()
        if not (first.verdict.missing or first.verdict.mismatch):
            return None  # every rank is in it, or none is in one: slow, or not a deadlock
        asked = time.monotonic()
        while time.monotonic() - asked < STALL_CONFIRM_S:
            self.host.receive(POLL_S)
        second = self.host.hang_report()
        moved = self.last_reply >= asked or _pending(first) != _pending(second)
        return None if moved else second

    def ask_pause(self, reason: str) -> None:
        if self.pause_reason is None:
            self.pause_reason = reason
            self.pause_deadline = time.monotonic() + PAUSE_WAIT_S
            self.host.send_pause()

    @property
    def error_stops(self) -> list[int]:
        """Ranks that stopped because a peer said it failed."""
        return sorted(r for r, m in self.done.items() if m.stopped == Stop.ERROR)

    def over(self) -> bool:
        if not self.pending or self.give_up_reason:
            return True
        now = time.monotonic()
        if self.first_failure is not None and now - self.first_failure > self.failure_grace:
            return True
        if self.pause_deadline is not None and now > self.pause_deadline:
            self.give_up_reason = f"{self.pause_reason}; ranks did not pause at a step boundary"
            return True
        return False

    def done_steps(self) -> int:
        done = [self.step_by_rank.get(r, self.first_step) for r in self.host.ranks]
        return max(0, min(done) - self.first_step)

    # --- the end -----------------------------------------------------------------------
    def result(self) -> RunResult:
        if self.host.trace is not None:
            self.host.trace.flush()
        if self.pending or self.failures:
            self._raise()
        if self.error_stops:  # a failure signal with no failed rank: a stale agreement
            raise DtlabError(
                f"{label_ranks(self.error_stops)} stopped on a failure signal that no rank "
                "of this run sent (left over from an earlier failed run); their control "
                "group is rebuilt before the next run: step again"
            )
        last = {r.step for r in self.done.values()}
        if len(last) != 1 and len(self.start_steps) == 1:  # they agree on where to stop
            raise DtlabError(f"ranks stopped after different steps: {sorted(last)}")
        stopped = {r.stopped for r in self.done.values()}
        if "until" in stopped:
            how = "until"
        elif self.pause_reason is not None and self.pause_reason.startswith("timed out"):
            how = "timeout"
        else:
            ended = stopped.pop()
            assert ended is not None  # a "done" reply always says how its run stopped
            how = ended
        return RunResult(
            first_step=self.first_step,
            last_step=max(last),
            stopped=how,
            seconds=time.monotonic() - self.started,
            condition=self.until,
            hit_ranks=tuple(sorted(r for r, m in self.done.items() if m.hit)),
        )

    def _raise(self) -> None:
        unfinished = sorted(self.pending)
        if unfinished:  # SIGINT can leave a gloo collective issued that never completes
            self.host.interrupted = True
            if self.hang is None:  # before SIGINT moves anyone: what they were doing
                self.hang = self.host.hang_report()
        stuck = self.host.interrupt_and_wait(unfinished, self._poll_late)
        ranks = dict(
            finished=sorted(self.done),
            stopped=[r for r in unfinished if r not in stuck],
            stuck=stuck,
        )
        what = f"step (run {self.id}, {self._reached()})"
        reason = self.give_up_reason or (self.pause_reason if unfinished else None)
        if self.failures and not (reason and unfinished):
            error = RankError(what, self.failures, **ranks)
        else:
            error = RankTimeoutError(what, reason or "interrupted", self.failures, **ranks)
        if self.hang is None and error.dead_ranks:  # what the others were doing
            self.hang = self.host.hang_report()
        raise error.explain(self.hang) if self.hang is not None else error

    def _reached(self) -> str:
        """How far the ranks got, from their last replies: where the run was cut off."""
        steps = sorted({self.step_by_rank.get(r, self.first_step) for r in self.host.ranks})
        if steps[-1] <= self.first_step:
            return f"no step finished after step {self.first_step}"
        where = str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
        return f"cut off after step {where}"

    def _poll_late(self) -> list[int]:
        self.host.receive(POLL_S)
        return sorted(self.pending)


def _pending(report) -> dict:
    """Per rank: its step and the collectives it has not completed (progress changes it)."""
    return {
        rank: (rep.step, tuple((c.group_id, c.seq) for c in rep.collectives if not c.done))
        for rank, rep in report.reports.items()
        if rep is not None
    }
