"""Step the attached job on every rank and collect what the ranks recorded.

One run, in order:
1. (once per session) each rank connects to the notebook's :class:`Channel` (one
   ipyparallel call, two with group relays: :mod:`dtlab.control.connection`) and says
   hello;
2. (after any ipyparallel call, which may have re-attached the job) the ranks describe
   their job; a new job starts a new Trace and run folder;
3. the notebook sends ``run`` to all ranks; each steps on its own event loop
   (:mod:`dtlab.agent.stepping`), all stopping after the same step;
4. progress and done replies bring whole-step summaries into the Trace; every reply goes
   through :meth:`Stepper.dispatch`, so none is lost whoever reads the socket;
5. waiting is bounded as :mod:`dtlab.control.runs` describes.

``run_async`` is the same run for the dashboard: it yields to the kernel's event loop so
the Pause button works while ranks step.
"""

from __future__ import annotations

import asyncio
import bisect
import warnings
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import numpy as np

from dtlab.agent import api
from dtlab.analysis.conditions import describe_condition
from dtlab.analysis.ranks import label_ranks
from dtlab.control.calls import counted_interrupts
from dtlab.control.channel import Channel
from dtlab.control.config import checked_timeout
from dtlab.control.connection import CONNECT_TIMEOUT_S, Connection
from dtlab.control.errors import DtlabError, OptionError, RankError, StepInterrupted
from dtlab.control.hangs import Hangs
from dtlab.control.run_folder_writer import FolderWriter
from dtlab.control.runs import FAILURE_GRACE_S, POLL_S, Run
from dtlab.control.world import World
from dtlab.records import Condition, RunResult
from dtlab.records.columns import step_seconds
from dtlab.records.run_folder import new_run_folder
from dtlab.records.trace import Trace
from dtlab.records.wire import (
    HostRows,
    PauseRequest,
    RankReply,
    ReplyKind,
    RunRequest,
    agree_every,
    failure_grace,
    reply_from,
)

REPORT_S = 0.25  # ranks send progress (and records) at most this often

HANG_MIN_S = 30.0  # a run with no step finished for this long (or 20 steps' time) is hung
HANG_STEPS = 20

Progress = Callable[[str, int, int], None]


class Stepper:
    """The notebook side of stepping (``dt.stepper``): the stepping channel, the trace of
    the attached job, the run in flight, the current step and when a run counts as hung."""

    def __init__(self, world: World, hangs: Hangs) -> None:
        self.world = world
        self.hangs = hangs
        self.hang_timeout: float | None = None  # None: max(HANG_MIN_S, HANG_STEPS x step)
        self._begin()

    def reset(self) -> None:
        """Forget the engines' state (they are stopping or replaced): close the trace and
        the channel; the next run connects afresh. ``hang_timeout`` is the user's: kept."""
        self.close()
        self._begin()

    def _begin(self) -> None:
        self.connection = Connection(self.world)
        self.trace: Trace | None = None
        self.attach_counts: dict[int, int] = {}
        self._attach_all: tuple[dict, int | None] = ({}, None)  # (counts, the count of all)
        self.active: Run | None = None
        self._next_id = 0
        self._calls_seen = -1  # world.calls when the attached job was last looked at
        self._regroup = False  # the last run failed: ranks rebuild their control group
        self.watch_modules = False  # name the first module with a non-finite output
        self.record_outputs = False  # fingerprint every module's output (bisection)
        self.interrupted = False  # a run was ended by SIGINT: collectives may hang on
        self._step_s: tuple[tuple[int, int, int], float | None] | None = None  # (for, step_s())
        self.on_output: Callable[[int, str], None] | None = None  # what a script prints

    # --- connecting and tracing --------------------------------------------------------
    @property
    def channel(self) -> Channel | None:
        """The stepping channel the ranks are connected to (None: not yet, or closed)."""
        return self.connection.channel

    def connect(self) -> None:
        """Connect the ranks to the stepping channel, unless they are already connected
        the way the job's size asks (control/connection.py)."""
        self.connection.connect()

    def sync_job(self) -> None:
        """Start a new trace when the job was (re-)attached. Only a call through the world
        can attach one, so this asks the ranks only after such calls."""
        if self.trace is not None and self.world.calls == self._calls_seen:
            return
        described = self.world.run(api.describe_job, timeout=CONNECT_TIMEOUT_S)
        self._calls_seen = self.world.calls
        counts = {rank: count for rank, (count, _) in described.items()}
        if len(set(counts.values())) > 1:
            newest = max(counts.values())
            stale = [r for r, c in counts.items() if c != newest]
            raise DtlabError(
                f"the job was attached again on some ranks but not on {label_ranks(stale)}: "
                "call dtlab.attach on every rank (a %%dt cell without --ranks)"
            )
        if self.trace is None or counts != self.attach_counts:
            if self.trace is not None:
                self.trace.close()
            infos = {rank: info for rank, (_, info) in described.items()}
            meta = {"backend": self.world.backend}
            self.trace = Trace(infos, sink=FolderWriter(new_run_folder()), meta=meta)
            self.attach_counts = counts

    @contextmanager
    def tracing(self, trace: Trace):
        """Records of the runs inside go to ``trace`` (a replay's), not the job's own."""
        old, self.trace = self.trace, trace
        try:
            yield trace
        finally:
            self.trace = old

    def new_trace(self, *, describe: bool = False, **meta) -> None:
        """Start the job's trace afresh (a checkpoint was loaded: a new timeline).
        ``describe``: ask the ranks what they hold now (a pipeline's stages moved)."""
        self.sync_job()
        old = self.trace
        assert old is not None  # sync_job starts one
        old.close()
        jobs = old.jobs
        if describe:
            jobs = {r: info for r, (_, info) in self.world.run(api.describe_job).items()}
        # the timeline before, for whoever shows the job's whole history (the report):
        # the run folder of the last one that recorded a step
        before = (
            str(old.folder.resolve()) if old.last_step and old.folder else old.meta.get("before")
        )
        self.trace = Trace(
            jobs,
            sink=FolderWriter(new_run_folder()),
            meta={"backend": self.world.backend, **meta} | ({"before": before} if before else {}),
        )

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        self.connection.close()

    # --- replies -----------------------------------------------------------------------
    def dispatch(self, replies: list[RankReply]) -> None:
        """Every reply, whoever received it: to the run in flight, or (late, from an older
        run) its records to the trace and its rank marked free."""
        for reply in replies:
            if reply.kind == ReplyKind.ERROR and reply.error and reply.error.ename == "RelayError":
                self.connection.relay_failed = True  # the next run connects them afresh
            if self.active is not None and reply.id == self.active.id:
                self.active.handle(reply)
                continue
            if self.trace is not None and reply.rows:
                self.ingest(reply)
            if reply.kind in (ReplyKind.DONE, ReplyKind.ERROR):
                self.world.activity.end_run(reply.rank, reply.id)
            if reply.kind == ReplyKind.ERROR:
                self._regroup = True  # its agreement may be left pending in the old group

    def ingest(self, reply: RankReply) -> None:
        if reply.output and self.on_output is not None:
            self.on_output(reply.rank, reply.output)
        self.note_attach((reply.rank,), reply.attach)
        if reply.rows:  # only a run's replies carry records: it started the trace
            assert self.trace is not None
            try:
                self.trace.add_packed(reply.rank, reply.rows)
            except ValueError as e:  # kept out of the trace; the run goes on
                warnings.warn(f"rank {reply.rank}: step records dropped: {e}", stacklevel=2)

    def ingest_host(self, rows: HostRows) -> None:
        """A relayed host's records, joined by its relay (kept out of the trace if not valid)."""
        if self.trace is None:
            return  # (no run has started one: nothing to keep them with)
        try:
            others = self.trace.add_host(rows.data, rows.ranks)
        except ValueError as e:
            where = label_ranks(sorted(rows.ranks)) if rows.ranks else "a relay with no ranks"
            warnings.warn(f"{where}: step records dropped: {e}", stacklevel=2)
            return
        if others:
            warnings.warn(
                f"{label_ranks(others)}: step records dropped: they came through a host's "
                "relay without a reply it may send for them (a rank that reconnected "
                "elsewhere, or a relay's fault); the next run connects the ranks afresh",
                stacklevel=2,
            )

    def note_attach(self, ranks: Iterable[int], attach: int | None) -> None:
        """The ranks' replies say how many jobs were attached on them so far."""
        counts, ranks = self.attach_counts, tuple(ranks)
        if self._attach_all[0] is not counts:  # (a new dict when the job was attached)
            values = set(counts.values())
            self._attach_all = (counts, values.pop() if len(values) == 1 else None)
        if attach is not None and attach == self._attach_all[1] and counts.keys() >= set(ranks):
            return  # (nearly always: every rank's count is the same, in one set operation)
        if any(counts.get(rank) != attach for rank in ranks):
            self._calls_seen = -1  # attached behind our back: look again before the next run

    # --- what a Run asks of it (runs.RunHost) ------------------------------------------
    @property
    def ranks(self) -> list[int]:
        return list(self.world.ranks)

    def current_step(self) -> int:
        """The job's step: the last one recorded, or where a loaded checkpoint left it."""
        trace = self.trace
        if trace is None:
            return 0
        return trace.last_step or int(trace.meta.get("step") or 0)

    def receive(self, timeout: float) -> None:
        assert self.channel is not None  # asked by a run, or by read_late_replies: connected
        got = self.channel.receive_with_rows(timeout)
        for rows in got.rows:  # relayed hosts' records: before their replies, as unrelayed
            self.ingest_host(rows)
        replies = (reply_from(data, rows) for data, rows in got.replies)
        self.dispatch([reply for reply in replies if reply is not None])
        for group in got.done:  # a host's finished ranks at once
            if self.active is not None and group.id == self.active.id:
                self.active.handle_done(group)
            else:  # (rare: a late group) reply by reply
                self.dispatch(group.replies())

    def ranks_finished(self, ranks: Iterable[int]) -> None:
        self.world.activity.end_runs(ranks)

    def dead_ranks(self, ranks: Iterable[int]) -> dict[int, str]:
        """Ranks whose engine is gone, with the cause (the controller is checked first:
        without it nothing can be asked)."""
        self.world.check_controller()
        dead = self.world.dead_ranks(ranks)
        return self.hangs.death_causes(dead) if dead else {}

    def stall_limit(self) -> float:
        """Seconds without a finished step after which a run counts as hung."""
        if self.hang_timeout is not None:
            return self.hang_timeout
        step_s = self.step_s() if self.trace is not None else None
        return max(HANG_MIN_S, HANG_STEPS * step_s) if step_s else HANG_MIN_S * 2

    def hang_report(self):
        return self.hangs.hang_report()

    def interrupt_and_wait(self, ranks: list[int], poll: Callable[[], list[int]]) -> list[int]:
        return self.world.interrupt_and_wait(ranks, poll)

    def run_in_flight(self) -> bool:
        """Is a run (the dashboard's) still going? Late replies are read first: a run
        that ended meanwhile frees its ranks."""
        self.read_late_replies()
        return self.active is not None

    def regroup_next(self) -> None:
        """The ranks rebuild their control group at the next run (their groups changed)."""
        self._regroup = True

    def read_late_replies(self) -> None:
        """Replies that came while no run was waiting (an earlier run's last ones)."""
        if self.world.activity.stepping() and self.channel is not None:
            self.receive(0)

    # --- running -----------------------------------------------------------------------
    def _start(
        self, steps: int, until: Condition | None, record: bool | None, timeout: float | None
    ) -> Run:
        if steps < 1:
            raise OptionError(f"the number of steps must be at least 1, got {steps}")
        timeout = checked_timeout(timeout)
        self.connect()
        self.world.check_ready(self.world.client(), list(self.world.ranks), "step")
        self.sync_job()
        assert self.channel is not None and self.trace is not None  # connected, synced
        if (
            until is not None
            and until.kind == "step"
            and until.value is not None  # (always: a step condition has its step)
            and until.value <= self.trace.last_step
        ):
            raise OptionError(
                f"{describe_condition(until)} holds already: the job is at step "
                f"{self.trace.last_step}"
            )
        unconnected = set(self.world.ranks) - self.channel.connected
        if unconnected:
            raise DtlabError(
                f"{label_ranks(unconnected)} never connected to the stepping channel; "
                f"run %dt_launch {self.world.world_size} --restart"
            )
        self._next_id += 1
        step_s = self.step_s()  # (the last steps' median: read once a run)
        run = Run(self, self._next_id, steps, until, timeout, self._failure_grace(step_s))
        message = RunRequest(
            id=run.id,
            steps=steps,
            report_s=REPORT_S,
            until=until,
            record=record,
            agree_every=self._agree_every(step_s),
            regroup=self._regroup,
            watch=self.watch_modules,
            outputs=self.record_outputs,
        )
        unreachable = self.channel.send(self.world.ranks, message)
        self.world.activity.start_run(self.world.ranks, run.id)
        self.active, self._regroup = run, False
        if unreachable:  # the others got it: have them stop at once, then report
            self._regroup = True
            run.could_not_send(unreachable)
        return run

    def step_s(self) -> float | None:
        """The median step time of the last 10 steps (kept until new rows arrive: a run
        asks at its start, and again for its stall limit)."""
        if self.trace is None:  # no job synced yet: no step timed
            return None
        rows = self.trace.columns.rows()  # by step, then rank: no record object made
        steps = rows["step"]
        last = int(steps[-1]) if len(rows) else 0
        key = (id(self.trace.columns), len(rows), last)
        if self._step_s is not None and self._step_s[0] == key:
            return self._step_s[1]
        found = None
        if len(rows):
            # the last 10 steps' rows (bisect reads ~20 steps of the column in place;
            # np.searchsorted would copy the strided column first: ~0.2 ms at 512 ranks)
            recent = rows[bisect.bisect_left(steps, last - 9) :]
            found = float(np.median(step_seconds(recent)))
        self._step_s = (key, found)
        return found

    @staticmethod
    def _agree_every(step_s: float | None) -> int:
        """Steps between agreements (~AGREE_S apart), from the last steps' durations (the
        cadence both ends share: records/wire.py)."""
        return agree_every(step_s)

    @classmethod
    def _failure_grace(cls, step_s: float | None) -> float:
        """After a failure, long enough for the others to reach their next agreement."""
        return failure_grace(step_s, FAILURE_GRACE_S)

    def _end(self, run: Run) -> RunResult:
        try:
            return run.result()  # may wait for late replies: they must still reach the run
        except RankError as e:
            self.hangs.advise(e)  # dead ranks: what brings them back
            raise
        finally:
            self.active = None
            if run.failures or run.pending or run.error_stops:
                self._regroup = True

    def _abandon(self) -> None:
        """The notebook side failed or was cancelled: ranks must not go on alone."""
        self.pause()
        self.active = None
        self._regroup = True

    def run(
        self,
        steps: int,
        until: Condition | None = None,
        *,
        record: bool | None = None,
        timeout: float | None = None,
        progress: Progress | None = None,
    ) -> RunResult:
        """Step every rank ``steps`` times or until ``until`` holds on some rank.

        Ctrl-C asks every rank to pause after the step it is in (a second one sends them
        SIGINT); once they have, StepInterrupted (a KeyboardInterrupt) is raised here, so
        the caller's code stops too."""
        with counted_interrupts() as interrupts:  # before the start: no Ctrl-C is lost
            run = self._start(steps, until, record, timeout)
            phase, total = _progress_of(run, steps, until)
            try:
                while not run.over():
                    self.receive(POLL_S)
                    run.check(interrupts[0])
                    if progress:
                        progress(phase, run.done_steps(), total)
            except BaseException:  # never leave ranks stepping unattended
                self._abandon()
                raise
            result = self._end(run)
        if interrupts[0]:  # (also when the run ended by itself meanwhile: a press is kept)
            raise StepInterrupted(result)
        return result

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
        run = self._start(steps, until, record, timeout)
        try:
            while not run.over():
                self.receive(0)
                run.check()
                if on_progress:
                    on_progress()
                await asyncio.sleep(POLL_S / 2)
        except BaseException:  # cancelled, or the callback failed: ranks must not go on
            self._abandon()
            raise
        return self._end(run)

    def pause(self) -> None:
        """Ask every rank in a run to stop after the step it is in (all the same step);
        ranks that do not get there within PAUSE_WAIT_S are sent SIGINT."""
        if self.active is not None:
            self.active.ask_pause("paused")  # bounded: the run gives up after a while
        else:
            self.send_pause()

    def send_pause(self) -> None:
        stepping = self.world.activity.stepping()
        if self.channel is not None and stepping:
            self.channel.send(stepping, PauseRequest())

    # --- looking closer ----------------------------------------------------------------
    def require_trace(self) -> Trace:
        """The attached job's trace, or DtlabError saying how to record steps."""
        if self.trace is None or self.trace.last_step == 0:
            since = self.trace.meta.get("step") if self.trace is not None else None
            if since is not None:
                raise DtlabError(
                    f"no steps recorded since the job was rewound to step {since} "
                    "(a checkpoint was loaded): run %dt_step"
                )
            raise DtlabError("no steps recorded yet: attach a job (%dt_demo) and run %dt_step")
        return self.trace

    def full_records(self, first: int, last: int) -> dict:
        """``{rank: [StepRecord]}`` of steps ``first..last`` with every per-parameter
        field, from the ranks' buffers."""
        return {
            rank: list(recs)
            for rank, recs in self.world.run(api.records_between, first, last).items()
        }

    def tensors(self, name: str, what: str, ranks) -> dict:
        """One parameter's gradient or value from each rank, as numpy arrays."""
        return self.world.run(api.fetch, name, what, ranks=ranks)

    def details(self, step: int, ranks) -> dict:
        """``{rank: StepRecord}`` with the per-parameter tuples, from the ranks' buffers."""
        found = self.world.run(api.record_at, step, ranks=ranks)
        gone = {rank: kept for rank, (rec, kept) in found.items() if rec is None}
        if gone:
            rank, (first, last) = min(gone.items())
            raise DtlabError(
                f"rank {rank} does not hold step {step} (it keeps steps {first}-{last}); "
                "attach with a larger capacity= to keep more"
            )
        return {rank: rec for rank, (rec, _) in found.items()}


def _progress_of(run: Run, steps: int, until: Condition | None) -> tuple[str, int]:
    """What a run's progress reports: (phase, total). Waiting for a condition has no
    total (0: the reporter shows steps run and their rate, not a bar), unless it is a
    step to reach; ``--max-steps`` is a cap, not a target."""
    if until is None:
        return "steps", steps
    phase = f"steps until {describe_condition(until)}"
    if until.kind == "step":
        assert until.value is not None  # a "step" condition always has its step
        return phase, max(int(until.value) - run.first_step, 1)
    return phase, 0
