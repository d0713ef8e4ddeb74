"""When ranks die or hang: what each is doing, how the dead died, and a restart that
continues from the last good checkpoint (``dt.recovery``).

- every rank runs a sidecar thread (:mod:`dtlab.agent.sidecar`) on a channel of its own,
  started at launch, so a rank stuck in a collective still says where it is;
- ``dt.hang_report()`` / ``%dt_stacks`` asks them all (bounded) and diagnoses
  (:func:`dtlab.analysis.hangs.diagnose`); runs and cells that time out attach it to
  their error; a dead rank's error says how it died (the fork server notes exit statuses);
- ``dt.restart()`` / ``%dt_restart`` replaces every engine, rebuilds the group at the same
  world size, attaches the job again and loads a checkpoint; ``dt.auto_restart(n)`` does
  it by itself when a run loses a rank or hangs, up to n times, noted in the trace.
"""

from __future__ import annotations

import signal
import time
from dataclasses import replace

from dtlab.agent import api
from dtlab.analysis.hangs import diagnose
from dtlab.analysis.ranks import label_ranks
from dtlab.control.channel import Channel
from dtlab.control.errors import DtlabError, OptionError
from dtlab.records import HangReport, RankReport

REPORT_TIMEOUT_S = 2.0  # a sidecar answers in ms; one that does not in 2 s will not
CONNECT_TIMEOUT_S = 30.0
HANG_MIN_S = 30.0  # a run with no step finished for this long (or 20 steps' time) is hung
HANG_STEPS = 20


def describe_exit(code: int | None) -> str:
    if code is None:
        return "the engine process exited (cause unknown)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        hint = ": kill -9 or the OOM killer" if -code == signal.SIGKILL else ""
        return f"killed by signal {-code} ({name}{hint})"
    return f"exited with code {code}"


class Recovery:
    """Hang reports, death causes and restarts (``dt.recovery``). Owns each rank's sidecar
    channel, which answers while the rank's main thread is stuck."""

    def __init__(self, session) -> None:
        self.session = session
        self.sidecars: Channel | None = None
        self.sidecar_problem: str | None = None  # why the sidecars could not be started
        self._auto: tuple[int, object] | None = None  # (restarts left, from_checkpoint)
        self.hang_timeout: float | None = None  # None: max(HANG_MIN_S, HANG_STEPS x step)
        self.restarts: list[dict] = []  # dt.restart() events, oldest first
        self._report_id = 0  # numbers the questions asked of the sidecars

    def stop_sidecars(self) -> None:
        if self.sidecars is not None:
            self.sidecars.close()
            self.sidecars = None

    def start_sidecars(self, timeout: float = CONNECT_TIMEOUT_S) -> None:
        """Start each rank's sidecar (at launch: a stuck rank can no longer be asked to)."""
        from dtlab.control.connection import channel_hosts

        if self.sidecars is not None:
            self.sidecars.close()
        channel = Channel(*channel_hosts(self.session))
        try:
            where = {r: (channel.address, channel.key, r) for r in self.session.ranks}
            deadline = time.monotonic() + timeout
            self.session.run_each(
                api.start_sidecar, where, what="start the sidecars", timeout=timeout
            )
            missing = channel.wait_connected(
                self.session.ranks, max(0.1, deadline - time.monotonic())
            )
        except BaseException:
            channel.close()
            raise
        if missing:
            channel.close()
            raise DtlabError(
                f"{label_ranks(missing)} did not connect their sidecar to "
                f"{channel.address} (a firewall between the hosts?)"
            )
        self.sidecars, self.sidecar_problem = channel, None

    def death_causes(self, ranks) -> dict[int, str]:
        """How each of ``ranks`` died, as far as the launcher knows."""
        exits = self.session.engines.exits()
        engine_rank = {eid: r for r, eid in enumerate(self.session.rank_map.engine_ids)}
        pids = {
            engine_rank[eid]: f.pid for eid, f in self.session.facts.items() if eid in engine_rank
        }
        return {r: describe_exit(exits.get(pids.get(r))) for r in ranks}

    def explain_failure(self, error) -> None:
        """Say how dead ranks died and, for a timeout, an interrupt or a death, what every
        rank was doing (added to ``error``'s message; best effort: the error itself must
        still come)."""
        from dtlab.control.errors import RankTimeoutError
        from dtlab.records import RemoteFailure

        dead = error.dead_ranks
        try:
            for rank, cause in self.death_causes(dead).items():
                error.failures[rank] = RemoteFailure("EngineError", cause)
            if dead or isinstance(error, RankTimeoutError):  # Ctrl-C on a hung cell too
                taken = self.session.last_hang  # before SIGINT, when there was one
                error.explain(taken if taken is not None else self.hang_report())
            else:
                error.args = (error._message(),)
        except Exception:
            pass

    def hang_report(self, ranks=None, *, timeout: float = REPORT_TIMEOUT_S) -> HangReport:
        """Ask every rank's sidecar what it is doing (the main threads may be stuck) and
        say why they are stuck."""
        chosen = self.session.select(ranks)
        dead = self.session.dead_ranks(chosen)
        alive = [r for r in chosen if r not in dead]
        reports: dict[int, RankReport | None] = {r: None for r in alive}
        if self.sidecars is not None and alive:
            reports.update(self._ask(alive, timeout))
        causes = self.death_causes(dead) if dead else {}
        verdict = diagnose(reports, causes)
        if self.sidecars is None and alive:
            why = self.sidecar_problem or "not started"
            verdict = replace(
                verdict, summary=f"ranks cannot be asked out of band ({why}); " + verdict.summary
            )
        return HangReport(verdict, reports, causes, time.time())

    def _ask(self, ranks: list[int], timeout: float) -> dict[int, RankReport]:
        assert self.sidecars is not None  # hang_report asks only when they are there
        self._report_id += 1
        asked = self._report_id
        self.sidecars.receive(0)  # late answers of an earlier question
        self.sidecars.send(ranks, {"op": "report", "id": asked})
        got: dict[int, RankReport] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(ranks) and time.monotonic() < deadline:
            for reply in self.sidecars.receive(max(0.0, deadline - time.monotonic())):
                if reply.get("kind") == "report" and reply.get("id") == asked:
                    got[reply["rank"]] = RankReport.from_dict(reply["rank"], reply)
        return got

    def stall_limit(self) -> float:
        """Seconds without a finished step after which a run counts as hung."""
        if self.hang_timeout is not None:
            return self.hang_timeout
        stepper = self.session.connected_stepper
        step_s = stepper.step_s() if stepper is not None and stepper.trace else None
        return max(HANG_MIN_S, HANG_STEPS * step_s) if step_s else HANG_MIN_S * 2

    # --- restart ------------------------------------------------------------------------
    def restart(self, from_checkpoint="latest", *, reason: str = "asked", progress=None) -> dict:
        """Replace every engine (dead, hung or not), rejoin at the same world size, build
        the job again (``dt.set_job_setup``; ``%dt_demo`` sets it) and load a checkpoint
        (``"latest"``: the last complete one; a step; None: start the job afresh)."""
        t0 = time.monotonic()
        if (
            self.session.connected_stepper is not None
            and self.session.connected_stepper.active is not None
        ):
            raise DtlabError("a dashboard run is in progress: pause it before restarting")
        if self.session.checkpointing.job_setup is None and self.session.scripts.is_current():
            return self.session.scripts.restart(reason=reason, progress=progress)  # run again
        self.session.checkpointing.refuse_unbuildable_job()
        chosen = (
            self.session.checkpointing.find_checkpoint(from_checkpoint)
            if from_checkpoint is not None
            else None
        )
        kept = (
            self.session.stepper.record_outputs,
            self.session.stepper.watch_modules,
        )  # a new stepper comes
        if self.session.checkpointing.job_setup is None and chosen is not None:
            self.session.checkpointing.set_up_job()  # raises, saying how to give the job setup
        self.session.renew(progress)
        loaded: dict = {}
        if (
            self.session.checkpointing.job_setup is not None
        ):  # else no job to rebuild: the fresh ranks are all
            self.session.checkpointing.set_up_job()
            self.session.stepper.record_outputs, self.session.stepper.watch_modules = kept
            loaded = self.session.checkpointing.load_into_job(chosen) if chosen is not None else {}
            self.session.checkpointing.apply_autosave(True)
        event = {
            "time": time.time(),
            "reason": reason,
            "seconds": time.monotonic() - t0,
            "checkpoint": str(chosen.path) if chosen else None,
            "step": chosen.step if chosen else 0,
        }
        self.restarts.append(event)
        if (
            self.session.checkpointing.job_setup is not None
        ):  # the new timeline's trace: where it came from
            self.session.stepper.new_trace(
                resumed_from=event["checkpoint"], step=event["step"], restarts=list(self.restarts)
            )
        return event | {"loaded": loaded}

    def auto_restart(self, max_restarts: int, from_checkpoint="latest") -> None:
        """From now on, when ``dt.step`` / ``dt.run_until`` loses a rank or hangs, restart
        (``dt.restart(from_checkpoint)``) and go on to the step it was asked to reach, up
        to ``max_restarts`` times (0: off). Each restart is kept in the trace's meta."""
        if max_restarts < 0:
            raise OptionError(f"max_restarts must be >= 0, got {max_restarts}")
        if max_restarts and from_checkpoint not in (None, "latest"):
            self.session.checkpointing.find_checkpoint(
                from_checkpoint
            )  # a wrong one is said now, not at a death
        scripted = self.session.scripts.is_current()  # restarted by running it again
        if max_restarts and self.session.checkpointing.job_setup is None and not scripted:
            self.session.checkpointing.set_up_job()  # raises, saying how to give the job setup
        self._auto = (max_restarts, from_checkpoint) if max_restarts else None

    def current_step(self) -> int:
        trace = self.session.trace
        if trace is None:
            return 0
        return trace.last_step or int(trace.meta.get("step") or 0)

    def resilient(self, num_steps: int, run):
        """``run(steps)`` until the job reaches ``num_steps`` more steps, restarting on a
        dead rank or a hang while automatic restarts are on."""
        from dtlab.control.errors import RankError, RankTimeoutError

        end = self.current_step() + num_steps
        left = num_steps  # the first time as asked (run() says what is wrong with it)
        while True:
            try:
                return run(left)
            except RankError as e:
                auto = self._auto
                hung = isinstance(e, RankTimeoutError) and e.hang is not None
                interrupted = isinstance(e, RankTimeoutError) and "interrupted" in e.reason
                if auto is None or interrupted or not (e.dead_ranks or hung):
                    raise
                self._auto = (auto[0] - 1, auto[1]) if auto[0] > 1 else None
                try:
                    self.restart(auto[1], reason=_reason(e))
                except Exception as failed:
                    raise DtlabError(f"the automatic restart failed ({failed}) after: {e}") from e
            left = end - self.current_step()
            if left < 1:
                now = self.current_step()
                raise DtlabError(
                    f"after the restart the job is at step {now}, at or past "
                    f"step {end} asked for: nothing left to run"
                )


def _reason(error) -> str:
    """One line for the restart log: who died and how, or why it hung."""
    if error.dead_ranks:
        causes = {error.failures[r].evalue for r in error.dead_ranks}
        return f"{label_ranks(error.dead_ranks)} died ({'; '.join(sorted(causes))})"
    return f"hung: {error.report}" if error.report else str(error).splitlines()[0]
