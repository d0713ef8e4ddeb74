"""Step the attached job on every rank and collect what the ranks recorded.

One run, in order:
1. (once per session) each rank connects to the notebook's :class:`Channel` (one
   ipyparallel call), and says hello;
2. the notebook sends ``run`` to all ranks; each steps on its own event loop
   (:mod:`dtlab.agent.stepping`), all stopping after the same step;
3. progress and done replies bring the new step records, which go into the Trace (and its
   run folder);
4. the wait is bounded: an error on one rank is reported a grace period later, a dead
   engine at once, Ctrl-C pauses all ranks at the next step boundary (a second Ctrl-C
   sends SIGINT), and ranks that never answer are called stuck.

``run_async`` is the same run for the dashboard: it yields to the kernel's event loop so
the Pause button works while ranks step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from dtlab.control.channel import Channel
from dtlab.control.errors import DtlabError, RankError, RankTimeoutError
from dtlab.records import Condition, JobInfo, RemoteFailure, RunResult
from dtlab.trace import Trace, new_run_folder

POLL_S = 0.1
FAILURE_GRACE_S = 1.0  # after one rank fails, how long the others get to finish
PAUSE_WAIT_S = 10.0  # after Ctrl-C, how long ranks get to reach the step boundary
CONNECT_TIMEOUT_S = 30.0
CHECK_EVERY_S = 0.25  # how often a waiting run asks whether engines and controller live
REPORT_S = 0.25  # ranks send progress (and records) at most this often

Progress = Callable[[str, int, int], None]


def _describe_job() -> tuple[int, JobInfo]:
    from dtlab.agent.job import attach_count, current

    return attach_count(), current().info


def _serve(address: str, key: str, rank: int) -> int:
    from dtlab.agent.stepping import serve

    return serve(address, key, rank)


def _record_at(step: int):
    from dtlab.agent.job import current

    job = current()
    return job.record_at(step), job.kept_steps()


def _fetch(name: str, what: str):
    from dtlab.agent.job import current

    tensor = current().tensor(name, what)
    return None if tensor is None else tensor.numpy()


class Stepper:
    """The notebook side of stepping, for one Session (``session.stepper``)."""

    def __init__(self, session):
        self.session = session
        self.channel: Channel | None = None
        self.trace: Trace | None = None
        self.attach_counts: dict[int, int] = {}
        self.busy: dict[int, int] = {}  # rank -> id of a run it has not finished
        self._next_id = 0
        self._calls_seen = -1  # session.calls when the attached job was last looked at

    # --- connecting and tracing --------------------------------------------------------
    def _connect(self) -> None:
        if self.channel is not None:
            return
        channel = Channel(_channel_host(self.session))
        try:
            ranks = self.session.ranks
            self.session.run_each(
                _serve,
                {r: (channel.address, channel.key, r) for r in ranks},
                what="connect the stepping channel",
                timeout=CONNECT_TIMEOUT_S,
            )
            missing = channel.wait_connected(ranks, CONNECT_TIMEOUT_S)
            if missing:
                raise DtlabError(
                    f"ranks {sorted(missing)} did not connect to the notebook's stepping "
                    f"channel at {channel.address} (a firewall between the hosts?)"
                )
        except BaseException:
            channel.close()
            raise
        self.channel = channel

    def _sync_job(self) -> None:
        """Start a new trace when the job was (re-)attached. Only a call through the session
        can attach one, so this asks the ranks only after such calls."""
        if self.trace is not None and self.session.calls == self._calls_seen:
            return
        described = self.session.run(_describe_job, timeout=CONNECT_TIMEOUT_S)
        self._calls_seen = self.session.calls
        counts = {rank: count for rank, (count, _) in described.items()}
        if self.trace is None or counts != self.attach_counts:
            if self.trace is not None:
                self.trace.close()
            meta = {"backend": self.session.backend}
            infos = {rank: info for rank, (_, info) in described.items()}
            self.trace = Trace(infos, folder=new_run_folder(), meta=meta)
            self.attach_counts = counts

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    # --- running -----------------------------------------------------------------------
    def busy_ranks(self) -> list[int]:
        """Ranks still inside an earlier run (collects their late replies first)."""
        if self.busy and self.channel is not None:
            for reply in self.channel.receive(0):
                if (
                    reply["kind"] in ("done", "error")
                    and self.busy.get(reply["rank"]) == reply["id"]
                ):
                    del self.busy[reply["rank"]]
        return sorted(self.busy)

    def _start(self, steps: int, until: Condition | None, record: bool | None) -> _Run:
        if steps < 1:
            raise ValueError(f"the number of steps must be at least 1, got {steps}")
        self._connect()
        self.session.check_ready(self.session._client(), self.session.ranks, "step")
        self._sync_job()
        self._next_id += 1
        run = _Run(self, self._next_id, steps, until)
        message = {
            "op": "run",
            "id": run.id,
            "steps": steps,
            "report_s": REPORT_S,
            "until": dataclasses.asdict(until) if until else None,
            "record": record,
        }
        unreachable = self.channel.send(self.session.ranks, message)
        for rank in unreachable:
            run.failures[rank] = RemoteFailure("EngineError", "not connected to the channel")
        self.busy.update({r: run.id for r in self.session.ranks})
        return run

    def run(
        self,
        steps: int,
        until: Condition | None = None,
        *,
        record: bool | None = None,
        timeout: float | None = None,
        progress: Progress | None = None,
    ) -> RunResult:
        """Step every rank ``steps`` times or until ``until`` holds on some rank."""
        run = self._start(steps, until, record)
        try:
            while not run.finished(timeout):
                run.handle(self.channel.receive(POLL_S))
                if progress:
                    progress("steps", run.done_steps(), steps)
        except KeyboardInterrupt:
            self._pause(run, progress)
        return run.result()

    async def run_async(
        self,
        steps: int,
        until: Condition | None = None,
        *,
        record: bool | None = None,
        timeout: float | None = None,
        on_progress: Callable[[], None] | None = None,
    ) -> RunResult:
        """``run`` for code on the kernel's event loop (the dashboard)."""
        run = self._start(steps, until, record)
        while not run.finished(timeout):
            run.handle(self.channel.receive(0))
            if on_progress:
                on_progress()
            await asyncio.sleep(POLL_S / 2)
        return run.result()

    def pause(self) -> None:
        """Ask every rank in a run to stop after the step it is in (all the same step)."""
        if self.channel is not None and self.busy:
            self.channel.send(sorted(self.busy), {"op": "pause"})

    def _pause(self, run: _Run, progress: Progress | None) -> None:
        self.pause()
        try:
            deadline = time.monotonic() + PAUSE_WAIT_S
            while run.pending and time.monotonic() < deadline and not run.failures:
                run.handle(self.channel.receive(POLL_S))
            if run.pending:
                run.give_up("interrupted; ranks did not pause at a step boundary")
        except KeyboardInterrupt:
            run.give_up("interrupted twice")

    # --- looking closer ----------------------------------------------------------------
    def tensors(self, name: str, what: str, ranks) -> dict:
        """One parameter's gradient or value from each rank, as numpy arrays."""
        return self.session.run(_fetch, name, what, ranks=ranks)

    def details(self, step: int, ranks) -> dict:
        """``{rank: StepRecord}`` with the per-parameter tuples, from the ranks' buffers."""
        found = self.session.run(_record_at, step, ranks=ranks)
        gone = {rank: kept for rank, (rec, kept) in found.items() if rec is None}
        if gone:
            rank, (first, last) = min(gone.items())
            raise DtlabError(
                f"rank {rank} no longer holds step {step} (it keeps steps {first}-{last}); "
                "attach with a larger capacity= to keep more"
            )
        return {rank: rec for rank, (rec, _) in found.items()}

    def ingest(self, rank: int, reply: dict) -> None:
        if reply.get("attach") != self.attach_counts.get(rank):
            self._calls_seen = -1  # attached behind our back: look again before the next run
        if reply.get("records"):
            self.trace.add_lines(rank, reply["records"])


class _Run:
    """The notebook's bookkeeping for one run command."""

    def __init__(self, stepper: Stepper, run_id: int, steps: int, until: Condition | None):
        self.stepper = stepper
        self.session = stepper.session
        self.id = run_id
        self.steps = steps
        self.until = until
        self.pending = set(self.session.ranks)
        self.done: dict[int, dict] = {}
        self.failures: dict[int, RemoteFailure] = {}
        self.first_step = stepper.trace.last_step if stepper.trace else 0
        self.started = self.last_check = time.monotonic()
        self.first_failure: float | None = None
        self.reason: str | None = None
        self.step_by_rank: dict[int, int] = {}

    def handle(self, replies: list[dict]) -> None:
        for reply in replies:
            rank = reply.get("rank")
            if reply.get("id") != self.id or rank not in self.pending:
                continue  # a late reply to an older run
            self.stepper.ingest(rank, reply)
            self.step_by_rank[rank] = reply.get("step", 0)
            if reply["kind"] == "done":
                self.done[rank] = reply
            elif reply["kind"] == "error":
                e = reply.get("error", {})
                self.failures[rank] = RemoteFailure(
                    e.get("ename", "Error"), e.get("evalue", ""), e.get("traceback", "")
                )
            if reply["kind"] in ("done", "error"):
                self.pending.discard(rank)
                self.stepper.busy.pop(rank, None)
        if time.monotonic() - self.last_check >= CHECK_EVERY_S:
            self._check_engines()
        if self.failures and self.first_failure is None:
            self.first_failure = time.monotonic()

    def _check_engines(self) -> None:
        self.last_check = time.monotonic()
        self.session.check_controller()
        for rank in self.session.dead_ranks(self.pending):
            self.failures[rank] = RemoteFailure("EngineError", "the engine process died")
            self.pending.discard(rank)
            self.stepper.busy.pop(rank, None)

    def done_steps(self) -> int:
        done = [self.step_by_rank.get(r, self.first_step) for r in self.session.ranks]
        return max(0, min(done) - self.first_step)

    def finished(self, timeout: float | None) -> bool:
        if not self.pending:
            return True
        now = time.monotonic()
        if self.first_failure is not None and now - self.first_failure > FAILURE_GRACE_S:
            return True
        if timeout is not None and now - self.started > timeout:
            self.reason = f"timed out after {timeout:g} s"
            return True
        return False

    def give_up(self, reason: str) -> None:
        self.reason = reason

    def result(self) -> RunResult:
        if self.stepper.trace is not None:
            self.stepper.trace.flush()
        if self.pending or self.failures:
            self._raise()
        stopped = {r["stopped"] for r in self.done.values()}
        last = {r["step"] for r in self.done.values()}
        if len(last) != 1:  # ranks are meant to agree; say so loudly if they did not
            raise DtlabError(f"ranks stopped after different steps: {sorted(last)}")
        return RunResult(
            first_step=self.first_step,
            last_step=last.pop(),
            stopped="until" if "until" in stopped else stopped.pop(),
            seconds=time.monotonic() - self.started,
            condition=self.until,
            hit_ranks=tuple(sorted(r for r, m in self.done.items() if m.get("hit"))),
        )

    def _raise(self) -> None:
        unfinished = sorted(self.pending)
        stuck = self.session.interrupt_and_wait(unfinished, lambda: self._poll_late())
        ranks = dict(
            finished=sorted(self.done),
            stopped=[r for r in unfinished if r not in stuck],
            stuck=stuck,
        )
        what = f"step (run {self.id})"
        if self.reason is not None or not self.failures:
            raise RankTimeoutError(what, self.reason or "interrupted", self.failures, **ranks)
        raise RankError(what, self.failures, **ranks)

    def _poll_late(self) -> list[int]:
        self.handle(self.stepper.channel.receive(POLL_S))
        return sorted(self.pending)


def _channel_host(session) -> str:
    """Where the ranks can reach the notebook: loopback when every engine is local."""
    if session.config.launcher == "local":
        return "127.0.0.1"
    return "*"
